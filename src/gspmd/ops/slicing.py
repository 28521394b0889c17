"""Data-formatting ops: pad, slice, dynamic-slice, dynamic-update-slice, concatenate.

Dims an op leaves untouched partition as factors. Along a split dim the op moves data
along (paper 4.3, 4.6). A pad, slice or concatenate that changes one dim, with the
chain of pads, slices, concatenates and reverses below it, is one step: each device
takes the pieces of its tile that it lacks from their holders (ops/formatting.py,
spmd/segments.py) — a shift, a rotation (concatenate(x[k:], x[:k]), as jnp.roll
traces), a wrap-around pad. Strided or dilated pads and slices, and those changing
several dims, are windows of size 1 planned by spmd/halo.py (a slice looks through the
pad and slices below it: one halo step per chain). dynamic-slice at a runtime offset
sums the partial windows the partitions hold, and dynamic-update-slice writes the part
of the window each partition holds."""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
from jax import lax

from gspmd.ir import Instr, Value
from gspmd.ir.emit import mask_range, pad_dim
from gspmd.ir.reducer import ADD, OR, Reducer
from gspmd.ops.loop_motion import same_within
from gspmd.ops.formatting import clip, in_one_step_or_by_factors, partition_in_one_step
from gspmd.ops.registry import (LAYOUT, Facets, Frontend, Memory, Rewrites, Rule, SegmentRule, Semantics, Storage,
                                Timing, jointly_linear, linear_in, register, result_sized_bytes, update_sized_bytes)
from gspmd.ops.window import pad_array
from gspmd.sharding import Sharding
from gspmd.spmd import factors as fx
from gspmd.spmd.context import INDEX_DTYPE
from gspmd.spmd import segments as sg
from gspmd.spmd.factors import PASS, PERMUTE, REDUCE, REPLICATE, Factor, FactorKind
from gspmd.spmd.halo import Window, partition_windowed, plan_dim, plan_layout, slice_outputs
from gspmd.spmd.partitioned import PartitionedValue


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
    a = instr.attrs
    return [pad_array(args[0], args[1], a["low"], a["high"], a["interior"])]


def _evaluate_concatenate(instr, args, device):
    return [np.concatenate(args, axis=instr.attrs["dimension"])]


def _dim_factors(operands: Sequence[Value], shape, kinds: Sequence[FactorKind]) -> list[Factor]:
    """Dim d of every non-scalar operand and of the output is one factor of kind kinds[d]."""
    return [Factor(n, tuple(d if v.rank else None for v in operands) + (d,), kinds[d]) for d, n in enumerate(shape)]


# -- pad and slice: windows of size 1 -----------------------------------------------------
def _pad_windows(instr) -> list[Window]:
    a = instr.attrs
    return [Window(low=lo, high=hi, base_dilation=i + 1) for lo, hi, i in zip(a["low"], a["high"], a["interior"])]


def _slice_windows(shape, start, limit, strides) -> list[Window]:
    return [Window(stride=st, low=-s, high=e - n) for n, s, e, st in zip(shape, start, limit, strides)]


def _unit_chain(instr) -> tuple[Value, list[Window], Optional[Value]]:
    """A pad or slice as (base, per-dim size-1 windows over it, pad value or None). A slice
    looks through the slices below it and at most one pad, so that the whole chain is one
    halo step (paper 4.6)."""
    if instr.opcode == "pad":
        return instr.operands[0], _pad_windows(instr), instr.operands[1]
    x, a = instr.operands[0], instr.attrs
    inner = x.producer
    if inner is None or inner.opcode not in ("pad", "slice") or 0 in x.shape:
        return x, _slice_windows(x.shape, a["start"], a["limit"], a["strides"]), None
    base, windows, fill = _unit_chain(inner)
    return base, [w.sliced(n, s, st, m) for w, n, s, st, m in
                  zip(windows, base.shape, a["start"], a["strides"], instr.outputs[0].shape)], fill


# -- segment rules (ops/formatting.py): along the one dim changed --------------------------
def _only(changed: list[int], plain: bool) -> Optional[int]:
    return changed[0] if plain and len(changed) == 1 else None


def _pad_changed_dim(instr) -> Optional[int]:
    a, x = instr.attrs, instr.operands[0]
    return _only([d for d in range(x.rank) if a["low"][d] or a["high"][d]], not any(a["interior"]))


