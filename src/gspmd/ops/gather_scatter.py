"""gather and scatter (HLO semantics, index vector in the indices' last dim).

Factors (Shardy's view of gather/scatter):
- batching dims (`take_along_axis`, vmapped lookups) pass through operand, indices and
  result alike: each device gathers from its own batch of the operand;
- the indices' other batch dims (index passthrough) pass through to the result's batch
  dims; for a combining scatter they are a `reduce` factor instead: each device scatters
  its share of the updates into the reducer's identity and the shares combine;
- operand dims taken whole (operand passthrough; an indexed dim whose window is the whole
  dim counts, its start can only be 0) pass through to the window dims;
- an indexed dim whose window is one row can be split too (an embedding table split on
  its vocab): each device answers only for the rows it holds — its gather yields zeros
  for the others (summed afterwards: `reduce`), its scatter drops them;
- everything else stays whole.
An index component that is an iota along a batch dim of the indices (jnp's
`x[jnp.arange(n), i]`, `x.at[jnp.arange(n), i].add(u)`: each row indexes its own row) is a
batching dim in disguise: the converter makes it one (`_iota_batching`), so the batch
stays split as `take_along_axis`'s does.
Out-of-range starts clamp (CLIP) or fill the window with `fill_value` / drop the update
(FILL), both decided against the whole operand, as the unpartitioned op decides.
"""
from __future__ import annotations

from functools import partial
from typing import Optional

import numpy as np
from jax import lax

from gspmd.dtypes import is_floating
from gspmd.ir import Instr, Value
from gspmd.ir.emit import concatenate, slice_dim
from gspmd.ir.reducer import ADD, AND, MAX, MIN, MUL, OR, Reducer
from gspmd.ops.convert import convert_by_impl
from gspmd.ops.registry import (Facets, Frontend, LAYOUT, Memory, Rewrites, Rule, Semantics, Storage, Timing,
                                lookup, register, result_sized_bytes, update_sized_bytes)
from gspmd.sharding import Sharding
from gspmd.spmd import factors as fx
from gspmd.spmd.context import INDEX_DTYPE, DeviceContext
from gspmd.spmd.factors import REDUCE, REPLICATE, Factor

CLIP, FILL = "clip", "fill"   # out-of-range starts: clamp, or fill (gather) / drop (scatter)


# -- reference semantics ------------------------------------------------------------------
def _starts(indices: np.ndarray, index_map, batching, operand_shape, sizes, mode):
    """[N, operand rank] window starts and a [N] in-bounds flag, N = number of index
    vectors. `batching` pairs (operand dim, indices dim): there the window starts at the
    vector's own position along that indices dim."""
    flat = indices.reshape(int(np.prod(indices.shape[:-1])), indices.shape[-1]).astype(np.int64)
    starts = np.zeros((flat.shape[0], len(operand_shape)), np.int64)
    starts[:, list(index_map)] = flat
    for operand_dim, indices_dim in batching:
        starts[:, operand_dim] = np.indices(indices.shape[:-1])[indices_dim].ravel()
    limit = np.asarray(operand_shape) - np.asarray(sizes)
    if mode == CLIP:
        starts = np.clip(starts, 0, limit)
    return starts, np.all((starts >= 0) & (starts <= limit), axis=1)


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
    batching = list(zip(a["operand_batching_dims"], a["start_indices_batching_dims"]))
    starts, valid = _starts(indices, a["start_index_map"], batching, operand.shape, a["slice_sizes"], a["mode"])
    safe = np.clip(starts, 0, np.asarray(operand.shape) - np.asarray(a["slice_sizes"]))
    windows = operand[tuple(_window_index(safe, a["slice_sizes"]))]            # [N, *sizes]
    if a["mode"] == FILL:
        windows = np.where(valid.reshape((-1,) + (1,) * operand.ndim), windows, a["fill_value"])
    dropped = set(a["collapsed_slice_dims"]) | set(a["operand_batching_dims"])
    windows = windows.reshape((-1,) + tuple(s for d, s in enumerate(a["slice_sizes"]) if d not in dropped))
    windows = windows.reshape(indices.shape[:-1] + windows.shape[1:])   # batch dims, then window dims
    batch_pos = [d for d in range(out.rank) if d not in a["offset_dims"]]
    dest = batch_pos + list(a["offset_dims"])
    return [np.moveaxis(windows, list(range(out.rank)), dest).astype(out.dtype, copy=False)]


