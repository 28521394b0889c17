"""gather and scatter (HLO semantics, index vector in the indices' last dim).

Factors: the indices' batch dims pass through to the gathered dims (or, for scatter,
are a `reduce` factor: each device scatters its share of the updates and the partial
results are summed); operand dims taken whole pass through to the window dims. An
operand dim that is indexed can be split too (an embedding table split on its vocab):
each device then answers only for the rows it holds — its gather yields zeros for the
others (summed afterwards), its scatter drops them. Everything else stays whole.
"""
from __future__ import annotations

from functools import partial

import numpy as np
from jax import lax

from gspmd.dtypes import is_floating
from gspmd.errors import ShardingError
from gspmd.ir import Instr, Value
from gspmd.ir.reducer import ADD, AND, MAX, MIN, MUL, Reducer
from gspmd.ops.registry import LAYOUT, Storage, register, result_sized_bytes, update_sized_bytes
from gspmd.sharding import Sharding
from gspmd.spmd import factors as fx
from gspmd.spmd.context import INDEX_DTYPE, DeviceContext
from gspmd.spmd.factors import REDUCE, REPLICATE, Factor

CLIP, FILL = "clip", "fill"   # out-of-range starts: clamp, or fill (gather) / drop (scatter)


# -- reference semantics ------------------------------------------------------------------
def _starts(indices: np.ndarray, index_map, operand_shape, sizes, mode):
    """[N, operand rank] window starts and a [N] in-bounds flag, N = indices batch size."""
    flat = indices.reshape(-1, indices.shape[-1]).astype(np.int64)
    starts = np.zeros((flat.shape[0], len(operand_shape)), np.int64)
    starts[:, list(index_map)] = flat
    limit = np.asarray(operand_shape) - np.asarray(sizes)
    valid = np.all((starts >= 0) & (starts <= limit), axis=1)
    return (np.clip(starts, 0, limit) if mode == CLIP else starts), valid


def _window_index(starts, sizes):
    """Per operand dim, an index array of shape [N, *sizes] (broadcastable)."""
    rank = len(sizes)
    out = []
    for d, size in enumerate(sizes):
        shape = [1] * (rank + 1)
        shape[d + 1] = size
        out.append(starts[:, d].reshape((-1,) + (1,) * rank) + np.arange(size).reshape(shape))
    return out


def _evaluate_gather(instr, args, device):
    operand, indices = args
    a, out = instr.attrs, instr.outputs[0]
    starts, valid = _starts(indices, a["start_index_map"], operand.shape, a["slice_sizes"], a["mode"])
    safe = np.clip(starts, 0, np.asarray(operand.shape) - np.asarray(a["slice_sizes"]))
    windows = operand[tuple(_window_index(safe, a["slice_sizes"]))]            # [N, *sizes]
    if a["mode"] == FILL:
        windows = np.where(valid.reshape((-1,) + (1,) * operand.ndim), windows, a["fill_value"])
    windows = windows.reshape((-1,) + tuple(s for d, s in enumerate(a["slice_sizes"])
                                            if d not in a["collapsed_slice_dims"]))
    windows = windows.reshape(indices.shape[:-1] + windows.shape[1:])   # batch dims, then window dims
    batch_pos = [d for d in range(out.rank) if d not in a["offset_dims"]]
    dest = batch_pos + list(a["offset_dims"])
    return [np.moveaxis(windows, list(range(out.rank)), dest).astype(out.dtype, copy=False)]


def _evaluate_scatter(instr, args, device):
    operand, indices, updates = args
    a = instr.attrs
    window_dims = [d for d in range(operand.ndim) if d not in a["inserted_window_dims"]]
    scatter_dims = [d for d in range(updates.ndim) if d not in a["update_window_dims"]]
    # Updates as [N, *window sizes with inserted dims of size 1].
    moved = np.moveaxis(updates, scatter_dims + list(a["update_window_dims"]), range(updates.ndim))
    sizes = [1] * operand.ndim
    for d, w in zip(window_dims, a["update_window_dims"]):
        sizes[d] = updates.shape[w]
    moved = moved.reshape((-1,) + tuple(sizes))
    starts, valid = _starts(indices, a["scatter_dims_to_operand_dims"], operand.shape, sizes, a["mode"])
    index = _window_index(starts, sizes)
    inside = valid.reshape((-1,) + (1,) * operand.ndim)
    for d, idx in enumerate(index):   # element-wise bounds too (drop what falls outside)
        inside = inside & (idx >= 0) & (idx < operand.shape[d])
    inside = np.broadcast_to(inside, moved.shape)
    picked = tuple(np.broadcast_to(i, moved.shape)[inside] for i in index)
    out = operand.copy()
    reducer = a["reducer"]
    if reducer is None:
        out[picked] = moved[inside]
    else:
        reducer.combine.at(out, picked, moved[inside])
    return [out]


