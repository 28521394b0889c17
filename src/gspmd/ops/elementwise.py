"""Element-wise ops: every dim is a pass-through factor shared by all operands. Also the
annotation op `sharding` (from gspmd.mesh_split, jax.lax.with_sharding_constraint and a
nested jax.jit's in/out shardings), `copy` and `optimization-barrier`, which only change
layout, and `bitcast-convert`, element-wise but for the bytes of one element.

`elementwise(opcode, numpy_fn, lax_fn, primitives)` registers one op in one line: the
JAX primitives it comes from, its NumPy reference, its jax lowering and its factors.
Ops NumPy lacks (erf, lgamma, ...) take jax's own kernel, run eagerly, as reference.
Complex numbers are out of scope (the frontend says so).
"""
from __future__ import annotations

import itertools
from typing import Callable, Optional, Sequence, Union

import jax
import numpy as np
from jax import lax
from jax.sharding import NamedSharding

from gspmd.dtypes import is_floating
from gspmd.errors import ShardingError
from gspmd.ir import Builder, Instr, Value
from gspmd.ir.reducer import ADD
from gspmd.ops.convert import Conversion, Converter, convert_by_impl, is_key
from gspmd.ops.registry import (ELEMENTWISE, Facets, Frontend, Memory, Rewrites, Rule, Semantics, Storage, Timing,
                                counts_exactly, elementwise_factors, elementwise_flops, is_zero, jointly_linear,
                                linear_in, register)
from gspmd.sharding import UNSPECIFIED, Sharding, dims_mapping_from_spec
from gspmd.spmd import factors as fx
from gspmd.spmd import reshard as rs
from gspmd.spmd.cost import ComputeKind


# -- conversion -----------------------------------------------------------------------
def convert_as(opcode: str, params: Sequence[str] = (), **attrs) -> Converter:
    """An equation becomes one `opcode` instruction (scalar operands broadcast); the
    equation's `params` become attributes of the same names."""
    def convert(b, eqn, args):
        shape, dtype = b.out_aval(eqn)
        return [b.add1(opcode, [b.broadcast_to(a, shape) for a in args], shape, dtype,
                       **{p: eqn.params[p] for p in params}, **attrs)]
    return convert


def _identity(b, eqn, args):
    return [args[0]]


# -- reference and lowering -------------------------------------------------------------
def _widen(x: np.ndarray) -> np.ndarray:
    """Narrow floats (bfloat16, float16) compute in float32 and round after, as XLA does."""
    return x.astype(np.float32) if is_floating(x.dtype) and x.dtype.itemsize < 4 else x


def _named(instr, params: Sequence[str]) -> dict:
    return {p: instr.attrs[p] for p in params}


def _evaluate_with(fn: Callable, params: Sequence[str] = ()) -> Callable:
    def evaluate(instr, args, device):
        out = instr.outputs[0]
        with np.errstate(all="ignore"):
            y = fn(*map(_widen, args), **_named(instr, params))
            return [np.asarray(y).astype(out.dtype, copy=False).reshape(out.shape)]
    return evaluate


def _keeping_nan(fn: Callable) -> Callable:
    """fn with NaN elements of its one operand returned as they are (the sign of a NaN
    decides where sorts and top_k put it)."""
    return lambda x: np.where(np.isnan(x), x, fn(x))


def _evaluate_eagerly(lax_fn: Callable, params: Sequence[str] = ()) -> Callable:
    """The reference of ops NumPy lacks (erf, lgamma, ...): jax's own kernel, eagerly (it
    computes narrow floats as XLA does; NaN in the padding stays there)."""
    def evaluate(instr, args, device):
        out = instr.outputs[0]
        args = [np.broadcast_to(a, out.shape) for a in args]
        return [np.asarray(lax_fn(*args, **_named(instr, params))).astype(out.dtype, copy=False)]
    return evaluate


def _lower_with(fn: Callable, params: Sequence[str] = ()) -> Callable:
    def lower(instr, args, lc):
        out = instr.outputs[0]
        # Scalars broadcast implicitly (as in the NumPy reference).
        args = [lax.broadcast(a, out.shape) if a.ndim == 0 and out.rank else a for a in args]
        return [_exactly(fn(*args, **_named(instr, params)), out.dtype)]
    return lower


