"""The jax backend: runs an SPMD program on jax devices as ONE jitted `jax.shard_map`.

The shard_map is over a 1-D jax mesh (axis "d") of the first N jax devices in order, so
partition-id == axis index == our device id, and our collectives' device groups are
`axis_index_groups` as they stand. The body is the per-device program, translated
instruction by instruction through LOWERINGS (one entry per opcode; add more with
`register`). Each parameter travels as its per-device (padded) shards stacked along dim
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
from typing import Callable, Sequence

import jax
import numpy as np
from jax import lax
from jax import numpy as jnp
from jax.sharding import Mesh as JaxMesh, NamedSharding, PartitionSpec as P

from gspmd.errors import ShardingError
from gspmd.ir import Instr, Program, Value
from gspmd.mesh import Mesh
from gspmd.runtime import sim
from gspmd.sharding import UNSPECIFIED, Sharding
from gspmd.ir.reducer import ADD, AND, MAX, MIN, MUL, OR

AXIS = "d"

# lower(instr, operand arrays inside the shard_map body) -> output arrays
Lowering = Callable[[Instr, list], list]
LOWERINGS: dict[str, Lowering] = {}


def register(*opcodes: str) -> Callable[[Lowering], Lowering]:
    """Decorator: `fn` lowers these opcodes to jax.lax inside the shard_map body."""
    def add(fn: Lowering) -> Lowering:
        for opcode in opcodes:
            LOWERINGS[opcode] = fn
        return fn
    return add


def lower_instr(instr: Instr, args: list) -> list:
    fn = LOWERINGS.get(instr.opcode)
    if fn is None:
        raise ShardingError(
            f"The jax backend has no lowering for opcode {instr.opcode!r} (instruction {instr.outputs} "
            f"from {instr.origin or 'the frontend'}); add one with "
            "gspmd.runtime.jax_backend.register, or run with backend='sim'.")
    return fn(instr, args)


# -- elementwise ------------------------------------------------------------------------
def _round_even(x):
    return lax.round(x, lax.RoundingMethod.TO_NEAREST_EVEN)


def _identity(x):
    return x


# HLO semantics, as in ops/elementwise.py (divide on ints truncates, remainder is fmod).
ELEMENTWISE: dict[str, Callable] = {
    "add": lax.add, "subtract": lax.sub, "multiply": lax.mul, "divide": lax.div,
    "maximum": lax.max, "minimum": lax.min, "power": lax.pow, "remainder": lax.rem,
    "and": lax.bitwise_and, "or": lax.bitwise_or, "xor": lax.bitwise_xor, "not": lax.bitwise_not,
    "atan2": lax.atan2, "negate": lax.neg, "exponential": lax.exp, "log": lax.log, "tanh": lax.tanh,
    "logistic": lax.logistic, "rsqrt": lax.rsqrt, "sqrt": lax.sqrt, "abs": lax.abs, "sign": lax.sign,
    "floor": lax.floor, "ceil": lax.ceil, "cosine": lax.cos, "sine": lax.sin,
    "exponential-minus-one": lax.expm1, "log-plus-one": lax.log1p, "is-finite": lax.is_finite,
    "round-nearest-even": _round_even, "convert": _identity, "copy": _identity, "sharding": _identity,
    "select": lax.select,
}
_COMPARE = {"EQ": lax.eq, "NE": lax.ne, "LT": lax.lt, "LE": lax.le, "GT": lax.gt, "GE": lax.ge}


def _elementwise(instr: Instr, args: list) -> list:
    out = instr.outputs[0]
    fn = _COMPARE[instr.attrs["direction"]] if instr.opcode == "compare" else ELEMENTWISE[instr.opcode]
    # Scalars broadcast implicitly (as in the NumPy reference).
    args = [lax.broadcast(a, out.shape) if a.ndim == 0 and out.rank else a for a in args]
    return [lax.convert_element_type(fn(*args), out.dtype)]


register("compare", *ELEMENTWISE)(_elementwise)


# -- layout, creation, reductions, dot ----------------------------------------------------
@register("reduce")
def _reduce(instr, args):
    out = instr.outputs[0]
    return [instr.attrs["reducer"].lax_reduce(args[0], instr.attrs["dims"]).astype(out.dtype)]


@register("dot")
def _dot(instr, args):
    a, out = instr.attrs, instr.outputs[0]
    lhs, rhs = (lax.convert_element_type(x, out.dtype) for x in args)
    dims = ((a["lhs_contracting"], a["rhs_contracting"]), (a["lhs_batch"], a["rhs_batch"]))
    return [lax.dot_general(lhs, rhs, dims, preferred_element_type=out.dtype)]


@register("broadcast")
def _broadcast(instr, args):
    return [lax.broadcast_in_dim(args[0], instr.outputs[0].shape, instr.attrs["dims"])]


@register("transpose")
def _transpose(instr, args):
    return [lax.transpose(args[0], instr.attrs["permutation"])]


@register("reshape")
def _reshape(instr, args):
    return [jnp.reshape(args[0], instr.outputs[0].shape)]


@register("constant")
def _constant(instr, args):
    return [jnp.asarray(instr.attrs["value"], instr.outputs[0].dtype)]


@register("iota")
def _iota(instr, args):
    out = instr.outputs[0]
    return [lax.broadcasted_iota(out.dtype, out.shape, instr.attrs["dimension"])]


@register("slice")
def _slice(instr, args):
    a = instr.attrs
    return [lax.slice(args[0], a["start"], a["limit"], a["strides"])]


# HLO clamps start indices into range; lax would first wrap negative ones from the end.
def _clamped(starts, shape, sizes) -> list:
    """Starts clamped into bounds explicitly, as HLO defines: XLA:CPU folds nested
    dynamic-slices into one at the summed start without clamping the inner one."""
    return [jnp.clip(s, 0, n - k).astype(s.dtype) for s, n, k in zip(starts, shape, sizes)]


@register("dynamic-slice")
def _dynamic_slice(instr, args):
    x, *starts = args
    sizes = instr.outputs[0].shape
    return [lax.dynamic_slice(x, _clamped(starts, x.shape, sizes), sizes, allow_negative_indices=False)]


@register("dynamic-update-slice")
def _dynamic_update_slice(instr, args):
    x, update, *starts = args
    return [lax.dynamic_update_slice(x, update, _clamped(starts, x.shape, update.shape),
                                     allow_negative_indices=False)]


@register("pad")
def _pad(instr, args):
    a = instr.attrs
    return [lax.pad(args[0], args[1], list(zip(a["low"], a["high"], a["interior"])))]


@register("concatenate")
def _concatenate(instr, args):
    return [lax.concatenate(args, instr.attrs["dimension"])]


@register("reverse")
def _reverse(instr, args):
    return [lax.rev(args[0], instr.attrs["dims"])]


@register("convolution")
def _convolution(instr, args):
    a, out = instr.attrs, instr.outputs[0]
    dims = lax.ConvDimensionNumbers(a["lhs_spec"], a["rhs_spec"], a["out_spec"])
    return [lax.conv_general_dilated(
        *args, a["window_strides"], a["padding"], a["lhs_dilation"], a["rhs_dilation"], dims,
        feature_group_count=a["feature_group_count"], batch_group_count=a["batch_group_count"],
        preferred_element_type=out.dtype)]


def _reduce_window_of(x, reducer, a: dict):
    # A concrete identity lets jax use its max/min/add pooling primitives (differentiable).
    init, ones = reducer.identity(x.dtype), (1,) * x.ndim
    return lax.reduce_window(x, init, reducer.lax_combine, a["window_dimensions"], a["window_strides"],
                             a["padding"], a.get("base_dilation", ones), a.get("window_dilation", ones))


@register("reduce-window")
def _reduce_window(instr, args):
    return [_reduce_window_of(args[0], instr.attrs["reducer"], instr.attrs)]


@register("select-and-scatter-add")
def _select_and_scatter_add(instr, args):
    """The transpose of max (ge) / min (le) pooling: jax's own gradient of reduce-window,
    which is HLO select-and-scatter (first extreme in each window wins)."""
    source, operand = args
    reducer = MAX if instr.attrs["select"] == "ge" else MIN
    _, pullback = jax.vjp(lambda o: _reduce_window_of(o, reducer, instr.attrs), operand)
    return [pullback(source.astype(operand.dtype))[0].astype(instr.outputs[0].dtype)]


# -- partition-id and collectives --------------------------------------------------------
@register("partition-id")
def _partition_id(instr, args):
    return [lax.convert_element_type(lax.axis_index(AXIS), instr.outputs[0].dtype)]


def _axis_groups(instr: Instr):
    """The instruction's groups as axis_index_groups (None: one group of all devices in
    order). JAX wants groups of equal size that cover every device."""
    groups = np.asarray(instr.attrs["groups"])
    n = lax.axis_size(AXIS)
    if sorted(groups.ravel().tolist()) != list(range(n)):
        raise ShardingError(f"{instr.opcode} groups {groups.tolist()} do not cover the {n} devices once each; "
                            "the jax backend cannot express that collective.")
    if groups.shape[0] == 1 and np.array_equal(groups[0], np.arange(n)):
        return None
    return groups.tolist()


def _rank_in_group(instr: Instr):
    """This device's position within its group (a scalar)."""
    groups = np.asarray(instr.attrs["groups"])
    rank = np.empty(groups.size, np.int32)
    rank[groups.ravel()] = np.tile(np.arange(groups.shape[1], dtype=np.int32), groups.shape[0])
    return jnp.asarray(rank)[lax.axis_index(AXIS)]


