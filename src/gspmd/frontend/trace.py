"""jaxpr -> Program. One converter per JAX primitive, in a table keyed by its name.
Calls (jit, custom_jvp/vjp, remat) are inlined."""
from __future__ import annotations

from typing import Callable

import jax
import numpy as np
from jax.extend import core as jcore

from gspmd.errors import ShardingError
from gspmd.frontend.annotation import mesh_split_p
from gspmd.ir import Builder, Program, Value
from gspmd.ir.reducer import ADD, AND, MAX, MIN, MUL, OR, Reducer

Converter = Callable[[Builder, "jcore.JaxprEqn", list[Value]], list[Value]]
CONVERTERS: dict[str, Converter] = {}


def trace(fn, flat_avals, name: str = "main") -> tuple[Program, object]:
    """Trace fn(*flat_args) into a Program; returns it and the output pytree def."""
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*flat_avals)
    program = Program(name)
    b = Builder(program)
    env_in = [b.param(v.aval.shape, v.aval.dtype, hint="arg") for v in closed.jaxpr.invars]
    program.outputs = _inline(b, closed, env_in)
    return program, jax.tree_util.tree_structure(out_shape)


def _inline(b: Builder, closed, args: list[Value]) -> list[Value]:
    jaxpr = closed.jaxpr if hasattr(closed, "jaxpr") else closed
    consts = closed.consts if hasattr(closed, "consts") else []
    env: dict = {}
    for var, c in zip(jaxpr.constvars, consts):
        env[var] = _constant(b, np.asarray(c))
    env.update(zip(jaxpr.invars, args))

    def read(atom) -> Value:
        if isinstance(atom, jcore.Literal):
            return _constant(b, np.asarray(atom.val, atom.aval.dtype))
        return env[atom]

    for eqn in jaxpr.eqns:
        convert = CONVERTERS.get(eqn.primitive.name)
        if convert is None:
            raise ShardingError(
                f"JAX primitive {eqn.primitive.name!r} (in `{eqn}`) is not supported by gspmd's "
                "frontend yet; rewrite that part with supported ops or file an issue.")
        b.origin = eqn.primitive.name
        outs = convert(b, eqn, [read(a) for a in eqn.invars])
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def _constant(b: Builder, value: np.ndarray) -> Value:
    return b.add1("constant", [], value.shape, value.dtype, value=value)


def _out_aval(eqn, i=0):
    aval = eqn.outvars[i].aval
    return aval.shape, aval.dtype


def _broadcast_to(b: Builder, x: Value, shape) -> Value:
    """Scalars (jaxpr literals) broadcast implicitly in JAX; make it explicit."""
    if x.shape == tuple(shape):
        return x
    return b.add1("broadcast", [x], shape, x.dtype, dims=tuple(range(len(shape) - x.rank, len(shape))))


def _elementwise(opcode: str, **attrs) -> Converter:
    def convert(b, eqn, args):
        shape, dtype = _out_aval(eqn)
        args = [_broadcast_to(b, a, shape) for a in args]
        return [b.add1(opcode, args, shape, dtype, **attrs)]
    return convert


def _identity(b, eqn, args):
    return [args[0]]


def _integer_pow(b, eqn, args):
    shape, dtype = _out_aval(eqn)
    exponent = _broadcast_to(b, _constant(b, np.asarray(eqn.params["y"], dtype)), shape)
    return [b.add1("power", [args[0], exponent], shape, dtype)]


def _square(b, eqn, args):
    shape, dtype = _out_aval(eqn)
    return [b.add1("multiply", [args[0], args[0]], shape, dtype)]


def _select_n(b, eqn, args):
    pred, *cases = args
    shape, dtype = _out_aval(eqn)
    if len(cases) != 2:
        raise ShardingError(f"select_n with {len(cases)} cases is not supported yet (`{eqn}`).")
    if pred.dtype != np.bool_:
        zero = _broadcast_to(b, _constant(b, np.zeros((), pred.dtype)), pred.shape)
        pred = b.add1("compare", [pred, zero], pred.shape, np.bool_, direction="NE")
    pred = _broadcast_to(b, pred, shape)
    return [b.add1("select", [pred, cases[1], cases[0]], shape, dtype)]


