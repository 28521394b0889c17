"""Typed emitters: one function per HLO op that code outside ops/ emits, each working out
its result's shape and dtype from its operands and checking that they fit together, so
that code outside ops/ neither spells opcodes nor computes result shapes by hand.

On top of them, the helpers partition rules share, one of each: pad or slice along one
dim (`pad_dim`, `slice_dim`) and the mask of the positions along a dim that lie in a
range (`in_range`, and `mask_range`, which replaces the others by a fill)."""
from __future__ import annotations

from typing import Optional, Sequence, Union

import numpy as np

from gspmd.ir.program import Builder, Value
from gspmd.ir.reducer import Reducer

INDEX_DTYPE = np.int32   # positions, offsets and partition ids

# A scalar given as a number (made a constant where it is used) or as a Value already.
Scalar = Union[Value, int, float, np.ndarray]


def _expect(ok: bool, op: str, why: str) -> None:
    if not ok:
        raise ValueError(f"emit.{op}: {why}")


def _one(b: Builder, opcode: str, operands: Sequence[Value], shape, dtype, **attrs) -> Value:
    return b.add1(opcode, operands, tuple(int(d) for d in shape), dtype, **attrs)


# -- values -------------------------------------------------------------------------
def constant(b: Builder, value, dtype=None) -> Value:
    value = np.asarray(value, dtype=dtype)
    return _one(b, "constant", [], value.shape, value.dtype, value=value)


def scalar(b: Builder, value: Scalar, dtype) -> Value:
    """A scalar Value as it is; a number as a constant of `dtype`."""
    return value if isinstance(value, Value) else constant(b, np.asarray(value, dtype))


def partition_id(b: Builder) -> Value:
    return _one(b, "partition-id", [], (), INDEX_DTYPE)


def iota(b: Builder, shape: Sequence[int], dim: int, dtype=INDEX_DTYPE) -> Value:
    """Each element's position along `dim`."""
    _expect(0 <= dim < len(shape), "iota", f"dim {dim} is not a dim of shape {tuple(shape)}")
    return _one(b, "iota", [], shape, dtype, dimension=dim)


# -- layout -------------------------------------------------------------------------
def broadcast(b: Builder, x: Value, shape: Sequence[int], dims: Sequence[int] = ()) -> Value:
    """x in `shape`, operand dim i at result dim dims[i] (a scalar: no dims)."""
    dims = tuple(dims)
    _expect(len(dims) == x.rank and all(shape[r] == n for r, n in zip(dims, x.shape)), "broadcast",
            f"{x.type_str()} does not fit shape {tuple(shape)} at dims {dims}")
    return _one(b, "broadcast", [x], shape, x.dtype, dims=dims)


def reshape(b: Builder, x: Value, shape: Sequence[int]) -> Value:
    _expect(int(np.prod(shape, dtype=np.int64)) == int(np.prod(x.shape, dtype=np.int64)), "reshape",
            f"{x.type_str()} has another number of elements than shape {tuple(shape)}")
    return _one(b, "reshape", [x], shape, x.dtype)


def transpose(b: Builder, x: Value, permutation: Sequence[int]) -> Value:
    """Result dim i is operand dim permutation[i]."""
    permutation = tuple(permutation)
    _expect(sorted(permutation) == list(range(x.rank)), "transpose",
            f"{permutation} is not a permutation of the dims of {x.type_str()}")
    return _one(b, "transpose", [x], [x.shape[p] for p in permutation], x.dtype, permutation=permutation)


def reverse(b: Builder, x: Value, dims: Sequence[int]) -> Value:
    return _one(b, "reverse", [x], x.shape, x.dtype, dims=tuple(dims))