def _exactly(x, dtype):
    """x as a strongly typed `dtype` array: converted only where it is not one (each
    no-op convert is a jax dispatch in the trace of the shard_map body)."""
    aval = jax.typeof(x)
    return x if aval.dtype == dtype and not aval.weak_type else lax.convert_element_type(x, dtype)


def elementwise(opcode: str, numpy_fn: Optional[Callable], lax_fn: Callable, primitives: Sequence[str] = (),
                converts: Optional[dict[str, Converter]] = None, converts_keys: Optional[dict[str, Converter]] = None,
                params: Sequence[str] = (),
                evaluate: Optional[Callable] = None, partition: Optional[Callable] = None,
                flops: Optional[Callable] = elementwise_flops, compute: ComputeKind = ComputeKind.MEMORY,
                storage: Storage = Storage.ELEMENTWISE, expensive: Union[bool, Callable] = False,
                linear: Optional[Callable] = None, facets: Optional[Facets] = None, fuses: bool = True,
                keeps_nan: bool = False) -> None:
    """Register element-wise `opcode`: each JAX primitive in `primitives` becomes it
    (more converters in `converts`, and in `converts_keys` those that see typed PRNG keys
    as their key data), its `params` becoming attributes that numpy_fn and
    lax_fn take by name; numpy_fn None: the reference runs lax_fn eagerly (or is
    `evaluate`, a whole reference of its own). One operation per element unless `flops`
    says otherwise. `keeps_nan`: XLA returns a NaN operand as it is, sign included, where
    NumPy's kernel returns +NaN."""
    if evaluate is None:
        evaluate = _evaluate_eagerly(lax_fn, params) if numpy_fn is None else \
            _evaluate_with(_keeping_nan(numpy_fn) if keeps_nan else numpy_fn, params)
    register(opcode,
             frontend=Frontend(converts={**{p: convert_as(opcode, params) for p in primitives}, **(converts or {})},
                               converts_keys=converts_keys or {}),
             semantics=Semantics(evaluate=evaluate, lower=_lower_with(lax_fn, params)),
             rule=Rule(factors=elementwise_factors, partition=partition, priority=ELEMENTWISE),
             timing=Timing(flops=flops, compute=compute, fuses=fuses),
             memory=Memory(storage=storage,
                           expensive=expensive), rewrites=Rewrites(linear=linear), facets=facets or Facets())


# -- HLO semantics where NumPy differs ------------------------------------------------------
def _int_div(a, b):
    # HLO integer division truncates toward zero.
    q = np.abs(a) // np.maximum(np.abs(b), 1)
    return np.where((a < 0) != (b < 0), -q, q)


def _divide(a, b):
    return _int_div(a, b) if np.asarray(a).dtype.kind in "iu" else np.divide(a, b)


def _logistic(x):
    return 1 / (1 + np.exp(-x))


def _round_even(x):
    return lax.round(x, lax.RoundingMethod.TO_NEAREST_EVEN)


def _round_away(x):
    whole = np.floor(np.abs(x))
    return np.copysign(whole + (np.abs(x) - whole >= 0.5), x)   # exact: no x + 0.5 rounding


def _round(b, eqn, args):
    away = eqn.params["rounding_method"] == lax.RoundingMethod.AWAY_FROM_ZERO
    return convert_as("round-nearest-afz" if away else "round-nearest-even")(b, eqn, args)


def _bits(x: np.ndarray) -> int:
    return 8 * x.dtype.itemsize


def _unsigned(x: np.ndarray) -> np.ndarray:
    return x.view(f"u{x.dtype.itemsize}")


def _signed(x: np.ndarray) -> np.ndarray:
    return x.view(f"i{x.dtype.itemsize}")


def _shift_count(x, s):
    """HLO shifts by s (read unsigned) of at least the bit width shift everything out."""
    s = _unsigned(np.asarray(s, x.dtype))
    return np.minimum(s, _bits(x) - 1).astype(x.dtype), s >= _bits(x)


