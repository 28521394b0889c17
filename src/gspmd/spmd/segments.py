"""Data formatting along one dim in one step (paper 4.6).

A chain of pad, slice, concatenate and reverse that changes only one dim makes a value
whose elements along that dim are segments: runs copied from other values (forwards or
reversed) and runs of a fill value. Such a value is partitioned as point-to-point
pieces: each device takes, of every segment overlapping its tile, the part that it does
not hold from a device that does; one collective-permute per round, as many rounds as
the busiest device has pieces. When the sources laid out as they are would need more
rounds than MAX_ROUNDS, or cost more than having them whole along the dim, they are
gathered along it first and the pieces are all local."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

import numpy as np

from gspmd.ir import Value, emit
from gspmd.sharding import Sharding
from gspmd.spmd import pieces
from gspmd.spmd import cost as cm
from gspmd.spmd import reshard as rs
from gspmd.spmd.context import DeviceContext, Why
from gspmd.spmd.partitioned import PartitionedValue

MAX_ROUNDS = 16   # collective-permutes one formatting step may take


@dataclass(frozen=True)
class Segment:
    """Elements [start, start + length) of the result along the dim: elements from
    `offset` on of source `source` (last to first when reverse), or fill `source`."""
    start: int
    length: int
    source: int
    offset: int = 0
    reverse: bool = False
    fill: bool = False

    def clipped(self, lo: int, hi: int) -> Optional["Segment"]:
        """The part inside [lo, hi), or None."""
        a, b = max(lo, self.start), min(hi, self.start + self.length)
        if a >= b:
            return None
        offset = self.offset + (self.start + self.length - b if self.reverse else a - self.start)
        return replace(self, start=a, length=b - a, offset=offset)

    def shifted(self, by: int) -> "Segment":
        return replace(self, start=self.start + by)

    def mirrored(self, size: int) -> "Segment":
        """The segment in reverse(value of `size`)."""
        return replace(self, start=size - self.start - self.length, reverse=not self.reverse)


def assemble(ctx: DeviceContext, segments: Sequence[Segment], sources: Sequence[PartitionedValue],
             fills: Sequence[Value], dim: int, shape: Sequence[int], target: Sharding) -> PartitionedValue:
    """The value of `shape`, laid out as `target`, whose elements along dim are the
    segments of `sources` and of the (scalar, local) `fills`."""
    itemsize = np.dtype(sources[0].dtype if sources else fills[0].dtype).itemsize
    others = [d for d in range(len(shape)) if d != dim]
    options = []
    for whole in (False, True):
        layouts = [_source_layout(s.sharding, target, dim, others, whole) for s in sources]
        moves = _transfers(segments, sources, layouts, dim, tuple(shape), target)
        if moves is not None:
            cost = cm.add_costs(*[rs.cost(s.sharding, lay, s.shape, itemsize, ctx.hardware)
                                  for s, lay in zip(sources, layouts)],
                                *[t.cost(itemsize, target.num_devices, ctx.hardware) for t in moves.values()])
            options.append((cm.rounded(cost), whole, layouts, moves))
    _, _, layouts, moves = min(options, key=lambda o: o[:2])
    locals_ = [rs.reshard(ctx, s, lay).local for s, lay in zip(sources, layouts)]
    tile = target.shard_shape(shape)
    out = _filled(ctx, segments, fills, dim, shape, target, tile)
    for (source, reverse), t in moves.items():
        out = pieces.move(ctx, locals_[source], t, tile, Why.DATA_FORMATTING, "data formatting", out,
                          dim if reverse else None)
    if out is None:   # an empty result
        out = emit.broadcast(ctx.b, ctx.constant(np.zeros((), sources[0].dtype)), tile)
    return PartitionedValue(out, target, tuple(shape))


def _source_layout(s: Sharding, target: Sharding, dim: int, others: list[int], whole: bool) -> Sharding:
    """Split like the target on the other dims (so that pieces move only along dim);
    along dim as the source is split already (or the target, if they conflict), or whole."""
    rest = target.keep_dims(others)
    if whole:
        return rest
    return rest.merge(s.keep_dims([dim])) or target


def _transfers(segments, sources, layouts, dim: int, shape: tuple, target: Sharding
               ) -> Optional[dict[tuple[int, bool], pieces.Transfers]]:
    """Per (source, reversed), the pieces each device needs; None when that takes more
    than MAX_ROUNDS rounds."""
    m = -(-shape[dim] // target.tiles[dim])
    tile_lo = target.coords()[:, dim] * m
    tile_hi = np.minimum(tile_lo + m, shape[dim])
    extent = np.asarray(target.shard_shape(shape))
    devices = np.arange(target.num_devices)
    parts: dict[tuple[int, bool], list[pieces.Transfers]] = {}
    for seg in (s for s in segments if not s.fill and s.length):
        a, b = np.maximum(tile_lo, seg.start), np.minimum(tile_hi, seg.start + seg.length)
        active = b > a
        # The source range, in source positions, of each device's part of the segment.
        far = seg.start + seg.length
        src_a = seg.offset + np.where(seg.reverse, far - b, a - seg.start)
        src_b = src_a + np.maximum(b - a, 0)
        layout = layouts[seg.source]
        n = -(-sources[seg.source].shape[dim] // layout.tiles[dim])
        first = src_a // n
        count = np.where(active, -(-src_b // n) - first, 0)
        for k in range(int(count.max(initial=0))):
            valid = k < count
            tile = first[valid] + k
            pa, pb = np.maximum(src_a[valid], tile * n), np.minimum(src_b[valid], (tile + 1) * n)
            receiver = devices[valid]
            ra = np.where(seg.reverse, far - (pb - seg.offset), seg.start + (pa - seg.offset))
            coords = layout.coords()[receiver].copy()
            kept = coords[:, dim] == tile
            coords[:, dim] = tile
            sender = receiver.copy()
            sender[~kept] = pieces.holders_in_turn(layout, coords[~kept])
            send_at, recv_at = np.zeros((len(receiver), len(shape)), np.int64), np.zeros((len(receiver), len(shape)),
                                                                                          np.int64)
            send_at[:, dim], recv_at[:, dim] = pa - tile * n, ra - tile_lo[receiver]
            length = np.broadcast_to(extent, send_at.shape).copy()
            length[:, dim] = pb - pa
            whole = np.ones(send_at.shape, bool)
            whole[:, dim] = (ra == tile_lo[receiver]) & (ra + pb - pa == tile_hi[receiver])
            parts.setdefault((seg.source, seg.reverse), []).append(
                pieces.Transfers(sender, receiver, send_at, recv_at, length, whole))
    moves = {key: pieces.concat_transfers(p) for key, p in parts.items()}
    return moves if sum(t.rounds() for t in moves.values()) <= MAX_ROUNDS else None


def _filled(ctx: DeviceContext, segments, fills: Sequence[Value], dim: int, shape, target: Sharding,
            tile) -> Optional[Value]:
    """Each device's tile holding the fill segments (the first fill everywhere, the
    others where they are), or None when there are none."""
    fill_segments = [s for s in segments if s.fill]
    if not fill_segments:
        return None
    b = ctx.b
    broadcast = [emit.broadcast(b, f, tile) for f in fills]
    first = fill_segments[0].source
    out = broadcast[first]
    m = tile[dim]
    tile_lo = target.coords()[:, dim] * m
    for seg in fill_segments:
        if seg.source != first:
            start = np.clip(seg.start - tile_lo, 0, m)
            end = np.clip(seg.start + seg.length - tile_lo, 0, m)
            inside = emit.in_range(b, tile, dim, ctx.table_lookup(start), ctx.table_lookup(end))
            out = emit.select(b, inside, broadcast[seg.source], out)
    return out