def _convert(b, eqn, args):
    shape, dtype = _out_aval(eqn)
    if args[0].dtype == np.dtype(dtype):
        return [args[0]]
    return [b.add1("convert", args, shape, dtype)]


def _broadcast_in_dim(b, eqn, args):
    shape, dtype = _out_aval(eqn)
    return [b.add1("broadcast", args[:1], shape, dtype, dims=tuple(int(d) for d in eqn.params["broadcast_dimensions"]))]


def _reshape(b, eqn, args):
    """reshape(x, dimensions=p) is XLA's transpose by p, then the reshape (grouped-conv
    gradients emit it)."""
    shape, dtype = _out_aval(eqn)
    x, perm = args[0], tuple(eqn.params.get("dimensions") or range(args[0].rank))
    if perm != tuple(range(x.rank)):
        x = b.add1("transpose", [x], tuple(x.shape[d] for d in perm), dtype, permutation=perm)
    return [b.add1("reshape", [x], shape, dtype)]


def _to_shape(b, eqn, args):
    shape, dtype = _out_aval(eqn)
    return [b.add1("reshape", args[:1], shape, dtype)]


def _transpose(b, eqn, args):
    shape, dtype = _out_aval(eqn)
    return [b.add1("transpose", args, shape, dtype, permutation=tuple(eqn.params["permutation"]))]


def _reduce(reducer: Reducer) -> Converter:
    def convert(b, eqn, args):
        shape, dtype = _out_aval(eqn)
        return [b.add1("reduce", args, shape, dtype, dims=tuple(int(a) for a in eqn.params["axes"]),
                       reducer=reducer)]
    return convert


def _arg_reduce(reducer: Reducer) -> Converter:
    """argmax/argmin as XLA lowers them to ordinary ops: the extreme value, then the
    smallest index holding it (NaN counts as the extreme, as in JAX). Each piece
    partitions and masks padding like any reduce."""
    def convert(b, eqn, args):
        (x,), (axis,) = args, eqn.params["axes"]
        shape, index_dtype = _out_aval(eqn)
        kept = tuple(d for d in range(x.rank) if d != axis)
        best = b.add1("reduce", [x], shape, x.dtype, dims=(axis,), reducer=reducer)
        best = b.add1("broadcast", [best], x.shape, x.dtype, dims=kept)
        hit = b.add1("compare", [x, best], x.shape, np.bool_, direction="EQ")
        nan = b.add1("compare", [x, x], x.shape, np.bool_, direction="NE")
        hit = b.add1("or", [hit, nan], x.shape, np.bool_)
        index = b.add1("iota", [], x.shape, index_dtype, dimension=axis)
        beyond = _broadcast_to(b, _constant(b, np.asarray(x.shape[axis], index_dtype)), x.shape)
        index = b.add1("select", [hit, index, beyond], x.shape, index_dtype)
        return [b.add1("reduce", [index], shape, index_dtype, dims=(axis,), reducer=MIN)]
    return convert


def _dot_general(b, eqn, args):
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    shape, dtype = _out_aval(eqn)
    return [b.add1("dot", args, shape, dtype, lhs_batch=tuple(lb), rhs_batch=tuple(rb),
                   lhs_contracting=tuple(lc), rhs_contracting=tuple(rc))]


def _iota(b, eqn, args):
    shape, dtype = _out_aval(eqn)
    return [b.add1("iota", [], shape, dtype, dimension=eqn.params["dimension"])]


def _mesh_split(b, eqn, args):
    shape, dtype = _out_aval(eqn)
    return [b.add1("sharding", args, shape, dtype, sharding=eqn.params["sharding"],
                   unspecified=eqn.params["unspecified"])]


def _call(b, eqn, args):
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        if key in eqn.params:
            origin = b.origin
            outs = _inline(b, eqn.params[key], args[len(args) - len(_invars(eqn.params[key])):])
            b.origin = origin
            return outs
    raise ShardingError(f"Cannot find the body of call primitive {eqn.primitive.name!r}.")