# -- factors --------------------------------------------------------------------------
def _gather_factors(instr: Instr) -> list[Factor]:
    operand, indices = instr.operands
    a, out = instr.attrs, instr.outputs[0]
    batch_pos = [d for d in range(out.rank) if d not in a["offset_dims"]]
    factors = [Factor(n, (None, i, batch_pos[i])) for i, n in enumerate(indices.shape[:-1])]
    factors.append(Factor(indices.shape[-1], (None, indices.rank - 1, None), REPLICATE))
    window = iter(a["offset_dims"])
    for d, n in enumerate(operand.shape):
        if d in a["collapsed_slice_dims"]:
            # One row per index: a split of this dim leaves each device the rows it holds.
            indexed = d in a["start_index_map"] and a["mode"] == CLIP
            factors.append(Factor(n, (d, None, None), REDUCE if indexed else REPLICATE))
            continue
        o = next(window)
        if d not in a["start_index_map"] and a["slice_sizes"][d] == n:
            factors.append(Factor(n, (d, None, o)))
        else:
            factors += [Factor(n, (d, None, None), REPLICATE), Factor(out.shape[o], (None, None, o), REPLICATE)]
    return factors


def _scatter_factors(instr: Instr) -> list[Factor]:
    operand, indices, updates = instr.operands
    a = instr.attrs
    scatter_dims = [d for d in range(updates.rank) if d not in a["update_window_dims"]]
    batch_kind = REDUCE if a["reducer"] is ADD else REPLICATE
    factors = [Factor(n, (None, i, u, None), batch_kind) for i, (n, u) in
               enumerate(zip(indices.shape[:-1], scatter_dims))]
    factors.append(Factor(indices.shape[-1], (None, indices.rank - 1, None, None), REPLICATE))
    window = iter(a["update_window_dims"])
    for d, n in enumerate(operand.shape):
        w = None if d in a["inserted_window_dims"] else next(window)
        indexed = d in a["scatter_dims_to_operand_dims"]
        if w is not None and not indexed and updates.shape[w] == n:
            factors.append(Factor(n, (d, None, w, d)))
        elif w is None and indexed:
            factors.append(Factor(n, (d, None, None, d)))    # each device keeps its rows
        else:
            factors.append(Factor(n, (d, None, None, d), REPLICATE))
            if w is not None:
                factors.append(Factor(updates.shape[w], (None, None, w, None), REPLICATE))
    return factors


# -- partitioning -----------------------------------------------------------------------
def _localize(ctx: DeviceContext, instr: Instr, indices: Value, operand: Value, layout: Sharding,
              index_map, window_sizes) -> tuple[Value, Value]:
    """Indices relative to the rows of the operand this device holds, and whether each
    index vector lands inside them ([batch] bool). Clamping, where the op clamps, is
    done first against the whole operand, as the unpartitioned op would."""
    b, k = ctx.b, indices.shape[-1]
    global_shape = instr.operands[0].shape
    vector = lambda v: b.add1("broadcast", [ctx.constant(np.asarray(v, INDEX_DTYPE))],   # noqa: E731
                              indices.shape, INDEX_DTYPE, dims=(indices.rank - 1,))
    idx = indices if indices.dtype == np.dtype(INDEX_DTYPE) else \
        b.add1("convert", [indices], indices.shape, INDEX_DTYPE)
    if instr.attrs["mode"] == CLIP:
        limits = [global_shape[d] - window_sizes[d] for d in index_map]
        idx = b.add1("minimum", [b.add1("maximum", [idx, vector(np.zeros(k))], idx.shape, INDEX_DTYPE),
                                 vector(limits)], idx.shape, INDEX_DTYPE)
    split = [(j, d) for j, d in enumerate(index_map) if layout.tiles[d] > 1]
    offsets = np.zeros((layout.num_devices, k), INDEX_DTYPE)
    lengths = np.full(k, np.iinfo(INDEX_DTYPE).max, INDEX_DTYPE)
    for j, d in split:
        offsets[:, j] = layout.coords()[:, d] * operand.shape[d]
        lengths[j] = operand.shape[d]
    columns = [b.add1("reshape", [ctx.table_lookup(offsets[:, j])], (1,), INDEX_DTYPE) for j in range(k)]
    offset = b.add1("concatenate", columns, (k,), INDEX_DTYPE, dimension=0)
    offset = b.add1("broadcast", [offset], idx.shape, INDEX_DTYPE, dims=(idx.rank - 1,))
    local = b.add1("subtract", [idx, offset], idx.shape, INDEX_DTYPE)
    ok = b.add1("and", [b.add1("compare", [local, vector(np.zeros(k))], idx.shape, np.bool_, direction="GE"),
                        b.add1("compare", [local, vector(lengths)], idx.shape, np.bool_, direction="LT")],
                idx.shape, np.bool_)
    inside = b.add1("reduce", [ok], idx.shape[:-1], np.bool_, dims=(idx.rank - 1,), reducer=AND)
    return local, inside


