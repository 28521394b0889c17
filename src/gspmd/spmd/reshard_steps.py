"""The steps a reshard plan (spmd/reshard.py) chains: what layout each leaves, what it
costs on the hardware being planned for (spmd/cost.py), and the per-device code it
emits.

  - cut: each device's target tile lies inside what it holds (dynamic-slice, free);
  - make: a value with no elements has nothing to move: each device makes its empty tile;
  - all-gather of the minor factor k of one dim's split (or, where most of the pieces
    are padding, an all-reduce of the pieces placed in zeros);
  - all-to-all moving the minor factors of some dims' splits to become minor factors of
    other dims' splits, several dims in one collective where the device groups allow;
  - exchange: each device receives exactly the pieces of its target tile that it does
    not hold, from holders, in a few rounds of collective-permutes (device-order changes,
    a split count changed on one dim such as 3 -> 2 pieces, cut-and-send).
Gathers and all-to-alls take part where the shards of uneven dims nest (padding to
whole shards, slicing after), exchanges everywhere."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from gspmd.ir import Value, emit
from gspmd.ir.reducer import ADD, OR
from gspmd.sharding import Sharding
from gspmd.spmd import cost as cm
from gspmd.spmd import pieces
from gspmd.spmd.context import INDEX_DTYPE, DeviceContext, Why
from gspmd.spmd.cost import FREE, Cost
from gspmd.spmd.layout import (Move, coarsen, local_nbytes, minor_groups, move_factors, move_groups,
                               shard_len)
from gspmd.spmd.padding import mask_padding
from gspmd.spmd.partitioned import PartitionedValue

MAX_ROUNDS = 4    # collective-permutes one exchange may take


@dataclass(frozen=True)
class SliceStep:
    """Target subdivides the source: each device cuts its tile out of what it holds."""
    target: Sharding

    def cost(self, shape, itemsize, s: Sharding, hw: cm.Hardware) -> Cost:
        return FREE

    def result(self, s: Sharding) -> Sharding:
        return self.target

    def apply(self, ctx: DeviceContext, pv: PartitionedValue) -> PartitionedValue:
        x, tgt = pv.local, self.target
        starts, sizes = [], []
        for dim in range(pv.rank):
            size = shard_len(pv.shape, tgt, dim)
            k = tgt.tiles[dim] // pv.sharding.tiles[dim]
            sizes.append(size)
            if k == 1:
                starts.append(ctx.constant(0, INDEX_DTYPE))
                continue
            # Pad so that the last sub-tile is in bounds (dynamic-slice would clamp).
            x = emit.pad_dim(ctx.b, x, dim, 0, size * k - x.shape[dim], 0)
            starts.append(ctx.table_lookup(tgt.coords()[:, dim] % k * size))
        return PartitionedValue(emit.dynamic_slice(ctx.b, x, starts, sizes), tgt, pv.shape)


@dataclass(frozen=True)
class MakeEmptyStep(SliceStep):
    """A value with no elements: each device makes its (empty) tile of the target."""

    def apply(self, ctx: DeviceContext, pv: PartitionedValue) -> PartitionedValue:
        return empty(ctx, pv.shape, pv.dtype, self.target)


def empty(ctx: DeviceContext, shape: Sequence[int], dtype, sharding: Sharding) -> PartitionedValue:
    """Each device's tile, laid out as `sharding`, of a value of `shape` with no elements."""
    tile = [shard_len(shape, sharding, dim) for dim in range(len(shape))]
    return PartitionedValue(emit.broadcast(ctx.b, emit.scalar(ctx.b, 0, dtype), tile), sharding, tuple(shape))


