"""Resharding between any two shardings of a value, as an ordered list of small
strategies: dynamic-slice (no communication), all-to-all, collective-permute, then
all-gather of the dims the target does not keep followed by a slice. The last one is
always correct; when it has to gather a dim that the target splits too, the step is
labelled a fallback so that reports show it."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from gspmd.sharding import Sharding
from gspmd.spmd.context import DeviceContext
from gspmd.spmd.partitioned import PartitionedValue


def groups_along(s: Sharding, dims: Sequence[int]) -> np.ndarray:
    """Device groups [G, k] whose members differ only in their tile index along
    `dims` (major to minor), ordered by that index; one group per other tile & replica."""
    dims = list(dims)
    rest = [i for i in range(s.rank + 1) if i not in dims]
    k = math.prod(s.tile_assignment.shape[d] for d in dims)
    return s.tile_assignment.transpose(rest + dims).reshape(-1, k)


def _shard_len(shape, s: Sharding, dim: int) -> int:
    return -(-shape[dim] // s.tiles[dim])


def _local_nbytes(shape, s: Sharding, itemsize: int) -> int:
    return math.prod(s.shard_shape(shape)) * itemsize


def moved(nbytes: int, group_size: int) -> float:
    """Bytes a device sends when a collective over `group_size` devices exchanges
    `nbytes` (ring algorithms move (k-1)/k of it)."""
    return nbytes * (group_size - 1) / group_size


Cost = tuple  # (bytes moved per device, number of collectives): compared lexicographically


def add_costs(*costs: Cost) -> Cost:
    return (sum(c[0] for c in costs), sum(c[1] for c in costs))


FREE: Cost = (0.0, 0)


@dataclass(frozen=True)
class SliceStep:
    """Target refines the source: each device cuts its tile out of what it holds."""
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
            sizes.append(size)
            if tgt.tiles[dim] == pv.sharding.tiles[dim]:
                starts.append(ctx.constant(0, np.int32))
                continue
            # Source holds the whole dim here: pad so the last tile is in bounds.
            x = ctx.pad_high(x, dim, size * tgt.tiles[dim] - x.shape[dim])
            starts.append(ctx.table_lookup(tgt.coords()[:, dim] * size))
        return PartitionedValue(ctx.dynamic_slice(x, starts, sizes), tgt, pv.shape)


@dataclass(frozen=True)
class GatherStep:
    dim: int
    rule: str = "reshard: all-gather"

    def result(self, s: Sharding) -> Sharding:
        return s.keep_dims([i for i in range(s.rank) if i != self.dim])

    def cost(self, shape, itemsize, s: Sharding) -> Cost:
        return (moved(_local_nbytes(shape, self.result(s), itemsize), s.tiles[self.dim]), 1)

    def apply(self, ctx: DeviceContext, pv: PartitionedValue) -> PartitionedValue:
        s = pv.sharding
        y = ctx.all_gather(pv.local, self.dim, groups_along(s, [self.dim]), self.rule)
        y = ctx.slice_prefix(y, self.dim, pv.shape[self.dim])
        return PartitionedValue(y, self.result(s), pv.shape)


@dataclass(frozen=True)
class AllToAllStep:
    """Move a split from dim `src` to dim `dst` within the same device groups."""
    src: int
    dst: int
    target: Sharding

    def cost(self, shape, itemsize, s: Sharding) -> Cost:
        return (moved(_local_nbytes(shape, self.target, itemsize), s.tiles[self.src]), 1)

    def result(self, s: Sharding) -> Sharding:
        return self.target

    def apply(self, ctx: DeviceContext, pv: PartitionedValue) -> PartitionedValue:
        groups = groups_along(pv.sharding, [self.src])
        y = ctx.all_to_all(pv.local, self.dst, self.src, groups, "reshard: all-to-all")
        return PartitionedValue(y, self.target, pv.shape)


@dataclass(frozen=True)
class PermuteStep:
    """Same tiling, other devices: each device fetches its tile from a holder."""
    target: Sharding

    def cost(self, shape, itemsize, s: Sharding) -> Cost:
        return (_local_nbytes(shape, self.target, itemsize), 1)

    def result(self, s: Sharding) -> Sharding:
        return self.target

    def apply(self, ctx: DeviceContext, pv: PartitionedValue) -> PartitionedValue:
        y = ctx.collective_permute(pv.local, _permute_pairs(pv.sharding, self.target),
                                   "reshard: collective-permute")
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


def _all_to_all(src: Sharding, dst: Sharding, shape) -> Optional[AllToAllStep]:
    for a in range(src.rank):
        k = src.tiles[a]
        if k == 1 or dst.tiles[a] != 1:
            continue
        for b in range(src.rank):
            if b == a or src.tiles[b] != 1 or dst.tiles[b] != k or shape[a] % k or shape[b] % k:
                continue
            dim_map = list(range(src.rank))
            dim_map[a], dim_map[b] = b, a
            if src.remap(dim_map, src.rank) == dst:
                return AllToAllStep(a, b, dst)
    return None


def plan(src: Sharding, dst: Sharding, shape: Sequence[int]) -> list:
    """Steps that turn a value laid out as `src` into `dst`."""
    if src == dst:
        return []
    if dst.refines(src):
        return [SliceStep(dst)]
    step = _all_to_all(src, dst, shape)
    if step is not None:
        return [step]
    if src.tiles == dst.tiles and src.num_replicas == dst.num_replicas:
        return [PermuteStep(dst)]
    same = [i for i in range(src.rank) if src.tiles[i] == dst.tiles[i]
            and np.array_equal(src.coords()[:, i], dst.coords()[:, i])]
    steps = []
    for dim in range(src.rank):
        if src.tiles[dim] > 1 and dim not in same:
            fallback = dst.tiles[dim] > 1
            steps.append(GatherStep(dim, "reshard fallback: all-gather then slice" if fallback
                                    else "reshard: all-gather"))
    mid = src.keep_dims(same)
    if mid != dst:
        steps.append(SliceStep(dst))
    return steps


def cost(src: Sharding, dst: Sharding, shape: Sequence[int], itemsize: int) -> Cost:
    """What resharding costs per device (the estimate planning compares)."""
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
