"""Reductions: reduced dims are `reduce` factors, kept dims pass through."""
from __future__ import annotations

import numpy as np

from gspmd.ops.registry import EXPAND, LAYOUT, register
from gspmd.spmd.factors import REDUCE, Factor


def _reduce_factors(instr):
    x, dims, reducer = instr.operands[0], instr.attrs["dims"], instr.attrs["reducer"]
    kept = [d for d in range(x.rank) if d not in dims]
    return [Factor(size, (d, None), REDUCE, reducer) if d in dims else Factor(size, (d, kept.index(d)))
            for d, size in enumerate(x.shape)]


def _evaluate_reduce(instr, args, device):
    out = instr.outputs[0]
    return [np.asarray(instr.attrs["reducer"].reduce(args[0], instr.attrs["dims"])).astype(out.dtype, copy=False)]


register("reduce", evaluate=_evaluate_reduce, factors=_reduce_factors, priority=LAYOUT,
         backward_priority=EXPAND)