def _all_reduce_value(instr: Instr, x):
    reducer, groups = instr.attrs["reducer"], _axis_groups(instr)
    if reducer is ADD:
        return lax.psum(x, AXIS, axis_index_groups=groups)
    if reducer in (MAX, MIN, AND, OR) and (reducer in (MAX, MIN) or x.dtype == jnp.bool_):
        op = lax.pmax if reducer in (MAX, OR) else lax.pmin
        wide = x.astype(jnp.int32) if x.dtype == jnp.bool_ else x   # no boolean max/min collective
        out = op(wide, AXIS, axis_index_groups=groups).astype(x.dtype)
        if jnp.issubdtype(x.dtype, jnp.floating):
            # HLO max/min propagate NaN; XLA's CPU all-reduce drops it.
            nan = lax.pmax(jnp.isnan(x).astype(jnp.int32), AXIS, axis_index_groups=groups)
            out = jnp.where(nan > 0, jnp.asarray(jnp.nan, x.dtype), out)
        return out
    # No native product collective: gather the group's values and multiply locally.
    members = lax.all_gather(x, AXIS, axis_index_groups=groups)
    return reducer.lax_reduce(members, (0,)).astype(x.dtype)


@register("all-reduce")
def _all_reduce(instr, args):
    if np.asarray(instr.attrs["groups"]).shape[1] == 1:
        return [args[0]]
    return [_all_reduce_value(instr, args[0])]