# -- slicing and padding ------------------------------------------------------------
def slice(b: Builder, x: Value, start: Sequence[int], limit: Sequence[int],
          strides: Optional[Sequence[int]] = None) -> Value:
    """Elements start[d], start[d] + strides[d], ... below limit[d] along every dim."""
    strides = (1,) * x.rank if strides is None else tuple(strides)
    _expect(len(start) == len(limit) == len(strides) == x.rank
            and all(0 <= s <= e <= n for s, e, n in zip(start, limit, x.shape)), "slice",
            f"[{tuple(start)}, {tuple(limit)}) is not inside {x.type_str()}")
    shape = [max(0, -(-(e - s) // k)) for s, e, k in zip(start, limit, strides)]
    return _one(b, "slice", [x], shape, x.dtype, start=tuple(start), limit=tuple(limit), strides=strides)


def pad(b: Builder, x: Value, fill: Value, low: Sequence[int], high: Sequence[int],
        interior: Optional[Sequence[int]] = None) -> Value:
    """x with low[d] and high[d] elements of the scalar `fill` around each dim (negative:
    cropped) and interior[d] between its elements."""
    interior = (0,) * x.rank if interior is None else tuple(interior)
    _expect(fill.rank == 0 and fill.dtype == x.dtype, "pad", f"fill {fill.type_str()} is no scalar of {x.dtype}")
    shape = [lo + hi + ((n - 1) * (k + 1) + 1 if n else 0) for n, lo, hi, k in zip(x.shape, low, high, interior)]
    _expect(len(low) == len(high) == len(interior) == x.rank and min(shape, default=0) >= 0, "pad",
            f"low {tuple(low)}, high {tuple(high)}, interior {interior} do not fit {x.type_str()}")
    return _one(b, "pad", [x, fill], shape, x.dtype, low=tuple(low), high=tuple(high), interior=interior)


def concatenate(b: Builder, pieces: Sequence[Value], dim: int) -> Value:
    """The pieces one after another along dim (one piece: itself)."""
    if len(pieces) == 1:
        return pieces[0]
    first = pieces[0]

    def others(v: Value) -> tuple:
        return v.dtype, v.shape[:dim] + v.shape[dim + 1:]
    _expect(all(others(p) == others(first) for p in pieces), "concatenate",
            f"{[p.type_str() for p in pieces]} differ beyond dim {dim}")
    shape = list(first.shape)
    shape[dim] = sum(p.shape[dim] for p in pieces)
    return _one(b, "concatenate", pieces, shape, first.dtype, dimension=dim)


def dynamic_slice(b: Builder, x: Value, starts: Sequence[Value], sizes: Sequence[int]) -> Value:
    """`sizes` elements of x from the scalar `starts` (clamped to stay inside x)."""
    _expect(len(starts) == len(sizes) == x.rank and all(0 <= k <= n for k, n in zip(sizes, x.shape)),
            "dynamic_slice", f"sizes {tuple(sizes)} from {len(starts)} starts do not fit {x.type_str()}")
    return _one(b, "dynamic-slice", [x, *starts], sizes, x.dtype)


def dynamic_update_slice(b: Builder, x: Value, update: Value, starts: Sequence[Value]) -> Value:
    """x with `update` written at the scalar `starts` (clamped to stay inside x)."""
    _expect(len(starts) == x.rank == update.rank and all(k <= n for k, n in zip(update.shape, x.shape)),
            "dynamic_update_slice", f"{update.type_str()} at {len(starts)} starts does not fit {x.type_str()}")
    return _one(b, "dynamic-update-slice", [x, update, *starts], x.shape, x.dtype)


# -- element-wise -------------------------------------------------------------------
def _same_shape(op: str, *values: Value) -> tuple[int, ...]:
    _expect(len({v.shape for v in values}) == 1, op, f"operands {[v.type_str() for v in values]} differ in shape")
    return values[0].shape


def add(b: Builder, x: Value, y: Value) -> Value:
    _expect(x.dtype == y.dtype, "add", f"operands {x.type_str()} and {y.type_str()} differ in dtype")
    return _one(b, "add", [x, y], _same_shape("add", x, y), x.dtype)


def compare(b: Builder, x: Value, y: Value, direction: str) -> Value:
    """x `direction` y element-wise (EQ, NE, LT, LE, GT, GE)."""
    return _one(b, "compare", [x, y], _same_shape("compare", x, y), np.bool_, direction=direction)


def logical_and(b: Builder, x: Value, y: Value) -> Value:
    return _one(b, "and", [x, y], _same_shape("logical_and", x, y), np.bool_)


def select(b: Builder, pred: Value, on_true: Value, on_false: Value) -> Value:
    _expect(pred.dtype == np.bool_ and on_true.dtype == on_false.dtype, "select",
            f"needs a bool mask and equal dtypes, not {pred.type_str()}, {on_true.type_str()}, {on_false.type_str()}")
    return _one(b, "select", [pred, on_true, on_false], _same_shape("select", pred, on_true, on_false),
                on_true.dtype)


# -- collectives over explicit groups of devices ([G, K]: G groups of K devices) -----
def all_reduce(b: Builder, x: Value, groups: np.ndarray, reducer: Reducer) -> Value:
    return _one(b, "all-reduce", [x], x.shape, x.dtype, groups=groups, reducer=reducer)


def all_gather(b: Builder, x: Value, dim: int, groups: np.ndarray) -> Value:
    """The group's pieces one after another along dim."""
    shape = list(x.shape)
    shape[dim] *= groups.shape[1]
    return _one(b, "all-gather", [x], shape, x.dtype, dim=dim, groups=groups)


def _split(op: str, x: Value, dim: int, parts: int) -> list[int]:
    _expect(x.shape[dim] % parts == 0, op, f"dim {dim} of {x.type_str()} does not split {parts} ways")
    shape = list(x.shape)
    shape[dim] //= parts
    return shape


def reduce_scatter(b: Builder, x: Value, dim: int, groups: np.ndarray, reducer: Reducer) -> Value:
    """The reduction over the group, each member keeping its piece along dim."""
    shape = _split("reduce_scatter", x, dim, groups.shape[1])
    return _one(b, "reduce-scatter", [x], shape, x.dtype, dim=dim, groups=groups, reducer=reducer)


def all_to_all(b: Builder, x: Value, split_dim: int, concat_dim: int, groups: np.ndarray) -> Value:
    """x cut along split_dim, piece j to member j; what arrives joined along concat_dim."""
    shape = _split("all_to_all", x, split_dim, groups.shape[1])
    shape[concat_dim] *= groups.shape[1]
    return _one(b, "all-to-all", [x], shape, x.dtype, split_dim=split_dim, concat_dim=concat_dim, groups=groups)


def collective_permute(b: Builder, x: Value, pairs: np.ndarray) -> Value:
    """x sent from pairs[i, 0] to pairs[i, 1]; devices that receive nothing get zeros."""
    return _one(b, "collective-permute", [x], x.shape, x.dtype, pairs=pairs)


# -- the shared helpers -------------------------------------------------------------
def pad_dim(b: Builder, x: Value, dim: int, low: int, high: int, fill: Scalar, interior: int = 0) -> Value:
    """x padded (or cropped, where negative) along one dim with `fill`; x itself when
    nothing changes."""
    if low == high == interior == 0:
        return x
    lows, highs, inner = [0] * x.rank, [0] * x.rank, [0] * x.rank
    lows[dim], highs[dim], inner[dim] = low, high, interior
    return pad(b, x, scalar(b, fill, x.dtype), lows, highs, inner)


def slice_dim(b: Builder, x: Value, dim: int, start: int, limit: int) -> Value:
    """Elements [start, limit) of x along one dim; x itself when that is all of it."""
    if start == 0 and limit == x.shape[dim]:
        return x
    starts, limits = [0] * x.rank, list(x.shape)
    starts[dim], limits[dim] = start, limit
    return slice(b, x, starts, limits)


def in_range(b: Builder, shape: Sequence[int], dim: int, start: Optional[Scalar], end: Optional[Scalar],
             offset: Optional[Value] = None) -> Value:
    """The mask (of `shape`) of the positions along `dim` in [start, end), where the
    first element's position is the scalar `offset` (0 without one); a bound that is
    None is not tested."""
    _expect(start is not None or end is not None, "in_range", "needs a start or an end")
    pos = iota(b, shape, dim)
    if offset is not None:
        pos = add(b, pos, broadcast(b, offset, shape))
    tests = [compare(b, pos, broadcast(b, scalar(b, bound, INDEX_DTYPE), shape), direction)
             for bound, direction in ((start, "GE"), (end, "LT")) if bound is not None]
    return tests[0] if len(tests) == 1 else logical_and(b, *tests)


def mask_range(b: Builder, x: Value, dim: int, start: Optional[Scalar], end: Optional[Scalar],
               fill: Scalar, offset: Optional[Value] = None) -> Value:
    """x where its position along `dim` (see in_range) is in [start, end), else `fill`:
    a scalar, or a value of x's shape."""
    inside = in_range(b, x.shape, dim, start, end, offset)
    if not (isinstance(fill, Value) and fill.shape == x.shape):
        fill = broadcast(b, scalar(b, fill, x.dtype), x.shape)
    return select(b, inside, x, fill)

