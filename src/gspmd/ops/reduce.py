"""Reductions: reduced dims are `reduce` factors, kept dims pass through. argmax/argmin
arrive as ordinary reductions too."""
from __future__ import annotations

import numpy as np

from gspmd.ir.reducer import ADD, AND, MAX, MIN, MUL, OR, Reducer
from gspmd.ops.convert import Converter
from gspmd.ops.registry import EXPAND, LAYOUT, register
from gspmd.spmd.factors import REDUCE, Factor


def _convert_reduce(reducer: Reducer) -> Converter:
    def convert(b, eqn, args):
        shape, dtype = b.out_aval(eqn)
        return [b.add1("reduce", args, shape, dtype, dims=tuple(int(a) for a in eqn.params["axes"]),
                       reducer=reducer)]
    return convert


def _convert_arg_reduce(reducer: Reducer) -> Converter:
    """argmax/argmin as XLA lowers them to ordinary ops: the extreme value, then the
    smallest index holding it (NaN counts as the extreme, as in JAX). Each piece
    partitions and masks padding like any reduce."""
    def convert(b, eqn, args):
        (x,), (axis,) = args, eqn.params["axes"]
        shape, index_dtype = b.out_aval(eqn)
        kept = tuple(d for d in range(x.rank) if d != axis)
        best = b.add1("reduce", [x], shape, x.dtype, dims=(axis,), reducer=reducer)
        best = b.add1("broadcast", [best], x.shape, x.dtype, dims=kept)
        hit = b.add1("compare", [x, best], x.shape, np.bool_, direction="EQ")
        nan = b.add1("compare", [x, x], x.shape, np.bool_, direction="NE")
        hit = b.add1("or", [hit, nan], x.shape, np.bool_)
        index = b.add1("iota", [], x.shape, index_dtype, dimension=axis)
        beyond = b.broadcast_to(b.constant(x.shape[axis], index_dtype), x.shape)
        index = b.add1("select", [hit, index, beyond], x.shape, index_dtype)
        return [b.add1("reduce", [index], shape, index_dtype, dims=(axis,), reducer=MIN)]
    return convert


def _reduce_factors(instr):
    x, dims, reducer = instr.operands[0], instr.attrs["dims"], instr.attrs["reducer"]
    kept = [d for d in range(x.rank) if d not in dims]
    return [Factor(size, (d, None), REDUCE, reducer) if d in dims else Factor(size, (d, kept.index(d)))
            for d, size in enumerate(x.shape)]


def _evaluate_reduce(instr, args, device):
    out = instr.outputs[0]
    return [np.asarray(instr.attrs["reducer"].reduce(args[0], instr.attrs["dims"])).astype(out.dtype, copy=False)]


def _lower_reduce(instr, args, lc):
    return [instr.attrs["reducer"].lax_reduce(args[0], instr.attrs["dims"]).astype(instr.outputs[0].dtype)]


register("reduce",
         converts={"reduce_sum": _convert_reduce(ADD), "reduce_max": _convert_reduce(MAX),
                   "reduce_min": _convert_reduce(MIN), "reduce_prod": _convert_reduce(MUL),
                   "reduce_and": _convert_reduce(AND), "reduce_or": _convert_reduce(OR),
                   "argmax": _convert_arg_reduce(MAX), "argmin": _convert_arg_reduce(MIN)},
         evaluate=_evaluate_reduce, lower=_lower_reduce, factors=_reduce_factors, priority=LAYOUT,
         backward_priority=EXPAND)
