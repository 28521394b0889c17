"""dot_general: batch and free dims pass through, contracting dims are reduce factors.
Result dims are ordered batch, lhs free, rhs free (as in XLA)."""
from __future__ import annotations

import math
import string

import numpy as np
from jax import lax

from gspmd.dtypes import is_floating
from gspmd.ops.registry import CONTRACTION, KernelLayout, linear_in, register, same_layout
from gspmd.spmd.cost import ComputeKind
from gspmd.spmd.factors import REDUCE, Factor


def dot_dims(instr):
    a = instr.attrs
    lhs, rhs = instr.operands
    lhs_free = [d for d in range(lhs.rank) if d not in a["lhs_batch"] and d not in a["lhs_contracting"]]
    rhs_free = [d for d in range(rhs.rank) if d not in a["rhs_batch"] and d not in a["rhs_contracting"]]
    return lhs_free, rhs_free


def _dot_factors(instr):
    a = instr.attrs
    lhs, rhs = instr.operands
    lhs_free, rhs_free = dot_dims(instr)
    nb = len(a["lhs_batch"])
    factors = [Factor(lhs.shape[l], (l, r, i)) for i, (l, r) in enumerate(zip(a["lhs_batch"], a["rhs_batch"]))]
    factors += [Factor(lhs.shape[l], (l, r, None), REDUCE)
                for l, r in zip(a["lhs_contracting"], a["rhs_contracting"])]
    factors += [Factor(lhs.shape[l], (l, None, nb + i)) for i, l in enumerate(lhs_free)]
    factors += [Factor(rhs.shape[r], (None, r, nb + len(lhs_free) + i)) for i, r in enumerate(rhs_free)]
    return factors


def _evaluate_dot(instr, args, device):
    lhs, rhs = args
    letters = iter(string.ascii_letters)
    lhs_sub = [None] * lhs.ndim
    rhs_sub = [None] * rhs.ndim
    a = instr.attrs
    out_sub = []
    for l, r in zip(a["lhs_batch"], a["rhs_batch"]):
        lhs_sub[l] = rhs_sub[r] = next(letters)
        out_sub.append(lhs_sub[l])
    for l, r in zip(a["lhs_contracting"], a["rhs_contracting"]):
        lhs_sub[l] = rhs_sub[r] = next(letters)
    for sub in (lhs_sub, rhs_sub):
        for d, s in enumerate(sub):
            if s is None:
                sub[d] = next(letters)
                out_sub.append(sub[d])
    spec = f"{''.join(lhs_sub)},{''.join(rhs_sub)}->{''.join(out_sub)}"
    out = instr.outputs[0]
    # Narrow floats (bfloat16) accumulate in float32, as XLA does; numpy's einsum has no bf16.
    acc = np.float32 if is_floating(out.dtype) and out.dtype.itemsize < 4 else out.dtype
    return [np.einsum(spec, lhs.astype(acc), rhs.astype(acc)).astype(out.dtype, copy=False)]


def _dot_flops(instr) -> int:
    contracted = math.prod(instr.operands[0].shape[d] for d in instr.attrs["lhs_contracting"])
    return 2 * math.prod(instr.outputs[0].shape) * contracted


def _convert_dot_general(b, eqn, args):
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    shape, dtype = b.out_aval(eqn)
    return [b.add1("dot", args, shape, dtype, lhs_batch=tuple(lb), rhs_batch=tuple(rb),
                   lhs_contracting=tuple(lc), rhs_contracting=tuple(rc))]


def _lower_dot(instr, args, lc):
    a, out = instr.attrs, instr.outputs[0]
    lhs, rhs = (lax.convert_element_type(x, out.dtype) for x in args)
    dims = ((a["lhs_contracting"], a["rhs_contracting"]), (a["lhs_batch"], a["rhs_batch"]))
    return [lax.dot_general(lhs, rhs, dims, preferred_element_type=out.dtype)]


def _layout(instr) -> KernelLayout:
    """XLA's CPU matmuls read row-major operands whose dims run [batch, free,
    contracting] or [batch, contracting, free]; another operand is transposed into the
    first (lhs) or the second (rhs) first."""
    a, wanted = instr.attrs, []
    for index, (batch, contracting) in enumerate([(a["lhs_batch"], a["lhs_contracting"]),
                                                  (a["rhs_batch"], a["rhs_contracting"])]):
        x = instr.operands[index]
        free = [d for d in range(x.rank) if d not in batch and d not in contracting]
        orders = [(*batch, *free, *contracting), (*batch, *contracting, *free)]
        row_major = tuple(range(x.rank))
        wanted.append((row_major,) if any(same_layout(x.shape, row_major, o) for o in orders) else (orders[index],))
    return KernelLayout(tuple(wanted))


register("dot", converts={"dot_general": _convert_dot_general}, evaluate=_evaluate_dot,
         lower=_lower_dot, factors=_dot_factors, priority=CONTRACTION, flops=_dot_flops, layout=_layout,
         compute=ComputeKind.MATMUL, linear=linear_in((0,), (1,)))