def _emit_gather(layout: Sharding, ctx, instr, operands, shapes):
    """Rows this device does not hold come out as zeros (the partial sums add up)."""
    operand, indices = operands
    b, (shape,), dtype = ctx.b, shapes, instr.outputs[0].dtype
    whole = instr.operands[0].shape
    # Windows that take a dim whole take this device's whole (local) part of it.
    a = {**instr.attrs, "slice_sizes": tuple(n if s == w else s for s, w, n in
                                             zip(instr.attrs["slice_sizes"], whole, operand.shape))}
    if not any(layout.tiles[d] > 1 for d in a["start_index_map"]):
        return [b.add1("gather", [operand, indices], shape, dtype, **a)]
    local, inside = _localize(ctx, instr, indices, operand, layout, a["start_index_map"], a["slice_sizes"])
    gathered = b.add1("gather", [operand, local], shape, dtype, **a)
    batch_pos = tuple(d for d in range(len(shape)) if d not in a["offset_dims"])
    inside = b.add1("broadcast", [inside], shape, np.bool_, dims=batch_pos)
    zeros = b.add1("broadcast", [ctx.constant(np.zeros((), dtype))], shape, dtype, dims=())
    return [b.add1("select", [inside, gathered, zeros], shape, dtype)]


def _emit_scatter(layout: Sharding, ctx, instr, operands, shapes):
    """Updates for rows this device does not hold are dropped."""
    operand, indices, updates = operands
    a, b = instr.attrs, ctx.b
    if not any(layout.tiles[d] > 1 for d in a["scatter_dims_to_operand_dims"]):
        return fx.emit_same_op(ctx, instr, operands, shapes)
    sizes = [1] * operand.rank
    window_dims = [d for d in range(operand.rank) if d not in a["inserted_window_dims"]]
    for d, w in zip(window_dims, a["update_window_dims"]):
        sizes[d] = updates.shape[w]
    local, inside = _localize(ctx, instr, indices, operand, layout, a["scatter_dims_to_operand_dims"], sizes)
    inside = b.add1("broadcast", [inside], local.shape, np.bool_, dims=tuple(range(local.rank - 1)))
    nowhere = b.add1("broadcast", [ctx.constant(np.iinfo(INDEX_DTYPE).max, INDEX_DTYPE)], local.shape,
                     INDEX_DTYPE, dims=())
    local = b.add1("select", [inside, local, nowhere], local.shape, INDEX_DTYPE)
    return [b.add1("scatter", [operand, local, updates], shapes[0], instr.outputs[0].dtype, **{**a, "mode": FILL})]


def _partition_with(factor_fn, emit):
    def partition_rule(ctx, instr, operands, targets):
        factors = factor_fn(instr)
        space = fx.choose_space(instr, factors, operands, targets)
        layout = fx.tensor_layout(factors, 0, space, instr.operands[0].rank)
        return fx.run(ctx, instr, factors, space, operands, targets, partial(emit, layout))
    return partition_rule


# -- conversion and lowering --------------------------------------------------------------
_MODES = {lax.GatherScatterMode.CLIP: CLIP, lax.GatherScatterMode.PROMISE_IN_BOUNDS: CLIP,
          lax.GatherScatterMode.FILL_OR_DROP: FILL}
_LAX_MODES = {CLIP: lax.GatherScatterMode.CLIP, FILL: lax.GatherScatterMode.FILL_OR_DROP}