def _shift_left(x, s):
    count, out = _shift_count(x, s)
    return np.where(out, 0, np.left_shift(x, count)).astype(x.dtype)


def _shift_right_logical(x, s):
    count, out = _shift_count(x, s)
    return np.where(out, 0, _unsigned(x) >> _unsigned(count)).astype(_unsigned(x).dtype).view(x.dtype)


def _shift_right_arithmetic(x, s):
    count, _ = _shift_count(x, s)   # shifting by width - 1 already leaves only the sign
    return (_signed(x) >> _signed(count)).view(x.dtype)


def _population_count(x):
    return np.bitwise_count(_unsigned(x)).astype(x.dtype)


def _clamp(low, x, high):
    return np.minimum(np.maximum(x, low), high)


def _convert_value(x: np.ndarray, dtype) -> np.ndarray:
    """XLA's conversion: floats to integers truncate and saturate, NaN becomes 0; floats
    to narrower floats (float16, bfloat16, float8) round to nearest even; complex numbers
    to real types keep their real part."""
    dtype = np.dtype(dtype)
    if np.iscomplexobj(x) and dtype.kind != "c":
        x = np.real(x)
    if is_floating(x.dtype) and dtype.kind in "iu":
        info = np.iinfo(dtype)
        x = np.clip(np.nan_to_num(x.astype(np.float64), nan=0.0), info.min, info.max)
    return x.astype(dtype)


def _evaluate_convert(instr, args, device):
    with np.errstate(all="ignore"):
        return [_convert_value(args[0], instr.outputs[0].dtype)]


def _square(b, eqn, args):
    shape, dtype = b.out_aval(eqn)
    return [b.add1("multiply", [args[0], args[0]], shape, dtype)]


def _one_minus_square(b, eqn, args):
    """jax >= 0.12's 1 - x^2, computed as its lowering does: (1 + x)(1 - x)."""
    shape, dtype = b.out_aval(eqn)
    one = b.broadcast_to(b.constant(1, dtype), shape)
    return [b.add1("multiply", [b.add1("add", [one, args[0]], shape, dtype),
                                b.add1("subtract", [one, args[0]], shape, dtype)], shape, dtype)]


def _polynomial(b, eqn, args):
    """jax >= 0.12's polynomial(x, a_0..a_N) by Horner's rule, as its lowering evaluates
    it: acc = a_N, then acc * x + a_k for k = N-1..0 (always unrolled: a loop jax uses
    for more than 8 terms runs the same operations in the same order)."""
    shape, dtype = b.out_aval(eqn)
    x, *coeffs = [b.broadcast_to(a, shape) for a in args]   # (a coefficient's size-1 dims stretch)
    acc = coeffs[-1]
    for c in reversed(coeffs[:-1]):
        acc = b.add1("add", [b.add1("multiply", [acc, x], shape, dtype), c], shape, dtype)
    return [acc]


def _log2(b, eqn, args):
    """jax >= 0.12's log2 primitive, as its lowering computes it: log(x) * (1 / ln 2)."""
    shape, dtype = b.out_aval(eqn)
    inverse_ln2 = b.broadcast_to(b.constant(1.4426950408889634, dtype), shape)
    return [b.add1("multiply", [b.add1("log", [args[0]], shape, dtype), inverse_ln2], shape, dtype)]


def _float_division(instr) -> bool:
    """Expensive (worth a buffer rather than recomputing in every user, as XLA's CPU
    fusion judges), like the transcendentals below; integer division is cheap."""
    return is_floating(instr.outputs[0].dtype)


# Binary ops (bitwise on integers, logical on booleans, as in HLO).
elementwise("add", np.add, lax.add, ["add", "add_any"], linear=jointly_linear, facets=Facets(combines=ADD))
elementwise("subtract", np.subtract, lax.sub, ["sub"], linear=jointly_linear)
elementwise("multiply", np.multiply, lax.mul, ["mul"], linear=linear_in((0,), (1,)),
            converts={"square": _square, "one_minus_square": _one_minus_square, "polynomial": _polynomial})