def _invars(jaxpr):
    return (jaxpr.jaxpr if hasattr(jaxpr, "jaxpr") else jaxpr).invars


def _pad(b, eqn, args):
    shape, dtype = _out_aval(eqn)
    cfg = eqn.params["padding_config"]
    return [b.add1("pad", args, shape, dtype, low=tuple(c[0] for c in cfg), high=tuple(c[1] for c in cfg),
                   interior=tuple(c[2] for c in cfg))]


def _slice(b, eqn, args):
    shape, dtype = _out_aval(eqn)
    p = eqn.params
    strides = p["strides"] or (1,) * len(shape)
    return [b.add1("slice", args, shape, dtype, start=tuple(p["start_indices"]), limit=tuple(p["limit_indices"]),
                   strides=tuple(strides))]


def _concatenate(b, eqn, args):
    shape, dtype = _out_aval(eqn)
    return [b.add1("concatenate", args, shape, dtype, dimension=eqn.params["dimension"])]


def _dynamic_slice(b, eqn, args):
    shape, dtype = _out_aval(eqn)
    return [b.add1("dynamic-slice", args, shape, dtype)]   # sizes: the output shape


def _dynamic_update_slice(b, eqn, args):
    shape, dtype = _out_aval(eqn)
    return [b.add1("dynamic-update-slice", args, shape, dtype)]


_BINARY = {"add": "add", "add_any": "add", "sub": "subtract", "mul": "multiply", "div": "divide",
           "max": "maximum", "min": "minimum", "pow": "power", "rem": "remainder", "atan2": "atan2",
           "and": "and", "or": "or", "xor": "xor"}
_UNARY = {"neg": "negate", "exp": "exponential", "log": "log", "tanh": "tanh", "logistic": "logistic",
          "rsqrt": "rsqrt", "sqrt": "sqrt", "abs": "abs", "sign": "sign", "floor": "floor", "ceil": "ceil",
          "cos": "cosine", "sin": "sine", "expm1": "exponential-minus-one", "log1p": "log-plus-one",
          "is_finite": "is-finite", "not": "not", "round": "round-nearest-even"}
_COMPARE = {"eq": "EQ", "ne": "NE", "lt": "LT", "le": "LE", "gt": "GT", "ge": "GE"}
_REDUCE = {"reduce_sum": ADD, "reduce_max": MAX, "reduce_min": MIN, "reduce_prod": MUL,
           "reduce_and": AND, "reduce_or": OR}

for _name, _op in {**_BINARY, **_UNARY}.items():
    CONVERTERS[_name] = _elementwise(_op)
for _name, _dir in _COMPARE.items():
    CONVERTERS[_name] = _elementwise("compare", direction=_dir)
for _name, _red in _REDUCE.items():
    CONVERTERS[_name] = _reduce(_red)
CONVERTERS["argmax"] = _arg_reduce(MAX)
CONVERTERS["argmin"] = _arg_reduce(MIN)
for _name in ("jit", "pjit", "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr", "remat",
              "checkpoint", "closed_call", "core_call"):
    CONVERTERS[_name] = _call
CONVERTERS.update({
    "stop_gradient": _identity, "copy": _identity, "copy_p": _identity,
    "integer_pow": _integer_pow, "square": _square, "select_n": _select_n,
    "convert_element_type": _convert, "broadcast_in_dim": _broadcast_in_dim, "reshape": _reshape,
    "squeeze": _to_shape, "expand_dims": _to_shape, "transpose": _transpose, "dot_general": _dot_general,
    "iota": _iota, mesh_split_p.name: _mesh_split, "pad": _pad, "slice": _slice,
    "concatenate": _concatenate, "dynamic_slice": _dynamic_slice,
    "dynamic_update_slice": _dynamic_update_slice,
})


