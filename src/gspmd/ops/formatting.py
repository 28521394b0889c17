"""Chains of data formatting along one dim — pad, slice, concatenate, reverse (records
with a segment rule), and the annotations and copies between them — seen as segments of the values they start from,
so that the whole chain is partitioned in one step (spmd/segments.py, paper 4.6): a
shift (pad then slice), a rotation (slices then concatenate), a wrap-around pad, a
mirrored reverse."""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from gspmd.ir import Instr, Value
from gspmd.ops.registry import lookup
from gspmd.sharding import Sharding
from gspmd.spmd import factors as fx
from gspmd.spmd import segments as sg
from gspmd.spmd.context import DeviceContext
from gspmd.spmd.partitioned import PartitionedValue

MAX_DEPTH = 8        # ops one chain looks through
MAX_SEGMENTS = 16


def changed_dim(instr: Instr) -> Optional[int]:
    """The one dim a stride-1, undilated pad/slice/concatenate/reverse changes (its
    record's segment rule says)."""
    rule = lookup(instr.opcode).facets.segments
    return None if rule is None else rule.changed_dim(instr)


class _Chain:
    """The values a chain's segments copy from, and its fill values."""

    def __init__(self):
        self.sources: list[Value] = []
        self.fills: list[Value] = []

    def _index(self, values: list[Value], v: Value) -> int:
        if v not in values:
            values.append(v)
        return values.index(v)

    def segments(self, v: Value, dim: int, depth: int = 0) -> list[sg.Segment]:
        """v's elements along dim, as segments of the values the chain below it starts from."""
        p = v.producer
        if p is not None and depth < MAX_DEPTH and lookup(p.opcode).facets.identity:
            return self.segments(p.operands[0], dim, depth + 1)
        if p is None or depth == MAX_DEPTH or changed_dim(p) != dim:
            return [sg.Segment(0, v.shape[dim], self._index(self.sources, v))]
        out = lookup(p.opcode).facets.segments.segments(p, dim, lambda x: self.segments(x, dim, depth + 1),
                                                        lambda fill: self._index(self.fills, fill))
        if len(out) > MAX_SEGMENTS:
            return [sg.Segment(0, v.shape[dim], self._index(self.sources, v))]
        return out


def clip(segments: list[sg.Segment], size: int) -> list[sg.Segment]:
    """The parts of `segments` within [0, size)."""
    return [c for c in (s.clipped(0, size) for s in segments) if c is not None]


def partition_in_one_step(ctx: DeviceContext, instr: Instr, target: Sharding) -> Optional[PartitionedValue]:
    """The op's result from the values its chain starts from, moving only the pieces
    devices lack; None when the op changes several dims (or strides or dilates), or
    when nothing along the dim is split (the op is then local)."""
    dim, out = changed_dim(instr), instr.outputs[0]
    if dim is None or 0 in out.shape:
        return None
    chain = _Chain()
    segments = chain.segments(out, dim)
    used = sorted({s.source for s in segments if not s.fill})   # clipping may drop some
    segments = [s if s.fill else replace(s, source=used.index(s.source)) for s in segments]
    sources = [ctx.partitioned(chain.sources[i]) for i in used]
    if target.tiles[dim] == 1 and all(s.sharding.tiles[dim] == 1 for s in sources):
        return None
    fills = [ctx.partitioned(f).local for f in chain.fills]
    return sg.assemble(ctx, segments, sources, fills, dim, out.shape, target)


def in_one_step_or_by_factors(ctx: DeviceContext, instr: Instr, operands: list[PartitionedValue],
                              targets: list[Sharding]) -> list[PartitionedValue]:
    """A partition rule: the chain in one step where a split dim changes, else the
    common partitioning of the record's factors (which keeps permutation factors whole)."""
    merged = partition_in_one_step(ctx, instr, targets[0])
    if merged is not None:
        return [merged]
    return fx.partition(ctx, instr, lookup(instr.opcode).rule.factors(instr), operands, targets)