elementwise("divide", _divide, lax.div, ["div"], expensive=_float_division, linear=linear_in((0,)))
elementwise("maximum", np.maximum, lax.max, ["max"])
elementwise("minimum", np.minimum, lax.min, ["min"])
elementwise("power", np.power, lax.pow, ["pow"], expensive=True)
elementwise("integer-power", lambda x, y: np.power(x, y), lax.integer_pow, ["integer_pow"], params=("y",),
            expensive=True)   # integers too
elementwise("remainder", np.fmod, lax.rem, ["rem"], expensive=_float_division)
elementwise("atan2", np.arctan2, lax.atan2, ["atan2"], expensive=True)
elementwise("and", np.bitwise_and, lax.bitwise_and, ["and"])
elementwise("or", np.bitwise_or, lax.bitwise_or, ["or"])
elementwise("xor", np.bitwise_xor, lax.bitwise_xor, ["xor"])
# Unary ops.
elementwise("not", np.invert, lax.bitwise_not, ["not"])
elementwise("negate", np.negative, lax.neg, ["neg"], linear=jointly_linear)
elementwise("exponential", np.exp, lax.exp, ["exp"], expensive=True, keeps_nan=True)
elementwise("log", np.log, lax.log, ["log"], converts={"log2": _log2}, expensive=True, keeps_nan=True)
elementwise("tanh", np.tanh, lax.tanh, ["tanh"], expensive=True, keeps_nan=True)
elementwise("logistic", _logistic, lax.logistic, ["logistic"], expensive=True)
elementwise("rsqrt", lambda x: 1 / np.sqrt(x), lax.rsqrt, ["rsqrt"], expensive=True)
elementwise("sqrt", np.sqrt, lax.sqrt, ["sqrt"], expensive=True)
elementwise("abs", np.abs, lax.abs, ["abs"])
elementwise("sign", np.sign, lax.sign, ["sign"])
elementwise("floor", np.floor, lax.floor, ["floor"])
elementwise("ceil", np.ceil, lax.ceil, ["ceil"])
elementwise("cosine", np.cos, lax.cos, ["cos"], keeps_nan=True)
elementwise("sine", np.sin, lax.sin, ["sin"], keeps_nan=True)
elementwise("exponential-minus-one", np.expm1, lax.expm1, ["expm1"], expensive=True)
elementwise("log-plus-one", np.log1p, lax.log1p, ["log1p"], expensive=True)
elementwise("is-finite", np.isfinite, lax.is_finite, ["is_finite"])
elementwise("complex", lambda x, y: x + 1j * y, lax.complex, ["complex"], linear=jointly_linear)
elementwise("real", np.real, lax.real, ["real"], linear=jointly_linear)
elementwise("imag", np.imag, lax.imag, ["imag"], linear=jointly_linear)
elementwise("conjugate", np.conj, lax.conj, ["conj"], linear=jointly_linear)
elementwise("round-nearest-even", np.round, _round_even, converts={"round": _round})
elementwise("round-nearest-afz", _round_away, lax.round)
elementwise("tan", np.tan, lax.tan, ["tan"], expensive=True)
elementwise("asin", np.arcsin, lax.asin, ["asin"], expensive=True)
elementwise("acos", np.arccos, lax.acos, ["acos"], expensive=True)
elementwise("atan", np.arctan, lax.atan, ["atan"], expensive=True)
elementwise("sinh", np.sinh, lax.sinh, ["sinh"], expensive=True)
elementwise("cosh", np.cosh, lax.cosh, ["cosh"], expensive=True)
elementwise("asinh", np.arcsinh, lax.asinh, ["asinh"], expensive=True)
elementwise("acosh", np.arccosh, lax.acosh, ["acosh"], expensive=True)
elementwise("atanh", np.arctanh, lax.atanh, ["atanh"], expensive=True)
elementwise("cbrt", np.cbrt, lax.cbrt, ["cbrt"], expensive=True)
elementwise("exponential2", np.exp2, lax.exp2, ["exp2"], expensive=True)
elementwise("clamp", _clamp, lax.clamp, ["clamp"])
# Special functions: jax's kernels are the reference.
elementwise("erf", None, lax.erf, ["erf"], expensive=True)
elementwise("erfc", None, lax.erfc, ["erfc"], expensive=True)
elementwise("erf-inv", None, lax.erf_inv, ["erf_inv"], expensive=True)
elementwise("lgamma", None, lax.lgamma, ["lgamma"], expensive=True)
elementwise("digamma", None, lax.digamma, ["digamma"], expensive=True)
elementwise("polygamma", None, lax.polygamma, ["polygamma"], expensive=True)
elementwise("zeta", None, lax.zeta, ["zeta"], expensive=True)
elementwise("igamma", None, lax.igamma, ["igamma"], expensive=True)
elementwise("igammac", None, lax.igammac, ["igammac"], expensive=True)
elementwise("igamma-grad-a", None, lax.igamma_grad_a, ["igamma_grad_a"], expensive=True)
elementwise("regularized-incomplete-beta", None, lax.betainc, ["regularized_incomplete_beta"], expensive=True)
elementwise("bessel-i0e", None, lax.bessel_i0e, ["bessel_i0e"], expensive=True)
elementwise("bessel-i1e", None, lax.bessel_i1e, ["bessel_i1e"], expensive=True)
elementwise("next-after", None, lax.nextafter, ["nextafter"])   # NumPy's would step in float32
elementwise("reduce-precision", None, lax.reduce_precision, ["reduce_precision"],
            params=("exponent_bits", "mantissa_bits"))
