"""Halo exchange (paper 4.3, Figure 9b) and the window plans of windowed ops.

A windowed op (convolution, reduce-window, pad, slice) reads, for the outputs partition i
holds, a contiguous range of its input along each partitioned dim. `plan_dim` works
that range out symbolically: partition i reads `count` base elements from
`first(i)`, an affine function of i; halo sizes follow from it. `window` then builds
that range on every device with one program: collective-permutes of the maximum halo
from the neighbours (several hops when a halo is longer than a shard), concatenate,
dynamic-slice by a partition-id table, and a mask of positions outside the tensor.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional, Sequence, Union

import numpy as np

from gspmd.ir import Instr, Value, emit
from gspmd.sharding import Sharding
from gspmd.spmd import factors as fx
from gspmd.spmd import reshard as rs
from gspmd.spmd.context import INDEX_DTYPE, DeviceContext, Why
from gspmd.spmd.layout import groups_along
from gspmd.spmd.partitioned import PartitionedValue


@dataclass(frozen=True)
class Affine:
    """floor((scale * i + offset) / divisor) for partition index i: the symbolic form of
    offsets and halo sizes."""
    scale: int
    offset: int
    divisor: int = 1

    def __call__(self, i):
        return (self.scale * np.asarray(i) + self.offset) // self.divisor


@dataclass(frozen=True)
class Window:
    """One dim of an HLO window: size, stride, low/high padding (negative crops), base
    (lhs) dilation and window (rhs) dilation."""
    size: int = 1
    stride: int = 1
    low: int = 0
    high: int = 0
    base_dilation: int = 1
    window_dilation: int = 1

    def out_size(self, base: int) -> int:
        padded = self.low + self.high + ((base - 1) * self.base_dilation + 1 if base else 0)
        span = (self.size - 1) * self.window_dilation + 1
        return max(0, (padded - span) // self.stride + 1) if padded >= span else 0

    @property
    def trivial(self) -> bool:
        return self == Window()

    def sliced(self, base: int, start: int, stride: int, size: int) -> "Window":
        """This size-1 window (a pad or slice) followed by a slice of `size` of its outputs
        from `start` every `stride`, as one window over the same base (paper 4.6: a pad +
        slice chain is one halo step). Valid because the slice reads only real outputs."""
        assert self.size == 1
        s, low = self.stride * stride, self.low - start * self.stride
        span = (base - 1) * self.base_dilation + 1 if base else 0
        return replace(self, stride=s, low=low, high=(size - 1) * s + 1 - low - span)


@dataclass(frozen=True)
class DimPlan:
    """How partition i computes its outputs along one dim.

    The local op reads base elements [first(i), first(i) + count), with the out-of-range
    ones masked, and runs with window `local`. Base dilation stays in the local op when
    every partition starts at the same phase of it (Appendix A.2 case 1); with stride 1
    the local op starts at the earliest phase and `out_offset` slices each partition's
    outputs (case 2); otherwise the gathered base is dilated locally and `predilate`
    says where each partition's window starts in it (case 3, which XLA solves by padding
    the window instead)."""
    parts: int
    shard: int                          # base elements per shard, ceil(size / parts)
    first: Affine
    count: int
    local: Window
    outs: int                           # outputs each partition ends up with
    span: int                           # dilated base positions those outputs read
    predilate: Optional[tuple[int, ...]] = None
    out_offset: Optional[tuple[int, ...]] = None
    mask: bool = True                   # whether live outputs read outside the tensor

    @property
    def left_halo(self) -> Affine:
        """i*shard - first(i): elements partition i needs before its shard."""
        f = self.first
        return Affine(f.divisor * self.shard - f.scale, f.divisor - 1 - f.offset, f.divisor)

    @property
    def right_halo(self) -> Affine:
        """first(i) + count - (i+1)*shard: elements partition i needs after its shard."""
        f = self.first
        return Affine(f.scale - f.divisor * self.shard, f.offset + f.divisor * (self.count - self.shard),
                      f.divisor)


def plan_dim(base: int, w: Window, parts: int, window_parts: bool = False) -> DimPlan:
    """Plan one dim of a windowed op over `base` input elements split `parts` ways.
    By default the outputs are split (each partition computes ceil(M/parts) of them);
    with window_parts the window is split instead (weight gradients: every partition
    computes all outputs from its part of the window, and partial results are summed)."""
    s, r, b = w.stride, w.window_dilation, w.base_dilation
    if window_parts:
        local_size = -(-w.size // parts)
        outs = w.out_size(base)
        q0 = Affine(local_size * r, -w.low)            # dilated position of window element i*local_size
    else:
        local_size = w.size
        outs = -(-w.out_size(base) // parts)
        q0 = Affine(outs * s, -w.low)                  # dilated position of partition i's first window
    span = max(outs - 1, 0) * s + (local_size - 1) * r + 1
    i = np.arange(parts)
    first = Affine(q0.scale, q0.offset, b)
    phase = q0(i) - first(i) * b                       # where the windows start after base element first(i)
    count = int(max(1, np.max((q0(i) + span - 1) // b - first(i) + 1)))
    local = Window(local_size, s, 0, 0, b, r)
    mask = window_parts or w.low > 0 or w.high > 0
    shard = -(-base // parts)
    if b == 1 or np.all(phase == phase[0]):
        lo = -int(phase[0])
        local = replace(local, low=lo, high=span - lo - ((count - 1) * b + 1))
        return DimPlan(parts, shard, first, count, local, outs, span, mask=mask)
    if s == 1:
        lo, extra = -int(phase.min()), int(phase.max() - phase.min())
        local = replace(local, low=lo, high=span + extra - lo - ((count - 1) * b + 1))
        return DimPlan(parts, shard, first, count, local, outs, span,
                       out_offset=tuple(int(p) for p in phase - phase.min()), mask=mask)
    return DimPlan(parts, shard, first, count, replace(local, base_dilation=1), outs, span,
                   predilate=tuple(int(p) for p in phase), mask=mask)


def local_base(plan: DimPlan) -> int:
    """Length along the dim of what the local op reads (after any local dilation)."""
    return plan.count if plan.predilate is None else plan.span


Fill = Union[np.ndarray, Value]


def window(ctx: DeviceContext, pv: PartitionedValue, dim: int, parts_of: np.ndarray, first: np.ndarray,
           count: int, fill: Fill, mask: bool = True) -> Value:
    """Device d's local value along `dim` becomes global elements
    [first[p], first[p] + count) of pv, p = parts_of[d] its partition index; elements
    outside the tensor read `fill` when `mask` (else whatever is there)."""
    size = pv.shape[dim]
    if pv.sharding.tiles[dim] == 1:
        buf, buf_start = _padded_whole(ctx, pv.local, dim, first, count, fill)
    else:
        assert np.array_equal(pv.sharding.coords()[:, dim], parts_of), "window partitions must match the shards"
        buf, buf_start = _exchange(ctx, pv, dim, first, count, fill)
    x = buf if buf.shape[dim] == count else dynamic_slice_dim(ctx, buf, dim, (first - buf_start)[parts_of], count)
    if mask and (first.min() < 0 or (first + count).max() > size):
        x = emit.mask_range(ctx.b, x, dim, 0, size, fill, offset=ctx.table_lookup(first[parts_of]))
    return x


def _padded_whole(ctx, x: Value, dim: int, first: np.ndarray, count: int, fill):
    """Source holds the whole dim: pad it so every window is in bounds; no communication."""
    lo = max(0, -int(first.min()))
    hi = max(0, int((first + count).max()) - x.shape[dim])
    return emit.pad_dim(ctx.b, x, dim, lo, hi, fill), np.full_like(first, -lo)


def _exchange(ctx, pv: PartitionedValue, dim: int, first: np.ndarray, count: int, fill):
    """A buffer holding every partition's window: pieces of the neighbours' shards
    (several hops away when halos are long) around what it keeps of its own. Returns it
    and, per partition, the global position it starts at. Only elements inside the
    tensor travel; the rest of the buffer is static padding."""
    n, size = pv.local.shape[dim], pv.shape[dim]
    own = np.arange(len(first)) * n                        # where each shard starts
    lo, hi = first - own, first + count - own              # windows, relative to the own shard
    data_lo, data_hi = np.maximum(first, 0) - own, np.minimum(first + count, size) - own
    touches = data_hi > data_lo
    a, b = (int(data_lo[touches].min()), int(data_hi[touches].max())) if touches.any() else (0, 0)
    start, end = min(int(lo.min()), a), max(int(hi.max()), b)
    groups = groups_along(pv.sharding, [dim])
    pieces = [pad_piece(ctx, pv.local, dim, a - start, fill)] if a > start else []
    for delta in range(a // n, -(-b // n)) if b > a else ():   # shard of partition p + delta
        piece = emit.slice_dim(ctx.b, pv.local, dim, max(a, delta * n) - delta * n,
                               min(b, (delta + 1) * n) - delta * n)
        if delta:
            side = "left" if delta < 0 else "right"
            piece = _shift(ctx, piece, groups, -delta, f"{side} halo")
        pieces.append(piece)
    if end > b:
        pieces.append(pad_piece(ctx, pv.local, dim, end - b, fill))
    return emit.concatenate(ctx.b, pieces, dim), own + start


def _shift(ctx, x: Value, groups: np.ndarray, hop: int, detail: str) -> Value:
    """Partition p receives x from partition p - hop of its group (zeros at the ends)."""
    k = groups.shape[1]
    hop = max(-k, min(k, hop))   # further than the group: nobody sends
    if hop >= 0:
        senders, receivers = groups[:, :k - hop], groups[:, hop:]
    else:
        senders, receivers = groups[:, -hop:], groups[:, :k + hop]
    return ctx.collective_permute(x, np.stack([senders.ravel(), receivers.ravel()], axis=1),
                                  Why.HALO, detail)


def pad_piece(ctx, x: Value, dim: int, length: int, fill: Fill) -> Value:
    """A block of `fill`, shaped like x except `length` long along dim."""
    shape = list(x.shape)
    shape[dim] = length
    return emit.broadcast(ctx.b, emit.scalar(ctx.b, fill, x.dtype), shape)


def windowed(ctx, pv: PartitionedValue, plans: dict[int, DimPlan], layout: Sharding, fill: Fill) -> PartitionedValue:
    """The local input of a windowed op: for each planned dim, the base range its
    partition reads (halo exchange), dilated locally where the plan says so. `layout`
    gives each device's partition index per dim. The result is laid out as `layout`
    over a virtual global value: the partitions' windows side by side."""
    def dilate(d, y):
        plan = plans[d]
        if plan.predilate is None:
            return y
        bd = plan.first.divisor
        y = emit.pad_dim(ctx.b, y, d, 0, bd - 1, fill, interior=bd - 1)
        return dynamic_slice_dim(ctx, y, d, np.asarray(plan.predilate)[layout.coords()[:, d]], local_base(plan))
    ranges = {d: (p.first(np.arange(p.parts)), p.count, p.mask) for d, p in plans.items()}
    return windowed_ranges(ctx, pv, ranges, layout, fill, dilate)


