"""dot_general: batch and free dims pass through, contracting dims are reduce factors.
Result dims are ordered batch, lhs free, rhs free (as in XLA). ragged_dot_general
(grouped matmuls): the same, with the groups whole."""
from __future__ import annotations

import math
import string

import numpy as np
from jax import lax
from jax import numpy as jnp

from gspmd.dtypes import accumulator
from gspmd.ops.registry import (CONTRACTION, Frontend, Kernel, KernelOrders, Memory, Rewrites, Rule, Semantics,
                                Timing, linear_in, register, same_order)
from gspmd.spmd import factors as fx
from gspmd.spmd.context import DeviceContext
from gspmd.spmd.cost import ComputeKind
from gspmd.spmd.factors import REDUCE, Factor


def dot_dims(instr):
    a = instr.attrs
    lhs, rhs = instr.operands[:2]
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


def einsum_dot(lhs: np.ndarray, rhs: np.ndarray, lhs_batch, rhs_batch, lhs_contracting, rhs_contracting,
               dtype) -> np.ndarray:
    """XLA's dot_general in NumPy: result dims batch, lhs free, rhs free."""
    letters = iter(string.ascii_letters)
    lhs_sub = [None] * lhs.ndim
    rhs_sub = [None] * rhs.ndim
    out_sub = []
    for l, r in zip(lhs_batch, rhs_batch):
        lhs_sub[l] = rhs_sub[r] = next(letters)
        out_sub.append(lhs_sub[l])
    for l, r in zip(lhs_contracting, rhs_contracting):
        lhs_sub[l] = rhs_sub[r] = next(letters)
    for sub in (lhs_sub, rhs_sub):
        for d, s in enumerate(sub):
            if s is None:
                sub[d] = next(letters)
                out_sub.append(sub[d])
    spec = f"{''.join(lhs_sub)},{''.join(rhs_sub)}->{''.join(out_sub)}"
    acc = accumulator(dtype)
    return np.einsum(spec, lhs.astype(acc), rhs.astype(acc)).astype(dtype, copy=False)


def _evaluate_dot(instr, args, device):
    a = instr.attrs
    return [einsum_dot(*args, a["lhs_batch"], a["rhs_batch"], a["lhs_contracting"], a["rhs_contracting"],
                       instr.outputs[0].dtype)]


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


def _layout(instr) -> KernelOrders:
    """XLA's matmuls read row-major operands whose dims run [batch, free, contracting]
    or [batch, contracting, free]; another operand is transposed into the first (lhs) or
    the second (rhs) first. XLA:CPU reads them in place only where the dot is canonical,
    each operand with its batch dims leading, one contracting dim and at most one free
    dim (size-1 dims counted); otherwise its DotDecomposer transposes both, the lhs into
    [batch, free, contracting] and the rhs into [batch, contracting, free] (a copy
    unless only size-1 dims move)."""
    a, wanted, decomposed, canonical = instr.attrs, [], [], True
    for index, (batch, contracting) in enumerate([(a["lhs_batch"], a["lhs_contracting"]),
                                                  (a["rhs_batch"], a["rhs_contracting"])]):
        x = instr.operands[index]
        free = [d for d in range(x.rank) if d not in batch and d not in contracting]
        orders = [(*batch, *free, *contracting), (*batch, *contracting, *free)]
        row_major = tuple(range(x.rank))
        wanted.append((row_major,) if any(same_order(x.shape, row_major, o) for o in orders) else (orders[index],))
        decomposed.append((orders[index],))
        canonical = canonical and _canonical(batch, contracting, free)
    cpu = tuple((tuple(range(x.rank)),) for x in instr.operands) if canonical else tuple(decomposed)
    return KernelOrders(tuple(wanted), cpu_operands=cpu)


def _canonical(batch, contracting, free) -> bool:
    """Whether XLA's DotDecomposer leaves a dot operand with these dims as it is."""
    return len(contracting) == 1 and len(free) <= 1 and tuple(batch) == tuple(range(len(batch)))


register("dot",
         frontend=Frontend(converts={"dot_general": _convert_dot_general}),
         semantics=Semantics(evaluate=_evaluate_dot, lower=_lower_dot),
         rule=Rule(factors=_dot_factors, priority=CONTRACTION),
         timing=Timing(flops=_dot_flops, compute=ComputeKind.MATMUL),
         kernel=Kernel(orders=_layout),
         rewrites=Rewrites(linear=linear_in((0,), (1,))))