# Bits (HLO semantics on two's complement; shift counts read unsigned).
elementwise("popcnt", _population_count, lax.population_count, ["population_count"])
elementwise("count-leading-zeros", None, lax.clz, ["clz"])
elementwise("shift-left", _shift_left, lax.shift_left, ["shift_left"])
elementwise("shift-right-logical", _shift_right_logical, lax.shift_right_logical, ["shift_right_logical"])
elementwise("shift-right-arithmetic", _shift_right_arithmetic, lax.shift_right_arithmetic,
            ["shift_right_arithmetic"])


# -- compare, select, convert --------------------------------------------------------------
_COMPARE = {"EQ": (np.equal, lax.eq), "NE": (np.not_equal, lax.ne), "LT": (np.less, lax.lt),
            "LE": (np.less_equal, lax.le), "GT": (np.greater, lax.gt), "GE": (np.greater_equal, lax.ge)}


def _total_order(x, bitcast, where):
    """Integers ordered as IEEE 754's totalOrder orders floats (-NaN < -inf < ... < -0 <
    +0 < ... < inf < NaN): a float's bits read as a signed integer, the magnitude bits of
    negatives flipped. Integers order as they are."""
    if not is_floating(x.dtype):
        return x
    bits = bitcast(x, np.dtype(f"int{8 * np.dtype(x.dtype).itemsize}"))
    return where(bits < 0, bits ^ np.iinfo(bits.dtype).max, bits)


def _evaluate_compare(instr, args, device):
    if instr.attrs.get("total_order"):
        args = [_total_order(a, lambda x, t: np.asarray(x).view(t), np.where) for a in args]
    return [_COMPARE[instr.attrs["direction"]][0](*args)]


def _lower_compare(instr, args, lc):
    if instr.attrs.get("total_order"):
        args = [_total_order(a, lax.bitcast_convert_type, jax.numpy.where) for a in args]
    return [_COMPARE[instr.attrs["direction"]][1](*args)]


# eq_to, lt_to, le_to: the total order (jax.random.choice with p= compares with le_to)
register("compare",
         frontend=Frontend(converts={
             **{p: convert_as("compare", direction=p.upper()) for p in ("eq", "ne", "lt", "le", "gt", "ge")},
             **{f"{p}_to": convert_as("compare", direction=p.upper(), total_order=True) for p in ("eq", "lt", "le")}}),
         semantics=Semantics(evaluate=_evaluate_compare, lower=_lower_compare),
         rule=Rule(factors=elementwise_factors, priority=ELEMENTWISE),
         timing=Timing(flops=elementwise_flops),
         memory=Memory(storage=Storage.ELEMENTWISE))


