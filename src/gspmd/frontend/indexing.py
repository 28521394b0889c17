"""gather and scatter primitives (what x[ids], jnp.take and x.at[...].add trace to)."""
from __future__ import annotations

import numpy as np
from jax import lax

from gspmd.dtypes import is_floating
from gspmd.errors import ShardingError
from gspmd.frontend.trace import CONVERTERS, _broadcast_to, _constant, _out_aval
from gspmd.ir import Builder, Value
from gspmd.ir.reducer import ADD, MAX, MIN, MUL

_MODES = {lax.GatherScatterMode.CLIP: "clip", lax.GatherScatterMode.PROMISE_IN_BOUNDS: "clip",
          lax.GatherScatterMode.FILL_OR_DROP: "fill"}


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


def _gather(b: Builder, eqn, args: list[Value]) -> list[Value]:
    p, dn = eqn.params, eqn.params["dimension_numbers"]
    _no_batching_dims(eqn, dn, "operand_batching_dims")
    shape, dtype = _out_aval(eqn)
    return [b.add1("gather", args, shape, dtype, offset_dims=tuple(dn.offset_dims),
                   collapsed_slice_dims=tuple(dn.collapsed_slice_dims), start_index_map=tuple(dn.start_index_map),
                   slice_sizes=tuple(int(s) for s in p["slice_sizes"]), mode=_MODES[p["mode"]],
                   fill_value=_fill_value(p["fill_value"], dtype))]


def _scatter(reducer):
    def convert(b: Builder, eqn, args: list[Value]) -> list[Value]:
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
        zeros = _broadcast_to(b, _constant(b, np.zeros((), operand.dtype)), operand.shape)
        scattered = b.add1("scatter", [zeros, indices, updates], operand.shape, operand.dtype, **attrs)
        return [b.add1("add", [operand, scattered], operand.shape, operand.dtype)]
    return convert


CONVERTERS["gather"] = _gather
CONVERTERS["scatter"] = _scatter(None)
CONVERTERS["scatter-add"] = _scatter(ADD)
CONVERTERS["scatter_add"] = _scatter(ADD)
CONVERTERS["scatter-mul"] = _scatter(MUL)
CONVERTERS["scatter-min"] = _scatter(MIN)
CONVERTERS["scatter-max"] = _scatter(MAX)
