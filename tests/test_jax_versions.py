"""What differs between the jax versions gspmd supports (0.10 to 0.12) is read in both
forms: a scan's operand counts (num_consts/num_carry, or the `ft_in` trees of jax 0.12),
the primitives jax 0.12 added (polynomial, one_minus_square, log2) and its "hijax" primitives
(call_hi_primitive: jnp.searchsorted, ...). On a jax without them, stand-ins of the same
name and parameters pin the converters, so CI on either version tests both forms."""
from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax._src import hijax
from jax._src.interpreters import mlir
from jax.extend import core as jcore

import gspmd
from gspmd.ops.control import scan_counts
from util import check, rand

MESH = gspmd.Mesh(np.arange(8).reshape(2, 4), ("x", "y"))


def split(x, *spec):
    return gspmd.mesh_split(x, MESH, spec)


# -- scan's operand counts ---------------------------------------------------------------
class _Trees:
    """jax 0.12's `ft_in`: it unpacks into the constants', carries' and xs' trees."""
    def __init__(self, *trees):
        self.trees = trees

    def unpack(self):
        return self.trees


def test_scan_counts_read_either_form():
    assert scan_counts({"num_consts": 2, "num_carry": 1, "length": 4}) == (2, 1)
    assert scan_counts({"ft_in": _Trees((None, None), (None,), (None, None, None)), "length": 4}) == (2, 1)


def test_scan_with_constants_carries_and_forwarded_xs():
    """jax 0.12 forwards a ys that is an xs outside the scan: the equation has fewer
    results than the scan's ys."""
    def f(c, xs, w):
        c, (sums, same) = lax.scan(lambda c, x: (c * w + x, (c.sum(), x)), split(c, "y"), split(xs, None, "y"))
        return c, sums, same

    rng = np.random.RandomState(0)
    check(f, rand(rng, 6), rand(rng, 5, 6), np.float32(0.5), mesh=MESH)


# -- primitives jax 0.12 added ------------------------------------------------------------
def _standin(name: str, shape_of, lowering) -> jcore.Primitive:
    """A primitive named as jax 0.12's, for jax versions without it."""
    primitive = jcore.Primitive(name)
    primitive.def_abstract_eval(lambda *avals, **_: jax.core.ShapedArray(shape_of(*avals), avals[0].dtype))
    primitive.def_impl(lowering)
    mlir.register_lowering(primitive, mlir.lower_fun(lowering, multiple_results=False))
    return primitive


def _horner(x, *coeffs, unroll=None):
    acc = coeffs[-1]
    for c in reversed(coeffs[:-1]):
        acc = acc * x + c
    return acc


def _broadcast_shape(*avals):
    return jnp.broadcast_shapes(*(a.shape for a in avals))


if hasattr(lax, "polynomial"):
    polynomial, one_minus_square, log2 = lax.polynomial, lax.one_minus_square, lax.log2
else:
    _polynomial_p = _standin("polynomial", _broadcast_shape, _horner)
    _one_minus_square_p = _standin("one_minus_square", lambda a: a.shape, lambda x: (1 + x) * (1 - x))
    log2 = _standin("log2", lambda a: a.shape, lambda x: jnp.log(x) * np.float32(1.4426950408889634)).bind

    def polynomial(x, coeffs):
        return _polynomial_p.bind(x, *(jnp.asarray(c, x.dtype) for c in coeffs))

    def one_minus_square(x):
        return _one_minus_square_p.bind(x)


def test_polynomial_with_scalar_and_broadcast_coefficients():
    """Coefficients of x's rank with size-1 dims broadcast; 6 rows over 4 devices: uneven."""
    def f(x, row):
        return polynomial(split(x, "y", "x"), [1.0, row, 0.5, jnp.float32(-0.25)])

    rng = np.random.RandomState(1)
    lowered = check(f, rand(rng, 6, 5), rand(rng, 1, 5), mesh=MESH, rtol=1e-5, atol=1e-5)
    assert lowered.report().collectives == []   # element-wise: nothing moves


def test_one_minus_square_and_what_jax_builds_on_it():
    """jax 0.12's arcsin and arccos's gradients use one_minus_square."""
    def f(x):
        x = split(x, "x", None)
        return one_minus_square(x), jax.grad(lambda v: jnp.sum(jnp.arcsin(v)))(x)

    x = np.random.RandomState(2).uniform(-0.9, 0.9, (5, 3)).astype(np.float32)
    check(f, x, mesh=MESH, rtol=1e-5, atol=1e-5)


def test_log2():
    """jax 0.12's log2 primitive (jax 0.10's jnp.log2 divides two logs); 7 over 2 devices: uneven."""
    x = np.random.RandomState(5).uniform(0.1, 9.0, (7, 3)).astype(np.float32)
    lowered = check(lambda x: log2(split(x, "x", None)), x, mesh=MESH, rtol=1e-6, atol=1e-6)
    assert lowered.report().collectives == []


# -- hijax primitives ------------------------------------------------------------------------
_HiPrimitive = getattr(hijax, "HiPrim", None) or hijax.VJPHiPrimitive   # jax 0.12 / 0.10


class _ScaledCube(_HiPrimitive):
    """A hijax primitive: `expand` is all gspmd reads of it."""
    def __init__(self, aval, scale: float):
        self.in_avals, self.out_aval, self.params = (aval,), aval, {"scale": scale}
        super().__init__()

    def expand(self, x):
        return self.scale * x * x * x


def test_hijax_primitive_is_converted_from_its_expansion():
    def f(x):
        x = split(x, None, "y")
        return _ScaledCube(jax.typeof(x), 2.0)(x) + 1

    lowered = check(f, rand(np.random.RandomState(3), 3, 7), mesh=MESH, rtol=1e-5, atol=1e-5)
    assert lowered.report().collectives == []


@pytest.mark.parametrize("side", ["left", "right"])
def test_searchsorted(side):
    """jax 0.12 emits jnp.searchsorted as a hijax primitive (jax 0.10: a scan)."""
    def f(table, queries):
        return jnp.searchsorted(table, split(queries, "y"), side=side)

    table = np.sort(np.random.RandomState(4).randint(0, 9, 13)).astype(np.float32)
    queries = np.arange(10, dtype=np.float32) - 0.5
    check(f, table, np.concatenate([queries, table[:3]]), mesh=MESH)