def _select_n(b, eqn, args):
    pred, *cases = args
    shape, dtype = b.out_aval(eqn)
    if len(cases) > 2:   # a chain of selects, one per case beyond the first
        index = pred if pred.dtype != np.bool_ else b.add1("convert", [pred], pred.shape, np.int32)
        index = b.broadcast_to(index, shape)
        out = cases[0]
        for k, case in enumerate(cases[1:], start=1):
            hit = b.add1("compare", [index, b.broadcast_to(b.constant(k, index.dtype), shape)], shape, np.bool_,
                         direction="GE")
            out = b.add1("select", [hit, case, out], shape, dtype)
        return [out]
    if pred.dtype != np.bool_:
        pred = b.add1("compare", [pred, b.broadcast_to(b.constant(0, pred.dtype), pred.shape)], pred.shape,
                      np.bool_, direction="NE")
    return [b.add1("select", [b.broadcast_to(pred, shape), cases[1], cases[0]], shape, dtype)]


def _evaluate_select(instr, args, device):
    pred, on_true, on_false = args
    return [np.where(pred, on_true, on_false).astype(instr.outputs[0].dtype, copy=False)]


def _nonnegative_wrap(instr: Instr) -> Optional[Value]:
    """x for jnp's wrap of negative indices, select(x < 0, x + n, x); None otherwise."""
    pred, _, x = instr.operands
    p = pred.producer
    if p is None or p.opcode != "compare" or p.attrs["direction"] != "LT" or not is_zero(p.operands[1]):
        return None
    return x if p.operands[0] is x else None


def _select_position(instr, fixed, below):
    """An iota is never negative: jnp's wrap of negative indices picks it as it is."""
    x = _nonnegative_wrap(instr)
    return None if x is None else below(x, fixed)


register("select",
         frontend=Frontend(converts={"select_n": _select_n}),
         semantics=Semantics(evaluate=_evaluate_select, lower=_lower_with(lax.select)),
         rule=Rule(factors=elementwise_factors, priority=ELEMENTWISE),
         timing=Timing(flops=elementwise_flops),
         memory=Memory(storage=Storage.ELEMENTWISE),
         rewrites=Rewrites(linear=linear_in((1, 2))),
         facets=Facets(position=_select_position))


def _convert(b, eqn, args):
    shape, dtype = b.out_aval(eqn)
    if args[0].dtype == dtype:
        return [args[0]]
    return [b.add1("convert", args, shape, dtype)]


def _narrowing_float(instr) -> bool:
    """f32 -> bf16 rounds with NaN checks; widening is a shift."""
    src, dst = instr.operands[0].dtype, instr.outputs[0].dtype
    return is_floating(src) and is_floating(dst) and dst.itemsize < src.itemsize


def _float_to_float(instr) -> list:
    """A conversion between floating dtypes is linear (up to rounding)."""
    return jointly_linear(instr) if is_floating(instr.operands[0].dtype) and is_floating(instr.outputs[0].dtype) else []


def _convert_position(instr, fixed, below):
    """An iota's positions, where the new dtype still counts them exactly."""
    k, out = below(instr.operands[0], fixed), instr.outputs[0]
    return k if k is not None and counts_exactly(out.dtype, out.shape[k]) else None


elementwise("convert", None, lambda x: x, converts={"convert_element_type": _convert}, evaluate=_evaluate_convert,
            expensive=_narrowing_float, linear=_float_to_float, facets=Facets(position=_convert_position))


# -- layout only: annotations and copies ---------------------------------------------------
def _reshard_to_target(ctx, instr, operands, targets):
    """Annotations and copies only change layout."""
    return [rs.reshard(ctx, operands[0], targets[0])]


def annotated(b: Builder, x: Value, layout: Sharding, unspecified: Sequence[int] = ()) -> Value:
    """x annotated with `layout`, its dims `unspecified` left to propagation."""
    return b.add1("sharding", [x], x.shape, x.dtype, sharding=layout, unspecified=tuple(unspecified))


