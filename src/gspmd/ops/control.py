"""Control flow: `while` with cond and body sub-programs over one carried tuple
(JAX's while_loop, fori_loop and scan all become it; scan as XLA lowers it: a counter,
dynamic-slices of the scanned inputs, dynamic-update-slices of the stacked outputs).

Every carried value is tied across five places: the loop operand, the loop result,
the body's parameter and result, and the cond's parameter. Propagation drives all five
to one layout, and the partitioner keeps the carry in that layout on every iteration.
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np
from jax import lax

from gspmd.errors import ShardingError
from gspmd.ir import Instr, Value
from gspmd.ops.convert import Conversion
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


# -- conversion -------------------------------------------------------------------------
INDEX = np.int32
# build(conversion of the sub-program, its parameters) -> its results
Build = Callable[[Conversion, list[Value]], list[Value]]


def emit_while(b: Conversion, carry: list[Value], cond: Build, body: Build,
               trip_count: Optional[int] = None) -> list[Value]:
    """trip_count: how often the body runs, where known statically (for reports)."""
    return b.add("while", carry, [(v.shape, v.dtype) for v in carry], cond=b.subprogram("cond", carry, cond),
                 body=b.subprogram("body", carry, body), trip_count=trip_count)


def _convert_while(b: Conversion, eqn, args: list[Value]) -> list[Value]:
    p = eqn.params
    nc, nb = p["cond_nconsts"], p["body_nconsts"]
    fixed = nc + nb

    def cond(sb, params):
        return sb.inline(p["cond_jaxpr"], params[:nc] + params[fixed:])

    def body(sb, params):
        return params[:fixed] + sb.inline(p["body_jaxpr"], params[nc:fixed] + params[fixed:])

    return emit_while(b, args, cond, body)[fixed:]


def _convert_scan(b: Conversion, eqn, args: list[Value]) -> list[Value]:
    p = eqn.params
    length, nconst, ncarry, jaxpr = p["length"], p["num_consts"], p["num_carry"], p["jaxpr"]
    nx = len(args) - nconst - ncarry
    y_avals = [v.aval for v in jaxpr.jaxpr.outvars[ncarry:]]
    ys = [b.broadcast_to(b.constant(0, a.dtype), (length, *a.shape)) for a in y_avals]
    carry = [b.constant(0, INDEX)] + args + ys

    def cond(sb, params):
        return [sb.add1("compare", [params[0], sb.constant(length, INDEX)], (), np.bool_, direction="LT")]

    def body(sb, params):
        i, consts = params[0], params[1:1 + nconst]
        c = params[1 + nconst:1 + nconst + ncarry]
        xs = params[1 + nconst + ncarry:1 + nconst + ncarry + nx]
        bufs = params[1 + nconst + ncarry + nx:]
        index = sb.add1("subtract", [sb.constant(length - 1, INDEX), i], (), INDEX) if p["reverse"] else i
        zero = sb.constant(0, INDEX)

        def starts(rank):   # the scanned dim at `index`, the others whole
            return [index] + [zero] * (rank - 1)

        x_t = [sb.add1("reshape", [sb.add1("dynamic-slice", [x, *starts(x.rank)], (1, *x.shape[1:]), x.dtype)],
                       x.shape[1:], x.dtype) for x in xs]
        outs = sb.inline(jaxpr, consts + c + x_t)
        new_bufs = [sb.add1("dynamic-update-slice",
                            [buf, sb.add1("reshape", [y], (1, *y.shape), y.dtype), *starts(buf.rank)],
                            buf.shape, buf.dtype) for buf, y in zip(bufs, outs[ncarry:])]
        step = sb.add1("add", [i, sb.constant(1, INDEX)], (), INDEX)
        return [step, *consts, *outs[:ncarry], *xs, *new_bufs]

    outs = emit_while(b, carry, cond, body, trip_count=length)
    return outs[1 + nconst:1 + nconst + ncarry] + outs[len(outs) - len(ys):]


def _lower_while(instr, args, lc):
    body, cond = instr.attrs["body"], instr.attrs["cond"]
    return list(lax.while_loop(lambda carry: lc.run(cond, carry)[0], lambda carry: tuple(lc.run(body, carry)),
                               tuple(args)))


register("while", converts={"while": _convert_while, "scan": _convert_scan}, evaluate_programs=_evaluate_while,
         lower=_lower_while, propagate=_while_propagate, tied=tied_values, informants=_tied_places,
         partition=_partition_while, priority=ELEMENTWISE)
