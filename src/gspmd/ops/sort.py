"""Sorting: `sort` (several operands of one shape sorted together along `dimension`,
ordered lexicographically by the first `num_keys`; JAX's sort, jnp.sort, argsort) and
`top-k` (the k largest, or smallest, elements along `axis` and their int32 indices;
JAX's top_k, approx_max_k and approx_min_k).

Both sort whole dims on one device. Where the dim is split, the split moves to another
dim (one all-to-all, uneven dims padded to whole pieces) rather than everything being
gathered; where no other dim can take the split, that one dim is gathered, or a sort
merges its sorted shards over the devices (rounds of collective-permutes of one shard;
see "merge" below; over any number of devices) where the cost model finds that cheaper
or the gathered dim would not fit a device. A sort's results stay in the moved layout
(propagation puts them there) unless a neighbour wants them back (a second all-to-all),
whichever the cost model finds cheaper; a split no other dim can take (a vector's) stays
on the results, merged or sliced from the gathered sort, unless a neighbour asks
otherwise. A split top-k dim may instead keep its split: each device takes the top k of
its own shard, one small all-gather brings every shard's k candidates together and a
second top-k picks among them (the one that moves fewer bytes is chosen).

Order, as XLA has it: `sort` compares floats after mapping -0.0 to +0.0 and every NaN to
+NaN (-inf < ... < 0 < ... < inf < NaN; complex by real, then imaginary part), equal keys
keeping their order when stable. `top-k` compares floats by their bits' total order
(-NaN < -inf < ... < -0.0 < +0.0 < ... < inf < +NaN) and breaks ties by the lower index.
An exact top-k is also what approx_max_k/approx_min_k promise at best (recall 1).
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
from jax import lax
from jax import numpy as jnp

from gspmd.dtypes import is_floating
from gspmd.errors import ShardingError
from gspmd.ir import Instr, emit
from gspmd.ops.registry import Frontend, LAYOUT, Rule, Semantics, register
from gspmd.sharding import Sharding
from gspmd.spmd import factors as fx
from gspmd.spmd import reshard as rs
from gspmd.spmd.context import INDEX_DTYPE, DeviceContext, Why
from gspmd.spmd import cost as cm
from gspmd.spmd.layout import groups_along, whole_along
from gspmd.spmd.padding import mask_padding
from gspmd.spmd.partitioned import PartitionedValue


# -- orders --------------------------------------------------------------------------------
def _bits(x: np.ndarray) -> np.ndarray:
    return x.view(np.dtype(f"i{x.dtype.itemsize}"))


def total_order_key(x: np.ndarray) -> np.ndarray:
    """Integers ordered as XLA's total order orders x (floats by their bits)."""
    if x.dtype == np.bool_:
        return x.astype(np.int8)
    if not is_floating(x.dtype):
        return x
    bits = _bits(x)
    # Negative floats grow more negative as their magnitude bits grow: flip those bits.
    return np.where(bits < 0, bits ^ np.iinfo(bits.dtype).max, bits)


def _sort_keys(x: np.ndarray) -> list[np.ndarray]:
    """sort's comparison keys for one key operand: floats with -0.0 as +0.0 and every
    NaN as +NaN; complex numbers by real part, then imaginary part."""
    if np.iscomplexobj(x):
        return _sort_keys(x.real) + _sort_keys(x.imag)
    if is_floating(x.dtype):
        x = np.where(x == 0, np.zeros((), x.dtype), x)
        x = np.where(np.isnan(x), np.asarray(np.nan, x.dtype), x)
    return [total_order_key(x)]


def _lax_total_order_key(x):
    """total_order_key in jax."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.int8)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return x
    bits = lax.bitcast_convert_type(x, jnp.dtype(f"int{8 * x.dtype.itemsize}"))
    return jnp.where(bits < 0, bits ^ jnp.iinfo(bits.dtype).max, bits)


def _last_in_order(dtype, largest: bool) -> np.ndarray:
    """A value no element precedes in top-k's order (padding is masked with it): the
    lowest of the total order when the largest come first, else the highest."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return np.asarray(not largest)
    if is_floating(dtype):   # -NaN or +NaN with every payload bit set
        info = np.iinfo(np.dtype(f"i{dtype.itemsize}"))
        return np.asarray(-1 if largest else info.max, info.dtype).view(dtype)
    info = np.iinfo(dtype)
    return np.asarray(info.min if largest else info.max, dtype)