def _evaluate_scatter(instr, args, device):
    operand, indices, updates = args
    a = instr.attrs
    dropped = set(a["inserted_window_dims"]) | set(a["operand_batching_dims"])
    window_dims = [d for d in range(operand.ndim) if d not in dropped]
    scatter_dims = [d for d in range(updates.ndim) if d not in a["update_window_dims"]]
    # Updates as [N, *window sizes with inserted dims of size 1].
    moved = np.moveaxis(updates, scatter_dims + list(a["update_window_dims"]), range(updates.ndim))
    sizes = [1] * operand.ndim
    for d, w in zip(window_dims, a["update_window_dims"]):
        sizes[d] = updates.shape[w]
    moved = moved.reshape((-1,) + tuple(sizes))
    batching = list(zip(a["operand_batching_dims"], a["scatter_indices_batching_dims"]))
    starts, valid = _starts(indices, a["scatter_dims_to_operand_dims"], batching, operand.shape, sizes, a["mode"])
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
def _row_dims(index_map, window_sizes) -> list[int]:
    """Indexed operand dims whose window is one row: split there, each device answers
    for the rows it holds."""
    return [d for d in index_map if window_sizes[d] == 1]


def _partials_reducer(dtype) -> Reducer:
    """How zeros from devices not holding a row combine with the row (booleans: or)."""
    return OR if np.dtype(dtype) == np.bool_ else ADD


def _gather_factors(instr: Instr) -> list[Factor]:
    """Tensors: operand, indices, result."""
    operand, indices = instr.operands
    a, out = instr.attrs, instr.outputs[0]
    batch_pos = [d for d in range(out.rank) if d not in a["offset_dims"]]
    batching = dict(zip(a["start_indices_batching_dims"], a["operand_batching_dims"]))
    factors = [Factor(n, (batching.get(i), i, batch_pos[i])) for i, n in enumerate(indices.shape[:-1])]
    factors.append(Factor(indices.shape[-1], (None, indices.rank - 1, None), REPLICATE))
    window = iter(a["offset_dims"])
    rows = _row_dims(a["start_index_map"], a["slice_sizes"])
    for d, n in enumerate(operand.shape):
        if d in a["operand_batching_dims"]:
            continue
        o = None if d in a["collapsed_slice_dims"] else next(window)
        if d in rows:
            factors.append(Factor(n, (d, None, None), REDUCE, _partials_reducer(out.dtype)))
        elif a["slice_sizes"][d] == n:
            factors.append(Factor(n, (d, None, o)))
            continue
        else:
            factors.append(Factor(n, (d, None, None), REPLICATE))
        if o is not None:
            factors.append(Factor(out.shape[o], (None, None, o), REPLICATE))
    return factors


def _scatter_factors(instr: Instr) -> list[Factor]:
    """Tensors: operand, indices, updates, result. A combining scatter's operand is its
    reducer's identity (the converter makes it so), so shares of the updates scattered
    on different devices combine with the reducer."""
    operand, indices, updates = instr.operands
    a = instr.attrs
    scatter_dims = [d for d in range(updates.rank) if d not in a["update_window_dims"]]
    batching = dict(zip(a["scatter_indices_batching_dims"], a["operand_batching_dims"]))
    share = (REPLICATE, ADD) if a["reducer"] is None else (REDUCE, a["reducer"])   # kind, reducer
    factors = [Factor(n, (batching[i], i, u, batching[i])) if i in batching else Factor(n, (None, i, u, None), *share)
               for i, (n, u) in enumerate(zip(indices.shape[:-1], scatter_dims))]
    factors.append(Factor(indices.shape[-1], (None, indices.rank - 1, None, None), REPLICATE))
    window = iter(a["update_window_dims"])
    sizes = _scatter_window_sizes(a, operand.rank, updates.shape)
    rows = _row_dims(a["scatter_dims_to_operand_dims"], sizes)
    for d, n in enumerate(operand.shape):
        if d in a["operand_batching_dims"]:
            continue
        w = None if d in a["inserted_window_dims"] else next(window)
        if d in rows:
            factors.append(Factor(n, (d, None, None, d)))    # each device keeps its rows
        elif sizes[d] == n:
            factors.append(Factor(n, (d, None, w, d)))
            continue
        else:
            factors.append(Factor(n, (d, None, None, d), REPLICATE))
        if w is not None:
            factors.append(Factor(updates.shape[w], (None, None, w, None), REPLICATE))
    return factors


