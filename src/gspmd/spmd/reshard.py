"""Resharding between any two layouts of a value: the cheapest short chain of steps,
found by a cheapest-first search over layouts (A*, guided by the most data any device
still lacks), priced in seconds by the one cost model (spmd/cost.py) on the hardware
being planned for. The common one-collective transitions are recognised directly.

Steps:
  - cut: each device's target tile lies inside what it holds (dynamic-slice, free);
  - all-gather of the minor factor k of one dim's split (or, where most of the pieces
    are padding, an all-reduce of the pieces placed in zeros);
  - all-to-all moving the minor factors of some dims' splits to become minor factors of
    other dims' splits, several dims in one collective where the device groups allow;
  - exchange: each device receives exactly the pieces of its target tile that it does
    not hold, from holders, in a few rounds of collective-permutes (device-order changes,
    a split count changed on one dim such as 3 -> 2 pieces, cut-and-send).
A dim split into t tiles is coarsened by k (tile c -> c // k) by the k devices that
differ only in c % k. Shards of uneven dims only nest when ceil(D/(t/k)) == k*ceil(D/t)
or the coarse layout is the whole dim; gathers and all-to-alls take part where they
nest (padding to whole shards, slicing after), exchanges everywhere. A gather of a dim
that the target splits again is labelled a fallback so that reports show it; the search
takes it only when nothing cheaper exists."""
from __future__ import annotations

import functools
import heapq
import itertools
import math
from dataclasses import dataclass, replace
from typing import Optional, Sequence

import numpy as np

from gspmd.ir import Value
from gspmd.ir.reducer import ADD, OR
from gspmd.sharding import Sharding
from gspmd.spmd import cost as cm
from gspmd.spmd import pieces
from gspmd.spmd.context import INDEX_DTYPE, DeviceContext, Why
from gspmd.spmd.padding import mask_padding
from gspmd.spmd.partitioned import PartitionedValue

Cost = float  # estimated seconds on the hardware being planned for (spmd/cost.py)
FREE: Cost = 0.0
MAX_ROUNDS = 4    # collective-permutes one exchange may take
MAX_STEPS = 4     # steps one plan may take
MAX_EXPANSIONS = 100   # layouts one search expands before it settles for what it has found
# A search that only tries to beat the direct gathers expands IMPROVING_WORK / devices^2
# layouts (an expansion costs in proportion to the devices, and so do the layouts worth
# trying): 128 on 8 devices, 32 on 16, none from 128 on, where the direct gathers stand
# and planning at paper scale stays seconds.
IMPROVING_WORK = 8192


def add_costs(*costs: Cost) -> Cost:
    return float(sum(costs))


def rounded(cost: Cost) -> float:
    """A cost to compare: equal plans priced by different sums must tie (so that the
    layout order decides between them)."""
    return round(cost, 12)


def priced(pattern: cm.Pattern, nbytes: int, groups: np.ndarray, num_devices: int) -> Cost:
    """One collective whose result holds `nbytes` per device, on the current hardware."""
    return cm.collective_seconds(pattern, nbytes, groups, num_devices)


# -- layout arithmetic -------------------------------------------------------------------
def groups_along(s: Sharding, dims: Sequence[int]) -> np.ndarray:
    """Device groups [G, k] whose members differ only in their tile index along
    `dims` (major to minor), ordered by that index; one group per other tile & replica."""
    dims = list(dims)
    rest = [i for i in range(s.rank + 1) if i not in dims]
    k = math.prod(s.tile_assignment.shape[d] for d in dims)
    return s.tile_assignment.transpose(rest + dims).reshape(-1, k)


def minor_groups(s: Sharding, dim: int, k: int) -> np.ndarray:
    """Groups [G, k] of devices that differ only in (tile index along dim) % k."""
    return _move_groups(s, ((dim, None, k),))