def _pad_segments(instr, dim, below, fill):
    low, size, x = instr.attrs["low"][dim], instr.outputs[0].shape[dim], instr.operands[0]
    value = fill(instr.operands[1])
    inner = [s.shifted(low) for s in below(x)]
    high = low + x.shape[dim]
    edges = [sg.Segment(0, low, value, fill=True), sg.Segment(high, size - high, value, fill=True)]
    return clip(inner + edges, size)


def _slice_changed_dim(instr) -> Optional[int]:
    a, x = instr.attrs, instr.operands[0]
    return _only([d for d in range(x.rank) if a["start"][d] or a["limit"][d] != x.shape[d]],
                 all(s == 1 for s in a["strides"]))


def _slice_segments(instr, dim, below, fill):
    start = instr.attrs["start"][dim]
    return clip([s.shifted(-start) for s in below(instr.operands[0])], instr.outputs[0].shape[dim])


def _concatenate_segments(instr, dim, below, fill):
    out, at = [], 0
    for operand in instr.operands:
        out += [s.shifted(at) for s in below(operand)]
        at += operand.shape[dim]
    return out


def _unit_factors(instr, windows: Sequence[Window]) -> list[Factor]:
    """Every dim of a pad or slice passes through; those it changes are permutation
    factors (splits carry through them; the partition rule moves the elements, by halo
    exchange)."""
    return _dim_factors(instr.operands, instr.outputs[0].shape, [PASS if w.trivial else PERMUTE for w in windows])


def _pad_factors(instr) -> list[Factor]:
    return _unit_factors(instr, _pad_windows(instr))


def _slice_factors(instr) -> list[Factor]:
    x, a = instr.operands[0], instr.attrs
    return _unit_factors(instr, _slice_windows(x.shape, a["start"], a["limit"], a["strides"]))


