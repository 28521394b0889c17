"""Matrix decompositions and solves (jnp.linalg, jax.scipy.linalg; the orthogonal
initializer's QR) and FFTs (jnp.fft), partitioned as XLA partitions them: along their
batch dims, each device transforming its own matrices or signals; a split matrix (or
transformed) dim is gathered first. Every primitive is one `linalg` op holding the JAX
primitive it runs (a BoundPrimitive), which both backends call on each device's data
(LAPACK's and the FFT library's results, as under jax.jit, signs of eigenvectors
included).
jnp.linalg.solve's custom_linear_solve is its solve in place."""
from __future__ import annotations

import math

from gspmd.ops.convert import BoundPrimitive, call_eagerly
from gspmd.ops.registry import register
from gspmd.spmd.cost import ComputeKind
from gspmd.spmd.factors import REPLICATE, Factor

# JAX primitive -> how many trailing dims of its first operand make one matrix (or
# vector): the dims before them are batch dims, shared by every operand and result.
_MATRIX_DIMS = {"cholesky": 2, "cholesky_update": 2, "eig": 2, "eigh": 2, "svd": 2, "qr": 2, "geqrf": 2, "geqp3": 2,
                "ormqr": 2, "householder_product": 2, "lu": 2, "triangular_solve": 2, "symmetric_product": 2,
                "schur": 2, "hessenberg": 2, "tridiagonal": 2, "tridiagonal_solve": 1, "lu_pivots_to_permutation": 1}


def _convert(b, eqn, args):
    name = eqn.primitive.name
    core = len(eqn.params["fft_lengths"]) if name == "fft" else _MATRIX_DIMS[name]   # an FFT: its transformed dims
    return b.add("linalg", args, [b.out_aval(eqn, i) for i in range(len(eqn.outvars))],
                 call=BoundPrimitive(eqn.primitive, dict(eqn.params)), batch_dims=args[0].rank - core)


def _convert_linear_solve(b, eqn, args):
    """x = solve(matvec, b): the `solve` jaxpr on its constants and b (how jax runs it)."""
    lengths, jaxprs = eqn.params["const_lengths"], eqn.params["jaxprs"]
    start = lengths.matvec + lengths.vecmat
    consts, rhs = args[start:start + lengths.solve], args[sum(lengths):]
    return b.inline(jaxprs.solve, [*consts, *rhs])


def _factors(instr) -> list[Factor]:
    """Batch dims pass through; each matrix dim of each operand and result stays whole."""
    tensors = instr.operands + instr.outputs
    batch = instr.attrs["batch_dims"]
    factors = [Factor(tensors[0].shape[d], (d,) * len(tensors)) for d in range(batch)]
    for t, value in enumerate(tensors):
        factors += [Factor(value.shape[d], tuple(d if u == t else None for u in range(len(tensors))), REPLICATE)
                    for d in range(batch, value.rank)]
    return factors


# Operations per m x n matrix, in units of m * n * min(m, n) (n^3 for a square one): the
# textbook (Golub and Van Loan) counts, with vectors where the op returns them.
_CUBIC = {"cholesky": 1 / 3, "lu": 2 / 3, "qr": 4 / 3, "geqrf": 4 / 3, "geqp3": 4 / 3, "householder_product": 4 / 3,
          "ormqr": 2, "symmetric_product": 1, "hessenberg": 10 / 3,
          "tridiagonal": 4 / 3, "schur": 25, "eigh": (4 / 3, 9), "eig": (10, 25), "svd": (4, 21)}


def _flops(instr) -> int:
    """Per batch element: an FFT's 5 N log2 N (half for real signals); a triangular
    solve's m^2 per right-hand side column; a decomposition's count from _CUBIC."""
    call, x, batch_dims = instr.attrs["call"], instr.operands[0], instr.attrs["batch_dims"]
    batch, name = math.prod(x.shape[:batch_dims]), call.primitive.name
    if name == "fft":
        n = math.prod(call.params["fft_lengths"])
        return int(batch * 5 * n * math.log2(max(n, 2)) / (2 if call.params["fft_type"].value >= 2 else 1))
    if name == "triangular_solve":
        return batch * x.shape[-1] * math.prod(instr.operands[1].shape[batch_dims:])
    if name not in _CUBIC:   # banded and permutation ops: linear in their size
        return 8 * math.prod(instr.outputs[0].shape)
    m, n = x.shape[-2:]
    count = _CUBIC[name]
    if isinstance(count, tuple):   # (values only, with vectors)
        count = count[len(instr.outputs) > 1]
    return int(batch * count * m * n * min(m, n))


def _lower(instr, args, lc):
    return instr.attrs["call"](*args)


register("linalg", converts={**{name: _convert for name in (*_MATRIX_DIMS, "fft")},
                             "custom_linear_solve": _convert_linear_solve},
         evaluate=lambda instr, args, device: call_eagerly(instr, args), lower=_lower, factors=_factors,
         flops=_flops, compute=ComputeKind.MATMUL)
