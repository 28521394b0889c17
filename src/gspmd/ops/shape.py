"""Layout ops (broadcast, transpose, reshape) and value creation (constant, iota)."""
from __future__ import annotations

import functools
import math
from typing import Optional

import numpy as np
from jax import lax
from jax import numpy as jnp

from gspmd.ops.registry import (EXPAND, Facets, Frontend, Kernel, LAYOUT, Memory, Rewrites, Rule, Semantics, Storage,
                                Timing, counts_exactly, jointly_linear, register)
from gspmd.sharding import Sharding
from gspmd.spmd import cost as cm
from gspmd.spmd import reshard as rs
from gspmd.spmd.cost import ComputeKind
from gspmd.spmd.halo import windowed_ranges
from gspmd.spmd import factors as fx
from gspmd.spmd.factors import REPLICATE, Factor
from gspmd.spmd.layout import coarsen
from gspmd.spmd.partitioned import PartitionedValue


# -- broadcast: attrs dims[i] = result dim of operand dim i --------------------------
def _broadcast_factors(instr):
    x, out = instr.operands[0], instr.outputs[0]
    src = {r: i for i, r in enumerate(instr.attrs["dims"]) if x.shape[i] == out.shape[r]}
    return [Factor(size, (src.get(r), r)) for r, size in enumerate(out.shape)]


def _evaluate_broadcast(instr, args, device):
    x, out = args[0], instr.outputs[0]
    shape = [1] * out.rank
    for i, r in enumerate(instr.attrs["dims"]):
        shape[r] = x.shape[i]
    return [np.broadcast_to(x.reshape(shape), out.shape).copy()]


# -- transpose: out dim i is operand dim permutation[i] -------------------------------
def _transpose_factors(instr):
    out = instr.outputs[0]
    return [Factor(out.shape[i], (p, i)) for i, p in enumerate(instr.attrs["permutation"])]


def _evaluate_transpose(instr, args, device):
    return [np.transpose(args[0], instr.attrs["permutation"])]


def _transpose_storage(instr) -> Storage:
    """A transpose that only moves size-1 dims keeps every element where it was: XLA
    makes it a bitcast. Any other moves data (fusible, each element read once)."""
    shape = instr.operands[0].shape
    moved = [d for d in instr.attrs["permutation"] if shape[d] != 1]
    return Storage.BITCAST if moved == sorted(moved) else Storage.INDEXED