def _scatter_window_sizes(a, rank: int, updates_shape) -> list[int]:
    """Per operand dim, the update window's size there (1 where inserted or batching)."""
    sizes = [1] * rank
    dropped = set(a["inserted_window_dims"]) | set(a["operand_batching_dims"])
    for d, w in zip([d for d in range(rank) if d not in dropped], a["update_window_dims"]):
        sizes[d] = updates_shape[w]
    return sizes


# -- partitioning -----------------------------------------------------------------------
def _index_vector(ctx: DeviceContext, values, like: Value) -> Value:
    """A constant per index-vector column, broadcast to `like`'s shape."""
    return ctx.b.add1("broadcast", [ctx.constant(np.asarray(values, INDEX_DTYPE))], like.shape, INDEX_DTYPE,
                      dims=(like.rank - 1,))


def _all_columns(ctx: DeviceContext, flags: Value) -> Value:
    """[batch] bool: whether every column of an index-vector flag array holds."""
    return ctx.b.add1("reduce", [flags], flags.shape[:-1], np.bool_, dims=(flags.rank - 1,), reducer=AND)


def _in_range(ctx: DeviceContext, idx: Value, lengths) -> Value:
    b = ctx.b
    return b.add1("and", [b.add1("compare", [idx, _index_vector(ctx, np.zeros(len(lengths)), idx)], idx.shape,
                                 np.bool_, direction="GE"),
                          b.add1("compare", [idx, _index_vector(ctx, lengths, idx)], idx.shape, np.bool_,
                                 direction="LT")], idx.shape, np.bool_)


def _localize(ctx: DeviceContext, instr: Instr, indices: Value, operand: Value, layout: Sharding,
              index_map, window_sizes) -> tuple[Value, Value, Value]:
    """Indices relative to the rows of the `operand` shard this device holds (`window_sizes`
    are the whole op's); whether each index
    vector lands inside them; whether its starts along the split row dims lie inside the
    whole operand (each [batch] bool). Clamping, where the op clamps, is done first
    against the whole operand, as the unpartitioned op would."""
    b, k = ctx.b, indices.shape[-1]
    global_shape = instr.operands[0].shape
    idx = indices if indices.dtype == np.dtype(INDEX_DTYPE) else \
        b.add1("convert", [indices], indices.shape, INDEX_DTYPE)
    if instr.attrs["mode"] == CLIP:
        limits = [global_shape[d] - window_sizes[d] for d in index_map]
        idx = b.add1("minimum", [b.add1("maximum", [idx, _index_vector(ctx, np.zeros(k), idx)], idx.shape,
                                        INDEX_DTYPE), _index_vector(ctx, limits, idx)], idx.shape, INDEX_DTYPE)
    rows = set(_row_dims(index_map, window_sizes))
    split = [(j, d) for j, d in enumerate(index_map) if d in rows and layout.tiles[d] > 1]
    offsets = np.zeros((layout.num_devices, k), INDEX_DTYPE)
    unbounded = np.iinfo(INDEX_DTYPE).max
    local_lengths, global_lengths = np.full(k, unbounded, INDEX_DTYPE), np.full(k, unbounded, INDEX_DTYPE)
    for j, d in split:
        offsets[:, j] = layout.coords()[:, d] * operand.shape[d]
        local_lengths[j], global_lengths[j] = operand.shape[d], global_shape[d]
    columns = [b.add1("reshape", [ctx.table_lookup(offsets[:, j])], (1,), INDEX_DTYPE) for j in range(k)]
    offset = b.add1("concatenate", columns, (k,), INDEX_DTYPE, dimension=0)
    offset = b.add1("broadcast", [offset], idx.shape, INDEX_DTYPE, dims=(idx.rank - 1,))
    local = b.add1("subtract", [idx, offset], idx.shape, INDEX_DTYPE)
    valid = _all_columns(ctx, _in_range(ctx, idx, global_lengths))
    inside = b.add1("and", [_all_columns(ctx, _in_range(ctx, local, local_lengths)), valid], valid.shape, np.bool_)
    return local, inside, valid


