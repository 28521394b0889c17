"""The jax backend: runs an SPMD program on jax devices as ONE jitted `jax.shard_map`.

The shard_map is over a 1-D jax mesh (axis "d") of the first N jax devices in order, so
partition-id == axis index == our device id, and our collectives' device groups are
`axis_index_groups` as they stand. The body is the per-device program, translated
instruction by instruction through each op record's `lower` (gspmd/ops). Each parameter travels as its per-device (padded) shards stacked along dim
0 (a jax.Array already laid out our way is used in place); outputs come back as
jax.Arrays with our sharding as a NamedSharding (over the user's mesh where a
dims_mapping expresses it, else over a mesh shaped like the tile assignment) or, where
shards are uneven (which a NamedSharding cannot express), assembled on every device
inside the same program. Multi-process runs need nothing else: each process feeds and
reads its own devices' shards.
"""
from __future__ import annotations

import itertools
import math
import re
from typing import Sequence

import jax
import numpy as np
from jax import lax
from jax.sharding import Mesh as JaxMesh, NamedSharding, PartitionSpec as P

from gspmd import ops
from gspmd.errors import ShardingError
from gspmd.ir import Instr, Program, Value
from gspmd.mesh import Mesh
from gspmd.ops.convert import LowerContext
from gspmd.runtime import sim
from gspmd.sharding import UNSPECIFIED, Sharding

AXIS = "d"


def lower_instr(instr: Instr, args: list, lc: LowerContext) -> list:
    """The instruction as jax.lax calls, from its op record's lowering."""
    lower = ops.lookup(instr.opcode).lower
    if lower is None:
        raise ShardingError(
            f"The jax backend has no lowering for opcode {instr.opcode!r} (instruction {instr.outputs} "
            f"from {instr.origin or 'the frontend'}); give its record in gspmd/ops a `lower`, or run with "
            "backend='sim'.")
    return lower(instr, args, lc)


# -- the executable --------------------------------------------------------------------------
def _run_body(spmd: Program, local_args: Sequence) -> list:
    """The per-device program as jax calls (inside the shard_map body)."""
    lc = LowerContext(AXIS, _run_body)
    env: dict[Value, object] = dict(zip(spmd.params, local_args))
    for instr in spmd.instrs:
        env.update(zip(instr.outputs, lower_instr(instr, [env[o] for o in instr.operands], lc)))
    return [env[o] for o in spmd.outputs]


def is_even(sharding: Sharding, shape: Sequence[int]) -> bool:
    return all(d % t == 0 for d, t in zip(shape, sharding.tiles))


def _assemble(local, sharding: Sharding, shape: Sequence[int]):
    """Inside the body: the global array from every device's (padded) shard."""
    gathered = lax.all_gather(local, AXIS)                        # [N, *local]
    owners = sharding.tile_assignment[..., 0].ravel()             # one device per tile
    tiles = gathered[owners].reshape(*sharding.tiles, *local.shape)
    r = len(shape)
    interleaved = tiles.transpose([i for d in range(r) for i in (d, r + d)])
    full = interleaved.reshape([t * n for t, n in zip(sharding.tiles, local.shape)])
    return full[tuple(slice(0, n) for n in shape)]