def _annotation(b, eqn, args):
    sharding = b.local_layout(eqn.params["sharding"], f"the value {args[0].type_str()}")
    if is_key(eqn.invars[0].aval.dtype):   # key data: the key's layout, its words kept whole
        sharding = sharding.insert_dim(sharding.rank)
    return [annotated(b, args[0], sharding, eqn.params["unspecified"])]


def annotate(b: Conversion, x: Value, sharding, unconstrained=(), only_named: bool = False) -> Value:
    """x annotated with a jax NamedSharding, as mesh_split over its mesh would. Dims in
    `unconstrained` (with `only_named`: all dims its spec leaves None) are left to
    propagation."""
    if not isinstance(sharding, NamedSharding):
        raise ShardingError(f"The value {x.type_str()} is constrained to {sharding}, but gspmd reads only "
                            "NamedSharding or PartitionSpec layouts; write NamedSharding(mesh, PartitionSpec(...)).")
    mapping = dims_mapping_from_spec(sharding.spec, x.shape)
    mapping = [UNSPECIFIED if d in unconstrained or (only_named and e is None) else e for d, e in enumerate(mapping)]
    if all(e is UNSPECIFIED for e in mapping):
        return x
    layout = b.local_layout(Sharding.from_mesh(b.mesh_of(sharding.mesh), mapping, x.shape), f"the value {x.type_str()}")
    return annotated(b, x, layout, [d for d, e in enumerate(mapping) if e is UNSPECIFIED])


def _sharding_constraint(b, eqn, args):
    # jax >= 0.12.1 writes unconstrained dims into the spec (P.UNCONSTRAINED), not a param
    return [annotate(b, args[0], eqn.params["sharding"], eqn.params.get("unconstrained_dims", ()))]


def _reshard(b, eqn, args):
    """jax.sharding.reshard constrains the dims its spec names; jnp emits it with an
    all-None spec under a context mesh of automatic axes, where it changes nothing."""
    return [annotate(b, args[0], eqn.params["dst_sharding"], only_named=True)]


def _nested_jit(b, eqn, args):
    """A jax.jit inside the function: its body in place, its in/out shardings (where
    given) as annotations."""
    def annotated(values, shardings):
        return [annotate(b, v, s) if isinstance(s, jax.sharding.Sharding) else v for v, s in zip(values, shardings)]
    outs = b.inline(eqn.params["jaxpr"], annotated(args, eqn.params["in_shardings"]))
    return annotated(outs, eqn.params["out_shardings"])


# "mesh_split" is gspmd.frontend.annotation.mesh_split_p's name. Layouts of typed keys
# annotate their key data (a spec leaves its trailing words dim unsplit), not each word
# apart, which would slice the key data into words and stack them again around each.
elementwise("sharding", lambda x: x, lambda x: x, partition=_reshard_to_target, flops=None, compute=ComputeKind.FREE,
            converts={"jit": _nested_jit},
            converts_keys={"mesh_split": _annotation, "sharding_constraint": _sharding_constraint, "reshard": _reshard},
            facets=Facets(annotation=True, identity=True, layouts_named=lambda instr: [instr.attrs["sharding"]]))


def _select_if_vmap(b, eqn, args):
    """Equinox's select_if_vmap(pred, x, y) unbatched is x (its loops' steps: a predicate
    not under vmap holds); vmap rewrites it before gspmd sees the program."""
    return [args[1]]


# "pvary" marks a value in a shard_map body as varying over axes (check_vma); equinox's
# nonbatchable, nontraceable and nondifferentiable_backward are identities that refuse a
# transformation, which JAX applies before gspmd sees the program.
_IDENTITIES = ("copy", "copy_p", "stop_gradient", "pvary", "nonbatchable", "nontraceable",
               "nondifferentiable_backward")
elementwise("copy", lambda x: x, lambda x: x, flops=None,
            converts={**{p: _identity for p in _IDENTITIES}, "select_if_vmap": _select_if_vmap},
            partition=_reshard_to_target, linear=jointly_linear, facets=Facets(identity=True))


# -- optimization barriers and rematerialization -------------------------------------------
# A barrier is the identity, but no pass looks through it: each barrier carries its
# region's id, so common-subexpression elimination never merges what follows it with
# values computed elsewhere (XLA's opt-barrier plays this role for remat).
_regions = itertools.count()