# -- reshape ----------------------------------------------------------------------------
def reshape_groups(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """The runs of src dims and dst dims with equal element counts, in order (size-1 dims
    left out): the reshape maps each run's elements onto its counterpart's, row-major.
    A value with no elements has none."""
    if 0 in src:
        return []
    a = [i for i, d in enumerate(src) if d != 1]
    b = [j for j, d in enumerate(dst) if d != 1]
    groups, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        ga, gb = [a[i]], [b[j]]
        pa, pb = src[a[i]], dst[b[j]]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                ga.append(a[i]); pa *= src[a[i]]; i += 1
            else:
                gb.append(b[j]); pb *= dst[b[j]]; j += 1
        groups.append((ga, gb))
    return groups


def reshape_dim_pairs(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """(src dim, dst dim, modulus): a split of src dim into t tiles carries over to dst dim
    when modulus % t == 0. A split carries through a run's major dims (size-1 dims never
    carry one)."""
    pairs = []
    for ga, gb in reshape_groups(src, dst):
        if len(ga) == 1 and len(gb) == 1:
            pairs.append((ga[0], gb[0], 0))           # same dim: any split carries
        elif len(ga) == 1:
            pairs.append((ga[0], gb[0], dst[gb[0]]))  # split dim: major part must divide
        elif len(gb) == 1:
            pairs.append((ga[0], gb[0], src[ga[0]]))  # merged dims: major dim must divide
    return pairs


def reshape_factors(src: tuple[int, ...], dst: tuple[int, ...]) -> list[Factor]:
    """A reshape's factors: per run of dims with equal element counts, the common
    refinement of its src and dst dims, major to minor (16 -> [2, 8]: factors 2 and 8,
    both on src's dim, one on each dst dim); where a run has none ([2, 3] -> [3, 2]),
    the rest of its dims is kept whole, as are all dims of a value with no elements."""
    if 0 in src:
        return ([Factor(n, (d, None), REPLICATE) for d, n in enumerate(src)]
                + [Factor(n, (None, d), REPLICATE) for d, n in enumerate(dst)])
    factors = []
    for ga, gb in reshape_groups(src, dst):
        run, i, j, left_a, left_b = [], 0, 0, src[ga[0]], dst[gb[0]]
        while i < len(ga) and math.gcd(left_a, left_b) > 1:
            size = math.gcd(left_a, left_b)
            run.append(Factor(size, (ga[i], gb[j])))
            left_a, left_b = left_a // size, left_b // size
            if left_a == 1:
                i += 1
                left_a = src[ga[i]] if i < len(ga) else 1
            if left_b == 1:
                j += 1
                left_b = dst[gb[j]] if j < len(gb) else 1
        if i < len(ga):   # the rest of the run has none: kept whole
            run += [Factor(n, (d, None), REPLICATE) for d, n in [(ga[i], left_a)] + [(d, src[d]) for d in ga[i + 1:]]]
            run += [Factor(n, (None, d), REPLICATE) for d, n in [(gb[j], left_b)] + [(d, dst[d]) for d in gb[j + 1:]]]
        factors += run
    return factors


def _reshape_factors(instr) -> list[Factor]:
    return reshape_factors(instr.operands[0].shape, instr.outputs[0].shape)


@functools.lru_cache(maxsize=4096)     # every layer's reshapes ask alike, in completion and partitioning
def reshaped_layout(s: Sharding, src: tuple[int, ...], dst: tuple[int, ...]) -> Optional[Sharding]:
    """The layout of a reshape from src to dst in which each device holds exactly the
    elements of its shard of s, so the reshape is local (the factors carry s over);
    None when there is none. Uneven splits have none: their shards realign by halo
    exchange."""
    if any(n % t for n, t in zip(src, s.tiles)):
        return None
    return fx.carried(reshape_factors(src, dst), s, 0, 1, len(dst))


def _carry_map(s: Sharding, pairs, forward: bool) -> list[Optional[int]]:
    dim_map: list[Optional[int]] = [None] * s.rank
    for a, b, modulus in pairs:
        src, dst = (a, b) if forward else (b, a)
        if s.tiles[src] > 1 and modulus % s.tiles[src] == 0:
            dim_map[src] = dst
    return dim_map


def _carry(s: Sharding, pairs, forward: bool, rank: int) -> Sharding:
    return s.remap(_carry_map(s, pairs, forward), rank)


def _uneven_runs(s: Sharding, groups, exact: list[Optional[int]], forward: bool) -> dict[int, int]:
    """Splits that do not carry exactly because shards would not line up (uneven sizes,
    or a run that both merges and splits dims): when only a run's major dim is split, its
    split can go to the other side's major dim, and the partitioner realigns the elements
    by halo exchange (paper Figure 5). {src: dst}."""
    runs = {}
    for ga, gb in groups:
        src, dst = (ga, gb) if forward else (gb, ga)
        if s.tiles[src[0]] > 1 and exact[src[0]] is None and all(s.tiles[d] == 1 for d in src[1:]):
            runs[src[0]] = dst[0]
    return runs


def _major_part(s: Sharding, pairs, forward: bool, shape) -> Sharding:
    """Keep, of each evenly split dim whose split cannot carry whole, the major tiles
    that can (16 split 8 ways into [2, 8]: the 2-way major part), so that propagation
    carries as much of a split as the reshape allows."""
    for a, b, modulus in pairs:
        src = a if forward else b
        t = s.tiles[src]
        if t > 1 and modulus % t and shape[src] % t == 0:
            s = coarsen(s, src, t // math.gcd(modulus, t))
    return s


def _reshape_propagate(instr, shardings, target):
    x, out = instr.operands[0], instr.outputs[0]
    pairs = reshape_dim_pairs(x.shape, out.shape)
    source = shardings[1 - target]
    if source is None:
        return []
    forward = target == 1
    shapes = (x.shape, out.shape) if forward else (out.shape, x.shape)
    exact = reshaped_layout(source, *shapes)
    if exact is not None:
        return [exact]
    # After what carries below (a split of a run's major dim whole, realigned by halo
    # exchange), the major part of each split that the reshape carries exactly.
    major = reshaped_layout(fx.major_part(reshape_factors(*shapes), source, 0, 1), *shapes)
    source = _major_part(source, pairs, forward, x.shape if forward else out.shape)
    dim_map = _carry_map(source, pairs, forward)
    runs = _uneven_runs(source, reshape_groups(x.shape, out.shape), dim_map, forward)
    dst_shape = out.shape if forward else x.shape
    for a, b in runs.items():
        if dst_shape[b] >= source.tiles[a]:   # a shorter dim would leave partitions empty
            dim_map[a] = b
    return [source.remap(dim_map, out.rank if forward else x.rank)] + ([major] if major is not None else [])


def _realigned_reshape(ctx, instr, x: PartitionedValue, target: Sharding) -> Optional[PartitionedValue]:
    """Runs whose major dim x splits t ways and the target splits alike, but whose shards
    do not line up: each partition flattens its rows of the run, takes the flat window
    its output rows cover from its neighbours (halo exchange), and unflattens them."""
    out = instr.outputs[0]
    if 0 in x.shape or 0 in out.shape:
        return None
    groups = reshape_groups(x.shape, out.shape)
    exact = _carry_map(x.sharding, reshape_dim_pairs(x.shape, out.shape), True)
    runs = {a: b for a, b in _uneven_runs(x.sharding, groups, exact, True).items()
            if target.tiles[b] == x.sharding.tiles[a]
            and np.array_equal(target.coords()[:, b], x.sharding.coords()[:, a])}
    if not runs:
        return None
    dim_map = [runs.get(d, e) for d, e in enumerate(exact)]
    op_layout = x.sharding.keep_dims([d for d, e in enumerate(dim_map) if e is not None])
    out_layout = op_layout.remap(dim_map, out.rank)
    local = op_layout.shard_shape(x.shape)
    flat_map: list[Optional[int]] = [None] * x.rank   # x dim -> dim of the flattened value
    flat_local, flat_shape, ranges = [], [], {}
    for ga, gb in groups:
        pieces = [ga] if ga[0] in runs else [[d] for d in ga]
        for dims in pieces:
            flat_map[dims[0]] = len(flat_shape)
            flat_local.append(math.prod(local[d] for d in dims))
            flat_shape.append(math.prod(x.shape[d] for d in dims))
        if ga[0] in runs:
            rows = math.prod(out_layout.shard_shape(out.shape)[d] for d in gb)   # per partition, flat
            ranges[len(flat_shape) - 1] = (np.arange(x.sharding.tiles[ga[0]]) * rows, rows, False)
    local_x = rs.reshard(ctx, x, op_layout).local
    flat = ctx.b.add1("reshape", [local_x], tuple(flat_local), x.dtype)
    layout = op_layout.remap(flat_map, len(flat_shape))
    pv = PartitionedValue(flat, layout, tuple(flat_shape))
    pv = windowed_ranges(ctx, pv, ranges, layout.keep_dims(list(ranges)), np.zeros((), x.dtype))
    y, shape = pv.local, out_layout.shard_shape(out.shape)
    y = y if y.shape == shape else ctx.b.add1("reshape", [y], shape, out.dtype)
    return rs.reshard(ctx, PartitionedValue(y, out_layout, out.shape), target)


def _reshape_partition(ctx, instr, operands, targets):
    (x,), (out,), (target,) = operands, instr.outputs, targets
    realigned = _realigned_reshape(ctx, instr, x, target)
    if realigned is not None:
        return [realigned]
    pairs = reshape_dim_pairs(x.shape, out.shape)

    def plan(op_layout, out_layout=None):
        out_layout = out_layout or _carry(op_layout, pairs, True, out.rank)
        cost = cm.add_costs(rs.cost(x.sharding, op_layout, x.shape, x.dtype.itemsize, ctx.hardware),
                            rs.cost(out_layout, target, out.shape, out.dtype.itemsize, ctx.hardware))
        return cm.rounded(cost), op_layout.order_key(), op_layout, out_layout

    from_target = _carry(target, pairs, False, x.rank)
    from_operand = _carry(_carry(x.sharding, pairs, True, out.rank), pairs, False, x.rank)
    # First (preferred on ties) the layouts a local reshape keeps whole: the operand's, the target's.
    exact_out, exact_op = reshaped_layout(x.sharding, x.shape, out.shape), reshaped_layout(target, out.shape, x.shape)
    plans = ([plan(x.sharding, exact_out)] if exact_out is not None else []) + \
        ([plan(exact_op, target)] if exact_op is not None else []) + [plan(from_target), plan(from_operand)]
    _, _, op_layout, out_layout = min(plans, key=lambda p: p[:2])
    local_x = rs.reshard(ctx, x, op_layout).local
    y = ctx.b.add1("reshape", [local_x], out_layout.shard_shape(out.shape), out.dtype)
    return [rs.reshard(ctx, PartitionedValue(y, out_layout, out.shape), target)]


def _evaluate_reshape(instr, args, device):
    return [np.reshape(args[0], instr.outputs[0].shape)]


# -- constant & iota ------------------------------------------------------------------
def _evaluate_constant(instr, args, device):
    return [np.asarray(instr.attrs["value"], instr.outputs[0].dtype)]


def _constant_partition(ctx, instr, operands, targets):
    out = instr.outputs[0]
    full = ctx.b.add1("constant", [], out.shape, out.dtype, value=instr.attrs["value"])
    return [rs.reshard(ctx, PartitionedValue(full, Sharding.replicated(out.rank, ctx.num_devices), out.shape),
                       targets[0])]


def _evaluate_iota(instr, args, device):
    out, dim = instr.outputs[0], instr.attrs["dimension"]
    shape = [1] * out.rank
    shape[dim] = out.shape[dim]
    return [np.broadcast_to(np.arange(out.shape[dim]).reshape(shape), out.shape).astype(out.dtype)]


def _iota_partition(ctx, instr, operands, targets):
    """Local iota plus this partition's offset along the iota dim."""
    (out,), (target,), dim = instr.outputs, targets, instr.attrs["dimension"]
    shape = target.shard_shape(out.shape)
    y = ctx.b.add1("iota", [], shape, out.dtype, dimension=dim)
    if target.tiles[dim] > 1:
        start = ctx.table_lookup(target.coords()[:, dim] * shape[dim])
        start = ctx.b.add1("convert", [start], (), out.dtype)
        start = ctx.b.add1("broadcast", [start], shape, out.dtype, dims=())
        y = ctx.b.add1("add", [y, start], shape, out.dtype)
    return [PartitionedValue(y, target, out.shape)]


# -- conversion and lowering --------------------------------------------------------------
def _convert_broadcast_in_dim(b, eqn, args):
    shape, dtype = b.out_aval(eqn)
    return [b.add1("broadcast", args[:1], shape, dtype, dims=tuple(int(d) for d in eqn.params["broadcast_dimensions"]))]


def _convert_tile(b, eqn, args):
    """jnp.tile (its own primitive in this JAX): each dim d of size n broadcast to
    [reps[d], n], then the pairs merged, as jnp.tile used to emit it."""
    (x,), reps = args, tuple(int(r) for r in eqn.params["reps"])
    shape, dtype = b.out_aval(eqn)
    pairs = tuple(size for r, n in zip(reps, x.shape) for size in (r, n))
    spread = b.add1("broadcast", [x], pairs, dtype, dims=tuple(range(1, len(pairs), 2)))
    return [b.add1("reshape", [spread], shape, dtype)]


def _convert_transpose(b, eqn, args):
    shape, dtype = b.out_aval(eqn)
    return [b.add1("transpose", args, shape, dtype, permutation=tuple(eqn.params["permutation"]))]


def _convert_reshape(b, eqn, args):
    """reshape(x, dimensions=p) is XLA's transpose by p, then the reshape (grouped-conv
    gradients emit it)."""
    x, perm = args[0], tuple(eqn.params.get("dimensions") or range(args[0].rank))
    if perm != tuple(range(x.rank)):
        x = b.add1("transpose", [x], tuple(x.shape[d] for d in perm), x.dtype, permutation=perm)
    return _convert_plain_reshape(b, eqn, [x])


def _convert_plain_reshape(b, eqn, args):
    """squeeze and expand_dims (whose `dimensions` name the dims dropped or added)."""
    shape, dtype = b.out_aval(eqn)
    return [b.add1("reshape", args, shape, dtype)]


def _convert_iota(b, eqn, args):
    shape, dtype = b.out_aval(eqn)
    return [b.add1("iota", [], shape, dtype, dimension=eqn.params["dimension"])]


def _lower_broadcast(instr, args, lc):
    return [lax.broadcast_in_dim(args[0], instr.outputs[0].shape, instr.attrs["dims"])]


def _lower_transpose(instr, args, lc):
    return [lax.transpose(args[0], instr.attrs["permutation"])]


def _lower_reshape(instr, args, lc):
    return [jnp.reshape(args[0], instr.outputs[0].shape)]


def _lower_constant(instr, args, lc):
    return [jnp.asarray(instr.attrs["value"], instr.outputs[0].dtype)]


def _lower_iota(instr, args, lc):
    out = instr.outputs[0]
    return [lax.broadcasted_iota(out.dtype, out.shape, instr.attrs["dimension"])]


# -- positions: which dim of a value counts its own index (Facets.position) -------------
def _iota_position(instr, fixed, below):
    k, out = instr.attrs["dimension"], instr.outputs[0]
    return None if k in fixed or not counts_exactly(out.dtype, out.shape[k]) else k


def _broadcast_position(instr, fixed, below):
    """The operand's, where its dim is not widened from one."""
    x, out, dims = instr.operands[0], instr.outputs[0], instr.attrs["dims"]
    whole = [x.shape[i] == out.shape[r] for i, r in enumerate(dims)]
    k = below(x, {i: fixed[r] if whole[i] else 0 for i, r in enumerate(dims) if r in fixed})
    return dims[k] if k is not None and whole[k] else None


def _reshaped_dim(source: tuple[int, ...], target: tuple[int, ...], dim: int) -> Optional[int]:
    """The dim of a reshape's `target` shape that holds `source`'s dim `dim` unchanged
    (same size, as many elements before it), if any."""
    before = math.prod(source[:dim])
    for t, n in enumerate(target):
        if n == source[dim] and math.prod(target[:t]) == before:
            return t
    return None


def _reshape_position(instr, fixed, below):
    """The operand's, where the reshape keeps that dim (and the fixed ones) whole."""
    x, out = instr.operands[0], instr.outputs[0]
    below_fixed = {_reshaped_dim(out.shape, x.shape, d): i for d, i in fixed.items()}
    if None in below_fixed:
        return None
    k = below(x, below_fixed)
    return None if k is None else _reshaped_dim(x.shape, out.shape, k)


register("broadcast",
         frontend=Frontend(converts={"broadcast_in_dim": _convert_broadcast_in_dim, "tile": _convert_tile}),
         semantics=Semantics(evaluate=_evaluate_broadcast, lower=_lower_broadcast),
         rule=Rule(factors=_broadcast_factors, priority=LAYOUT, forward_priority=EXPAND),
         memory=Memory(storage=Storage.REPEATED),
         rewrites=Rewrites(linear=jointly_linear),
         facets=Facets(zero=lambda instr, is_zero: is_zero(instr.operands[0]),
                       splat=lambda instr: instr.operands[0].rank == 0, position=_broadcast_position))
register("transpose",
         frontend=Frontend(converts={"transpose": _convert_transpose}),
         semantics=Semantics(evaluate=_evaluate_transpose, lower=_lower_transpose),
         rule=Rule(factors=_transpose_factors, priority=LAYOUT),
         memory=Memory(storage=_transpose_storage),
         kernel=Kernel(transposes=True),
         rewrites=Rewrites(linear=jointly_linear))
register("reshape",
         frontend=Frontend(converts={"reshape": _convert_reshape, "squeeze": _convert_plain_reshape,
                                     "expand_dims": _convert_plain_reshape}),
         semantics=Semantics(evaluate=_evaluate_reshape, lower=_lower_reshape),
         rule=Rule(factors=_reshape_factors, propagate=_reshape_propagate, partition=_reshape_partition,
                   priority=LAYOUT),
         timing=Timing(compute=ComputeKind.FREE),
         memory=Memory(storage=Storage.BITCAST),
         rewrites=Rewrites(linear=jointly_linear),     # a bitcast
         facets=Facets(position=_reshape_position))
def _platform_index(b, eqn, args):
    """lax.platform_dependent's branch index: which of its platforms jax runs on, asked
    of jax itself (outside any trace the primitive evaluates on the default device)."""
    return [b.constant(np.int32(eqn.primitive.bind(**eqn.params)))]


def _convert_empty(b, eqn, args):
    """An uninitialized buffer (residuals of untaken cond branches): zeros will do."""
    shape, dtype = b.out_aval(eqn)
    return [b.broadcast_to(b.constant(0, dtype), shape)]


# Constants come from jaxpr literals and closed-over arrays (the frontend driver's job),
# from platform_index and from empty buffers.
register("constant",
         frontend=Frontend(converts={"platform_index": _platform_index, "empty": _convert_empty,
                                     "empty2": _convert_empty}),
         semantics=Semantics(evaluate=_evaluate_constant, lower=_lower_constant),
         rule=Rule(partition=_constant_partition),
         timing=Timing(compute=ComputeKind.FREE),
         memory=Memory(storage=Storage.LITERAL),
         facets=Facets(zero=lambda instr, is_zero: not np.any(instr.attrs["value"]),
                       uniform=lambda instr, groups, uniform: True))
register("iota",
         frontend=Frontend(converts={"iota": _convert_iota}),
         semantics=Semantics(evaluate=_evaluate_iota, lower=_lower_iota),
         rule=Rule(partition=_iota_partition),
         memory=Memory(storage=Storage.INDEXED),
         facets=Facets(position=_iota_position))