class Executable:
    """An SPMD program compiled for jax devices; call it with the global arrays."""

    def __init__(self, spmd: Program, params: Sequence[Value], outputs: Sequence[Value], num_devices: int,
                 user_mesh: Mesh | None = None):
        devices = jax.devices()
        if num_devices > len(devices):
            raise ShardingError(
                f"The program is partitioned for {num_devices} devices but jax has {len(devices)} "
                f"({devices[0].platform}); on CPU set XLA_FLAGS=--xla_force_host_platform_device_count="
                f"{num_devices} (or jax_num_cpu_devices) before importing jax.")
        self.spmd, self.params, self.outputs = spmd, list(params), list(outputs)
        self.devices = devices[:num_devices]
        self.mesh = JaxMesh(np.array(self.devices), (AXIS,))
        self.user_mesh = user_mesh
        self._local = [i for i, d in enumerate(self.devices) if d.process_index == jax.process_index()]
        self._named: dict[Sharding, NamedSharding] = {}
        self._compiled = None

    # -- layouts ------------------------------------------------------------------------
    def _stacked(self, local: Value) -> tuple[tuple[int, ...], NamedSharding]:
        """How a per-device value travels: shards concatenated along dim 0 over "d"."""
        if local.rank == 0:
            return (), NamedSharding(self.mesh, P())
        return (len(self.devices) * local.shape[0],) + local.shape[1:], NamedSharding(self.mesh, P(AXIS))

    def named_sharding(self, sharding: Sharding) -> NamedSharding:
        """Our sharding as a jax NamedSharding: over the user's mesh where some dims_mapping
        gives it (so that arrays can meet in one jax.jit), else over a mesh shaped like
        the tile assignment."""
        if sharding not in self._named:
            mapping = dims_mapping_of(sharding, self.user_mesh) if self.user_mesh else None
            if mapping is not None:
                self._named[sharding] = mesh_split_sharding(self.user_mesh, mapping)
                return self._named[sharding]
            names = tuple(f"t{i}" for i in range(sharding.rank)) + ("replica",)
            devices = np.array(self.devices, dtype=object)[sharding.tile_assignment]
            self._named[sharding] = NamedSharding(JaxMesh(devices, names), P(*names[:-1]))
        return self._named[sharding]

    def input_sharding(self, i: int) -> NamedSharding | None:
        """The layout in which argument i is used without copies (None: uneven shards)."""
        p = self.params[i]
        return self.named_sharding(p.sharding) if is_even(p.sharding, p.shape) else None

    # -- compile ------------------------------------------------------------------------
    @property
    def compiled(self) -> jax.stages.Compiled:
        if self._compiled is None:
            in_types = [jax.ShapeDtypeStruct(shape, p.dtype, sharding=sharding)
                        for p in self.spmd.params for shape, sharding in [self._stacked(p)]]
            with jax.set_mesh(self.mesh):   # not the caller's jax.set_mesh: the program runs over "d"
                self._compiled = jax.jit(self._shard_mapped()).lower(*in_types).compile()
        return self._compiled

    def _shard_mapped(self):
        def body(*local_args):
            outs = _run_body(self.spmd, local_args)
            return tuple(o if is_even(v.sharding, v.shape) else _assemble(o, v.sharding, v.shape)
                         for o, v in zip(outs, self.outputs))
        in_specs = tuple(self._stacked(p)[1].spec for p in self.spmd.params)
        out_specs = tuple(self._stacked(local)[1].spec if is_even(v.sharding, v.shape) else P()
                          for local, v in zip(self.spmd.outputs, self.outputs))
        return jax.shard_map(body, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

    # -- run ------------------------------------------------------------------------------
    def shard_inputs(self, flat_args: Sequence) -> list[jax.Array]:
        """Global arrays -> the stacked per-device buffers the compiled program takes.
        Each process builds only its own devices' shards."""
        return [self._shard_one(x, p, local) for x, p, local in zip(flat_args, self.params, self.spmd.params)]

    def _shard_one(self, x, param: Value, local: Value) -> jax.Array:
        shape, stacked = self._stacked(local)
        if isinstance(x, jax.Array) and self._holds_our_shards(x, param):
            by_device = {s.device: s.data for s in x.addressable_shards}
            buffers = [by_device[self.devices[d]] for d in self._local]
        else:
            shards = sim.shard(_host_array(x, param), param.sharding)
            buffers = [jax.device_put(shards[d], self.devices[d]) for d in self._local]
        return jax.make_array_from_single_device_arrays(shape, stacked, buffers)

    def _holds_our_shards(self, x: jax.Array, param: Value) -> bool:
        """True if each device already holds exactly (unpadded) our shard of x."""
        if not is_even(param.sharding, param.shape) or param.rank == 0:
            return False
        indices = x.sharding.devices_indices_map(param.shape)
        for d in self._local:
            want = sim.tile_slices(param.sharding, param.shape, d)
            got = indices.get(self.devices[d])
            if got is None or [s.indices(n)[:2] for s, n in zip(got, param.shape)] != \
                    [(s.start, s.stop) for s in want]:
                return False
        return True

    def run_sharded(self, stacked: Sequence[jax.Array]) -> list[jax.Array]:
        """Run on buffers from shard_inputs; returns the raw per-device outputs."""
        return list(self.compiled(*stacked))

    def __call__(self, flat_args: Sequence) -> list[jax.Array]:
        return [self._global(raw, v) for raw, v in zip(self.run_sharded(self.shard_inputs(flat_args)),
                                                       self.outputs)]

    def _global(self, raw: jax.Array, value: Value) -> jax.Array:
        if not is_even(value.sharding, value.shape) or value.rank == 0:
            return raw    # already the global array, replicated
        buffers = [s.data for s in raw.addressable_shards]   # each is exactly our shard
        return jax.make_array_from_single_device_arrays(value.shape, self.named_sharding(value.sharding), buffers)


def dims_mapping_of(sharding: Sharding, mesh: Mesh) -> list | None:
    """A dims_mapping with which mesh_split over `mesh` gives exactly `sharding`, or None.
    Tries each way to hand the mesh axes to tensor dims (meshes have few axes)."""
    for owner in itertools.product(range(sharding.rank + 1), repeat=mesh.ndim):   # rank: replicated
        per_dim = [[a for a in range(mesh.ndim) if owner[a] == d] for d in range(sharding.rank)]
        if any(math.prod(mesh.shape[a] for a in axes) != t for axes, t in zip(per_dim, sharding.tiles)):
            continue
        for orders in itertools.product(*(itertools.permutations(axes) for axes in per_dim)):
            mapping = [tuple(order) or None for order in orders]
            if Sharding.from_mesh(mesh, mapping, (1,) * sharding.rank) == sharding:
                return mapping
    return None


def mesh_split_sharding(mesh: Mesh, dims_mapping: Sequence) -> NamedSharding:
    """What mesh_split(x, mesh, dims_mapping) asks for, as a NamedSharding over jax devices
    (device id d is jax.devices()[d]); UNSPECIFIED dims are left to XLA."""
    def spec(entry):
        if entry is UNSPECIFIED:
            return P.UNCONSTRAINED
        if entry is None or (isinstance(entry, int) and entry == -1):
            return None
        entries = entry if isinstance(entry, (tuple, list)) else (entry,)
        return tuple(mesh.axis_names[mesh.axis_index(e)] for e in entries)
    devices = np.array(jax.devices()[:mesh.size], dtype=object)[mesh.devices]
    return NamedSharding(JaxMesh(devices, mesh.axis_names), P(*map(spec, dims_mapping)))


def xla_constraint(x, mesh: Mesh, dims_mapping: Sequence):
    """mesh_split for XLA's own partitioner: use as mesh_split_as(xla_constraint)."""
    return jax.lax.with_sharding_constraint(x, mesh_split_sharding(mesh, dims_mapping))


def _host_array(x, param: Value) -> np.ndarray:
    if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated):
        raise ShardingError(
            f"Argument %{param.name} {param.type_str()} is a jax.Array spread over several processes whose "
            f"layout differs from its sharding {param.sharding}; pass a NumPy array (each process then "
            "feeds its own devices' shards) or a jax.Array laid out as Executable.input_sharding(i).")
    return np.asarray(x, param.dtype)


_HLO_COLLECTIVE = re.compile(r"=\s*(\([^=]*?\)|\w+\[[\d,]*\]\S*)\s+(all-reduce|all-gather|reduce-scatter|all-to-all|"
                             r"collective-permute)(-start|-done)?\(")
_HLO_ITEMSIZE = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s16": 2,
                 "u16": 2, "pred": 1, "s8": 1, "u8": 1}


def hlo_collective_bytes(hlo_text: str) -> dict[str, int]:
    """Per-device result bytes of each collective kind in compiled HLO text (ours or
    XLA's; an async pair counts once, at its -done)."""
    total: dict[str, int] = {}
    for line in hlo_text.splitlines():
        m = _HLO_COLLECTIVE.search(re.sub(r"/\*.*?\*/", "", line))   # tuples carry /*index=5*/ marks
        if m is None or m.group(3) == "-start":
            continue
        shapes = re.findall(r"(\w+)\[([\d,]*)\]", m.group(1))
        nbytes = sum(_HLO_ITEMSIZE[t] * math.prod(int(d) for d in dims.split(",") if d) for t, dims in shapes)
        total[m.group(2)] = total.get(m.group(2), 0) + nbytes
    return total
