"""Data-formatting ops: pad, slice, dynamic-slice, dynamic-update-slice, concatenate.
Dims an op leaves untouched partition as factors; a split of a dim the op moves data
along is still gathered (halo-exchange rules for those dims are not written yet)."""
from __future__ import annotations

import numpy as np

from gspmd.ops.registry import LAYOUT, register
from gspmd.spmd.factors import PASS, REPLICATE, Factor


def _clamped_starts(x_shape, starts, sizes):
    # HLO clamps start indices so the slice stays in bounds.
    return [int(min(max(int(s), 0), d - k)) for s, d, k in zip(starts, x_shape, sizes)]


def _evaluate_dynamic_slice(instr, args, device):
    x, *starts = args
    sizes = instr.outputs[0].shape   # local sizes once partitioned
    starts = _clamped_starts(x.shape, starts, sizes)
    return [x[tuple(slice(s, s + k) for s, k in zip(starts, sizes))]]


def _evaluate_dynamic_update_slice(instr, args, device):
    x, update, *starts = args
    starts = _clamped_starts(x.shape, starts, update.shape)
    y = x.copy()
    y[tuple(slice(s, s + k) for s, k in zip(starts, update.shape))] = update
    return [y]


def _evaluate_slice(instr, args, device):
    a = instr.attrs
    return [args[0][tuple(slice(s, e, st) for s, e, st in zip(a["start"], a["limit"], a["strides"]))]]


def _evaluate_pad(instr, args, device):
    x, fill = args
    a = instr.attrs
    out = instr.outputs[0]
    y = np.full(out.shape, fill, out.dtype)
    # Interior padding spreads elements apart; negative low/high padding crops.
    spread_shape = [d + (d - 1) * i if d else 0 for d, i in zip(x.shape, a["interior"])]
    spread = np.full(spread_shape, fill, out.dtype)
    spread[tuple(slice(None, None, i + 1) for i in a["interior"])] = x
    src, dst = [], []
    for n, lo, size in zip(spread_shape, a["low"], out.shape):
        s0 = max(0, -lo)
        d0 = max(0, lo)
        length = min(n - s0, size - d0)
        src.append(slice(s0, s0 + max(length, 0)))
        dst.append(slice(d0, d0 + max(length, 0)))
    y[tuple(dst)] = spread[tuple(src)]
    return [y]


def _evaluate_concatenate(instr, args, device):
    return [np.concatenate(args, axis=instr.attrs["dimension"])]


def _dynamic_slice_factors(instr):
    """Dims taken whole pass through (their start clamps to 0 on every shard); dims
    cut at a runtime offset must stay whole here (halo-free cases come later)."""
    x, out = instr.operands[0], instr.outputs[0]
    starts = (None,) * (len(instr.operands) - 1)
    factors = []
    for d, (n, k) in enumerate(zip(x.shape, out.shape)):
        if n == k:
            factors.append(Factor(n, (d, *starts, d)))
        else:
            factors += [Factor(n, (d, *starts, None), REPLICATE), Factor(k, (None, *starts, d), REPLICATE)]
    return factors


def _dynamic_update_slice_factors(instr):
    x, update = instr.operands[:2]
    starts = (None,) * (len(instr.operands) - 2)
    factors = []
    for d, (n, k) in enumerate(zip(x.shape, update.shape)):
        if n == k:
            factors.append(Factor(n, (d, d, *starts, d)))
        else:
            factors += [Factor(n, (d, None, *starts, d), REPLICATE), Factor(k, (None, d, *starts, None), REPLICATE)]
    return factors


register("dynamic-slice", evaluate=_evaluate_dynamic_slice, factors=_dynamic_slice_factors, priority=LAYOUT)
register("dynamic-update-slice", evaluate=_evaluate_dynamic_update_slice, factors=_dynamic_update_slice_factors,
         priority=LAYOUT)
def _untouched_dims_factors(instr, untouched):
    """Dims the op leaves as they are pass through (scalar operands aside); the others
    stay whole here."""
    ranks = [v.rank for v in instr.operands]
    return [Factor(n, tuple(d if r else None for r in ranks) + (d,), PASS if untouched[d] else REPLICATE)
            for d, n in enumerate(instr.outputs[0].shape)]


def _slice_factors(instr):
    a, x = instr.attrs, instr.operands[0]
    return _untouched_dims_factors(instr, [s == 0 and e == n and st == 1 for s, e, st, n in
                                           zip(a["start"], a["limit"], a["strides"], x.shape)])


def _concatenate_factors(instr):
    dim = instr.attrs["dimension"]
    return _untouched_dims_factors(instr, [d != dim for d in range(instr.outputs[0].rank)])


def _pad_factors(instr):
    a = instr.attrs
    return _untouched_dims_factors(instr, [lo == hi == i == 0 for lo, hi, i in zip(a["low"], a["high"], a["interior"])])


register("slice", evaluate=_evaluate_slice, factors=_slice_factors, priority=LAYOUT)
register("pad", evaluate=_evaluate_pad, factors=_pad_factors, priority=LAYOUT)
register("concatenate", evaluate=_evaluate_concatenate, factors=_concatenate_factors, priority=LAYOUT)