def _no_batching_dims(eqn, dn, operand_field: str) -> None:
    if getattr(dn, operand_field):
        raise ShardingError(f"{eqn.primitive.name} with batching dims ({dn}) is not supported yet; "
                            "vmap over the lookup outside the partitioned function or use jnp.take_along_axis.")


def _fill_value(value, dtype) -> float:
    """JAX's default fill for out-of-range gathers."""
    if value is not None:
        return value
    dtype = np.dtype(dtype)
    if is_floating(dtype):
        return np.nan
    if dtype == np.bool_:
        return True
    return np.iinfo(dtype).min if dtype.kind == "i" else np.iinfo(dtype).max


def _convert_gather(b, eqn, args: list[Value]) -> list[Value]:
    p, dn = eqn.params, eqn.params["dimension_numbers"]
    _no_batching_dims(eqn, dn, "operand_batching_dims")
    shape, dtype = b.out_aval(eqn)
    return [b.add1("gather", args, shape, dtype, offset_dims=tuple(dn.offset_dims),
                   collapsed_slice_dims=tuple(dn.collapsed_slice_dims), start_index_map=tuple(dn.start_index_map),
                   slice_sizes=tuple(int(s) for s in p["slice_sizes"]), mode=_MODES[p["mode"]],
                   fill_value=_fill_value(p["fill_value"], dtype))]


def _convert_scatter(reducer: Reducer | None):
    def convert(b, eqn, args: list[Value]) -> list[Value]:
        p, dn = eqn.params, eqn.params["dimension_numbers"]
        _no_batching_dims(eqn, dn, "operand_batching_dims")
        operand, indices, updates = args
        attrs = dict(update_window_dims=tuple(dn.update_window_dims),
                     inserted_window_dims=tuple(dn.inserted_window_dims),
                     scatter_dims_to_operand_dims=tuple(dn.scatter_dims_to_operand_dims),
                     mode=_MODES[p["mode"]], reducer=reducer)
        if reducer is not ADD:
            return [b.add1("scatter", args, operand.shape, operand.dtype, **attrs)]
        # operand + (updates scattered into zeros): the scattered part can then be summed
        # across devices that each scatter a share of the updates.
        zeros = b.broadcast_to(b.constant(0, operand.dtype), operand.shape)
        scattered = b.add1("scatter", [zeros, indices, updates], operand.shape, operand.dtype, **attrs)
        return [b.add1("add", [operand, scattered], operand.shape, operand.dtype)]
    return convert


def _lower_gather(instr, args, lc):
    a = instr.attrs
    dn = lax.GatherDimensionNumbers(offset_dims=a["offset_dims"], collapsed_slice_dims=a["collapsed_slice_dims"],
                                    start_index_map=a["start_index_map"])
    return [lax.gather(args[0], args[1], dn, a["slice_sizes"], mode=_LAX_MODES[a["mode"]],
                       fill_value=a["fill_value"])]


_LAX_SCATTERS = {None: lax.scatter, ADD: lax.scatter_add, MUL: lax.scatter_mul, MIN: lax.scatter_min,
                 MAX: lax.scatter_max}


def _lower_scatter(instr, args, lc):
    a = instr.attrs
    dn = lax.ScatterDimensionNumbers(update_window_dims=a["update_window_dims"],
                                     inserted_window_dims=a["inserted_window_dims"],
                                     scatter_dims_to_operand_dims=a["scatter_dims_to_operand_dims"])
    return [_LAX_SCATTERS[a["reducer"]](*args, dn, mode=_LAX_MODES[a["mode"]])]


register("gather", converts={"gather": _convert_gather}, evaluate=_evaluate_gather, lower=_lower_gather,
         factors=_gather_factors, partition=_partition_with(_gather_factors, _emit_gather), priority=LAYOUT,
         storage=Storage.REPEATED, expensive=True, bytes_accessed=result_sized_bytes)
register("scatter",
         converts={"scatter": _convert_scatter(None), "scatter-add": _convert_scatter(ADD),
                   "scatter-mul": _convert_scatter(MUL),
                   "scatter-min": _convert_scatter(MIN), "scatter-max": _convert_scatter(MAX)},
         evaluate=_evaluate_scatter, lower=_lower_scatter, factors=_scatter_factors,
         partition=_partition_with(_scatter_factors, _emit_scatter), priority=LAYOUT,
         bytes_accessed=update_sized_bytes(2))