def windowed_ranges(ctx, pv: PartitionedValue, ranges: dict[int, tuple[np.ndarray, int, bool]], layout: Sharding,
                    fill: Fill, then=lambda d, y: y) -> PartitionedValue:
    """pv resharded to split the `ranges` dims as `layout` does; then, along each such dim,
    partition i's elements [first[i], first[i] + count) (masked outside the tensor when
    asked), passed through then(dim, value). Dims pv holds whole are cut locally."""
    want = split_like(pv, ranges, layout)
    whole = [d for d in ranges if pv.sharding.tiles[d] == 1]
    x = rs.reshard(ctx, pv, want.keep_dims([d for d in range(pv.rank) if d not in whole]))
    # Exchanges first: their groups assume the whole dims' data is still the same everywhere.
    for d in sorted(ranges, key=lambda d: d in whole):
        first, count, mask = ranges[d]
        y = then(d, window(ctx, x, d, layout.coords()[:, d], first, count, fill, mask))
        shape = list(x.shape)
        shape[d] = y.shape[d] * len(first)
        x = PartitionedValue(y, x.sharding, tuple(shape))
    return PartitionedValue(x.local, want, x.shape)


def plan_layout(windows: Sequence[Window], x: PartitionedValue, target: Sharding,
                plan: Callable[[int, int], DimPlan]) -> tuple[dict, Sharding]:
    """Windowed dims that the operand or the (same-rank) target splits, each with
    plan(dim, parts), and one Sharding of their partitions (the operand's split preferred)."""
    layout = Sharding.replicated(x.rank, x.sharding.num_devices)
    plans = {}
    for d, w in enumerate(windows):
        source = x.sharding if x.sharding.tiles[d] > 1 else target
        if w.trivial or source.tiles[d] == 1:
            continue
        merged = layout.merge(source.keep_dims([d]))
        if merged is not None:
            layout, plans[d] = merged, plan(d, source.tiles[d])
    return plans, layout