# -- ragged-dot: lax.ragged_dot_general -------------------------------------------------
# Operands (lhs, rhs, group_sizes[, start[, first]]); attrs dot's, plus lhs_ragged (a lhs
# dim that runs through consecutive groups of group_sizes[..., g] elements, the rest
# belonging to none) and rhs_group. Ragged dim free (a MoE's tokens sorted by expert): each
# element multiplies its group's slice of rhs along rhs_group; result dims as dot's.
# Ragged dim contracting (that product's weight gradient; rhs_group None): one product per
# group, over its elements; result dims [group, then as dot's]. group_sizes: [prefix...,
# groups], the prefix being the lhs dims (batch dims, then the free or contracting dims
# before the ragged one) along which the sizes differ. In per-device programs only, where
# the ragged dim or the groups are split: `start`, where the device's part of the ragged
# dim starts in the whole one; `first`, its first group (group_sizes stays whole).
def _ragged_prefix(attrs, rank: int) -> list[int]:
    """The lhs dims that group_sizes' leading dims run along (as jax orders them)."""
    batch, contracting, ragged = list(attrs["lhs_batch"]), list(attrs["lhs_contracting"]), attrs["lhs_ragged"]
    if ragged in contracting:
        return batch + contracting[:contracting.index(ragged)]
    free = [d for d in range(rank) if d not in batch and d not in contracting]
    return batch + free[:free.index(ragged)]


def _place(xp, b, prefix: list[int], rank: int):
    """b, of dims [lead..., prefix...] (group_sizes' prefix order), with the prefix dims
    moved to where they are in the lhs and size-1 dims for the others: [lead..., lhs]."""
    lead = b.ndim - len(prefix)
    order = sorted(range(len(prefix)), key=prefix.__getitem__)
    b = xp.transpose(b, [*range(lead), *(lead + i for i in order)])
    sizes = iter(b.shape[lead:])
    return b.reshape(b.shape[:lead] + tuple(next(sizes) if d in prefix else 1 for d in range(rank)))


def _localized(xp, instr, args):
    """(lhs, rhs, group sizes) of one device's part: the sizes of its groups within its
    own elements of the ragged dim. Holding only some groups, its first group takes the
    elements before it too, which are zeroed in the lhs (another device's groups)."""
    lhs, rhs, sizes = args[:3]
    if len(args) == 3:
        return lhs, rhs, sizes
    a, start = instr.attrs, args[3].astype(sizes.dtype)
    rows = lhs.shape[a["lhs_ragged"]]
    ends = xp.cumsum(sizes, axis=-1, dtype=sizes.dtype)
    starts = ends - sizes
    within = lambda at: xp.clip(at - start, 0, rows)
    if len(args) == 4:
        return lhs, rhs, within(ends) - within(starts)
    count = instr.outputs[0].shape[0] if a["rhs_group"] is None else rhs.shape[a["rhs_group"]]
    index = args[4].astype(sizes.dtype) + xp.arange(count, dtype=sizes.dtype)
    real = index < sizes.shape[-1]   # a padded group (an uneven split) is empty
    starts, ends = (xp.where(real, xp.take(b, xp.minimum(index, sizes.shape[-1] - 1), axis=-1), ends[..., -1:])
                    for b in (starts, ends))
    before = within(starts[..., 0])
    at = xp.arange(rows, dtype=sizes.dtype).reshape([-1 if d == a["lhs_ragged"] else 1 for d in range(lhs.ndim)])
    lhs = xp.where(at < _place(xp, before, _ragged_prefix(a, lhs.ndim), lhs.ndim), xp.zeros((), lhs.dtype), lhs)
    sizes = within(ends) - within(starts)
    return lhs, rhs, xp.concatenate([sizes[..., :1] + before[..., None], sizes[..., 1:]], axis=-1)


def _per_group(x: np.ndarray, sizes: np.ndarray, dim: int, prefix: list[int]) -> np.ndarray:
    """[groups, *x.shape]: x with only group g's elements along `dim` in row g."""
    ends = np.moveaxis(np.cumsum(sizes, axis=-1), -1, 0)
    starts = ends - np.moveaxis(sizes, -1, 0)
    at = np.arange(x.shape[dim]).reshape([-1 if d == dim else 1 for d in range(x.ndim)])
    inside = (_place(np, starts, prefix, x.ndim) <= at) & (at < _place(np, ends, prefix, x.ndim))
    return np.where(inside, x[None], np.zeros((), x.dtype))


