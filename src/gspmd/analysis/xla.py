"""Side by side with XLA's own partitioner (benchmarks and tests): our annotations as
jax.jit sharding constraints, and the collective bytes of compiled HLO text.

Run a function annotated with gspmd.mesh_split under jax.jit with the same layouts
(mesh_split_as is gspmd.frontend.annotation's):

    with mesh_split_as(xla.xla_constraint):
        compiled = jax.jit(fn, in_shardings=..., out_shardings=...).lower(*args).compile()
    xla.hlo_collective_bytes(compiled.as_text())    # {"all-gather": bytes per device, ...}
"""
from __future__ import annotations

import math
import re
from typing import Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from gspmd.mesh import Mesh
from gspmd.sharding import UNSPECIFIED


def mesh_split_sharding(mesh: Mesh, dims_mapping: Sequence) -> NamedSharding:
    """What mesh_split(x, mesh, dims_mapping) asks for, as a NamedSharding over the mesh's
    jax devices; UNSPECIFIED dims are left to XLA."""
    def spec(entry):
        if entry is UNSPECIFIED:
            return P.UNCONSTRAINED
        if entry is None or (isinstance(entry, int) and entry == -1):
            return None
        entries = entry if isinstance(entry, (tuple, list)) else (entry,)
        return tuple(mesh.axis_names[mesh.axis_index(e)] for e in entries)
    return NamedSharding(mesh.to_jax(), P(*map(spec, dims_mapping)))


def xla_constraint(x, mesh: Mesh, dims_mapping: Sequence):
    """mesh_split for XLA's own partitioner: use as mesh_split_as(xla_constraint)."""
    return jax.lax.with_sharding_constraint(x, mesh_split_sharding(mesh, dims_mapping))


_HLO_COLLECTIVE = re.compile(r"=\s*(\([^=]*?\)|\w+\[[\d,]*\]\S*)\s+(all-reduce|all-gather|reduce-scatter|all-to-all|"
                             r"collective-permute)(-start|-done)?\(")
_HLO_ITEMSIZE = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s16": 2,
                 "u16": 2, "pred": 1, "s8": 1, "u8": 1}


_COMBINED = ("all-reduce", "all-gather", "reduce-scatter")   # XLA's combiners make tuples of these


def hlo_collectives(hlo_text: str) -> list[tuple[str, int]]:
    """(kind, per-device result bytes) of each collective in compiled HLO text (ours or
    XLA's), as many times as the text holds it (a loop body's once): an async pair
    counts once, at its -done; a tuple that XLA's combiner made of several all-reduces
    (all-gathers, reduce-scatters) counts as each of them; a tuple all-to-all (XLA's
    form of one, a piece per peer) as one."""
    found = []
    for line in hlo_text.splitlines():
        m = _HLO_COLLECTIVE.search(re.sub(r"/\*.*?\*/", "", line))   # tuples carry /*index=5*/ marks
        if m is None or m.group(3) == "-start":
            continue
        kind = m.group(2)
        sizes = [_HLO_ITEMSIZE[t] * math.prod(int(d) for d in dims.split(",") if d)
                 for t, dims in re.findall(r"(\w+)\[([\d,]*)\]", m.group(1))]
        found += [(kind, size) for size in sizes] if kind in _COMBINED else [(kind, sum(sizes))]
    return found


def hlo_collective_bytes(hlo_text: str) -> dict[str, int]:
    """Per-device result bytes of each collective kind in compiled HLO text (see
    hlo_collectives)."""
    total: dict[str, int] = {}
    for kind, nbytes in hlo_collectives(hlo_text):
        total[kind] = total.get(kind, 0) + nbytes
    return total
