"""`manual` regions (gspmd.manual): per-device code placed into the SPMD program as it is.

Operands are laid out as the region's in_specs ask, the body's instructions are copied
with the local operands in place of its parameters, and its results are laid out as the
out_specs say. The body is not partitioned further (auto axes replicate it)."""
from __future__ import annotations

from gspmd.ir import Instr
from gspmd.ops.registry import CONTRACTION, register
from gspmd.spmd import reshard as rs
from gspmd.spmd.partitioned import PartitionedValue


def _propagate_manual(instr: Instr, shardings, target: int) -> list:
    """The specs fix the layouts at the region's boundary."""
    n = len(instr.operands)
    return [instr.attrs["in_shardings"][target] if target < n else instr.attrs["out_shardings"][target - n]]


def _partition_manual(ctx, instr: Instr, operands, targets) -> list[PartitionedValue]:
    body, a = instr.attrs["body"], instr.attrs
    local = {p: rs.reshard(ctx, o, s).local for p, o, s in zip(body.params, operands, a["in_shardings"])}
    for inner in body.instrs:
        outs = ctx.b.add(inner.opcode, [local[v] for v in inner.operands],
                         [(v.shape, v.dtype) for v in inner.outputs], **inner.attrs)
        for out in outs:
            out.producer.origin = f"{ctx.b.origin} [manual: {inner.origin or inner.opcode}]"
        local.update(zip(inner.outputs, outs))
    results = [PartitionedValue(local[v], s, o.shape)
               for v, s, o in zip(body.outputs, a["out_shardings"], instr.outputs)]
    return [rs.reshard(ctx, pv, t) for pv, t in zip(results, targets)]


register("manual", propagate=_propagate_manual, partition=_partition_manual, priority=CONTRACTION)