@register("all-gather")
def _all_gather(instr, args):
    return [lax.all_gather(args[0], AXIS, axis=instr.attrs["dim"], axis_index_groups=_axis_groups(instr),
                           tiled=True)]


@register("reduce-scatter")
def _reduce_scatter(instr, args):
    dim = instr.attrs["dim"]
    if instr.attrs["reducer"] is ADD:
        return [lax.psum_scatter(args[0], AXIS, scatter_dimension=dim, axis_index_groups=_axis_groups(instr),
                                 tiled=True)]
    # Other reducers: all-reduce, then keep this device's piece.
    size = instr.outputs[0].shape[dim]
    full = _all_reduce_value(instr, args[0])
    return [lax.dynamic_slice_in_dim(full, _rank_in_group(instr) * size, size, axis=dim)]


@register("all-to-all")
def _all_to_all(instr, args):
    a = instr.attrs
    return [lax.all_to_all(args[0], AXIS, a["split_dim"], a["concat_dim"], axis_index_groups=_axis_groups(instr),
                           tiled=True)]


@register("collective-permute")
def _collective_permute(instr, args):
    """ppermute needs unique sources: a source sending to several devices goes in rounds.
    Devices nobody sends to get zeros (HLO semantics, as ppermute does)."""
    pairs = [tuple(int(d) for d in p) for p in np.asarray(instr.attrs["pairs"]).reshape(-1, 2)]
    rounds: list[list] = []
    for src, dst in pairs:
        free = next((r for r in rounds if all(s != src for s, _ in r)), None)
        if free is None:
            rounds.append(free := [])
        free.append((src, dst))
    out = lax.ppermute(args[0], AXIS, rounds[0]) if rounds else jnp.zeros_like(args[0])
    for r in rounds[1:]:
        received = np.zeros(lax.axis_size(AXIS), bool)
        received[[d for _, d in r]] = True
        out = jnp.where(jnp.asarray(received)[lax.axis_index(AXIS)], lax.ppermute(args[0], AXIS, r), out)
    return [out]


_MODES = {"clip": lax.GatherScatterMode.CLIP, "fill": lax.GatherScatterMode.FILL_OR_DROP}


@register("gather")
def _gather(instr, args):
    a = instr.attrs
    dn = lax.GatherDimensionNumbers(offset_dims=a["offset_dims"], collapsed_slice_dims=a["collapsed_slice_dims"],
                                    start_index_map=a["start_index_map"])
    return [lax.gather(args[0], args[1], dn, a["slice_sizes"], mode=_MODES[a["mode"]],
                       fill_value=a["fill_value"])]


_SCATTERS = {None: lax.scatter, ADD: lax.scatter_add, MUL: lax.scatter_mul, MIN: lax.scatter_min,
             MAX: lax.scatter_max}


@register("scatter")
def _scatter(instr, args):
    a = instr.attrs
    dn = lax.ScatterDimensionNumbers(update_window_dims=a["update_window_dims"],
                                     inserted_window_dims=a["inserted_window_dims"],
                                     scatter_dims_to_operand_dims=a["scatter_dims_to_operand_dims"])
    return [_SCATTERS[a["reducer"]](*args, dn, mode=_MODES[a["mode"]])]


@register("while")
def _while(instr, args):
    body, cond = instr.attrs["body"], instr.attrs["cond"]
    return list(lax.while_loop(lambda carry: _run_body(cond, carry)[0],
                               lambda carry: tuple(_run_body(body, carry)), tuple(args)))


# -- the executable --------------------------------------------------------------------------
def _run_body(spmd: Program, local_args: Sequence) -> list:
    env: dict[Value, object] = dict(zip(spmd.params, local_args))
    for instr in spmd.instrs:
        env.update(zip(instr.outputs, lower_instr(instr, [env[o] for o in instr.operands])))
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
