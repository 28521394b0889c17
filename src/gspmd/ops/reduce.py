"""Reductions and scans.

`reduce` (one operand, a Reducer): reduced dims are `reduce` factors, kept dims pass
through. argmax/argmin arrive as ordinary reductions too.

`variadic-reduce` (JAX's reduce with a computation of its own, over several operands at
once, as `lax.reduce` with tuples builds argmax-like pairs): operands (*xs, *inits),
attrs dims and computation (the combining jaxpr, taken to be associative and
commutative, as XLA does). Split along a reduced dim, each device reduces its shard,
the partial results of the devices along that dim are all-gathered (one per device:
no larger than the result) and reduced once more.

`cumulative` (cumsum, cumprod, cummax, cummin, cumlogsumexp): attrs reducer, dim,
reverse. Split along its dim, each device scans its shard once the carry from the
shards before it (after it, reversed) is known: every shard's total is all-gathered
(one element per row and shard) and each device combines those of its predecessors.
Nothing as large as the operand moves.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import jax
import numpy as np
from jax import lax
from jax.extend import core as jcore

from gspmd.ir import Instr, Value
from gspmd.ir.reducer import ADD, AND, LOGADDEXP, MAX, MIN, MUL, OR, XOR, Reducer
from gspmd.ops.convert import Converter, closed_in
from gspmd.ops.registry import (ELEMENTWISE, EXPAND, Frontend, LAYOUT, Memory, Rewrites, Rule, Semantics,
                                Storage, Timing, elementwise_factors, operand_flops, register)
from gspmd.spmd import factors as fx
from gspmd.spmd import reshard as rs
from gspmd.spmd.context import INDEX_DTYPE, DeviceContext, Why
from gspmd.spmd.factors import PASS, REDUCE, Factor
from gspmd.spmd.layout import groups_along
from gspmd.spmd.padding import mask_padding
from gspmd.spmd.partitioned import PartitionedValue


def _convert_reduce(reducer: Reducer) -> Converter:
    """A reduction over its `axes`; without (equinox's unvmap_any/all/max, which differ
    from jnp.any/all/max only under vmap, applied before gspmd sees the program) over all."""
    def convert(b, eqn, args):
        shape, dtype = b.out_aval(eqn)
        axes = eqn.params.get("axes", range(args[0].rank))
        return [b.add1("reduce", args, shape, dtype, dims=tuple(int(a) for a in axes), reducer=reducer)]
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
    with np.errstate(all="ignore"):   # padding rows the op does not reduce over hold NaN
        y = instr.attrs["reducer"].reduce(args[0], instr.attrs["dims"])
    return [np.asarray(y).astype(out.dtype, copy=False)]


def _lower_reduce(instr, args, lc):
    return [instr.attrs["reducer"].lax_reduce(args[0], instr.attrs["dims"]).astype(instr.outputs[0].dtype)]


register("reduce",
         frontend=Frontend(converts={"reduce_sum": _convert_reduce(ADD), "reduce_max": _convert_reduce(MAX),
                   "reduce_min": _convert_reduce(MIN), "reduce_prod": _convert_reduce(MUL),
                   "reduce_and": _convert_reduce(AND), "reduce_or": _convert_reduce(OR),
                   "reduce_xor": _convert_reduce(XOR),
                   "argmax": _convert_arg_reduce(MAX), "argmin": _convert_arg_reduce(MIN),
                   "unvmap_any": _convert_reduce(OR), "unvmap_all": _convert_reduce(AND),
                   "unvmap_max": _convert_reduce(MAX)}),
         semantics=Semantics(evaluate=_evaluate_reduce, lower=_lower_reduce),
         rule=Rule(factors=_reduce_factors, priority=LAYOUT, backward_priority=EXPAND),
         timing=Timing(flops=operand_flops),
         memory=Memory(storage=Storage.INDEXED, expensive=True),
         rewrites=Rewrites(linear=lambda instr: [(0,)] if instr.attrs["reducer"] is ADD else []))


# -- variadic-reduce: operands (*xs, *inits) -------------------------------------------------
@dataclass(frozen=True, eq=False)
class Computation:
    """A reduction's combining function: (*accumulators, *elements) -> accumulators, all
    scalars, as the closed jaxpr JAX traced it (printed on one line)."""
    jaxpr: object

    def __call__(self, *args):
        # under the context it is called in (a shard_map's manual axes), not the one it was
        # traced in, which jax would check the arguments against
        return jcore.jaxpr_as_fun(closed_in(self.jaxpr, jax.sharding.get_abstract_mesh()))(*args)

    def __repr__(self):
        return " ".join(str(self.jaxpr).split())


def _convert_variadic_reduce(b, eqn, args):
    return b.add("variadic-reduce", args, [b.out_aval(eqn, i) for i in range(len(eqn.outvars))],
                 dims=tuple(int(d) for d in eqn.params["dimensions"]), computation=Computation(eqn.params["jaxpr"]))


@functools.lru_cache(maxsize=64)
def vectorized(computation: Computation) -> Callable:
    """The scalar computation applied element by element to 1-D arrays."""
    return jax.jit(jax.vmap(computation))


def _evaluate_variadic_reduce(instr: Instr, args, device):
    """Combine the elements along the reduced dims into the init values, one at a time."""
    n, dims, outs = len(instr.outputs), instr.attrs["dims"], instr.outputs
    xs, inits = args[:n], args[n:]
    last = list(range(xs[0].ndim - len(dims), xs[0].ndim))
    rows = [np.moveaxis(x, list(dims), last).reshape(-1, int(np.prod([x.shape[d] for d in dims]))) for x in xs]
    acc = [np.broadcast_to(i, (rows[0].shape[0],)) for i in inits]
    combine = vectorized(instr.attrs["computation"])
    for j in range(rows[0].shape[1]):
        acc = combine(*acc, *(r[:, j] for r in rows))
    return [np.asarray(a).astype(o.dtype, copy=False).reshape(o.shape) for a, o in zip(acc, outs)]


def _lower_variadic_reduce(instr, args, lc):
    n, fn = len(instr.outputs), instr.attrs["computation"]
    return list(lax.reduce(tuple(args[:n]), tuple(args[n:]), lambda a, b: tuple(fn(*a, *b)), instr.attrs["dims"]))


def _variadic_factors(instr: Instr) -> list[Factor]:
    """Each operand dim is a factor shared by every x (the inits are scalars): reduced
    dims are reduce factors, kept dims pass through to every result."""
    n, dims, x = len(instr.outputs), instr.attrs["dims"], instr.operands[0]
    kept = [d for d in range(x.rank) if d not in dims]
    return [Factor(size, (d,) * n + (None,) * n + (None if d in dims else kept.index(d),) * n,
                   REDUCE if d in dims else PASS) for d, size in enumerate(x.shape)]


def _partition_variadic_reduce(ctx: DeviceContext, instr: Instr, operands, targets) -> list[PartitionedValue]:
    n, b = len(instr.outputs), ctx.b
    factors = _variadic_factors(instr)
    space = fx.choose_space(instr, factors, operands, targets, ctx.hardware)
    split = [d for d in instr.attrs["dims"] if space.tiles[d] > 1]   # factor f is operand dim f
    inits = [o.local for o in operands[n:]]
    xs = []
    for t, (o, init) in enumerate(zip(operands[:n], inits)):
        pv = rs.reshard(ctx, o, fx.tensor_layout(factors, t, space, o.rank))
        for d in split:   # padding must not count: it becomes the init value
            pv = mask_padding(ctx, pv, d, init)
        xs.append(pv.local)
    layouts = [fx.tensor_layout(factors, 2 * n + j, space, out.rank) for j, out in enumerate(instr.outputs)]
    types = [(layout.shard_shape(out.shape), out.dtype) for layout, out in zip(layouts, instr.outputs)]
    partials = b.add("variadic-reduce", xs + inits, types, **instr.attrs)
    if split:
        groups = groups_along(space, split)
        stacked = [ctx.all_gather(b.add1("reshape", [p], (1, *p.shape), p.dtype), 0, groups, Why.PARTIAL_RESULTS,
                                  "partial reductions") for p in partials]
        partials = b.add("variadic-reduce", stacked + inits, types, **dict(instr.attrs, dims=(0,)))
    return [rs.reshard(ctx, PartitionedValue(v, layout, out.shape), t)
            for v, layout, out, t in zip(partials, layouts, instr.outputs, targets)]


register("variadic-reduce",
         frontend=Frontend(converts={"reduce": _convert_variadic_reduce}),
         semantics=Semantics(evaluate=_evaluate_variadic_reduce, lower=_lower_variadic_reduce),
         rule=Rule(factors=_variadic_factors, partition=_partition_variadic_reduce, priority=LAYOUT,
                   backward_priority=EXPAND),
         memory=Memory(storage=Storage.INDEXED, expensive=True))


# -- cumulative: attrs reducer, dim, reverse ------------------------------------------------
_CUMULATIVE = {"cumsum": (ADD, lax.cumsum), "cumprod": (MUL, lax.cumprod), "cummax": (MAX, lax.cummax),
               "cummin": (MIN, lax.cummin), "cumlogsumexp": (LOGADDEXP, lax.cumlogsumexp)}
_LAX_CUMULATIVE = {reducer: fn for reducer, fn in _CUMULATIVE.values()}


def _convert_cumulative(reducer: Reducer) -> Converter:
    def convert(b, eqn, args):
        shape, dtype = b.out_aval(eqn)
        return [b.add1("cumulative", args, shape, dtype, reducer=reducer, dim=eqn.params["axis"],
                       reverse=eqn.params["reverse"])]
    return convert


def _evaluate_cumulative(instr: Instr, args, device):
    a = instr.attrs
    flip = (lambda v: np.flip(v, a["dim"])) if a["reverse"] else (lambda v: v)
    with np.errstate(all="ignore"):
        y = a["reducer"].combine.accumulate(flip(args[0]), axis=a["dim"])
    return [flip(y).astype(instr.outputs[0].dtype, copy=False)]


def _lower_cumulative(instr, args, lc):
    a = instr.attrs
    return [_LAX_CUMULATIVE[a["reducer"]](args[0], axis=a["dim"], reverse=a["reverse"])]


def _partition_cumulative(ctx: DeviceContext, instr: Instr, operands, targets) -> list[PartitionedValue]:
    factors = elementwise_factors(instr)   # factor f is dim f: the space is the layout
    space = fx.choose_space(instr, factors, operands, targets, ctx.hardware)
    a = instr.attrs
    if space.tiles[a["dim"]] == 1:
        return fx.run(ctx, instr, factors, space, operands, targets)
    x = rs.reshard(ctx, operands[0], space)
    x = mask_padding(ctx, x, a["dim"], a["reducer"].identity(x.dtype))
    y = _scan_after_carry(ctx, instr, x.local, _carry_in(ctx, instr, x))
    return [rs.reshard(ctx, PartitionedValue(y, space, instr.outputs[0].shape), targets[0])]


def _carry_in(ctx: DeviceContext, instr: Instr, x: PartitionedValue) -> Value:
    """The combination of the shards before this device's along the dim (after it when
    reversed), as a unit-length slice along the dim."""
    a, b, s = instr.attrs, ctx.b, x.sharding
    dim, reducer, local = a["dim"], a["reducer"], x.local
    unit = local.shape[:dim] + (1,) + local.shape[dim + 1:]
    total = b.add1("reduce", [local], unit[:dim] + unit[dim + 1:], local.dtype, dims=(dim,), reducer=reducer)
    total = b.add1("reshape", [total], unit, local.dtype)
    totals = ctx.all_gather(total, dim, groups_along(s, [dim]), Why.PARTIAL_RESULTS, "shard totals")
    shape = totals.shape
    shard = b.add1("iota", [], shape, INDEX_DTYPE, dimension=dim)
    mine = b.add1("broadcast", [ctx.table_lookup(s.coords()[:, dim])], shape, INDEX_DTYPE, dims=())
    earlier = b.add1("compare", [shard, mine], shape, np.bool_, direction="GT" if a["reverse"] else "LT")
    identity = b.add1("broadcast", [ctx.constant(reducer.identity(local.dtype))], shape, local.dtype, dims=())
    carry = b.add1("reduce", [b.add1("select", [earlier, totals, identity], shape, local.dtype)],
                   unit[:dim] + unit[dim + 1:], local.dtype, dims=(dim,), reducer=reducer)
    return b.add1("reshape", [carry], unit, local.dtype)


def _scan_after_carry(ctx: DeviceContext, instr: Instr, local: Value, carry: Value) -> Value:
    """The local scan seeded with the carry: scan [carry, shard] (reversed: [shard,
    carry]) and drop the carry's place."""
    a, b, dim = instr.attrs, ctx.b, instr.attrs["dim"]
    pieces = [local, carry] if a["reverse"] else [carry, local]
    shape = list(local.shape)
    shape[dim] += 1
    seeded = b.add1("concatenate", pieces, shape, local.dtype, dimension=dim)
    scanned = b.add1("cumulative", [seeded], shape, local.dtype, **a)
    start = [0] * local.rank
    start[dim] = 0 if a["reverse"] else 1
    limit = [start[d] + local.shape[d] for d in range(local.rank)]
    return b.add1("slice", [scanned], local.shape, local.dtype, start=tuple(start), limit=tuple(limit),
                  strides=(1,) * local.rank)


register("cumulative",
         frontend=Frontend(converts={name: _convert_cumulative(reducer) for name, (reducer, _) in _CUMULATIVE.items()}),
         semantics=Semantics(evaluate=_evaluate_cumulative, lower=_lower_cumulative),
         rule=Rule(factors=elementwise_factors, partition=_partition_cumulative, priority=ELEMENTWISE))