# -- windowed ops (convolution, reverse) ------------------------------------------------
def _conv_general_dilated(b, eqn, args):
    p, shape_dtype = eqn.params, _out_aval(eqn)
    dn = p["dimension_numbers"]
    return [b.add1("convolution", args, *shape_dtype, lhs_spec=tuple(dn.lhs_spec), rhs_spec=tuple(dn.rhs_spec),
                   out_spec=tuple(dn.out_spec), window_strides=tuple(p["window_strides"]),
                   padding=tuple((int(lo), int(hi)) for lo, hi in p["padding"]),
                   lhs_dilation=tuple(p["lhs_dilation"]), rhs_dilation=tuple(p["rhs_dilation"]),
                   feature_group_count=int(p["feature_group_count"]),
                   batch_group_count=int(p["batch_group_count"]))]


def _rev(b, eqn, args):
    return [b.add1("reverse", args, *_out_aval(eqn), dims=tuple(int(d) for d in eqn.params["dimensions"]))]


CONVERTERS.update({"conv_general_dilated": _conv_general_dilated, "rev": _rev})


def _reduce_window(reducer: Reducer) -> Converter:
    def convert(b, eqn, args):
        p = eqn.params
        return [b.add1("reduce-window", args, *_out_aval(eqn), reducer=reducer,
                       window_dimensions=tuple(p["window_dimensions"]), window_strides=tuple(p["window_strides"]),
                       padding=tuple((int(lo), int(hi)) for lo, hi in p["padding"]),
                       base_dilation=tuple(p["base_dilation"]), window_dilation=tuple(p["window_dilation"]))]
    return convert


def _select_and_scatter_add(b, eqn, args):
    p = eqn.params
    select = {"ge": "ge", "le": "le"}.get(p["select_prim"].name)
    if select is None:
        raise ShardingError(f"select_and_scatter_add with select_prim {p['select_prim']} is not supported (`{eqn}`).")
    return [b.add1("select-and-scatter-add", args, *_out_aval(eqn), select=select,
                   window_dimensions=tuple(p["window_dimensions"]), window_strides=tuple(p["window_strides"]),
                   padding=tuple((int(lo), int(hi)) for lo, hi in p["padding"]))]


CONVERTERS.update({"reduce_window_sum": _reduce_window(ADD), "reduce_window_max": _reduce_window(MAX),
                   "reduce_window_min": _reduce_window(MIN), "select_and_scatter_add": _select_and_scatter_add})


# -- scans along one axis ---------------------------------------------------------------
def _cumsum(b, eqn, args):
    """cumsum as a dot with a triangular matrix of ones: it then partitions like any
    contraction (a split scanned dim gives partial sums that an all-reduce combines)."""
    (x,), axis = args, eqn.params["axis"]
    shape, dtype = _out_aval(eqn)
    n = x.shape[axis]
    rows, cols = np.indices((n, n))
    tri = _constant(b, ((rows >= cols) if eqn.params["reverse"] else (rows <= cols)).astype(dtype))
    free = [d for d in range(x.rank) if d != axis]
    summed = b.add1("dot", [x, tri], tuple(x.shape[d] for d in free) + (n,), dtype, lhs_batch=(), rhs_batch=(),
                    lhs_contracting=(axis,), rhs_contracting=(0,))
    perm = list(range(x.rank - 1))
    perm.insert(axis, x.rank - 1)
    return [b.add1("transpose", [summed], shape, dtype, permutation=tuple(perm))]


CONVERTERS["cumsum"] = _cumsum


def _split(b, eqn, args):
    """jax.lax.split (the transpose of concatenate): one slice per piece."""
    (x,), axis, outs, start = args, eqn.params["axis"], [], 0
    for var in eqn.outvars:
        limit = list(x.shape)
        limit[axis] = start + var.aval.shape[axis]
        begin = [0] * x.rank
        begin[axis] = start
        outs.append(b.add1("slice", [x], var.aval.shape, var.aval.dtype, start=tuple(begin), limit=tuple(limit),
                           strides=(1,) * x.rank))
        start = limit[axis]
    return outs


CONVERTERS["split"] = _split
