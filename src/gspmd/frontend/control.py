"""Loops: JAX's while and scan become the IR's `while` (scan as XLA lowers it: a counter,
dynamic-slices of the scanned inputs, dynamic-update-slices of the stacked outputs)."""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from gspmd.frontend.trace import CONVERTERS, _broadcast_to, _constant, _inline
from gspmd.ir import Builder, Program, Value

INDEX = np.int32

# build(builder of the sub-program, its parameters) -> its results
Build = Callable[[Builder, list[Value]], list[Value]]


def _subprogram(b: Builder, name: str, carry: Sequence[Value], build: Build) -> Program:
    sub = Program(f"{b.program.name}.{name}", parent=b.program)
    sb = Builder(sub, origin=b.origin)
    params = [sb.param(v.shape, v.dtype, hint="carry") for v in carry]
    sub.outputs = build(sb, params)
    return sub


def emit_while(b: Builder, carry: list[Value], cond: Build, body: Build, trip_count=None) -> list[Value]:
    """trip_count: how often the body runs, where known statically (for reports)."""
    cond_p = _subprogram(b, "cond", carry, cond)
    body_p = _subprogram(b, "body", carry, body)
    return b.add("while", carry, [(v.shape, v.dtype) for v in carry], cond=cond_p, body=body_p,
                 trip_count=trip_count)


def _while(b: Builder, eqn, args: list[Value]) -> list[Value]:
    p = eqn.params
    nc, nb = p["cond_nconsts"], p["body_nconsts"]
    fixed = nc + nb

    def cond(sb, params):
        return _inline(sb, p["cond_jaxpr"], params[:nc] + params[fixed:])

    def body(sb, params):
        return params[:fixed] + _inline(sb, p["body_jaxpr"], params[nc:fixed] + params[fixed:])

    return emit_while(b, args, cond, body)[fixed:]


def _scalar(b: Builder, value) -> Value:
    return _constant(b, np.asarray(value, INDEX))


def _scan(b: Builder, eqn, args: list[Value]) -> list[Value]:
    p = eqn.params
    length, nconst, ncarry, jaxpr = p["length"], p["num_consts"], p["num_carry"], p["jaxpr"]
    nx = len(args) - nconst - ncarry
    y_avals = [v.aval for v in jaxpr.jaxpr.outvars[ncarry:]]
    ys = [_broadcast_to(b, _constant(b, np.zeros((), a.dtype)), (length, *a.shape)) for a in y_avals]
    carry = [_scalar(b, 0)] + args + ys

    def cond(sb, params):
        limit = _scalar(sb, length)
        return [sb.add1("compare", [params[0], limit], (), np.bool_, direction="LT")]

    def body(sb, params):
        i, consts = params[0], params[1:1 + nconst]
        c = params[1 + nconst:1 + nconst + ncarry]
        xs = params[1 + nconst + ncarry:1 + nconst + ncarry + nx]
        bufs = params[1 + nconst + ncarry + nx:]
        index = sb.add1("subtract", [_scalar(sb, length - 1), i], (), INDEX) if p["reverse"] else i
        zero = _scalar(sb, 0)

        def starts(rank):   # the scanned dim at `index`, the others whole
            return [index] + [zero] * (rank - 1)

        x_t = [sb.add1("reshape", [sb.add1("dynamic-slice", [x, *starts(x.rank)], (1, *x.shape[1:]), x.dtype)],
                       x.shape[1:], x.dtype) for x in xs]
        outs = _inline(sb, jaxpr, consts + c + x_t)
        new_bufs = [sb.add1("dynamic-update-slice",
                            [buf, sb.add1("reshape", [y], (1, *y.shape), y.dtype), *starts(buf.rank)],
                            buf.shape, buf.dtype) for buf, y in zip(bufs, outs[ncarry:])]
        step = sb.add1("add", [i, _scalar(sb, 1)], (), INDEX)
        return [step, *consts, *outs[:ncarry], *xs, *new_bufs]

    outs = emit_while(b, carry, cond, body, trip_count=length)
    return outs[1 + nconst:1 + nconst + ncarry] + outs[len(outs) - len(ys):]


CONVERTERS["while"] = _while
CONVERTERS["scan"] = _scan
