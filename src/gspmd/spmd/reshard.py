"""Resharding between any two shardings of a value, as an ordered list of small
strategies: dynamic-slice (target subdivides the source: no communication),
all-to-all (move a split factor to another dim), collective-permute (same tiling, other
devices), then all-gather down to the layout both share followed by a slice. The last
one is always correct; when it gathers a dim that the target splits again, its
collective is labelled a fallback so that reports show it.

A dim split into t tiles can be coarsened by a factor k (tile c -> c // k): the k
devices that differ only in c % k hold the pieces, so a k-way all-gather among them
coarsens and a slice refines. Shards of uneven dims only nest when
ceil(D/(t/k)) == k * ceil(D/t) (or the coarse layout is the whole dim)."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from gspmd.sharding import Sharding
from gspmd.spmd import cost as cm
from gspmd.spmd.context import DeviceContext, Why
from gspmd.spmd.partitioned import PartitionedValue

Cost = float  # estimated seconds on the hardware being planned for (spmd/cost.py)
FREE: Cost = 0.0


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
    shape = s.tile_assignment.shape
    split = s.tile_assignment.reshape(shape[:dim] + (shape[dim] // k, k) + shape[dim + 1:])
    order = [i for i in range(split.ndim) if i != dim + 1] + [dim + 1]
    return split.transpose(order).reshape(-1, k)


def _coarsen_to(s: Sharding, tiles: Sequence[int]) -> Sharding:
    """Each dim's split coarsened to `tiles` (tile c -> c // (old / new))."""
    return Sharding.from_coords(s.coords() // (np.asarray(s.tiles) // np.asarray(tiles)), tiles)


def coarsen(s: Sharding, dim: int, k: int) -> Sharding:
    tiles = list(s.tiles)
    tiles[dim] //= k
    return _coarsen_to(s, tiles)


def _nests(size: int, fine_tiles: int, k: int) -> bool:
    """Do the shards of a (fine_tiles/k)-way split hold exactly k shards of a
    fine_tiles-way split each?"""
    coarse = fine_tiles // k
    return coarse == 1 or -(-size // coarse) == k * -(-size // fine_tiles)


def _shard_len(shape, s: Sharding, dim: int) -> int:
    return -(-shape[dim] // s.tiles[dim])


def _local_nbytes(shape, s: Sharding, itemsize: int) -> int:
    return math.prod(s.shard_shape(shape)) * itemsize


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
                starts.append(ctx.constant(0, np.int32))
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
        return priced(cm.Pattern.ALL_GATHER, _local_nbytes(shape, self.result(s), itemsize),
                      minor_groups(s, self.dim, self.k), s.num_devices)

    def apply(self, ctx: DeviceContext, pv: PartitionedValue) -> PartitionedValue:
        s = pv.sharding
        y = ctx.all_gather(pv.local, self.dim, minor_groups(s, self.dim, self.k), self.why, self.detail)
        result = self.result(s)
        if result.tiles[self.dim] == 1:
            y = ctx.slice_prefix(y, self.dim, pv.shape[self.dim])
        return PartitionedValue(y, result, pv.shape)


@dataclass(frozen=True)
class AllToAllStep:
    """Move the minor factor k of dim `src`'s split to become the minor factor of dim
    `dst`'s split, within the k-device groups that hold it."""
    src: int
    dst: int
    k: int
    target: Sharding

    def result(self, s: Sharding) -> Sharding:
        return self.target

    def cost(self, shape, itemsize, s: Sharding) -> Cost:
        return priced(cm.Pattern.ALL_TO_ALL, _local_nbytes(shape, self.target, itemsize),
                      minor_groups(s, self.src, self.k), s.num_devices)

    def apply(self, ctx: DeviceContext, pv: PartitionedValue) -> PartitionedValue:
        groups = minor_groups(pv.sharding, self.src, self.k)
        y = ctx.all_to_all(pv.local, self.dst, self.src, groups, Why.RESHARD, "all-to-all")
        return PartitionedValue(y, self.target, pv.shape)


@dataclass(frozen=True)
class PermuteStep:
    """Same tiling, other devices: each device fetches its tile from a holder."""
    target: Sharding

    def result(self, s: Sharding) -> Sharding:
        return self.target

    def cost(self, shape, itemsize, s: Sharding) -> Cost:
        return priced(cm.Pattern.PERMUTE, _local_nbytes(shape, self.target, itemsize),
                      _permute_pairs(s, self.target), s.num_devices)

    def apply(self, ctx: DeviceContext, pv: PartitionedValue) -> PartitionedValue:
        y = ctx.collective_permute(pv.local, _permute_pairs(pv.sharding, self.target),
                                   Why.RESHARD, "collective-permute")
        return PartitionedValue(y, self.target, pv.shape)


def _permute_pairs(src: Sharding, dst: Sharding) -> np.ndarray:
    """(source, target) pairs; devices that already hold their tile send to themselves."""
    have = src.tile_assignment.reshape(-1, src.num_replicas)
    want = dst.tile_assignment.reshape(-1, dst.num_replicas)
    pairs = []
    for holders, needers in zip(have, want):
        stay = sorted(set(holders) & set(needers))
        senders = stay + [d for d in holders if d not in stay]
        receivers = stay + [d for d in needers if d not in stay]
        pairs += list(zip(senders, receivers))
    return np.asarray(pairs, np.int64)


# -- planning --------------------------------------------------------------------------
def _subdivides(dst: Sharding, src: Sharding, shape) -> bool:
    if any(d % s for d, s in zip(dst.tiles, src.tiles)):
        return False
    if not all(_nests(n, d, d // s) for n, d, s in zip(shape, dst.tiles, src.tiles)):
        return False
    return _coarsen_to(dst, src.tiles) == src


def _all_to_alls(src: Sharding, shape):
    """Every single all-to-all from `src`: the minor factor k of dim a's split moves to
    become the minor factor of dim b's split (evenly dividing dims only)."""
    for a in range(src.rank):
        if shape[a] % src.tiles[a]:
            continue
        for k in (k for k in range(2, src.tiles[a] + 1) if src.tiles[a] % k == 0):
            for b in range(src.rank):
                if b == a or shape[b] % (src.tiles[b] * k):
                    continue
                coords = src.coords().copy()
                coords[:, b] = coords[:, b] * k + coords[:, a] % k
                coords[:, a] //= k
                tiles = list(src.tiles)
                tiles[a] //= k
                tiles[b] *= k
                yield AllToAllStep(a, b, k, Sharding.from_coords(coords, tiles))


def _agreement(s: Sharding, dst: Sharding) -> int:
    """How many of the dims `dst` splits `s` already splits exactly that way."""
    return sum(dst.tiles[d] > 1 and s.tiles[d] == dst.tiles[d]
               and np.array_equal(s.coords()[:, d], dst.coords()[:, d]) for d in range(s.rank))


def _all_to_all_toward(src: Sharding, dst: Sharding, shape) -> Optional[AllToAllStep]:
    """An all-to-all that lands on dst, else one that moves a split to a dim dst splits
    and so matches dst on more dims."""
    best, score = None, _agreement(src, dst)
    for step in _all_to_alls(src, shape):
        if step.target == dst:
            return step
        gained = _agreement(step.target, dst)
        if gained > score and dst.tiles[step.dst] > 1:
            best, score = step, gained
    return best


def _common_tiles(src: Sharding, dst: Sharding, dim: int, size: int) -> int:
    """The finest split of `dim` that both layouts refine, device by device."""
    ts, td = src.tiles[dim], dst.tiles[dim]
    for m in range(math.gcd(ts, td), 0, -1):
        if ts % m or td % m or not (_nests(size, ts, ts // m) and _nests(size, td, td // m)):
            continue
        if np.array_equal(src.coords()[:, dim] // (ts // m), dst.coords()[:, dim] // (td // m)):
            return m
    return 1


def plan(src: Sharding, dst: Sharding, shape: Sequence[int]) -> tuple:
    """Steps that turn a value laid out as `src` into `dst`."""
    return _plan(src, dst, tuple(shape))


@functools.lru_cache(maxsize=65536)
def _plan(src: Sharding, dst: Sharding, shape: tuple[int, ...]) -> tuple:
    # Partition rules price the same few transitions over and over (each candidate
    # layout of every op): plans are immutable, so they are computed once.
    return tuple(_plan_steps(src, dst, shape))


def _plan_steps(src: Sharding, dst: Sharding, shape: tuple[int, ...]) -> list:
    if src == dst:
        return []
    if _subdivides(dst, src, shape):
        return [SliceStep(dst)]
    step = _all_to_all_toward(src, dst, shape)
    if step is not None:
        return [step, *_plan(step.target, dst, shape)]
    if src.tiles == dst.tiles and src.num_replicas == dst.num_replicas:
        return [PermuteStep(dst)]
    steps, cur = [], src
    for dim in range(src.rank):
        m = _common_tiles(src, dst, dim, shape[dim])
        if src.tiles[dim] > m:
            k = src.tiles[dim] // m
            steps.append(GatherStep(dim, k, Why.FALLBACK, f"all-gather then slice, {src} -> {dst}")
                         if dst.tiles[dim] > m else GatherStep(dim, k))
            cur = steps[-1].result(cur)
    if cur != dst:
        steps.append(SliceStep(dst))
    return steps


def cost(src: Sharding, dst: Sharding, shape: Sequence[int], itemsize: int) -> Cost:
    """What resharding takes, in seconds on the hardware being planned for (the
    estimate planning compares)."""
    return _cost(src, dst, tuple(shape), itemsize, cm.current())


@functools.lru_cache(maxsize=65536)
def _cost(src: Sharding, dst: Sharding, shape: tuple[int, ...], itemsize: int, hw: cm.Hardware) -> Cost:
    total, s = FREE, src
    for step in plan(src, dst, shape):
        total = add_costs(total, step.cost(shape, itemsize, s))
        s = step.result(s)
    return total


def reshard(ctx: DeviceContext, pv: PartitionedValue, dst: Sharding) -> PartitionedValue:
    for step in plan(pv.sharding, dst, pv.shape):
        pv = step.apply(ctx, pv)
    assert pv.sharding == dst, (pv.sharding, dst)
    return pv