def split_like(pv: PartitionedValue, dims, layout: Sharding) -> Sharding:
    """pv's layout with `dims` split as `layout` splits them (its other splits kept when
    they are compatible)."""
    return pv.sharding.keep_dims([d for d in range(pv.rank) if d not in dims]).merge(layout) or layout


def dynamic_slice_dim(ctx, x: Value, dim: int, starts: np.ndarray, size: int) -> Value:
    """x[..., starts[device] : +size, ...] along one dim."""
    indices = [ctx.constant(0, INDEX_DTYPE)] * x.rank
    indices[dim] = ctx.table_lookup(starts)
    sizes = list(x.shape)
    sizes[dim] = size
    return emit.dynamic_slice(ctx.b, x, indices, sizes)


def slice_outputs(ctx, y: Value, dims: dict[int, DimPlan], layout: Sharding, plan_dims: dict[int, int]) -> Value:
    """Case 2 plans compute extra outputs; cut out each partition's. dims maps an output
    dim of y to its plan, plan_dims maps it to the layout dim giving partition indices."""
    for dim, plan in dims.items():
        if plan.out_offset is not None:
            offsets = np.asarray(plan.out_offset)[layout.coords()[:, plan_dims[dim]]]
            y = dynamic_slice_dim(ctx, y, dim, offsets, plan.outs)
    return y


