"""`mesh_split`: a JAX primitive that is the identity at run time and carries a Sharding.

Its JVP and transpose put the same annotation on tangents and cotangents, so gradients
get the layout of the value they belong to; under vmap the new dim is left UNSPECIFIED.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Sequence

import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from gspmd.mesh import Mesh
from gspmd.sharding import UNSPECIFIED, Sharding

mesh_split_p = Primitive("mesh_split")
_substitutes: list[Callable] = []


@contextlib.contextmanager
def mesh_split_as(fn: Callable) -> Iterator[None]:
    """Within the block, mesh_split(x, mesh, dims_mapping) returns fn(x, mesh, dims_mapping)
    instead: e.g. a with_sharding_constraint, to hand the same annotated model to XLA's
    own partitioner."""
    _substitutes.append(fn)
    try:
        yield
    finally:
        _substitutes.pop()


def mesh_split(x, mesh: Mesh, dims_mapping: Sequence):
    """Annotate `x` as split over `mesh`: dims_mapping[i] is the mesh dim(s) (index,
    name, or tuple major-to-minor) that split tensor dim i, or -1/None for unsplit, or
    UNSPECIFIED to let propagation decide."""
    if _substitutes:
        return _substitutes[-1](x, mesh, list(dims_mapping))
    shape = np.shape(x)
    dims_mapping = list(dims_mapping)
    sharding = Sharding.from_mesh(mesh, dims_mapping, shape)
    unspecified = tuple(i for i, e in enumerate(dims_mapping) if e is UNSPECIFIED)
    return mesh_split_p.bind(x, sharding=sharding, unspecified=unspecified)


def _transpose(ct, x, *, sharding, unspecified):
    return [mesh_split_p.bind(ct, sharding=sharding, unspecified=unspecified)]


def _batch(args, dims, *, sharding, unspecified):
    (x,), (bd,) = args, dims
    if bd is None:   # operand not batched
        return mesh_split_p.bind(x, sharding=sharding, unspecified=unspecified), bd
    shifted = tuple(d + (d >= bd) for d in unspecified)
    return mesh_split_p.bind(x, sharding=sharding.insert_dim(bd),
                             unspecified=tuple(sorted(shifted + (bd,)))), bd


mesh_split_p.def_impl(lambda x, **_: x)
mesh_split_p.def_abstract_eval(lambda x, **_: x)
ad.deflinear2(mesh_split_p, _transpose)
batching.primitive_batchers[mesh_split_p] = _batch
mlir.register_lowering(mesh_split_p, mlir.lower_fun(lambda x, **_: x, multiple_results=False))