def _split_rows(layout: Sharding, index_map, window_sizes) -> list[int]:
    return [d for d in _row_dims(index_map, window_sizes) if layout.tiles[d] > 1]


def _first_along(ctx: DeviceContext, layout: Sharding, dims, shape) -> Value:
    """Bool of `shape`: whether this device is the first along every one of `dims`."""
    first = np.all(layout.coords()[:, list(dims)] == 0, axis=1).astype(INDEX_DTYPE)
    flag = ctx.b.add1("compare", [ctx.table_lookup(first), ctx.constant(1, INDEX_DTYPE)], (), np.bool_,
                      direction="EQ")
    return ctx.b.add1("broadcast", [flag], shape, np.bool_, dims=())


def _emit_gather(layout: Sharding, ctx, instr, operands, shapes):
    """Rows this device does not hold come out as zeros (the partial results add up). A
    window out of range of the whole operand comes out as the fill value on the first
    device along the split rows only."""
    operand, indices = operands
    b, (shape,), dtype = ctx.b, shapes, instr.outputs[0].dtype
    sizes, whole = instr.attrs["slice_sizes"], instr.operands[0].shape
    # Windows that take a dim whole take this device's whole (local) part of it.
    a = {**instr.attrs, "slice_sizes": tuple(n if s == w else s for s, w, n in zip(sizes, whole, operand.shape))}
    split = _split_rows(layout, a["start_index_map"], sizes)
    if not split:
        return [b.add1("gather", [operand, indices], shape, dtype, **a)]
    local, inside, valid = _localize(ctx, instr, indices, operand, layout, a["start_index_map"], sizes)
    if a["mode"] == FILL:   # out of range everywhere: the first device's local gather fills it
        outside = b.add1("not", [valid], valid.shape, np.bool_)
        first = _first_along(ctx, layout, split, valid.shape)
        inside = b.add1("or", [inside, b.add1("and", [outside, first], valid.shape, np.bool_)], valid.shape,
                        np.bool_)
    gathered = b.add1("gather", [operand, local], shape, dtype, **a)
    batch_pos = tuple(d for d in range(len(shape)) if d not in a["offset_dims"])
    inside = b.add1("broadcast", [inside], shape, np.bool_, dims=batch_pos)
    zeros = b.add1("broadcast", [ctx.constant(np.zeros((), dtype))], shape, dtype, dims=())
    return [b.add1("select", [inside, gathered, zeros], shape, dtype)]


def _emit_scatter(layout: Sharding, ctx, instr, operands, shapes):
    """Updates for rows this device does not hold are dropped."""
    operand, indices, updates = operands
    a, b = instr.attrs, ctx.b
    sizes = _scatter_window_sizes(a, operand.rank, instr.operands[2].shape)
    if not _split_rows(layout, a["scatter_dims_to_operand_dims"], sizes):
        return fx.emit_same_op(ctx, instr, operands, shapes)
    local, inside, _ = _localize(ctx, instr, indices, operand, layout, a["scatter_dims_to_operand_dims"], sizes)
    inside = b.add1("broadcast", [inside], local.shape, np.bool_, dims=tuple(range(local.rank - 1)))
    # Just past the shard's end: with INT32_MAX there, XLA:CPU (jax 0.10.2) wrote into a
    # scatter-mul's operand inside a larger program.
    nowhere = _index_vector(ctx, [operand.shape[d] for d in a["scatter_dims_to_operand_dims"]], local)
    local = b.add1("select", [inside, local, nowhere], local.shape, INDEX_DTYPE)
    return [b.add1("scatter", [operand, local, updates], shapes[0], instr.outputs[0].dtype, **{**a, "mode": FILL})]


