"""Matrix decompositions and solves (jnp.linalg, jax.scipy.linalg; the orthogonal
initializer's QR) and FFTs (jnp.fft), partitioned along their batch dims, each device
transforming its own matrices or signals; a split matrix dim is gathered first, as XLA
does. Every primitive is one `linalg` op holding the JAX primitive it runs (a
BoundPrimitive), which both backends call on each device's data (LAPACK's and the FFT
library's results, as under jax.jit, signs of eigenvectors included).
An FFT over several dims, some of them split, runs as distributed FFTs do (slabs and
pencils): the whole dims are transformed first, then each split moves onto a dim done
with (one all-to-all) and the rest are transformed; its splits pass through it in
propagation. jnp.linalg.solve's custom_linear_solve is its solve in place."""
from __future__ import annotations

import math
from typing import Optional

from jax.lax import FftType

from gspmd.ops.convert import BoundPrimitive, call_eagerly
from gspmd.ops.registry import Frontend, Kernel, Rule, Semantics, Timing, register
from gspmd.spmd import factors as fx
from gspmd.spmd import cost as cm
from gspmd.spmd import reshard as rs
from gspmd.spmd.cost import ComputeKind
from gspmd.spmd.factors import REPLICATE, Factor
from gspmd.spmd.layout import whole_along
from gspmd.sharding import Sharding
from gspmd.spmd.partitioned import PartitionedValue

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


def _is_fft(instr) -> bool:
    return instr.attrs["call"].primitive.name == "fft"


def _propagated_factors(instr) -> list[Factor]:
    """As _factors, but an FFT's dims that keep their size pass their splits through
    (the partition rule moves them while it transforms)."""
    if not _is_fft(instr):
        return _factors(instr)
    x, out = instr.operands[0], instr.outputs[0]
    return [Factor(x.shape[d], (d, d)) if x.shape[d] == out.shape[d] else
            Factor(x.shape[d], (d, None), REPLICATE) for d in range(x.rank)] + \
        [Factor(out.shape[d], (None, d), REPLICATE) for d in range(x.rank) if x.shape[d] != out.shape[d]]


def _partition(ctx, instr, operands, targets) -> list[PartitionedValue]:
    x = operands[0]
    if _is_fft(instr) and any(t > 1 for t in x.sharding.tiles[instr.attrs["batch_dims"]:]):
        return [rs.reshard(ctx, _distributed_fft(ctx, instr, x), targets[0])]
    return fx.partition(ctx, instr, _factors(instr), operands, targets)


def _distributed_fft(ctx, instr, x: PartitionedValue) -> PartitionedValue:
    """The FFT in steps over the dims that are whole, in an order that keeps a real FFT's
    real dim first and its inverse's last; where none is, a split moves onto a dim done
    with (a batch dim or one transformed already). A split that no dim can take is
    gathered before the first step (where the data is smallest; and XLA:CPU cannot
    all-gather an FFT's result along an inner dim)."""
    gathered: list[int] = []
    while True:
        start = x.sharding.keep_dims([d for d in range(x.rank) if d not in gathered])
        steps, stuck = _fft_steps(instr, start, x.shape, ctx.hardware)
        if stuck is None:
            break
        gathered.append(stuck)
    x = rs.reshard(ctx, x, start)
    for step in steps:
        x = rs.reshard(ctx, x, step) if isinstance(step, Sharding) else _fft_along(ctx, instr, x, *step)
    return x


def _fft_steps(instr, s: Sharding, shape, hw: cm.Hardware) -> tuple[list, Optional[int]]:
    """The steps from layout `s`: (dims, FftType) transforms and layouts to move to (the
    cheapest on `hw`); or the dim whose split no done dim can take."""
    kind, batch = instr.attrs["call"].params["fft_type"], instr.attrs["batch_dims"]
    shape, last, pending, steps = list(shape), len(shape) - 1, list(range(batch, len(shape))), []
    while pending:
        whole = [d for d in pending if s.tiles[d] == 1]
        if kind == FftType.RFFT and last in pending:
            dims, step = (whole if last in whole else []), FftType.RFFT
        elif kind == FftType.IRFFT:
            dims, step = (pending, kind) if whole == pending else ([d for d in whole if d != last], FftType.IFFT)
        else:   # complex dims (a real FFT's, once its real dim is done)
            dims, step = whole, FftType.FFT if kind == FftType.RFFT else kind
        if dims:
            steps.append((dims, step))
            if step in (FftType.RFFT, FftType.IRFFT):   # the real dim, which changes size
                shape[last] = instr.outputs[0].shape[last]
            pending = [d for d in pending if d not in dims]
            continue
        dim = next(d for d in pending if s.tiles[d] > 1 and (kind != FftType.IRFFT or d != last or pending == [last]))
        done = [d for d in range(len(shape)) if d not in pending]
        moves = [m for m in whole_along(s, dim, shape)[1:] if any(m.tiles[d] > s.tiles[d] for d in done)]
        if not moves:
            return steps, dim
        s = min(moves, key=lambda m: cm.rounded(rs.cost(s, m, tuple(shape), instr.outputs[0].dtype.itemsize, hw)))
        steps.append(s)
    return steps, None


def _fft_along(ctx, instr, x: PartitionedValue, dims: list[int], kind: FftType) -> PartitionedValue:
    """One FFT of `kind` over `dims` (whole on every device; the real dim last), run on
    each device's piece with those dims moved to the end."""
    b, call, out = ctx.b, instr.attrs["call"], instr.outputs[0]
    order = [d for d in range(x.rank) if d not in dims] + dims
    moved, local = order != list(range(x.rank)), x.local
    if moved:
        local = b.add1("transpose", [local], [local.shape[d] for d in order], local.dtype, permutation=tuple(order))
    lengths, shape, global_shape, dtype = [x.shape[d] for d in dims], list(local.shape), list(x.shape), x.dtype
    if kind in (FftType.RFFT, FftType.IRFFT):   # the real dim (last) takes the result's size
        shape[-1] = global_shape[-1] = out.shape[-1]
        dtype = out.dtype
        if kind == FftType.IRFFT:
            lengths[-1] = out.shape[-1]
    local = b.add1("linalg", [local], shape, dtype, batch_dims=x.rank - len(dims),
                   call=BoundPrimitive(call.primitive,
                                       {**call.params, "fft_type": kind, "fft_lengths": tuple(lengths)}))
    if moved:
        back = [order.index(d) for d in range(x.rank)]
        local = b.add1("transpose", [local], [shape[i] for i in back], dtype, permutation=tuple(back))
    return PartitionedValue(local, x.sharding, tuple(global_shape))


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


register("linalg",
         frontend=Frontend(converts={**{name: _convert for name in (*_MATRIX_DIMS, "fft")},
                             "custom_linear_solve": _convert_linear_solve}),
         semantics=Semantics(evaluate=lambda instr, args, device: call_eagerly(instr, args), lower=_lower),
         rule=Rule(factors=_propagated_factors, partition=_partition),
         timing=Timing(flops=_flops, compute=ComputeKind.MATMUL),
         kernel=Kernel(row_major=_is_fft))