def _barrier_each(b, values, together: bool = False) -> list:
    region = next(_regions)
    attrs = {"region": region, "together": region} if together else {"region": region}
    return [b.add1("optimization-barrier", [v], v.shape, v.dtype, **attrs) for v in values]


def _convert_optimization_barrier(b, eqn, args):
    """lax.optimization_barrier: one barrier per value, which live as one (dead-code
    elimination keeps all if one is read: XLA computes every operand of the barrier)."""
    return _barrier_each(b, args, together=True)


def _convert_remat(b, eqn, args):
    """jax.checkpoint: JAX's partial evaluation already split the computation by the
    policy; what the backward pass recomputes is the body of the differentiated remat2.
    Its inputs pass through barriers, so the recomputed values (and the partitioner's
    reshards of them) are not merged with the forward pass's: the forward's copies die
    early and the backward recomputes near its use."""
    body = eqn.params["jaxpr"]
    if eqn.params["differentiated"] and eqn.params["prevent_cse"]:
        args = _barrier_each(b, args)
    return b.inline(body, args)


def _convert_device_put(b, eqn, args):
    """device_put inside a traced function: onto a NamedSharding, an annotation (as
    jax.jit takes it); otherwise it moves nothing between our devices, except offloading
    to host memory (remat offload policies), which gspmd does not model."""
    outs = []
    for x, where in zip(args, eqn.params["devices"]):
        if where == jax.memory.Space.Host:
            raise ShardingError(
                f"`{eqn}` offloads a value to {where} (a jax.checkpoint offload policy such as "
                "offload_dot_with_no_batch_dims or save_and_offload_only_these_names, or device_put to host "
                "memory); gspmd does not model host memory: use a policy that saves or recomputes instead "
                "(dots_saveable, save_only_these_names, nothing_saveable).")
        outs.append(annotate(b, x, where) if isinstance(where, NamedSharding) else x)
    return outs


def _identity_each(b, eqn, args):
    return list(args)


elementwise("optimization-barrier", lambda x: x, lax.optimization_barrier, storage=Storage.VIEW, flops=None,
            compute=ComputeKind.FREE, fuses=False,
            # equinox's noinline: a function XLA compiles apart, whose body gspmd partitions in place
            converts={"remat2": _convert_remat, "device_put": _convert_device_put, "name": _identity_each,
                      "noinline": convert_by_impl},
            converts_keys={"optimization_barrier": _convert_optimization_barrier})   # keys' data pass as they are


# -- bitcasts: element-wise, but an element of a wider type is a minor dim of a narrower one
def _bitcast_convert(b, eqn, args):
    shape, dtype = b.out_aval(eqn)
    if args[0].dtype == dtype:
        return [args[0]]
    return [b.add1("bitcast-convert", args, shape, dtype)]


def _bitcast_factors(instr: Instr) -> list[fx.Factor]:
    x, out = instr.operands[0], instr.outputs[0]
    shared = min(x.rank, out.rank)
    factors = [fx.Factor(n, (d, d)) for d, n in enumerate(out.shape[:shared])]
    if x.rank != out.rank:   # the narrower type's elements of one wide element stay together
        n = max(x, out, key=lambda v: v.rank).shape[-1]
        factors.append(fx.Factor(n, (x.rank - 1 if x.rank > shared else None, out.rank - 1 if out.rank > shared
                                     else None), fx.REPLICATE))
    return factors


def _evaluate_bitcast(instr, args, device):
    out = instr.outputs[0]
    return [np.ascontiguousarray(args[0]).view(out.dtype).reshape(out.shape)]


register("bitcast-convert",
         frontend=Frontend(converts={"bitcast_convert_type": _bitcast_convert}),
         semantics=Semantics(evaluate=_evaluate_bitcast, lower=lambda instr, args,
                             lc: [lax.bitcast_convert_type(args[0], instr.outputs[0].dtype)]),
         rule=Rule(factors=_bitcast_factors, priority=ELEMENTWISE),
         memory=Memory(storage=Storage.BITCAST))