def _partition_with(factor_fn, emit):
    def partition_rule(ctx, instr, operands, targets):
        factors = factor_fn(instr)
        space = fx.choose_space(instr, factors, operands, targets, ctx.hardware)
        layout = fx.tensor_layout(factors, 0, space, instr.operands[0].rank)
        return fx.run(ctx, instr, factors, space, operands, targets, partial(emit, layout))
    return partition_rule


# -- index components that are iotas: batching dims --------------------------------
def _iota_dim(v: Value, fixed: dict[int, int]) -> Optional[int]:
    """The dim along which every element of `v` at the positions `fixed` ({dim: index})
    equals its own position along that dim (an iota seen through the ops whose records'
    `position` facet carries it: broadcasts, reshapes, converts, concatenates and jnp's
    wrap of negative indices); None when not known."""
    fixed = {d: i for d, i in fixed.items() if v.shape[d] > 1}    # a dim of one fixes nothing
    p = v.producer
    if p is None:
        return None
    facets = lookup(p.opcode).facets
    if facets.identity:
        return _iota_dim(p.operands[0], fixed)
    return None if facets.position is None else facets.position(p, fixed, _iota_dim)


def _without_columns(b, indices: Value, dropped: set[int]) -> Value:
    """`indices` without the `dropped` index-vector columns: the pieces of the
    concatenate that made it where they are whole, slices of them otherwise (all
    dropped: an empty index vector, which reads nothing)."""
    last, p = indices.rank - 1, indices.producer
    pieces = p.operands if p is not None and p.opcode == "concatenate" and p.attrs["dimension"] == last \
        else [indices]
    kept, start = [], 0
    for piece in pieces:
        columns = [c for c in range(piece.shape[last]) if start + c not in dropped]
        if len(columns) == piece.shape[last]:
            kept.append(piece)
        else:
            kept.extend(slice_dim(b, piece, last, c, c + 1) for c in columns)
        start += piece.shape[last]
    if not kept:    # every component dropped: an empty index vector
        none = b.add1("constant", [], (0,), indices.dtype, value=np.zeros(0, indices.dtype))
        return b.add1("broadcast", [none], indices.shape[:-1] + (0,), indices.dtype, dims=(last,))
    return concatenate(b, kept, last)


def _iota_batching(b, operand: Value, indices: Value, attrs: dict,
                   names: tuple[str, str, str, str]) -> tuple[dict, Value]:
    """Index components that are an iota along a batch dim of the indices, of the same
    size as the operand dim they index, made batching dims (as XLA's parallel dims of a
    gather): the op's `attrs` and indices with those components dropped. `names`: the
    op's attribute names for the index map, the collapsed (inserted) dims and the two
    batching dims lists. The iota is in range: clamping and filling decide the same."""
    index_map, collapsed, operand_batching, indices_batching = names
    last = indices.rank - 1
    pairs, taken = {}, set(attrs[indices_batching])    # component -> (operand dim, indices dim)
    for column, d in enumerate(attrs[index_map]):
        i = _iota_dim(indices, {last: column})
        if i is not None and i not in taken and d in attrs[collapsed] and indices.shape[i] == operand.shape[d]:
            pairs[column] = (int(d), i)
            taken.add(i)
    if not pairs:
        return attrs, indices
    batching = sorted([*zip(attrs[operand_batching], attrs[indices_batching]), *pairs.values()])
    dims = {d for d, _ in pairs.values()}
    return {**attrs, index_map: tuple(d for c, d in enumerate(attrs[index_map]) if c not in pairs),
            collapsed: tuple(d for d in attrs[collapsed] if d not in dims),
            operand_batching: tuple(d for d, _ in batching), indices_batching: tuple(i for _, i in batching)}, \
        _without_columns(b, indices, set(pairs))


