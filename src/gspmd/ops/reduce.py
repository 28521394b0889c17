"""Reductions: reduced dims are `reduce` factors, kept dims pass through."""
from __future__ import annotations

import numpy as np

from gspmd.ops.registry import EXPAND, LAYOUT, register
from gspmd.spmd.factors import REDUCE, Factor

REDUCERS = {"add": np.sum, "mul": np.prod, "max": np.max, "min": np.min, "and": np.all, "or": np.any}


def _reduce_factors(instr):
    x, dims, reducer = instr.operands[0], instr.attrs["dims"], instr.attrs["reducer"]
    kept = [d for d in range(x.rank) if d not in dims]
    return [Factor(size, (d, None), REDUCE, reducer) if d in dims else Factor(size, (d, kept.index(d)))
            for d, size in enumerate(x.shape)]


def _evaluate_reduce(instr, args, device):
    out = instr.outputs[0]
    fn = REDUCERS[instr.attrs["reducer"]]
    return [np.asarray(fn(args[0], axis=tuple(instr.attrs["dims"]))).astype(out.dtype, copy=False)]


register("reduce", evaluate=_evaluate_reduce, factors=_reduce_factors, priority=LAYOUT,
         backward_priority=EXPAND)