def _evaluate_ragged_dot(instr, args, device):
    a, dtype = instr.attrs, instr.outputs[0].dtype
    lhs, rhs, sizes = _localized(np, instr, args)
    ragged, lc, rc = a["lhs_ragged"], a["lhs_contracting"], a["rhs_contracting"]
    prefix = _ragged_prefix(a, lhs.ndim)
    grouped = _per_group(lhs, sizes, ragged, prefix)
    after = lambda dims: tuple(d + 1 for d in dims)
    if a["rhs_group"] is not None:
        return [einsum_dot(grouped, rhs, after(a["lhs_batch"]), a["rhs_batch"], after(lc) + (0,),
                           rc + (a["rhs_group"],), dtype)]
    rhs_ragged = rc[lc.index(ragged)]
    rhs_prefix = list(a["rhs_batch"]) + list(rc[:rc.index(rhs_ragged)])
    return [einsum_dot(grouped, _per_group(rhs, sizes, rhs_ragged, rhs_prefix), (0, *after(a["lhs_batch"])),
                       (0, *after(a["rhs_batch"])), after(lc), after(rc), dtype)]


def _ragged_dot_factors(instr) -> list[Factor]:
    """dot's factors, the ragged dim's and the prefix dims in group_sizes too. Split
    groups leave partial results where the ragged dim is free (each device adds its
    groups' products), parts of the result where it contracts; group_sizes stays whole:
    a device needs all the sizes before its first group to tell which elements are its."""
    a = instr.attrs
    lhs, rhs = instr.operands[:2]
    prefix, extra = _ragged_prefix(a, lhs.rank), (None,) * (len(instr.operands) - 3)
    lhs_free, rhs_free = dot_dims(instr)
    rhs_free = [r for r in rhs_free if r != a["rhs_group"]]
    first = 0 if a["rhs_group"] is not None else 1   # the result's first dim after the groups

    def dims(l, r, out):
        return (l, r, prefix.index(l) if l in prefix else None, *extra, out)
    factors = [Factor(lhs.shape[l], dims(l, r, first + i)) for i, (l, r) in enumerate(zip(a["lhs_batch"], a["rhs_batch"]))]
    factors += [Factor(lhs.shape[l], dims(l, r, None), REDUCE) for l, r in zip(a["lhs_contracting"], a["rhs_contracting"])]
    out = first + len(a["lhs_batch"])
    factors += [Factor(lhs.shape[l], dims(l, None, out + i)) for i, l in enumerate(lhs_free)]
    out += len(lhs_free)
    factors += [Factor(rhs.shape[r], dims(None, r, out + i)) for i, r in enumerate(rhs_free)]
    groups = instr.operands[2].shape[-1]
    if first == 0:
        factors.append(Factor(groups, (None, a["rhs_group"], None, *extra, None), REDUCE))
    else:
        factors.append(Factor(groups, (None, None, None, *extra, 0)))
    return factors


