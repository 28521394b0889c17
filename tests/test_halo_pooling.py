"""Pooling (reduce-window) and its derivatives, reverse and forward mode, partitioned on
spatial dims by halo exchange."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from util import check, rand

import gspmd

MESH = gspmd.Mesh(np.arange(8).reshape(2, 4), ("x", "y"))


def _pool(kind, window, strides, padding):
    init, op = (-jnp.inf, lax.max) if kind == "max" else (0.0, lax.add)

    def pool(x):
        x = gspmd.mesh_split(x, MESH, [-1, -1, "x", "y"])
        return lax.reduce_window(x, init, op, (1, 1) + window, (1, 1) + strides, ((0, 0), (0, 0)) + padding)
    return pool


@pytest.mark.parametrize("kind", ["max", "sum"])
@pytest.mark.parametrize("window,strides,padding", [
    ((2, 2), (2, 2), ((0, 0), (0, 0))),
    ((3, 2), (2, 2), ((1, 1), (0, 1))),
    ((3, 3), (1, 3), ((1, 1), (2, 0))),
])
def test_pool_forward_moves_only_halos(kind, window, strides, padding):
    x = rand(np.random.RandomState(0), 2, 3, 13, 11)
    report = check(_pool(kind, window, strides, padding), x, mesh=MESH).report()
    assert set(report.counts()) <= {"collective-permute"}, str(report)


@pytest.mark.parametrize("window,strides,padding", [
    ((2, 2), (2, 2), ((0, 0), (0, 0))),
    ((3, 2), (2, 2), ((1, 1), (0, 1))),
])
def test_max_pool_gradient(window, strides, padding):
    """jax emits select_and_scatter_add for the gradient of max pooling."""
    pool = _pool("max", window, strides, padding)
    x = rand(np.random.RandomState(1), 2, 3, 13, 11)
    grad = jax.grad(lambda x: (pool(x) ** 2).sum())
    report = check(grad, x, mesh=MESH).report()
    assert set(report.counts()) <= {"collective-permute", "all-reduce"}, str(report)


@pytest.mark.parametrize("kind", ["max", "min"])
@pytest.mark.parametrize("window,strides,padding", [
    ((2, 2), (2, 2), ((0, 0), (0, 0))),
    ((3, 2), (2, 2), ((1, 1), (0, 1))),
    ((3, 3), (1, 3), ((1, 1), (2, 0))),
])
def test_max_and_min_pool_forward_mode_derivative(kind, window, strides, padding):
    """jax.jvp (jacfwd, hessian) of max/min pooling emits select_and_gather_add: each
    window's tangent where its operand is extreme; both operands' halos are exchanged."""
    pool = _pool("max", window, strides, padding)
    if kind == "min":
        pool = lambda x, max_pool=pool: -max_pool(-x)
    rng = np.random.RandomState(3)
    x, t = rand(rng, 2, 3, 13, 11), rand(rng, 2, 3, 13, 11)
    report = check(lambda x, t: jax.jvp(pool, (x,), (t,)), x, t, mesh=MESH).report()
    assert set(report.counts()) <= {"collective-permute"}, str(report)


def test_hessian_vector_product_through_max_pooling():
    pool = _pool("max", (3, 3), (2, 2), ((1, 1), (1, 1)))
    rng = np.random.RandomState(4)
    x, v = rand(rng, 2, 3, 13, 11), rand(rng, 2, 3, 13, 11)
    loss = lambda x: jnp.sum(jnp.tanh(pool(x)) ** 2)
    check(lambda x, v: jax.jvp(jax.grad(loss), (x,), (v,))[1], x, v, mesh=MESH)


def test_avg_pool_gradient():
    """jax emits pad (interior) + reduce_window_sum for the gradient of sum pooling: the
    pad partitions by halo exchange too, so nothing is gathered."""
    pool = _pool("sum", (3, 3), (2, 1), ((1, 1), (1, 1)))
    x = rand(np.random.RandomState(2), 2, 3, 13, 11)
    report = check(jax.grad(lambda x: (pool(x) ** 2).sum()), x, mesh=MESH).report()
    assert set(report.counts()) == {"collective-permute"}, str(report)


@pytest.mark.parametrize("combine,init", [(lambda p, q: p + q, 0.0), (lambda p, q: jnp.maximum(p, q), -jnp.inf),
                                          (lambda p, q: p * q, 1.0)])
def test_reduce_window_with_a_computation_of_its_own(combine, init):
    """lax.reduce_window given a Python function (JAX's generic reduce_window primitive) on
    a split spatial dim (9 over 2: uneven): the window reduction of that op, halos and all."""
    rng = np.random.RandomState(4)
    x = rand(rng, 2, 9, 6)

    def f(x):
        x = gspmd.mesh_split(x, MESH, [-1, "x", -1])
        return jax.lax.reduce_window(x, init, combine, (1, 3, 2), (1, 1, 1), "SAME")
    check(f, x, mesh=MESH)


def test_reduce_window_with_another_init_counted_at_padding_says_what_to_do():
    x = np.ones((2, 8, 4), np.float32)
    with pytest.raises(gspmd.ShardingError, match="for add and mul from their identity"):
        gspmd.jit(lambda x: jax.lax.reduce_window(x, 1.0, lambda p, q: p + q, (1, 2, 1), (1, 1, 1), "SAME"),
                  mesh=MESH)(x)
