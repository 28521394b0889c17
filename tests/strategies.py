"""Hypothesis strategies shared by the randomized differential suites."""
from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

import gspmd

MESH_SHAPES = [(2,), (4,), (8,), (16,), (3,), (2, 2), (2, 4), (4, 2), (2, 8), (4, 4), (3, 2), (2, 2, 2),
               (2, 2, 4), (2, 4, 2), (2, 2, 2, 2)]


@st.composite
def meshes(draw, shapes=MESH_SHAPES) -> gspmd.Mesh:
    shape = draw(st.sampled_from(shapes))
    n = int(np.prod(shape))
    order = draw(st.permutations(list(range(n))))
    return gspmd.Mesh(np.asarray(order).reshape(shape), tuple("abcd"[: len(shape)]))


@st.composite
def dims_mappings(draw, mesh: gspmd.Mesh, rank: int) -> list:
    """Each mesh axis goes to one tensor dim or to replication; a dim may take several
    axes (a tuple, major to minor)."""
    per_dim: list[list[str]] = [[] for _ in range(rank)]
    for axis in draw(st.permutations(list(mesh.axis_names))):
        choice = draw(st.integers(-1, rank - 1)) if rank else -1
        if choice >= 0:
            per_dim[choice].append(axis)
    return [(-1 if not axes else axes[0] if len(axes) == 1 else tuple(axes)) for axes in per_dim]