def _partition_ragged_dot(ctx: DeviceContext, instr, operands, targets):
    """As dot, the lhs's ragged dim and the groups split too: each device multiplies its
    own elements with its own groups, told where both start, and the sizes of its groups
    within its elements follow from all the sizes (tokens split: no communication where
    the ragged dim is free, partial sums per group where it contracts)."""
    factors = _ragged_dot_factors(instr)
    space = fx.choose_space(instr, factors, operands, targets, ctx.hardware)
    ragged = next(f for f, fac in enumerate(factors) if fac.dims[0] == instr.attrs["lhs_ragged"])
    group = len(factors) - 1

    def emit(ctx: DeviceContext, instr, local, shapes):
        if space.tiles[group] > 1 or space.tiles[ragged] > 1:
            rows = local[0].shape[instr.attrs["lhs_ragged"]]
            local = [*local, ctx.table_lookup(space.coords()[:, ragged] * rows)]
        if space.tiles[group] > 1:
            count = -(-factors[group].size // space.tiles[group])
            local = [*local, ctx.table_lookup(space.coords()[:, group] * count)]
        return fx.emit_same_op(ctx, instr, local, shapes)
    return fx.run(ctx, instr, factors, space, operands, targets, emit)


def _convert_ragged_dot(b, eqn, args):
    numbers = eqn.params["ragged_dot_dimension_numbers"]
    (lc, rc), (lb, rb) = (tuple(tuple(int(d) for d in ds) for ds in pair) for pair in numbers.dot_dimension_numbers)
    dims = dict(lhs_batch=lb, rhs_batch=rb, lhs_contracting=lc, rhs_contracting=rc)
    lhs, rhs, sizes = args
    shape, dtype = b.out_aval(eqn)
    ragged = int(numbers.lhs_ragged_dimensions[0])
    if ragged in lb:   # a ragged batch dim: each batch element is its own group, as in a dot
        return [b.add1("dot", [lhs, rhs], shape, dtype, **dims)]
    group = tuple(numbers.rhs_group_dimensions)
    attrs = dict(dims, lhs_ragged=ragged, rhs_group=int(group[0]) if group else None)
    prefix = _ragged_prefix(attrs, lhs.rank)
    if sizes.rank == 1 and prefix:   # the same sizes along every prefix dim: made explicit
        sizes = b.add1("broadcast", [sizes], tuple(lhs.shape[d] for d in prefix) + sizes.shape, sizes.dtype,
                       dims=(len(prefix),))
    return [b.add1("ragged-dot", [lhs, rhs, sizes], shape, dtype, **attrs)]


def _lower_ragged_dot(instr, args, lc):
    a, out = instr.attrs, instr.outputs[0]
    lhs, rhs, sizes = _localized(jnp, instr, [*(lax.convert_element_type(x, out.dtype) for x in args[:2]), *args[2:]])
    numbers = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=((a["lhs_contracting"], a["rhs_contracting"]), (a["lhs_batch"], a["rhs_batch"])),
        lhs_ragged_dimensions=(a["lhs_ragged"],),
        rhs_group_dimensions=() if a["rhs_group"] is None else (a["rhs_group"],))
    return [lax.ragged_dot_general(lhs, rhs, sizes, numbers, preferred_element_type=out.dtype)]


def _ragged_dot_flops(instr) -> int:
    """Each lhs element meets one group's rhs (as a grouped-matmul kernel computes it)."""
    lhs, rhs = instr.operands[:2]
    _, rhs_free = dot_dims(instr)
    return 2 * math.prod(lhs.shape) * math.prod(rhs.shape[r] for r in rhs_free if r != instr.attrs["rhs_group"])


def _expanded_ragged_operands(instr) -> dict[int, int]:
    """JAX runs a grouped matmul off TPU as one dense product over [groups, ...] copies
    of each operand with the ragged dim, the other groups' elements zeroed."""
    a = instr.attrs
    if a["rhs_group"] is not None:
        return {0: instr.operands[1].shape[a["rhs_group"]]}
    return {0: instr.outputs[0].shape[0], 1: instr.outputs[0].shape[0]}


def _ragged_layout(instr) -> KernelOrders:
    """Off TPU, JAX's dense product over the masked copies (written in the order the
    kernel wants) contracts the groups along with the contracting dims where the ragged
    dim is free: XLA:CPU's DotDecomposer transposes the weights into [batch, contracting,
    group, free] first (no copy where that is their order)."""
    a = instr.attrs
    cpu: list = [None] * len(instr.operands)
    if a["rhs_group"] is not None:
        rhs = instr.operands[1]
        contracting = (*a["rhs_contracting"], a["rhs_group"])
        free = tuple(d for d in range(rhs.rank) if d not in a["rhs_batch"] and d not in contracting)
        cpu[1] = ((*a["rhs_batch"], *contracting, *free),)
    return KernelOrders((None,) * len(instr.operands), cpu_operands=tuple(cpu))


register("ragged-dot",
         frontend=Frontend(converts={"ragged_dot_general": _convert_ragged_dot}),
         semantics=Semantics(evaluate=_evaluate_ragged_dot, lower=_lower_ragged_dot),
         rule=Rule(factors=_ragged_dot_factors, partition=_partition_ragged_dot, priority=CONTRACTION),
         timing=Timing(flops=_ragged_dot_flops, compute=ComputeKind.MATMUL),
         memory=Memory(expanded=_expanded_ragged_operands),
         kernel=Kernel(orders=_ragged_layout),
         rewrites=Rewrites(linear=linear_in((0,), (1,))))