# -- sort ------------------------------------------------------------------------------------
def _evaluate_sort(instr: Instr, args, device):
    d, num_keys = instr.attrs["dimension"], instr.attrs["num_keys"]
    keys = [np.moveaxis(k, d, -1) for a in args[:num_keys] for k in _sort_keys(a)]
    order = np.lexsort(keys[::-1], axis=-1)   # stable; lexsort's primary key comes last
    return [np.moveaxis(np.take_along_axis(np.moveaxis(a, d, -1), order, -1), -1, d) for a in args]


def _lower_sort(instr, args, lc):
    a = instr.attrs
    return list(lax.sort(tuple(args), dimension=a["dimension"], is_stable=a["is_stable"], num_keys=a["num_keys"]))


def _convert_sort(b, eqn, args):
    p = eqn.params
    return b.add("sort", args, [b.out_aval(eqn, i) for i in range(len(args))], dimension=p["dimension"],
                 is_stable=p["is_stable"], num_keys=p["num_keys"])


def _whole_dim_factors(instr: Instr, dim: int) -> list[fx.Factor]:
    """Every tensor shares every dim; `dim` stays whole (its sizes may differ: top-k)."""
    n = len(instr.operands) + len(instr.outputs)
    return [fx.Factor(size, (d,) * n, fx.REPLICATE if d == dim else fx.PASS)
            for d, size in enumerate(instr.operands[0].shape)]


def _space_whole_along(instr: Instr, dim: int, operands, targets, hw: cm.Hardware):
    """The factors and the cheapest layout that keeps `dim` whole (each dim is its own
    factor, so layouts of the operand serve as factor-space layouts), on `hw`."""
    factors = _whole_dim_factors(instr, dim)
    moved = [m for o in operands for m in whole_along(o.sharding, dim, o.shape)]
    return factors, fx.choose_space(instr, factors, operands, targets, hw, candidates=moved)


def _propagate_sort(instr: Instr, shardings: list[Optional[Sharding]], target: int) -> list[Sharding]:
    """Every tensor shares every dim, the sorted one whole: its split moves to another
    dim, so that the sort's operands arrive there by one all-to-all and its results stay
    (where no neighbour wants them otherwise) instead of moving back. A split no other
    dim can take (a vector's) stays on the results as it is, but goes neither back from
    a result onto the operands nor onto the other operands (the rule makes them whole or
    slices them, free, where they have none): the partition rule then merges the sorted
    shards or gathers the dim and keeps its own slice of the results, whichever is
    cheaper, where a gathered result would be whole on every device."""
    dim, shape, n_in = instr.attrs["dimension"], instr.operands[0].shape, len(instr.operands)
    proposals = []
    for t, s in enumerate(shardings):
        if t == target or s is None:
            continue
        gathered, *moved = whole_along(s, dim, shape)
        if s.tiles[dim] > 1 and not moved and target >= n_in:
            proposals.append(s)
        else:
            proposals.append(min(moved, key=lambda m: -sum(n > 1 for n in m.tiles), default=gathered))
    return proposals


def _partition_sort(ctx, instr: Instr, operands, targets) -> list[PartitionedValue]:
    """Sort where the sorted dim is whole (its split moved or gathered), or merge the
    sorted shards over the devices that split it: whichever the cost model finds cheaper."""
    hw = ctx.hardware
    factors, space = _space_whole_along(instr, instr.attrs["dimension"], operands, targets, hw)
    merges = [(_merge_cost(instr, operands, s, targets, hw), s) for s in _merge_layouts(instr, operands)]
    if merges:
        cost, layout = min(merges, key=lambda c: c[0])
        whole = fx.cost(factors, space, operands, instr, targets, hw)
        if cm.rounded(cost) < cm.rounded(whole) or not _fits(instr, space, hw):
            return _merge_sort(ctx, instr, operands, layout, targets)
    return fx.run(ctx, instr, factors, space, operands, targets)