def _coarsen_to(s: Sharding, tiles: Sequence[int]) -> Sharding:
    """Each dim's split coarsened to `tiles` (tile c -> c // (old / new))."""
    return Sharding.from_coords(s.coords() // (np.asarray(s.tiles) // np.asarray(tiles)), tiles)


def coarsen(s: Sharding, dim: int, k: int) -> Sharding:
    tiles = list(s.tiles)
    tiles[dim] //= k
    return _coarsen_to(s, tiles)


def _nests(size: int, fine_tiles: int, k: int) -> bool:
    """Do the shards of a (fine_tiles/k)-way split hold exactly k shards of a
    fine_tiles-way split each (or is the coarse split the whole dim)?"""
    coarse = fine_tiles // k
    return coarse == 1 or -(-size // coarse) == k * -(-size // fine_tiles)


def _shard_len(shape, s: Sharding, dim: int) -> int:
    return -(-shape[dim] // s.tiles[dim])


def _local_nbytes(shape, s: Sharding, itemsize: int) -> int:
    return math.prod(s.shard_shape(shape)) * itemsize


def _subdivides(dst: Sharding, src: Sharding, shape) -> bool:
    """Does every device's dst tile lie inside its src tile?"""
    if any(d % s for d, s in zip(dst.tiles, src.tiles)):
        return False
    if not all(_nests(n, d, d // s) for n, d, s in zip(shape, dst.tiles, src.tiles)):
        return False
    return _coarsen_to(dst, src.tiles) == src


# -- steps -----------------------------------------------------------------------------
@dataclass(frozen=True)
class SliceStep:
    """Target subdivides the source: each device cuts its tile out of what it holds."""
    target: Sharding

    def cost(self, shape, itemsize, s: Sharding) -> Cost:
        return FREE

    def result(self, s: Sharding) -> Sharding:
        return self.target

    def apply(self, ctx: DeviceContext, pv: PartitionedValue) -> PartitionedValue:
        x, tgt = pv.local, self.target
        starts, sizes = [], []
        for dim in range(pv.rank):
            size = _shard_len(pv.shape, tgt, dim)
            k = tgt.tiles[dim] // pv.sharding.tiles[dim]
            sizes.append(size)
            if k == 1:
                starts.append(ctx.constant(0, INDEX_DTYPE))
                continue
            # Pad so that the last sub-tile is in bounds (dynamic-slice would clamp).
            x = ctx.pad_high(x, dim, size * k - x.shape[dim])
            starts.append(ctx.table_lookup(tgt.coords()[:, dim] % k * size))
        return PartitionedValue(ctx.dynamic_slice(x, starts, sizes), tgt, pv.shape)


@dataclass(frozen=True)
class GatherStep:
    """All-gather the minor factor k of dim's split."""
    dim: int
    k: int
    why: Why = Why.RESHARD
    detail: str = "all-gather"

    def result(self, s: Sharding) -> Sharding:
        return coarsen(s, self.dim, self.k)

    def cost(self, shape, itemsize, s: Sharding) -> Cost:
        return priced(cm.Pattern.ALL_GATHER, self.k * _local_nbytes(shape, s, itemsize),
                      minor_groups(s, self.dim, self.k), s.num_devices)

    def apply(self, ctx: DeviceContext, pv: PartitionedValue) -> PartitionedValue:
        s = pv.sharding
        y = ctx.all_gather(pv.local, self.dim, minor_groups(s, self.dim, self.k), self.why, self.detail)
        result = self.result(s)
        if result.tiles[self.dim] == 1:
            y = ctx.slice_prefix(y, self.dim, pv.shape[self.dim])
        return PartitionedValue(y, result, pv.shape)


@dataclass(frozen=True)
class SumGatherStep:
    """Gather the minor factor k of dim's split by summing (all-reduce) each device's
    piece placed at its offset in zeros: cheaper than an all-gather where most of the
    k pieces are padding (a dim shorter than its split), since only the data travels."""
    dim: int
    k: int
    why: Why = Why.RESHARD
    detail: str = "all-reduce of zero-padded pieces"

    def result(self, s: Sharding) -> Sharding:
        return coarsen(s, self.dim, self.k)

    def cost(self, shape, itemsize, s: Sharding) -> Cost:
        return priced(cm.Pattern.ALL_REDUCE, _local_nbytes(shape, self.result(s), itemsize),
                      minor_groups(s, self.dim, self.k), s.num_devices)

    def apply(self, ctx: DeviceContext, pv: PartitionedValue) -> PartitionedValue:
        s, result, d = pv.sharding, self.result(pv.sharding), self.dim
        x = mask_padding(ctx, pv, d, 0).local          # what lies past the dim's end is not data
        n, shape = x.shape[d], list(x.shape)
        shape[d] = self.k * n
        zeros = ctx.b.add1("broadcast", [ctx.constant(np.zeros((), x.dtype))], tuple(shape), x.dtype, dims=())
        zero = ctx.constant(0, INDEX_DTYPE)
        at = [ctx.table_lookup(s.coords()[:, d] % self.k * n) if i == d else zero for i in range(x.rank)]
        placed = ctx.b.add1("dynamic-update-slice", [zeros, x, *at], tuple(shape), x.dtype)
        placed = ctx.slice_prefix(placed, d, _shard_len(pv.shape, result, d))
        reducer = OR if x.dtype == np.bool_ else ADD
        y = ctx.all_reduce(placed, minor_groups(s, d, self.k), reducer, self.why, self.detail)
        return PartitionedValue(y, result, pv.shape)


Move = tuple  # (source dim, destination dim, k): the minor factor k of the source's split
#               becomes the minor factor of the destination's


def _moved_layout(s: Sharding, moves: Sequence[Move]) -> Optional[Sharding]:
    """The layout after `moves`, applied in order."""
    coords, tiles = s.coords().copy(), list(s.tiles)
    for a, b, k in moves:
        digit = coords[:, a] % k
        coords[:, a] //= k
        coords[:, b] = coords[:, b] * k + digit
        tiles[a] //= k
        tiles[b] *= k
    return Sharding.from_coords(coords, tiles)


def _move_factors(moves: Sequence[Move], rank: int, side: int) -> list[int]:
    """Per dim, the product of the factors that leave it (side 0) or arrive (side 1)."""
    out = [1] * rank
    for move in moves:
        out[move[side]] *= move[2]
    return out


def _move_groups(s: Sharding, moves: Sequence[Move]) -> np.ndarray:
    """Groups [G, prod k] of devices that differ only in the digits the moves take from
    their source dims, ordered by those digits (first move major). A dim losing several
    factors gives its minor-most to the first move."""
    shape, digit_axis = [], {}
    for d, t in enumerate(s.tile_assignment.shape):
        mine = [i for i, move in enumerate(moves) if move[0] == d]
        shape.append(t // math.prod(moves[i][2] for i in mine))
        for i in reversed(mine):
            digit_axis[i] = len(shape)
            shape.append(moves[i][2])
    digits = [digit_axis[i] for i in range(len(moves))]
    rest = [ax for ax in range(len(shape)) if ax not in digits]
    k = math.prod(move[2] for move in moves)
    return s.tile_assignment.reshape(shape).transpose(rest + digits).reshape(-1, k)


def _moves_nest(s: Sharding, moves: Sequence[Move], shape) -> bool:
    """Uneven dims take part only where the shards before and after nest."""
    out, into = _move_factors(moves, s.rank, 0), _move_factors(moves, s.rank, 1)
    return all(_nests(shape[d], s.tiles[d], out[d]) and _nests(shape[d], s.tiles[d] * into[d], into[d])
               for d in range(s.rank))


@dataclass(frozen=True)
class AllToAllStep:
    """One all-to-all: each move's minor factor leaves its source dim's split and becomes
    the minor factor of its destination dim's, within the groups of devices that differ
    only in the moved digits. Destination dims are padded to whole pieces; source dims
    that end up whole are cut back to their size."""
    moves: tuple[Move, ...]
    target: Sharding

    def result(self, s: Sharding) -> Sharding:
        return self.target

    def _buffer(self, shape, s: Sharding) -> list[int]:
        into = _move_factors(self.moves, s.rank, 1)
        return [f * -(-n // (t * f)) for n, t, f in zip(shape, s.tiles, into)]

    def cost(self, shape, itemsize, s: Sharding) -> Cost:
        return priced(cm.Pattern.ALL_TO_ALL, math.prod(self._buffer(shape, s)) * itemsize,
                      _move_groups(s, self.moves), s.num_devices)

    def apply(self, ctx: DeviceContext, pv: PartitionedValue) -> PartitionedValue:
        x = pv.local
        for d, n in enumerate(self._buffer(pv.shape, pv.sharding)):
            x = ctx.pad_high(x, d, n - x.shape[d])
        groups = _move_groups(pv.sharding, self.moves)
        if len(self.moves) == 1:
            a, b, _ = self.moves[0]
            y = ctx.all_to_all(x, b, a, groups, Why.RESHARD, "all-to-all")
        else:
            y = _multi_all_to_all(ctx, x, self.moves, groups)
        for d in range(pv.rank):
            if self.target.tiles[d] == 1:
                y = ctx.slice_prefix(y, d, pv.shape[d])
        return PartitionedValue(y, self.target, pv.shape)


def _multi_all_to_all(ctx: DeviceContext, x: Value, moves: Sequence[Move], groups: np.ndarray) -> Value:
    """All-to-all for several moves at once: the pieces for each receiver are stacked
    on a leading dim (receiver's digits, first move major), exchanged, and each
    sender's piece is put back in its place along the source dims."""
    b, q, rank = ctx.b, len(moves), x.rank
    split, chunk_axis = [], {}
    for d, n in enumerate(x.shape):              # destination dims: (k_first, ..., k_last, rest)
        mine = [i for i, move in enumerate(moves) if move[1] == d]
        for i in mine:
            chunk_axis[i] = len(split)
            split.append(moves[i][2])
        split.append(n // math.prod(moves[i][2] for i in mine))
    chunks = [chunk_axis[i] for i in range(q)]
    others = [ax for ax in range(len(split)) if ax not in chunks]
    rest = [split[ax] for ax in others]
    group = math.prod(move[2] for move in moves)
    y = _transpose(ctx, b.add1("reshape", [x], tuple(split), x.dtype), chunks + others)
    y = b.add1("reshape", [y], (group, *rest), x.dtype)
    y = ctx.all_to_all(y, 0, 0, groups, Why.RESHARD, "all-to-all of several dims")
    y = b.add1("reshape", [y], tuple(move[2] for move in moves) + tuple(rest), x.dtype)
    order, merged = [], []
    for d in range(rank):                         # source dims: (k_last, ..., k_first, rest)
        mine = [i for i, move in enumerate(moves) if move[0] == d]
        order += list(reversed(mine)) + [q + d]
        merged.append(rest[d] * math.prod(moves[i][2] for i in mine))
    return b.add1("reshape", [_transpose(ctx, y, order)], tuple(merged), x.dtype)


def _transpose(ctx: DeviceContext, x: Value, permutation: Sequence[int]) -> Value:
    if list(permutation) == list(range(x.rank)):
        return x
    shape = tuple(x.shape[p] for p in permutation)
    return ctx.b.add1("transpose", [x], shape, x.dtype, permutation=tuple(permutation))


# -- exchange: point-to-point pieces ----------------------------------------------------
@functools.lru_cache(maxsize=4096)
def _transfers(src: Sharding, dst: Sharding, shape: tuple[int, ...]) -> Optional[pieces.Transfers]:
    """Per device, the pieces of its dst tile: the one it holds, the others from holders
    of their src tile in turn. None when some device would need more than MAX_ROUNDS."""
    n, m, size = np.asarray(src.shard_shape(shape)), np.asarray(dst.shard_shape(shape)), np.asarray(shape)
    tile_lo = dst.coords() * m
    tile_hi = np.minimum(tile_lo + m, size)
    first = tile_lo // n
    count = np.where(tile_hi > tile_lo, -(-tile_hi // n) - first, 0)
    if np.prod(count, axis=1).max() > MAX_ROUNDS + 1:
        return None
    # Every combination of the overlapped source tiles along each dim: [N, C, rank].
    offsets = np.stack(np.meshgrid(*[np.arange(max(1, c)) for c in count.max(axis=0)], indexing="ij"), -1)
    offsets = offsets.reshape(-1, src.rank)
    tile = first[:, None, :] + offsets[None]
    valid = np.all(offsets[None] < count[:, None, :], axis=-1)
    lo = np.maximum(tile_lo[:, None], tile * n)
    hi = np.minimum(tile_hi[:, None], (tile + 1) * n)
    receiver = np.broadcast_to(np.arange(dst.num_devices)[:, None], valid.shape)
    tile, lo, hi, receiver = tile[valid], lo[valid], hi[valid], receiver[valid]
    kept = np.all(tile == src.coords()[receiver], axis=1)
    sender = receiver.copy()
    sender[~kept] = pieces.holders_in_turn(src, tile[~kept])
    return pieces.Transfers(sender, receiver, lo - src.coords()[sender] * n, lo - tile_lo[receiver], hi - lo,
                            (lo == tile_lo[receiver]) & (hi == tile_hi[receiver]))


@dataclass(frozen=True)
class ExchangeStep:
    """Each device receives the pieces of its target tile that it does not hold (cut by
    their holders), one collective-permute per round, and keeps its own."""
    target: Sharding

    def result(self, s: Sharding) -> Sharding:
        return self.target

    def cost(self, shape, itemsize, s: Sharding) -> Cost:
        return _transfers(s, self.target, tuple(shape)).cost(itemsize, s.num_devices)

    def bound(self, shape, itemsize, s: Sharding) -> Cost:
        """An upper bound of cost(), quicker (the search compares many)."""
        return _transfers(s, self.target, tuple(shape)).bound(itemsize, s.num_devices)

    def apply(self, ctx: DeviceContext, pv: PartitionedValue) -> PartitionedValue:
        t = _transfers(pv.sharding, self.target, pv.shape)
        y = pieces.move(ctx, pv.local, t, self.target.shard_shape(pv.shape), Why.RESHARD, "collective-permute")
        return PartitionedValue(y, self.target, pv.shape)


# -- planning --------------------------------------------------------------------------
ALL_FACTORS_UP_TO = 16   # tiles of a split up to which every divisor is a factor to try


def _factors(t: int, *wanted: int) -> list[int]:
    """The split factors (>1, dividing t) worth trying out of t tiles: every divisor of
    a small split (all-to-alls that also reorder devices combine small factors); of a
    larger one, each of `wanted` and its greatest common divisor with t, those that take
    a dim toward the target's split (every divisor of a split over thousands of devices
    would be thousands of layouts to search)."""
    if t <= ALL_FACTORS_UP_TO:
        return [k for k in range(2, t + 1) if t % k == 0]
    return sorted({g for w in wanted for g in (w, math.gcd(t, w)) if g > 1 and t % g == 0})


def _gathers(s: Sharding, dst: Sharding, shape):
    for d, t in enumerate(s.tiles):
        for k in _factors(t, t, t // math.gcd(t, dst.tiles[d])):
            if _nests(shape[d], t, k):
                if shape[d] < t:   # some pieces are only padding; at equal cost, the smaller result
                    yield SumGatherStep(d, k)
                yield GatherStep(d, k)


def _single_moves(s: Sharding, dst: Sharding, shape):
    for a, t in enumerate(s.tiles):
        for b in range(s.rank):
            wanted = dst.tiles[b] // s.tiles[b] if dst.tiles[b] % s.tiles[b] == 0 else 1
            for k in _factors(t, t, t // math.gcd(t, dst.tiles[a]), wanted):
                if b != a and _moves_nest(s, ((a, b, k),), shape):
                    yield (a, b, k)


def _on_track(s: Sharding, dst: Sharding, dim: int) -> bool:
    """Does dst split `dim` as s does, or refine that split?"""
    t, u = s.tiles[dim], dst.tiles[dim]
    return u % t == 0 and np.array_equal(dst.coords()[:, dim] // (u // t), s.coords()[:, dim])


def _all_to_alls(s: Sharding, dst: Sharding, shape):
    """Every single move, and every set of moves toward dst that one all-to-all can do
    together (no dim both gives and receives)."""
    singles = list(_single_moves(s, dst, shape))
    combos = set()

    def extend(moves: tuple, layout: Sharding):
        if len(moves) > 1:
            combos.add(moves)
        for m in (singles if not moves else _single_moves(layout, dst, shape)):
            if m[0] in {x[1] for x in moves} or m[1] in {x[0] for x in moves}:
                continue
            after = _moved_layout(layout, (m,))
            if after is not None and _on_track(after, dst, m[1]) and _moves_nest(s, moves + (m,), shape):
                extend(moves + (m,), after)
    extend((), s)
    for moves in [(m,) for m in singles] + sorted(combos):
        target = _moved_layout(s, moves)
        if target is not None:
            yield AllToAllStep(moves, target)


def _refined(dst: Sharding, src: Sharding, dim: int, k: int) -> Optional[Sharding]:
    """dst with dim split k times finer among each tile's replicas (a layout one gather
    of dim turns into dst), giving devices the sub-tile they hold in src where possible."""
    r = dst.num_replicas
    if r % k:
        return None
    t = dst.tiles[dim] * k
    dst_c = dst.coords()
    members = dst.tile_assignment.reshape(-1, r)                  # [groups, r]: one tile's holders
    held = src.coords()[:, dim] // (src.tiles[dim] // t) if src.tiles[dim] % t == 0 else np.full(len(dst_c), -1)
    wish = np.where(held // k == dst_c[:, dim], held % k, k)[members]     # k: no wish
    # Each digit goes to r/k members: first to those who wish it (in order), then to the rest.
    order = np.argsort(wish, axis=-1, kind="stable")
    members, wish = np.take_along_axis(members, order, -1), np.take_along_axis(wish, order, -1)
    rank = np.arange(r) - (wish[:, :, None] > wish[:, None, :]).sum(-1)
    granted = (wish < k) & (rank < r // k)
    digits = np.where(granted, wish, -1)
    spare = r // k - np.stack([(digits == d).sum(1) for d in range(k)], 1)
    digits[~granted] = np.repeat(np.tile(np.arange(k), len(members)), spare.ravel())
    coords = dst_c.copy()
    coords[members.ravel(), dim] = dst_c[members.ravel(), dim] * k + digits.ravel()
    tiles = list(dst.tiles)
    tiles[dim] = t
    return Sharding.from_coords(coords, tiles)


def _preimages(src: Sharding, dst: Sharding, shape) -> list[Sharding]:
    """Layouts one gather or one all-to-all turns into dst: where an exchange from the
    source should land when the rest is cheaper done on small pieces."""
    out = []
    for d, t in enumerate(dst.tiles):
        finer = src.tiles[d] // t if src.tiles[d] % t == 0 else 1
        for k in _factors(dst.num_replicas, dst.num_replicas, finer):
            if _nests(shape[d], t * k, k):
                out.append(_refined(dst, src, d, k))
        for a in range(dst.rank):
            for k in _factors(t, t, src.tiles[a]):
                x = _moved_layout(dst, ((d, a, k),)) if a != d else None   # the inverse move
                if x is not None and _moves_nest(x, ((a, d, k),), shape):
                    out.append(x)
    return [x for x in out if x is not None and x not in (src, dst)]


def _steps_from(cur: Sharding, src: Sharding, dst: Sharding, shape, preimages: list[Sharding]):
    for target in [dst] + (preimages if cur == src else []):
        if _subdivides(target, cur, shape):
            yield SliceStep(target)
        elif (t := _transfers(cur, target, shape)) is not None and t.rounds() <= MAX_ROUNDS:
            yield ExchangeStep(target)
    yield from _gathers(cur, dst, shape)
    yield from _all_to_alls(cur, dst, shape)


def plan(src: Sharding, dst: Sharding, shape: Sequence[int], itemsize: int) -> tuple:
    """Steps that turn a value laid out as `src` into `dst` (elements of `itemsize`
    bytes), the cheapest on the hardware being planned for."""
    return _plan(src, dst, tuple(shape), itemsize, cm.current())


@functools.lru_cache(maxsize=65536)
def _plan(src: Sharding, dst: Sharding, shape: tuple[int, ...], itemsize: int, hw: cm.Hardware) -> tuple:
    # Partition rules price the same few transitions over and over (each candidate
    # layout of every op): plans are immutable, so they are computed once.
    if src == dst:
        return ()
    if _subdivides(dst, src, shape):
        return (SliceStep(dst),)
    if 0 in shape:   # nothing to move: gather whatever is split, then cut
        return _gather_all_and_cut(src, dst)
    # The direct gathers are usually the plan; the search, bounded by them, looks for a
    # cheaper one (an all-to-all that turns a slow ring into faster sub-rings, say).
    direct = _direct(src, dst, shape, itemsize)
    return _label_fallbacks(_search(src, dst, shape, itemsize, hw, direct), src, dst)


def _direct(src: Sharding, dst: Sharding, shape: tuple[int, ...], itemsize: int) -> Optional[tuple]:
    """A coarser split of dims at least as long as their splits: all-gathers, each
    device receiving just what it lacks in as few collectives as there are dims."""
    if _subdivides(src, dst, shape) and all(n >= t for n, t in zip(shape, src.tiles)):
        gathers = [GatherStep(d, s // t) for d, (s, t) in enumerate(zip(src.tiles, dst.tiles)) if s > t]
        return _cheapest_order(gathers, src, shape, itemsize)
    return None


def _cheapest_order(gathers: list, src: Sharding, shape: tuple[int, ...], itemsize: int) -> tuple:
    """Gathers of several dims in the order that moves least: a gathered uneven dim sheds
    its padding before the next."""
    return min(itertools.permutations(gathers), key=lambda steps: rounded(_chain_cost(steps, src, shape, itemsize)))


def at_least(src: Sharding, dst: Sharding, shape: Sequence[int], itemsize: int) -> Cost:
    """A lower bound of cost(src, dst, ...), without planning: callers comparing
    alternatives skip the plans that cannot win."""
    return _at_least(src, dst, tuple(shape), itemsize, cm.current())


@functools.lru_cache(maxsize=65536)
def _at_least(src: Sharding, dst: Sharding, shape: tuple[int, ...], itemsize: int, hw: cm.Hardware) -> Cost:
    return FREE if src == dst else _lacking(src, dst, shape, itemsize, hw)


def _lacking(cur: Sharding, dst: Sharding, shape: tuple[int, ...], itemsize: int, hw: cm.Hardware) -> Cost:
    """A lower bound of what turning cur into dst takes: the most data any device lacks
    (what it needs of its dst tile minus what its cur tile holds), received over all of
    its links at once by one collective."""
    n, m, size = np.asarray(cur.shard_shape(shape)), np.asarray(dst.shard_shape(shape)), np.asarray(shape)
    lo_c, lo_d = cur.coords() * n, dst.coords() * m
    hi_c, hi_d = np.minimum(lo_c + n, size), np.minimum(lo_d + m, size)
    need = np.prod(np.maximum(hi_d - lo_d, 0), axis=1)
    have = np.prod(np.maximum(np.minimum(hi_c, hi_d) - np.maximum(lo_c, lo_d), 0), axis=1)
    lacking = int((need - have).max()) * itemsize
    if not lacking:
        return FREE
    links = sum(d.bandwidth * (2 if d.link is cm.Link.RING else 1) for d in hw.network(cur.num_devices).dims)
    return hw.collective_overhead_s + lacking / links


def _search(src: Sharding, dst: Sharding, shape: tuple[int, ...], itemsize: int, hw: cm.Hardware,
            incumbent: Optional[tuple] = None) -> tuple:
    """The cheapest chain of at most MAX_STEPS steps (A* over layouts, guided by what
    devices still lack; at equal cost, fewer gathers of what is split again, then fewer
    collective-permutes), or `incumbent` where nothing is cheaper. Gathering everything
    and cutting is always possible, so a plan is always found."""
    budget = MAX_EXPANSIONS if incumbent is None else IMPROVING_WORK // src.num_devices ** 2
    if budget == 0:
        return incumbent
    bound = rounded(_chain_cost(incumbent, src, shape, itemsize)) if incumbent is not None else math.inf
    expansions = 0
    preimages = _preimages(src, dst, shape)
    start = (FREE, 0, 0)
    best = {src: start}
    frontier = [((rounded(_lacking(src, dst, shape, itemsize, hw)), 0, 0), start, next(_tie), src, ())]
    expanded = []   # (steps, layout) of the layouts one step or none from src expanded so far
    while frontier:
        guess, so_far, _, cur, steps = heapq.heappop(frontier)
        if guess[0] >= bound:   # nothing left can beat the incumbent
            return incumbent
        if cur == dst:
            return steps
        if so_far > best[cur] or len(steps) == MAX_STEPS:
            continue
        if expansions == budget:
            reached = expanded + [(steps, cur)] + [(e[4], e[3]) for e in heapq.nsmallest(15, frontier)]
            return _settle(src, dst, shape, itemsize, reached + ([(incumbent, dst)] if incumbent is not None else []))
        if len(steps) <= 1:
            expanded.append((steps, cur))
        expansions += 1
        for step in _steps_from(cur, src, dst, shape, preimages):
            nxt = step.result(cur)
            exchange = isinstance(step, ExchangeStep)
            seconds = so_far[0] + (step.bound if exchange else step.cost)(shape, itemsize, cur)
            resplit = isinstance(step, (GatherStep, SumGatherStep)) and dst.tiles[step.dim] > nxt.tiles[step.dim]
            total = (rounded(seconds), so_far[1] + resplit,
                     so_far[2] + (_transfers(cur, nxt, shape).rounds() if exchange else 0))
            if nxt not in best or total < best[nxt]:
                best[nxt] = total
                guess = rounded(seconds + _lacking(nxt, dst, shape, itemsize, hw))
                heapq.heappush(frontier, ((guess,) + total[1:], total, next(_tie), nxt, steps + (step,)))
    if incumbent is not None:
        return incumbent
    raise AssertionError(f"no reshard plan {src} -> {dst} for {shape}")


_tie = itertools.count()   # orders equal entries of the search's heap by when they came


def _settle(src: Sharding, dst: Sharding, shape: tuple[int, ...], itemsize: int, reached: list) -> tuple:
    """A search that ran out of expansions (large device counts, where the layouts between
    two far-apart ones are many) finishes the partial plans it reached (src and the steps
    from it that it expanded, and the most promising unexpanded ones) by a cut or the
    direct gathers where those reach dst, else by gathering down to the finest split both
    share (or everything) and cutting dst out, and takes the cheapest: planning a
    2048-device program stays seconds, not minutes."""
    def finishes(cur: Sharding) -> list:
        if cur == dst:
            return [()]
        if _subdivides(dst, cur, shape):
            return [(SliceStep(dst),)]
        direct = _direct(cur, dst, shape, itemsize)
        if direct is not None:
            return [direct]
        # Gathering less is not always faster: a whole-mesh gather may run on shorter rings.
        return [_gather_to_common_and_cut(cur, dst, shape, itemsize), _gather_all_and_cut(cur, dst)]
    plans = [steps + rest for steps, cur in reached for rest in finishes(cur)]
    return min(plans, key=lambda steps: rounded(_chain_cost(steps, src, shape, itemsize)))


def _gather_to_common_and_cut(cur: Sharding, dst: Sharding, shape: tuple[int, ...], itemsize: int) -> tuple:
    """Gather each dim only down to the finest split that dst's split refines device by
    device (the shards nest and each device's coarse piece is the same in both), then cut
    dst out; where that layout is not one dst subdivides (replication differs), gather
    everything instead."""
    gathers = [GatherStep(d, t // m) for d, t in enumerate(cur.tiles)
               if t > (m := _common_split(cur, dst, shape, d))]
    common = functools.reduce(lambda s, g: g.result(s), gathers, cur)
    if common != dst and not _subdivides(dst, common, shape):
        return _gather_all_and_cut(cur, dst)
    return _cheapest_order(gathers, cur, shape, itemsize) + ((SliceStep(dst),) if common != dst else ())


def _common_split(cur: Sharding, dst: Sharding, shape: tuple[int, ...], dim: int) -> int:
    """The most pieces dim can keep for dst: a split both cur's and dst's splits nest in,
    whose piece is the same one on every device in both."""
    ts, td = cur.tiles[dim], dst.tiles[dim]
    for m in range(math.gcd(ts, td), 1, -1):
        if (ts % m == 0 and td % m == 0 and _nests(shape[dim], ts, ts // m) and _nests(shape[dim], td, td // m)
                and np.array_equal(cur.coords()[:, dim] // (ts // m), dst.coords()[:, dim] // (td // m))):
            return m
    return 1


def _gather_all_and_cut(cur: Sharding, dst: Sharding) -> tuple:
    """The plan that always exists: gather every split dim, then cut dst out."""
    gathers = tuple(GatherStep(d, t) for d, t in enumerate(cur.tiles) if t > 1)
    whole = functools.reduce(lambda s, g: g.result(s), gathers, cur)
    return gathers + ((SliceStep(dst),) if whole != dst else ())


def _label_fallbacks(steps: tuple, src: Sharding, dst: Sharding) -> tuple:
    """A gather of a dim that the target splits further is data gathered only to be
    split again: label it so that reports warn."""
    out, s = [], src
    for step in steps:
        if isinstance(step, (GatherStep, SumGatherStep)) and dst.tiles[step.dim] > step.result(s).tiles[step.dim]:
            step = replace(step, why=Why.FALLBACK, detail=f"{step.detail} then slice, {src} -> {dst}")
        out.append(step)
        s = step.result(s)
    return tuple(out)


def whole_along(s: Sharding, dim: int, shape) -> list[Sharding]:
    """Layouts like `s` with `dim` whole: its split gathered, or moved to become the
    minor part of another dim's split (one all-to-all, uneven dims padded to whole
    pieces) where that dim has room for the finer split and its shards nest in the
    coarser ones."""
    layouts = [s.keep_dims([d for d in range(s.rank) if d != dim])]
    t = s.tiles[dim]
    if t == 1:
        return layouts
    for other in range(s.rank):
        move = ((dim, other, t),)
        if other != dim and shape[other] >= s.tiles[other] * t and _moves_nest(s, move, shape):
            layouts.append(_moved_layout(s, move))
    return layouts


def cost(src: Sharding, dst: Sharding, shape: Sequence[int], itemsize: int) -> Cost:
    """What resharding takes, in seconds on the hardware being planned for (the
    estimate planning compares)."""
    return _cost(src, dst, tuple(shape), itemsize, cm.current())


@functools.lru_cache(maxsize=65536)
def _cost(src: Sharding, dst: Sharding, shape: tuple[int, ...], itemsize: int, hw: cm.Hardware) -> Cost:
    return _chain_cost(plan(src, dst, shape, itemsize), src, shape, itemsize)


def _chain_cost(steps, src: Sharding, shape, itemsize: int) -> Cost:
    total, s = FREE, src
    for step in steps:
        total = add_costs(total, step.cost(shape, itemsize, s))
        s = step.result(s)
    return total


def reshard(ctx: DeviceContext, pv: PartitionedValue, dst: Sharding) -> PartitionedValue:
    for step in plan(pv.sharding, dst, pv.shape, pv.dtype.itemsize):
        pv = step.apply(ctx, pv)
    assert pv.sharding == dst, (pv.sharding, dst)
    return pv