@dataclass(frozen=True)
class GatherStep:
    """All-gather the minor factor k of dim's split."""
    dim: int
    k: int
    why: Why = Why.RESHARD
    detail: str = "all-gather"

    def result(self, s: Sharding) -> Sharding:
        return coarsen(s, self.dim, self.k)

    def cost(self, shape, itemsize, s: Sharding, hw: cm.Hardware) -> Cost:
        return cm.collective_seconds(cm.Pattern.ALL_GATHER, self.k * local_nbytes(shape, s, itemsize),
                                     minor_groups(s, self.dim, self.k), s.num_devices, hw)

    def apply(self, ctx: DeviceContext, pv: PartitionedValue) -> PartitionedValue:
        s = pv.sharding
        y = ctx.all_gather(pv.local, self.dim, minor_groups(s, self.dim, self.k), self.why, self.detail)
        result = self.result(s)
        if result.tiles[self.dim] == 1:
            y = emit.slice_dim(ctx.b, y, self.dim, 0, pv.shape[self.dim])
        return PartitionedValue(y, result, pv.shape)


@dataclass(frozen=True)
class SumGatherStep(GatherStep):
    """Gather the minor factor k of dim's split by summing (all-reduce) each device's
    piece placed at its offset in zeros: cheaper than an all-gather where most of the
    k pieces are padding (a dim shorter than its split), since only the data travels."""
    detail: str = "all-reduce of zero-padded pieces"

    def cost(self, shape, itemsize, s: Sharding, hw: cm.Hardware) -> Cost:
        return cm.collective_seconds(cm.Pattern.ALL_REDUCE, local_nbytes(shape, self.result(s), itemsize),
                                     minor_groups(s, self.dim, self.k), s.num_devices, hw)

    def apply(self, ctx: DeviceContext, pv: PartitionedValue) -> PartitionedValue:
        s, result, d = pv.sharding, self.result(pv.sharding), self.dim
        x = mask_padding(ctx, pv, d, 0).local          # what lies past the dim's end is not data
        n, shape = x.shape[d], list(x.shape)
        shape[d] = self.k * n
        zeros = emit.broadcast(ctx.b, ctx.constant(np.zeros((), x.dtype)), shape)
        zero = ctx.constant(0, INDEX_DTYPE)
        at = [ctx.table_lookup(s.coords()[:, d] % self.k * n) if i == d else zero for i in range(x.rank)]
        placed = emit.dynamic_update_slice(ctx.b, zeros, x, at)
        placed = emit.slice_dim(ctx.b, placed, d, 0, shard_len(pv.shape, result, d))
        reducer = OR if x.dtype == np.bool_ else ADD
        y = ctx.all_reduce(placed, minor_groups(s, d, self.k), reducer, self.why, self.detail)
        return PartitionedValue(y, result, pv.shape)


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
        into = move_factors(self.moves, s.rank, 1)
        return [f * -(-n // (t * f)) for n, t, f in zip(shape, s.tiles, into)]

    def cost(self, shape, itemsize, s: Sharding, hw: cm.Hardware) -> Cost:
        return cm.collective_seconds(cm.Pattern.ALL_TO_ALL, math.prod(self._buffer(shape, s)) * itemsize,
                                     move_groups(s, self.moves), s.num_devices, hw)

    def apply(self, ctx: DeviceContext, pv: PartitionedValue) -> PartitionedValue:
        x = pv.local
        for d, n in enumerate(self._buffer(pv.shape, pv.sharding)):
            x = emit.pad_dim(ctx.b, x, d, 0, n - x.shape[d], 0)
        groups = move_groups(pv.sharding, self.moves)
        if len(self.moves) == 1:
            a, b, _ = self.moves[0]
            y = ctx.all_to_all(x, b, a, groups, Why.RESHARD, "all-to-all")
        else:
            y = _multi_all_to_all(ctx, x, self.moves, groups)
        for d in range(pv.rank):
            if self.target.tiles[d] == 1:
                y = emit.slice_dim(ctx.b, y, d, 0, pv.shape[d])
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
    y = _transpose(ctx, emit.reshape(b, x, split), chunks + others)
    y = emit.reshape(b, y, (group, *rest))
    y = ctx.all_to_all(y, 0, 0, groups, Why.RESHARD, "all-to-all of several dims")
    y = emit.reshape(b, y, tuple(move[2] for move in moves) + tuple(rest))
    order, merged = [], []
    for d in range(rank):                         # source dims: (k_last, ..., k_first, rest)
        mine = [i for i, move in enumerate(moves) if move[0] == d]
        order += list(reversed(mine)) + [q + d]
        merged.append(rest[d] * math.prod(moves[i][2] for i in mine))
    return emit.reshape(b, _transpose(ctx, y, order), merged)


def _transpose(ctx: DeviceContext, x: Value, permutation: Sequence[int]) -> Value:
    if list(permutation) == list(range(x.rank)):
        return x
    return emit.transpose(ctx.b, x, permutation)


# -- exchange: point-to-point pieces ----------------------------------------------------
@functools.lru_cache(maxsize=4096)
def transfers(src: Sharding, dst: Sharding, shape: tuple[int, ...]) -> Optional[pieces.Transfers]:
    """Per device, the pieces of its dst tile: the one it holds, the others from holders
    of their src tile in turn. None when some device would need more than MAX_ROUNDS."""
    n, m, size = np.asarray(src.shard_shape(shape)), np.asarray(dst.shard_shape(shape)), np.asarray(shape)
    tile_lo = dst.coords() * m
    tile_hi = np.minimum(tile_lo + m, size)
    first = tile_lo // n
    count = np.where(tile_hi > tile_lo, -(-tile_hi // n) - first, 0)   # source tiles overlapped per dim
    most = count.max(axis=0)
    if most.max(initial=0) <= 1:    # the common case: one piece per (non-empty) tile
        receiver = np.flatnonzero(np.all(count == 1, axis=1))
        tile, lo, hi = first[receiver], tile_lo[receiver], tile_hi[receiver]
    else:
        if np.prod(count, axis=1).max() > MAX_ROUNDS + 1:
            return None
        # Every combination of the overlapped source tiles along each dim.
        offsets = np.indices(np.maximum(most, 1)).reshape(src.rank, -1).T
        receiver, which = np.nonzero(np.all(offsets[None] < count[:, None, :], axis=-1))
        tile = first[receiver] + offsets[which]
        lo = np.maximum(tile_lo[receiver], tile * n)
        hi = np.minimum(tile_hi[receiver], (tile + 1) * n)
    coords = src.coords()
    kept = np.all(tile == coords[receiver], axis=1)
    sender = receiver.copy()
    sender[~kept] = pieces.holders_in_turn(src, tile[~kept])
    at = lo - tile_lo[receiver]
    whole = (at == 0) & (hi == tile_hi[receiver])
    return pieces.Transfers(sender, receiver, lo - coords[sender] * n, at, hi - lo, whole)


@dataclass(frozen=True)
class ExchangeStep:
    """Each device receives the pieces of its target tile that it does not hold (cut by
    their holders), one collective-permute per round, and keeps its own."""
    target: Sharding

    def result(self, s: Sharding) -> Sharding:
        return self.target

    def cost(self, shape, itemsize, s: Sharding, hw: cm.Hardware) -> Cost:
        return transfers(s, self.target, tuple(shape)).cost(itemsize, s.num_devices, hw)

    def bound(self, shape, itemsize, s: Sharding, hw: cm.Hardware) -> Cost:
        """An upper bound of cost(), quicker (the search compares many)."""
        return transfers(s, self.target, tuple(shape)).bound(itemsize, s.num_devices, hw)

    def apply(self, ctx: DeviceContext, pv: PartitionedValue) -> PartitionedValue:
        t = transfers(pv.sharding, self.target, pv.shape)
        y = pieces.move(ctx, pv.local, t, self.target.shard_shape(pv.shape), Why.RESHARD, "collective-permute")
        return PartitionedValue(y, self.target, pv.shape)