def _fits(instr: Instr, space: Sharding, hw: cm.Hardware) -> bool:
    """Whether a device can hold the sort's operands and results in layout `space`."""
    held = sum(math.prod(space.shard_shape(v.shape)) * v.dtype.itemsize for v in [*instr.operands, *instr.outputs])
    return held <= hw.usable_bytes


# -- sort along a split dim: sorted shards merged over the devices -------------------------
# Each device sorts its shard; then the rounds of a sorting network whose comparators are
# merge-splits (Baudet & Stevenson: any sorting network sorts blocks so): two partners
# swap their shards (one collective-permute), sort the two together and keep the low
# or the high half. No device ever holds more than two shards and shapes stay static.
# Two networks, the cheaper on the hardware chosen (their rounds priced as the permutes
# they are):
# - Bitonic's, in the form whose comparators all keep the low half on the lower
#   position: log P (log P + 1) / 2 rounds of one shard each (over P = 8 devices 6
#   shards' bytes against the 7 a gather takes). Where P is not a power of 2 it runs as
#   over the next power of 2, the missing positions holding blocks that sort after
#   everything: a comparator of a real block with such a block leaves both as they are
#   (it keeps the low half on the lower position, the real one), so it is skipped and
#   its device sits the round out.
# - Odd-even transposition: P rounds, neighbours merged in turn at even and odd
#   positions, each partner one step away; as few rounds as the padded bitonic network
#   over 3 or 6 devices, fewer over 5 (5 against 6) or 9 (9 against 10). Its merges
#   are of neighbours only, so it is stable as it is; bitonic's (from 4 devices on)
#   carries each element's position to order equal keys (floats' -0.0/+0.0 and NaNs,
#   or keys with values): over 8 devices odd-even's 8 shards beat bitonic's 6 twice.
def _network_rounds(p: int) -> list[np.ndarray]:
    """Each round's partner of every position 0..p-1 in bitonic's network (p a power of 2)."""
    pos, rounds, k = np.arange(p), [], 2
    while k <= p:
        rounds.append(pos ^ (k - 1))                  # mirror within each block of k
        rounds += [pos ^ j for j in _halvings(k // 4)]
        k *= 2
    return rounds


def _halvings(j: int) -> list[int]:
    return [j >> i for i in range(j.bit_length())]


def _bitonic(p: int) -> list[np.ndarray]:
    """Bitonic's rounds over p positions, as over the next power of 2 (a partner past
    p: the position sits the round out, its partner itself)."""
    pos = np.arange(p)
    rounds = [np.where(partner[:p] < p, partner[:p], pos) for partner in _network_rounds(1 << (p - 1).bit_length())]
    return [r for r in rounds if np.any(r != pos)]


def _odd_even(p: int) -> list[np.ndarray]:
    """Odd-even transposition's p rounds: (i, i + 1) for i even, then odd, and so on."""
    pos, rounds = np.arange(p), []
    for r in range(p):
        lower = pos % 2 == r % 2
        partner = np.where(lower, pos + 1, pos - 1)
        rounds.append(np.where((partner >= 0) & (partner < p), partner, pos))
    return [r for r in rounds if np.any(r != pos)]


def _networks(p: int) -> list[list[np.ndarray]]:
    return [_bitonic(p), _odd_even(p)]


def _network(s: Sharding, instr: Instr, hw: cm.Hardware) -> tuple[cm.Cost, list[np.ndarray], bool]:
    """The cheaper network over the devices splitting the sorted dim, what its rounds'
    permutes cost (one per round per tensor carried, each of one shard), and whether it
    carries positions."""
    shard = math.prod(s.shard_shape(instr.operands[0].shape))
    groups = groups_along(s, [instr.attrs["dimension"]])

    def priced(rounds: list[np.ndarray]) -> tuple[cm.Cost, list[np.ndarray], bool]:
        positions = _carries_positions(instr) and not _neighbours_only(rounds)
        itemsizes = [o.dtype.itemsize for o in instr.operands] + [_position_dtype(s, instr).itemsize] * positions
        cost = cm.add_costs(*(cm.collective_seconds(cm.Pattern.PERMUTE, shard * size, _pairs(groups, partner),
                                                    s.num_devices, hw)
                              for partner in rounds for size in itemsizes))
        return cost, rounds, positions
    return min(map(priced, _networks(groups.shape[1])), key=lambda c: (cm.rounded(c[0]), len(c[1])))


def _neighbours_only(rounds: list[np.ndarray]) -> bool:
    """Whether every merge is of neighbouring blocks. Each merge then stably re-sorts a
    contiguous run of the vector (the lower block first), which never reorders equal
    keys: the network is stable with no positions carried (odd-even transposition's)."""
    return all(np.all(np.abs(partner - np.arange(len(partner))) <= 1) for partner in rounds)


def _merge_layouts(instr: Instr, operands) -> list[Sharding]:
    """The operands' layouts a merge can run in: those splitting the sorted dim."""
    dim = instr.attrs["dimension"]
    return sorted({o.sharding for o in operands if o.sharding.tiles[dim] > 1}, key=Sharding.order_key)


def _ties_need_positions(instr: Instr) -> bool:
    """Whether equal keys must be told apart by where they started: unless every operand
    is an integer key (equal keys are then equal bits: any order of them is the same)."""
    return len(instr.operands) > instr.attrs["num_keys"] or any(
        is_floating(o.dtype) for o in instr.operands)


def _given_positions(instr: Instr) -> Optional[int]:
    """The operand (not a key) that holds each element's position along the sorted dim,
    as argsort's iota does: it breaks ties, no positions need carrying beside it."""
    a = instr.attrs
    for t, o in enumerate(instr.operands[a["num_keys"]:], a["num_keys"]):
        p = o.producer
        if p is not None and p.opcode == "iota" and p.attrs["dimension"] == a["dimension"]:
            return t
    return None


def _carries_positions(instr: Instr) -> bool:
    return _ties_need_positions(instr) and _given_positions(instr) is None


def _position_dtype(s: Sharding, instr: Instr) -> np.dtype:
    """The narrowest integer that holds every position, padding included."""
    dim = instr.attrs["dimension"]
    extent = s.tiles[dim] * s.shard_shape(instr.operands[0].shape)[dim]
    return np.dtype(np.int16 if extent <= np.iinfo(np.int16).max else INDEX_DTYPE)


def _merge_cost(instr: Instr, operands, s: Sharding, targets, hw: cm.Hardware) -> cm.Cost:
    """Operands to `s`, the network's rounds, results to targets."""
    costs = [rs.cost(o.sharding, s, o.shape, o.dtype.itemsize, hw) for o in operands]
    costs += [rs.cost(s, t, o.shape, o.dtype.itemsize, hw) for o, t in zip(instr.outputs, targets)]
    return cm.add_costs(_network(s, instr, hw)[0], *costs)


def _pairs(groups: np.ndarray, partner: np.ndarray) -> np.ndarray:
    """(source, target) device pairs: every member sends to its partner in its group
    (none where the partner is itself: it sits the round out)."""
    moving = partner != np.arange(len(partner))
    return np.stack([groups[:, moving], groups[:, partner[moving]]], axis=-1).reshape(-1, 2)


def _last_in_sort(dtype) -> np.ndarray:
    """A value no element follows in sort's order (+NaN for floats; ties with real
    elements are broken by position, padding's being the highest)."""
    dtype = np.dtype(dtype)
    if is_floating(dtype):
        return np.asarray(np.nan, dtype)
    return np.asarray(True if dtype == np.bool_ else np.iinfo(dtype).max, dtype)


def _merge_sort(ctx: DeviceContext, instr: Instr, operands, s: Sharding, targets) -> list[PartitionedValue]:
    """Padding set to sort after everything (its keys last in order, its positions the
    highest), each shard sorted, then the network's rounds; the results keep `s`. Each
    merged pair is the lower position's shard, then the upper's: both partners sort
    the same sequence, stably, and keep their halves."""
    a, dim = instr.attrs, instr.attrs["dimension"]
    carried, num_keys, given = [rs.reshard(ctx, o, s) for o in operands], a["num_keys"], _given_positions(instr)
    _, rounds, positions = _network(s, instr, ctx.hardware)
    if given is not None:
        carried.insert(num_keys, carried.pop(given))
        num_keys += 1
    elif positions:
        carried.insert(num_keys, _positions(ctx, carried[0], dim, _position_dtype(s, instr)))
        num_keys += 1
    carried = [mask_padding(ctx, o, dim, _last_in_sort(o.dtype)) if t < num_keys else o
               for t, o in enumerate(carried)]
    stable = a["is_stable"] or not positions
    local = _sort_local(ctx, [c.local for c in carried], dim, num_keys, stable)
    groups = groups_along(s, [dim])
    shard = local[0].shape[dim]
    for partner in rounds:
        pairs = _pairs(groups, partner)
        theirs = [ctx.collective_permute(v, pairs, Why.PARTIAL_RESULTS, "sorted shards merged") for v in local]
        lower = _is_lower(ctx, groups, partner, s.num_devices)
        both = _sort_local(ctx, [emit.concatenate(ctx.b, _in_order(ctx, lower, v, t), dim)
                                 for v, t in zip(local, theirs)], dim, num_keys, stable)
        start = ctx.table_lookup(_half_starts(groups, partner, shard, s.num_devices))
        local = _kept(ctx, groups, partner, s.num_devices, local, [_half(ctx, v, dim, start, shard) for v in both])
    if given is not None:
        local.insert(given, local.pop(a["num_keys"]))
    elif positions:
        del local[a["num_keys"]]
    return [rs.reshard(ctx, PartitionedValue(v, s, o.shape), t) for v, o, t in zip(local, instr.outputs, targets)]


def _is_lower(ctx: DeviceContext, groups: np.ndarray, partner: np.ndarray, num_devices: int):
    """Whether this device holds the lower position of its pair (a device sitting the
    round out counts as lower: it keeps its own shard, first)."""
    return _device_flag(ctx, groups, np.arange(groups.shape[1]) <= partner, num_devices)


def _device_flag(ctx: DeviceContext, groups: np.ndarray, per_position: np.ndarray, num_devices: int):
    """This device's entry of a flag given per position in its group."""
    flags = np.zeros(num_devices, np.int64)
    flags[groups] = per_position
    return emit.compare(ctx.b, ctx.table_lookup(flags), ctx.constant(0, INDEX_DTYPE), "NE")


def _in_order(ctx: DeviceContext, lower, mine, theirs) -> list:
    """A pair's two shards, the lower position's first."""
    first = emit.broadcast(ctx.b, lower, mine.shape)
    return [emit.select(ctx.b, first, mine, theirs), emit.select(ctx.b, first, theirs, mine)]


def _positions(ctx: DeviceContext, like: PartitionedValue, dim: int, dtype) -> PartitionedValue:
    """Each element's global position along `dim`."""
    shape = like.local.shape
    start = ctx.table_lookup(like.sharding.coords()[:, dim] * shape[dim])
    pos = emit.add(ctx.b, emit.iota(ctx.b, shape, dim), emit.broadcast(ctx.b, start, shape))
    if dtype != INDEX_DTYPE:
        pos = ctx.b.add1("convert", [pos], shape, dtype)
    return PartitionedValue(pos, like.sharding, like.shape)


def _sort_local(ctx: DeviceContext, values, dim: int, num_keys: int, is_stable: bool) -> list:
    return ctx.b.add("sort", values, [(v.shape, v.dtype) for v in values], dimension=dim, is_stable=is_stable,
                     num_keys=num_keys)


def _half_starts(groups: np.ndarray, partner: np.ndarray, shard: int, num_devices: int) -> np.ndarray:
    """Where each device's half of a merged pair starts: the lower position keeps the low."""
    starts = np.zeros(num_devices, np.int64)
    starts[groups] = np.where(np.arange(groups.shape[1]) <= partner, 0, shard)   # idle: its own, first
    return starts


def _kept(ctx: DeviceContext, groups: np.ndarray, partner: np.ndarray, num_devices: int, mine: list,
          merged: list) -> list:
    """The merged halves, or on a device that sat the round out its own shard again."""
    idle = partner == np.arange(len(partner))
    if not idle.any():
        return merged
    sits_out = _device_flag(ctx, groups, idle, num_devices)
    return [emit.select(ctx.b, emit.broadcast(ctx.b, sits_out, v.shape), v, m) for v, m in zip(mine, merged)]


def _half(ctx: DeviceContext, x, dim: int, start, shard: int):
    """This device's half of a merged pair: `shard` elements from `start` along dim."""
    zero = ctx.constant(0, INDEX_DTYPE)
    sizes = list(x.shape)
    sizes[dim] = shard
    return ctx.dynamic_slice(x, [start if d == dim else zero for d in range(x.rank)], sizes)


register("sort",
         frontend=Frontend(converts={"sort": _convert_sort}),
         semantics=Semantics(evaluate=_evaluate_sort, lower=_lower_sort),
         rule=Rule(factors=lambda instr: _whole_dim_factors(instr, instr.attrs["dimension"]),
                   propagate=_propagate_sort, partition=_partition_sort, priority=LAYOUT))


# -- top-k: operands (x[, indices]) -> (values, indices) ------------------------------------
def _evaluate_top_k(instr: Instr, args, device):
    """The first k in order, and their positions (or, given a second operand, what it
    holds there: the indices the positions stand for)."""
    a, x = instr.attrs, args[0]
    key = total_order_key(x)
    order = np.argsort(~key if a["largest"] else key, axis=a["axis"], kind="stable")
    top = np.take(order, np.arange(a["k"]), axis=a["axis"])
    indices = top if len(args) == 1 else np.take_along_axis(args[1], top, a["axis"])
    return [np.take_along_axis(x, top, a["axis"]), indices.astype(instr.outputs[1].dtype)]


def _lower_top_k(instr, args, lc):
    a, x = instr.attrs, args[0]
    if a["largest"]:
        values, top = lax.top_k(x, a["k"], axis=a["axis"])
    else:
        _, top = lax.top_k(~_lax_total_order_key(x), a["k"], axis=a["axis"])
        values = jnp.take_along_axis(x, top, a["axis"])
    indices = top if len(args) == 1 else jnp.take_along_axis(args[1], top, a["axis"])
    return [values, indices.astype(instr.outputs[1].dtype)]


def _convert_top_k(b, eqn, args):
    return _emit_top_k(b, eqn, args, eqn.params["axis"], largest=True)


def _convert_approx_top_k(b, eqn, args):
    p = eqn.params
    return _emit_top_k(b, eqn, args, p["reduction_dimension"] % args[0].rank, largest=p["is_max_k"])


def _emit_top_k(b, eqn, args, axis: int, largest: bool):
    k = eqn.params["k"]
    types = [b.out_aval(eqn, i) for i in range(2)]
    if types[0][0][axis] != k:
        raise ShardingError(f"{eqn.primitive.name} of {args[0].type_str()} gives {types[0][0][axis]} results "
                            f"along dim {axis}, not k={k} (aggregate_to_topk=False); gspmd computes an exact "
                            "top-k: pass aggregate_to_topk=True.")
    return b.add("top-k", args, types, k=k, axis=axis, largest=largest)


def _top_k_factors(instr: Instr) -> list[fx.Factor]:
    return _whole_dim_factors(instr, instr.attrs["axis"])


def _partition_top_k(ctx, instr: Instr, operands, targets) -> list[PartitionedValue]:
    """Move the split away from the top-k dim, or take candidates per shard: the cheaper."""
    axis = instr.attrs["axis"]
    factors, space = _space_whole_along(instr, axis, operands, targets, ctx.hardware)
    x = operands[0]
    if len(operands) == 1 and x.sharding.tiles[axis] > 1:
        by_candidates = _candidates_cost(instr, x, targets, ctx.hardware)
        if cm.rounded(by_candidates) < cm.rounded(fx.cost(factors, space, operands, instr, targets, ctx.hardware)):
            return _top_k_of_candidates(ctx, instr, x, targets)
    return fx.run(ctx, instr, factors, space, operands, targets)


def _candidate_count(instr: Instr, x: PartitionedValue) -> int:
    """How many candidates each shard offers: k, or its whole shard if shorter."""
    return min(instr.attrs["k"], x.sharding.shard_shape(x.shape)[instr.attrs["axis"]])


def _candidates_layout(x: PartitionedValue, axis: int) -> Sharding:
    return x.sharding.keep_dims([d for d in range(x.rank) if d != axis])


def _candidates_cost(instr: Instr, x: PartitionedValue, targets, hw: cm.Hardware) -> cm.Cost:
    axis, s = instr.attrs["axis"], x.sharding
    shape = list(s.shard_shape(x.shape))
    shape[axis] = s.tiles[axis] * _candidate_count(instr, x)
    layout, groups = _candidates_layout(x, axis), groups_along(s, [axis])
    costs = [cm.collective_seconds(cm.Pattern.ALL_GATHER, math.prod(shape) * o.dtype.itemsize, groups, s.num_devices,
                                   hw) for o in instr.outputs]
    costs += [rs.cost(layout, t, o.shape, o.dtype.itemsize, hw) for o, t in zip(instr.outputs, targets)]
    return cm.add_costs(*costs)


def _top_k_of_candidates(ctx: DeviceContext, instr: Instr, x: PartitionedValue, targets) -> list[PartitionedValue]:
    """Each shard's top k (padding masked to come last; positions made global), all
    shards' candidates gathered along the dim in shard order, then their top k: equal
    values keep the order of their global indices, so ties still go to the lower one."""
    a, b, s = instr.attrs, ctx.b, x.sharding
    axis, values, indices = a["axis"], instr.outputs[0], instr.outputs[1]
    x = mask_padding(ctx, x, axis, _last_in_order(x.dtype, a["largest"]))
    count = _candidate_count(instr, x)
    shape = list(x.local.shape)
    shape[axis] = count
    top, pos = b.add("top-k", [x.local], [(shape, values.dtype), (shape, indices.dtype)], **dict(a, k=count))
    start = ctx.table_lookup(s.coords()[:, axis] * x.local.shape[axis])
    if indices.dtype != INDEX_DTYPE:
        start = b.add1("convert", [start], (), indices.dtype)
    pos = b.add1("add", [pos, b.add1("broadcast", [start], shape, indices.dtype, dims=())], shape, indices.dtype)
    groups = groups_along(s, [axis])
    top = ctx.all_gather(top, axis, groups, Why.PARTIAL_RESULTS, "top-k candidates")
    pos = ctx.all_gather(pos, axis, groups, Why.PARTIAL_RESULTS, "top-k candidate indices")
    shape[axis] = a["k"]
    outs = b.add("top-k", [top, pos], [(shape, values.dtype), (shape, indices.dtype)], **a)
    layout = _candidates_layout(x, axis)
    return [rs.reshard(ctx, PartitionedValue(v, layout, o.shape), t) for v, o, t in zip(outs, instr.outputs, targets)]


register("top-k",
         frontend=Frontend(converts={"top_k": _convert_top_k, "approx_top_k": _convert_approx_top_k}),
         semantics=Semantics(evaluate=_evaluate_top_k, lower=_lower_top_k),
         rule=Rule(factors=_top_k_factors, partition=_partition_top_k, priority=LAYOUT))