def _local_unit(ctx, x: Value, windows: Sequence[Window], fill: Value) -> Value:
    """Size-1 windows applied locally: pad (interior = base dilation - 1; negative low and
    high crop), then a strided slice down to the outputs."""
    rank = x.rank
    if not all(w.low == w.high == 0 and w.base_dilation == 1 for w in windows):
        spread = [(n - 1) * w.base_dilation + 1 if n else 0 for w, n in zip(windows, x.shape)]
        # A shard cropped away entirely leaves an empty dim, not a negative one.
        high = [max(w.high, -w.low - n) for w, n in zip(windows, spread)]
        shape = [w.low + h + n for w, h, n in zip(windows, high, spread)]
        x = ctx.b.add1("pad", [x, fill], shape, x.dtype, low=tuple(w.low for w in windows),
                       high=tuple(high), interior=tuple(w.base_dilation - 1 for w in windows))
    out = [max(0, (n - 1) // w.stride + 1) if n > 0 else 0 for w, n in zip(windows, x.shape)]
    if list(x.shape) == out:
        return x
    limit = [(m - 1) * w.stride + 1 if m else 0 for w, m in zip(windows, out)]
    return ctx.b.add1("slice", [x], out, x.dtype, start=(0,) * rank, limit=tuple(limit),
                      strides=tuple(w.stride for w in windows))


def _partition_unit(ctx, instr, x: PartitionedValue, windows: list[Window], fill: Optional[PartitionedValue],
                    target: Sharding) -> PartitionedValue:
    """Partition a pad/slice chain given as size-1 windows over x: split changed dims take
    each partition's window of x from its neighbours (halo exchange), other changed dims
    stay whole, untouched dims pass through."""
    out = instr.outputs[0]
    plans, layout = {}, None
    if 0 not in x.shape and 0 not in out.shape:
        plans, layout = plan_layout(windows, x, target, lambda d, parts: plan_dim(x.shape[d], windows[d], parts))
    operands = [x] + ([fill] if fill is not None else [])
    factors = _dim_factors(operands, out.shape, [PASS if w.trivial or d in plans else REPLICATE
                                                 for d, w in enumerate(windows)])
    zero = ctx.constant(np.zeros((), x.dtype)) if fill is None else None

    def emit(ctx, _instr, locals_, shapes):
        local = [plans[d].local if d in plans else w for d, w in enumerate(windows)]
        y = _local_unit(ctx, locals_[0], local, locals_[1] if fill is not None else zero)
        return [slice_outputs(ctx, y, plans, layout, {d: d for d in plans})]
    if not plans:
        return fx.partition(ctx, instr, factors, operands, [target], emit_local=emit)[0]
    return partition_windowed(ctx, instr, operands, [target], factors, 0, plans, layout, {d: d for d in plans},
                              [d for d in range(x.rank) if d not in plans],
                              fill.local if fill is not None else zero, emit)[0]


def _partition_pad_or_slice(ctx, instr, operands, targets):
    merged = partition_in_one_step(ctx, instr, targets[0])
    if merged is not None:
        return [merged]
    base, windows, fill = _unit_chain(instr)
    fill_pv = None if fill is None else ctx.partitioned(fill)
    return [_partition_unit(ctx, instr, ctx.partitioned(base), windows, fill_pv, targets[0])]


def _convert_slice(b, eqn, args):
    shape, dtype = b.out_aval(eqn)
    p = eqn.params
    return [b.add1("slice", args, shape, dtype, start=tuple(p["start_indices"]), limit=tuple(p["limit_indices"]),
                   strides=tuple(p["strides"] or (1,) * len(shape)))]


def _convert_split(b, eqn, args):
    """jax.lax.split (the transpose of concatenate): one slice per piece."""
    (x,), axis = args, eqn.params["axis"]
    return _pieces(b, x, axis, [var.aval.shape[axis] for var in eqn.outvars])


def _convert_unstack(b, eqn, args):
    """The transpose of jnp.stack: a slice per index along `axis`, without that dim."""
    (x,), axis = args, eqn.params["axis"]
    return [b.add1("reshape", [piece], var.aval.shape, var.aval.dtype)
            for piece, var in zip(_pieces(b, x, axis, [1] * len(eqn.outvars)), eqn.outvars)]


def _pieces(b, x, axis: int, sizes) -> list:
    """x cut along `axis` into consecutive slices of these sizes."""
    outs, start = [], 0
    for size in sizes:
        begin, limit = [0] * x.rank, list(x.shape)
        begin[axis], limit[axis] = start, start + size
        outs.append(b.add1("slice", [x], tuple(limit[d] - begin[d] for d in range(x.rank)), x.dtype,
                           start=tuple(begin), limit=tuple(limit), strides=(1,) * x.rank))
        start += size
    return outs


def _convert_pad(b, eqn, args):
    shape, dtype = b.out_aval(eqn)
    cfg = eqn.params["padding_config"]
    return [b.add1("pad", args, shape, dtype, low=tuple(c[0] for c in cfg), high=tuple(c[1] for c in cfg),
                   interior=tuple(c[2] for c in cfg))]


def _lower_slice(instr, args, lc):
    a = instr.attrs
    return [lax.slice(args[0], a["start"], a["limit"], a["strides"])]


def _lower_pad(instr, args, lc):
    a = instr.attrs
    return [lax.pad(args[0], args[1], list(zip(a["low"], a["high"], a["interior"])))]


register("slice",
         frontend=Frontend(converts={"slice": _convert_slice, "split": _convert_split, "unstack": _convert_unstack}),
         semantics=Semantics(evaluate=_evaluate_slice, lower=_lower_slice),
         rule=Rule(factors=_slice_factors, partition=_partition_pad_or_slice, priority=LAYOUT),
         timing=Timing(bytes_accessed=result_sized_bytes),
         memory=Memory(storage=Storage.INDEXED),
         rewrites=Rewrites(linear=jointly_linear),
         facets=Facets(segments=SegmentRule(_slice_changed_dim, _slice_segments)))
# pad(x, value): linear in both (the padding value zero when x is summed)
register("pad",
         frontend=Frontend(converts={"pad": _convert_pad}),
         semantics=Semantics(evaluate=_evaluate_pad, lower=_lower_pad),
         rule=Rule(factors=_pad_factors, partition=_partition_pad_or_slice, priority=LAYOUT),
         memory=Memory(storage=Storage.INDEXED),
         rewrites=Rewrites(linear=jointly_linear),
         facets=Facets(segments=SegmentRule(_pad_changed_dim, _pad_segments)))


# -- dynamic-slice and dynamic-update-slice -----------------------------------------------
def _constant_starts(instr, first: int) -> Optional[list[int]]:
    """The start indices (operands from `first` on) when all are constants."""
    producers = [v.producer for v in instr.operands[first:]]
    if any(p is None or p.opcode != "constant" for p in producers):
        return None
    return [int(p.attrs["value"]) for p in producers]


def _reducer(dtype) -> Reducer:
    return OR if np.dtype(dtype) == np.bool_ else ADD


def _dynamic_slice_factors(instr):
    """Dims taken whole pass through (their start clamps to 0 on every shard). A dim cut at
    a runtime offset is a reduction over the operand's split of it: each partition
    contributes the part of the window it holds (zeros elsewhere)."""
    x, out = instr.operands[0], instr.outputs[0]
    starts = (None,) * (len(instr.operands) - 1)
    factors = []
    for d, (n, k) in enumerate(zip(x.shape, out.shape)):
        if n == k:
            factors.append(Factor(n, (d, *starts, d)))
        else:
            factors += [Factor(n, (d, *starts, None), REDUCE, _reducer(x.dtype)),
                        Factor(k, (None, *starts, d), REPLICATE)]
    return factors


def _dynamic_update_slice_factors(instr):
    """The operand's dims pass through to the output; the update's cut dims stay whole
    (each partition writes the part of the window it holds)."""
    x, update = instr.operands[:2]
    starts = (None,) * (len(instr.operands) - 2)
    factors = []
    for d, (n, k) in enumerate(zip(x.shape, update.shape)):
        if n == k:
            factors.append(Factor(n, (d, d, *starts, d)))
        else:
            factors += [Factor(n, (d, None, *starts, d)), Factor(k, (None, d, *starts, None), REPLICATE)]
    return factors


def _relative_start(ctx, start: Value, limit: int, layout: Sharding, dim: int, shard: int) -> Value:
    """Where a window starting at `start` (clamped to [0, limit], as HLO does) begins
    relative to this partition's shard along dim."""
    b = ctx.b
    s = b.add1("convert", [start], (), INDEX_DTYPE)
    s = b.add1("maximum", [b.add1("minimum", [s, ctx.constant(limit, INDEX_DTYPE)], (), INDEX_DTYPE),
                           ctx.constant(0, INDEX_DTYPE)], (), INDEX_DTYPE)
    return b.add1("subtract", [s, ctx.table_lookup(layout.coords()[:, dim] * shard)], (), INDEX_DTYPE)


def _plus(ctx, x: Value, k: int) -> Value:
    return ctx.b.add1("add", [x, ctx.constant(k, INDEX_DTYPE)], (), INDEX_DTYPE)


def _split_cut_dims(layout: Sharding, whole: Sequence[int], window: Sequence[int]) -> list[int]:
    return [d for d, (n, k) in enumerate(zip(whole, window)) if n != k and layout.tiles[d] > 1]


def _partition_dynamic_slice(ctx, instr, operands, targets):
    """Constant starts make a slice (halo exchange). Otherwise a split cut dim is a
    reduction: each partition slices its shard padded with zeros (the clamped
    dynamic-slice reads only zeros where the window misses the shard), and the partial
    windows are summed."""
    x, out = instr.operands[0], instr.outputs[0]
    starts = _constant_starts(instr, 1)
    if starts is not None:
        starts = _clamped_starts(x.shape, starts, out.shape)
        windows = _slice_windows(x.shape, starts, [s + k for s, k in zip(starts, out.shape)], [1] * x.rank)
        return [_partition_unit(ctx, instr, operands[0], windows, None, targets[0])]
    factors = _dynamic_slice_factors(instr)
    space = fx.choose_space(instr, factors, operands, targets, ctx.hardware)
    layout = fx.tensor_layout(factors, 0, space, x.rank)
    split = _split_cut_dims(layout, x.shape, out.shape)

    def emit(ctx, _instr, locals_, shapes):
        local, *index = locals_
        for d in split:
            k, n = shapes[0][d], local.shape[d]
            local = pad_dim(ctx.b, local, d, k, k, np.zeros((), local.dtype))
            index[d] = _plus(ctx, _relative_start(ctx, index[d], x.shape[d] - k, layout, d, n), k)
        return [ctx.dynamic_slice(local, index, shapes[0])]
    return fx.run(ctx, instr, factors, space, operands, targets, emit)


def _partition_dynamic_update_slice(ctx, instr, operands, targets):
    """A split cut dim: each partition writes the part of the update window that falls on
    its shard (the update aligned to the shard by a padded dynamic-slice, then selected
    by position); no gather of the operand."""
    x, update = instr.operands[:2]
    factors = _dynamic_update_slice_factors(instr)
    space = fx.choose_space(instr, factors, operands, targets, ctx.hardware)
    layout = fx.tensor_layout(factors, 0, space, x.rank)
    if not _split_cut_dims(layout, x.shape, update.shape):
        return fx.run(ctx, instr, factors, space, operands, targets)
    cut = [d for d, (n, k) in enumerate(zip(x.shape, update.shape)) if n != k]

    def emit(ctx, _instr, locals_, shapes):
        local, upd, *index = locals_
        rel, zero = {}, np.zeros((), upd.dtype)
        for d in cut:
            n = local.shape[d]
            rel[d] = ctx.b.add1("negate", [_relative_start(ctx, index[d], x.shape[d] - upd.shape[d], layout, d, n)],
                                (), INDEX_DTYPE)
            upd = pad_dim(ctx.b, upd, d, n, n, zero)
            index[d] = _plus(ctx, rel[d], n)
        aligned = ctx.dynamic_slice(upd, [index[d] if d in rel else ctx.constant(0, INDEX_DTYPE)
                                          for d in range(x.rank)], local.shape)
        for d in cut:
            aligned = mask_range(ctx.b, aligned, d, 0, update.shape[d], local, offset=rel[d])
        return [aligned]
    return fx.run(ctx, instr, factors, space, operands, targets, emit)


def _convert_as_is(opcode: str):
    """dynamic_slice / dynamic_update_slice: same operands; sizes are the result shape."""
    def convert(b, eqn, args):
        return [b.add1(opcode, args, *b.out_aval(eqn))]
    return convert


def _clamped(instr: Instr, first: int, starts, shape, sizes, lc) -> list:
    """Starts clamped into bounds explicitly, as HLO defines (lax would first wrap negative
    ones from the end, and XLA:CPU folds nested dynamic-slices into one at the summed
    start without clamping the inner one), but for those known to lie in bounds (the
    constants and partition-id offset tables of partitioned programs: clamping them
    would be a third of such a program's ops)."""
    out = []
    for v, s, n, k in zip(instr.operands[first:], starts, shape, sizes):
        known = _start_bounds(v, lc.axis_size())
        inside = known is not None and 0 <= known[0] and known[1] <= n - k
        out.append(s if inside else lax.clamp(np.asarray(0, s.dtype), s, np.asarray(n - k, s.dtype)))
    return out


def _start_bounds(v: Value, num_devices: int) -> Optional[tuple[int, int]]:
    """The least and greatest value a start index can take, where constants and
    partition-id (0..num_devices-1) alone make it (through reshapes and lookups in a
    constant table); None where data does."""
    p = v.producer
    if p is None:
        return None
    if p.opcode == "constant":
        table = np.asarray(p.attrs["value"])
        return (int(table.min()), int(table.max())) if table.size else None
    if p.opcode == "partition-id":
        return 0, num_devices - 1
    if p.opcode == "reshape":
        return _start_bounds(p.operands[0], num_devices)
    if p.opcode == "dynamic-slice":    # a lookup: any element of the table
        return _start_bounds(p.operands[0], num_devices)
    return None


def _lower_dynamic_slice(instr, args, lc):
    x, *starts = args
    sizes = instr.outputs[0].shape
    return [lax.dynamic_slice(x, _clamped(instr, 1, starts, x.shape, sizes, lc), sizes, allow_negative_indices=False)]


def _lower_dynamic_update_slice(instr, args, lc):
    x, update, *starts = args
    return [lax.dynamic_update_slice(x, update, _clamped(instr, 2, starts, x.shape, update.shape, lc),
                                     allow_negative_indices=False)]


def _dynamic_slice_uniform(instr: Instr, groups: np.ndarray, uniform) -> bool:
    """A partition-id table lookup (dynamic-slice(constant table, partition-id)) is the
    same within groups where its table is; other slices where their operands are."""
    table, *starts = instr.operands
    if (table.producer is not None and table.producer.opcode == "constant" and table.rank == 1 and len(starts) == 1
            and starts[0].producer is not None and starts[0].producer.opcode == "partition-id"):
        return same_within(table.producer.attrs["value"][:, None], groups)
    return all(uniform(o, groups) for o in instr.operands)


def _dynamic_update_slice_added_to(instr: Instr, acc: Value, add: Instr, program) -> list[Instr]:
    """acc + dynamic-update-slice(0, u, i) = dynamic-update-slice(acc, dynamic-slice(acc, i) + u, i)."""
    _, u, *starts = instr.operands
    held = instr.remade([acc, *starts], Value(program.fresh_name("dynamic_slice"), u.shape, u.dtype),
                        "dynamic-slice", {})
    summed = add.remade([held.output, u], Value(program.fresh_name("add"), u.shape, u.dtype))
    held.output.sharding = summed.output.sharding = u.sharding
    return [held, summed, instr.remade([acc, summed.output, *starts], add.output)]


register("dynamic-slice",
         frontend=Frontend(converts={"dynamic_slice": _convert_as_is("dynamic-slice")}),
         semantics=Semantics(evaluate=_evaluate_dynamic_slice, lower=_lower_dynamic_slice),
         rule=Rule(factors=_dynamic_slice_factors, partition=_partition_dynamic_slice, priority=LAYOUT),
         timing=Timing(bytes_accessed=result_sized_bytes),
         memory=Memory(storage=Storage.INDEXED),
         rewrites=Rewrites(linear=linear_in((0,))),
         facets=Facets(uniform=_dynamic_slice_uniform))
register("dynamic-update-slice",
         frontend=Frontend(converts={"dynamic_update_slice": _convert_as_is("dynamic-update-slice")}),
         semantics=Semantics(evaluate=_evaluate_dynamic_update_slice, lower=_lower_dynamic_update_slice),
         rule=Rule(factors=_dynamic_update_slice_factors, partition=_partition_dynamic_update_slice, priority=LAYOUT),
         timing=Timing(bytes_accessed=update_sized_bytes(1)),
         memory=Memory(storage=Storage.IN_PLACE),
         rewrites=Rewrites(linear=linear_in((0, 1))),
         facets=Facets(added_to=_dynamic_update_slice_added_to))


def _concatenate_factors(instr):
    """Every dim passes through; the concatenated one is a permutation factor: a split
    of it carries over, and along a split one each device takes the pieces of its tile
    from the operands' holders (a rotation concatenate(x[k:], x[:k]), as jnp.roll
    traces, moves only what crosses shards)."""
    dim, out = instr.attrs["dimension"], instr.outputs[0]
    return [Factor(n, tuple(d if v.rank else None for v in instr.operands) + (d,), PERMUTE if d == dim else PASS)
            for d, n in enumerate(out.shape)]


def _convert_concatenate(b, eqn, args):
    shape, dtype = b.out_aval(eqn)
    return [b.add1("concatenate", args, shape, dtype, dimension=eqn.params["dimension"])]


def _convert_stack(b, eqn, args):
    """jnp.stack (its own primitive in this JAX): each operand with a size-1 dim at
    `axis`, concatenated along it."""
    shape, dtype = b.out_aval(eqn)
    axis = eqn.params["axis"]
    pieces = [b.add1("reshape", [x], shape[:axis] + (1,) + shape[axis + 1:], x.dtype) for x in args]
    return [b.add1("concatenate", pieces, shape, dtype, dimension=axis)]


def _lower_concatenate(instr, args, lc):
    return [lax.concatenate(args, instr.attrs["dimension"])]


def _concatenate_position(instr, fixed, below):
    """The position in the piece a fixed index along the concatenated dim falls in."""
    dim = instr.attrs["dimension"]
    if dim not in fixed:
        return None
    at = fixed[dim]
    for piece in instr.operands:
        if at < piece.shape[dim]:
            return below(piece, {**fixed, dim: at})
        at -= piece.shape[dim]
    return None


register("concatenate",
         frontend=Frontend(converts={"concatenate": _convert_concatenate, "stack": _convert_stack}),
         semantics=Semantics(evaluate=_evaluate_concatenate, lower=_lower_concatenate),
         rule=Rule(factors=_concatenate_factors, partition=in_one_step_or_by_factors, priority=LAYOUT),
         memory=Memory(storage=Storage.INDEXED, cpu_unfused=lambda instr: len(instr.operands) > 8),
         rewrites=Rewrites(linear=jointly_linear),
         facets=Facets(segments=SegmentRule(lambda instr: instr.attrs["dimension"], _concatenate_segments),
                       position=_concatenate_position))
