"""Control flow: `while` with cond and body sub-programs over one carried tuple
(scan and fori_loop arrive as while loops, as in XLA).

Every carried value is tied across five places: the loop operand, the loop result,
the body's parameter and result, and the cond's parameter. Propagation drives all five
to one layout, and the partitioner keeps the carry in that layout on every iteration.
"""
from __future__ import annotations

import numpy as np

from gspmd.errors import ShardingError
from gspmd.ir import Instr, Value
from gspmd.ops.registry import ELEMENTWISE, register
from gspmd.spmd import reshard as rs
from gspmd.spmd.partitioned import PartitionedValue


def tied_values(instr: Instr) -> list[Value]:
    """The loop's values beyond its operands and results: body params, body results, cond params."""
    body, cond = instr.attrs["body"], instr.attrs["cond"]
    return body.params + body.outputs + cond.params


def _tied_places(instr: Instr, target: int) -> list[int]:
    """Carried value i appears in five places (operand, result, body parameter, body
    result, cond parameter): the indices of target's four others."""
    n = len(instr.operands)
    return [place * n + target % n for place in range(5) if place * n + target % n != target]


def _while_propagate(instr: Instr, shardings, target: int) -> list:
    """Each place of a carried value takes the layouts the other four have."""
    return [shardings[i] for i in _tied_places(instr, target) if shardings[i] is not None]


def _evaluate_while(instr: Instr, per_device: list[list[np.ndarray]], run) -> list[list[np.ndarray]]:
    body, cond = instr.attrs["body"], instr.attrs["cond"]
    carry = per_device
    while True:
        decisions = {bool(out[0]) for out in run(cond, carry)}
        if len(decisions) > 1:
            raise ShardingError("Internal error: devices disagree on a while loop's condition; "
                                "please report this program.")
        if not decisions.pop():
            return carry
        carry = run(body, carry)


def _partition_while(ctx, instr: Instr, operands: list[PartitionedValue], targets) -> list[PartitionedValue]:
    """The carry keeps the loop results' layouts on every iteration."""
    body, cond = instr.attrs["body"], instr.attrs["cond"]
    carry = [rs.reshard(ctx, o, t) for o, t in zip(operands, targets)]
    local_body = ctx.partition_subprogram(body, targets, targets)
    local_cond = ctx.partition_subprogram(cond, targets, [cond.outputs[0].sharding])
    outs = ctx.b.add("while", [c.local for c in carry], [(p.shape, p.dtype) for p in local_body.params],
                     body=local_body, cond=local_cond, trip_count=instr.attrs.get("trip_count"))
    return [PartitionedValue(v, t, o.shape) for v, t, o in zip(outs, targets, instr.outputs)]


register("while", evaluate_programs=_evaluate_while, propagate=_while_propagate, tied=tied_values,
         informants=_tied_places, partition=_partition_while, priority=ELEMENTWISE)