def partition_windowed(ctx, instr: Instr, operands: list[PartitionedValue], targets: Sequence[Sharding],
                       factors: list[fx.Factor], index: int, plans: dict[int, DimPlan], layout: Sharding,
                       out_map: dict[int, int], out_keep: list[int], fill: Fill,
                       emit: fx.LocalEmitter) -> list[PartitionedValue]:
    """Partition a windowed op whose operand `index` is read through windows along the
    planned dims (partitions given by `layout`, which splits only those dims): cut each
    partition's window out by halo exchange, then partition the rest around it."""
    operands = list(operands)
    operands[index] = windowed(ctx, operands[index], plans, layout, fill)
    return partition_pinned(ctx, instr, operands, targets, factors, index, list(plans), layout, out_map,
                            out_keep, emit)


def pinned_space(factors: list[fx.Factor], index: int, dims: list[int], layout: Sharding, rank: int) -> Sharding:
    """The factor-space layout that splits the factors of operand `index`'s `dims` as
    `layout` splits those dims."""
    factor_of = {fac.dims[index]: f for f, fac in enumerate(factors) if fac.kind != fx.REPLICATE}
    return layout.remap([factor_of.get(d) if d in dims else None for d in range(rank)], len(factors))


def partition_pinned(ctx, instr: Instr, operands: list[PartitionedValue], targets: Sequence[Sharding],
                     factors: list[fx.Factor], index: int, dims: list[int], layout: Sharding,
                     out_map: dict[int, int], out_keep: list[int], emit: fx.LocalEmitter) -> list[PartitionedValue]:
    """The factor partitioner on operands whose `dims` (of operand `index`) already hold
    per-partition windows: those splits are pinned. `out_map` sends such a dim to the
    output dim it splits (in every output); the targets' splits of the `out_keep` dims
    are kept too."""
    rank = operands[index].rank
    pinned = pinned_space(factors, index, dims, layout, rank)
    inner = []
    for out, target in zip(instr.outputs, targets):
        out_layout = layout.remap([out_map.get(d) for d in range(rank)], out.rank)
        inner.append(target.keep_dims(out_keep).merge(out_layout) or out_layout)
    results = fx.partition(ctx, instr, factors, operands, inner, emit_local=emit, pinned=pinned)
    return [rs.reshard(ctx, res, target) for res, target in zip(results, targets)]