_GATHER_NAMES = ("start_index_map", "collapsed_slice_dims", "operand_batching_dims", "start_indices_batching_dims")
_SCATTER_NAMES = ("scatter_dims_to_operand_dims", "inserted_window_dims", "operand_batching_dims",
                  "scatter_indices_batching_dims")


# -- conversion and lowering --------------------------------------------------------------
# Indices promised in bounds get HLO's native behaviour: gather clamps, scatter drops.
_GATHER_MODES = {lax.GatherScatterMode.CLIP: CLIP, lax.GatherScatterMode.PROMISE_IN_BOUNDS: CLIP,
                 lax.GatherScatterMode.FILL_OR_DROP: FILL}
_SCATTER_MODES = {**_GATHER_MODES, lax.GatherScatterMode.PROMISE_IN_BOUNDS: FILL}
_LAX_MODES = {CLIP: lax.GatherScatterMode.CLIP, FILL: lax.GatherScatterMode.FILL_OR_DROP}


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
    shape, dtype = b.out_aval(eqn)
    operand, indices = args
    attrs, indices = _iota_batching(b, operand, indices, dict(
        collapsed_slice_dims=tuple(dn.collapsed_slice_dims), start_index_map=tuple(dn.start_index_map),
        operand_batching_dims=tuple(dn.operand_batching_dims),
        start_indices_batching_dims=tuple(dn.start_indices_batching_dims)), _GATHER_NAMES)
    return [b.add1("gather", [operand, indices], shape, dtype, offset_dims=tuple(dn.offset_dims), **attrs,
                   slice_sizes=tuple(int(s) for s in p["slice_sizes"]), mode=_GATHER_MODES[p["mode"]],
                   fill_value=_fill_value(p["fill_value"], dtype))]


# The element-wise op that applies a reducer, and how scatter-sub becomes a scatter-add.
_COMBINE = {ADD: "add", MUL: "multiply", MIN: "minimum", MAX: "maximum"}


def _convert_scatter(reducer: Reducer | None, combine: str | None = None):
    def convert(b, eqn, args: list[Value]) -> list[Value]:
        p, dn = eqn.params, eqn.params["dimension_numbers"]
        operand, indices, updates = args
        attrs, indices = _iota_batching(b, operand, indices, dict(
            inserted_window_dims=tuple(dn.inserted_window_dims),
            scatter_dims_to_operand_dims=tuple(dn.scatter_dims_to_operand_dims),
            operand_batching_dims=tuple(dn.operand_batching_dims),
            scatter_indices_batching_dims=tuple(dn.scatter_indices_batching_dims)), _SCATTER_NAMES)
        attrs.update(update_window_dims=tuple(dn.update_window_dims), mode=_SCATTER_MODES[p["mode"]], reducer=reducer)
        if reducer is None:
            return [b.add1("scatter", [operand, indices, updates], operand.shape, operand.dtype, **attrs)]
        # operand (op) updates scattered into the reducer's identity: the scattered part
        # can then be combined across devices that each scatter a share of the updates.
        identity = b.broadcast_to(b.constant(reducer.identity(operand.dtype)), operand.shape)
        scattered = b.add1("scatter", [identity, indices, updates], operand.shape, operand.dtype, **attrs)
        return [b.add1(combine or _COMBINE[reducer], [operand, scattered], operand.shape, operand.dtype)]
    return convert


def _lower_gather(instr, args, lc):
    a = instr.attrs
    dn = lax.GatherDimensionNumbers(offset_dims=a["offset_dims"], collapsed_slice_dims=a["collapsed_slice_dims"],
                                    start_index_map=a["start_index_map"],
                                    operand_batching_dims=a["operand_batching_dims"],
                                    start_indices_batching_dims=a["start_indices_batching_dims"])
    indices = _clamped_starts(args[1], a, args[0].shape) if a["mode"] == CLIP else args[1]
    return [lax.gather(args[0], indices, dn, a["slice_sizes"], mode=_LAX_MODES[a["mode"]],
                       fill_value=a["fill_value"])]


def _clamped_starts(indices, a: dict, operand_shape):
    """A clipping gather's starts clamped into bounds explicitly: XLA:CPU (jaxlib 0.10.2)
    folds a dynamic slice of such a gather into the gather at the summed start and
    clamps that against the slice's smaller size (what a partitioned program's per-device
    slice of a replicated gather is; plain jax's reproducer in test_gather_scatter.py)."""
    highest = np.array([operand_shape[d] - a["slice_sizes"][d] for d in a["start_index_map"]], indices.dtype)
    return lax.clamp(lax.full_like(indices, 0), indices,
                     lax.broadcast_in_dim(highest, indices.shape, (indices.ndim - 1,)))


_LAX_SCATTERS = {None: lax.scatter, ADD: lax.scatter_add, MUL: lax.scatter_mul, MIN: lax.scatter_min,
                 MAX: lax.scatter_max}


def _lower_scatter(instr, args, lc):
    a = instr.attrs
    dn = lax.ScatterDimensionNumbers(update_window_dims=a["update_window_dims"],
                                     inserted_window_dims=a["inserted_window_dims"],
                                     scatter_dims_to_operand_dims=a["scatter_dims_to_operand_dims"],
                                     operand_batching_dims=a["operand_batching_dims"],
                                     scatter_indices_batching_dims=a["scatter_indices_batching_dims"])
    operand, indices, updates = args
    if a["mode"] == FILL:
        # XLA:CPU (jaxlib 0.10) scatters in place into the buffer a dynamic-slice operand was
        # cut from, without bounds against the slice: a dropped index (the partitioner's "not
        # on this device") overwrote a neighbouring shard's row. A barrier keeps it a buffer.
        operand = lax.optimization_barrier(operand)
    return [_LAX_SCATTERS[a["reducer"]](operand, indices, updates, dn, mode=_LAX_MODES[a["mode"]])]


register("gather",
         frontend=Frontend(converts={"gather": _convert_gather}),
         semantics=Semantics(evaluate=_evaluate_gather, lower=_lower_gather),
         rule=Rule(factors=_gather_factors, partition=_partition_with(_gather_factors, _emit_gather),
                   priority=LAYOUT),
         timing=Timing(bytes_accessed=result_sized_bytes),
         memory=Memory(storage=Storage.REPEATED, expensive=True))
def _scatter_added_to(instr: Instr, acc: Value, add: Instr, program) -> Optional[list[Instr]]:
    """acc + scatter(0, i, u, +) = scatter(acc, i, u, +)."""
    if instr.attrs["reducer"] is not ADD:
        return None
    _, indices, updates = instr.operands
    return [instr.remade([acc, indices, updates], add.output)]


register("scatter",
         frontend=Frontend(converts={"scatter": _convert_scatter(None), "scatter-add": _convert_scatter(ADD),
                   "scatter-sub": _convert_scatter(ADD, "subtract"), "scatter-mul": _convert_scatter(MUL),
                   "scatter-min": _convert_scatter(MIN), "scatter-max": _convert_scatter(MAX),
                   # equinox's buffers (its loops' saved steps): xs.at[i].set(x), a scatter
                   "maybe_set": convert_by_impl}),
         semantics=Semantics(evaluate=_evaluate_scatter, lower=_lower_scatter),
         rule=Rule(factors=_scatter_factors, partition=_partition_with(_scatter_factors, _emit_scatter),
                   priority=LAYOUT),
         timing=Timing(bytes_accessed=update_sized_bytes(2)),
         memory=Memory(storage=Storage.UPDATED),
         rewrites=Rewrites(linear=lambda instr: [(0, 2)] if instr.attrs["reducer"] in (None, ADD) else []),
         facets=Facets(added_to=_scatter_added_to))
