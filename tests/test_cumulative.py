"""Cumulative ops (cumsum, cumprod, cummax, cummin, cumlogsumexp, forward and reverse)
along split dims without gathering: only one total per shard moves. Variadic reduce
(lax.reduce over tuples with a computation of its own) and reduce_and/or/xor along
split dims."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax import lax

import gspmd
from strategies import dims_mappings, meshes
from util import check, rand

MESH = gspmd.Mesh(np.arange(8).reshape(2, 4), ("x", "y"))
LINE = gspmd.Mesh(np.arange(8), ("x",))
SMALL_MESHES = [(2,), (4,), (8,), (3,), (2, 2), (2, 4), (4, 2), (3, 2), (2, 2, 2)]

CUMULATIVE = {
    "cumsum": lambda x, axis, reverse: lax.cumsum(x, axis, reverse),
    "cumprod": lambda x, axis, reverse: lax.cumprod(x, axis, reverse),
    "cummax": lambda x, axis, reverse: lax.cummax(x, axis, reverse),
    "cummin": lambda x, axis, reverse: lax.cummin(x, axis, reverse),
    "cumlogsumexp": lambda x, axis, reverse: lax.cumlogsumexp(x, axis, reverse),
}


def split(x, mesh, *dims):
    return gspmd.mesh_split(x, mesh, list(dims))


def test_every_cumulative_op_along_split_and_whole_dims():
    def f(x):
        x = split(x, MESH, "x", "y")
        return [fn(x, axis, reverse) for fn in CUMULATIVE.values() for axis in (0, 1) for reverse in (False, True)]

    x = rand(np.random.RandomState(0), 6, 7) / 2   # uneven over both mesh axes
    check(f, x, mesh=MESH)


def test_split_scan_moves_one_total_per_shard():
    def f(x):
        return jnp.cumsum(split(x, LINE, -1, "x"), axis=1), lax.cummax(split(x, LINE, -1, "x"), axis=1, reverse=True)

    x = rand(np.random.RandomState(1), 4, 1024)
    low = check(f, x, mesh=LINE)
    report = low.report()
    assert set(report.counts()) == {"all-gather"}, report
    assert all(c.bytes == 4 * 8 * 4 for c in report.collectives), report   # rows x shards x float32
    assert low.sharding_of(0) == gspmd.Sharding.from_mesh(LINE, [-1, "x"], x.shape)


def test_nan_padding_and_integers():
    def f(x, i):
        x, i = split(x, LINE, "x"), split(i, LINE, "x")
        return lax.cummax(x, 0), lax.cummin(x, 0, reverse=True), jnp.cumsum(i), lax.cumprod(i, 0, reverse=True)

    x = np.array([1, np.nan, 3, -2, 5, 0, -1, 2, 7, np.inf, -np.inf], np.float32)   # 11 over 8 devices
    i = np.random.RandomState(2).randint(-2, 3, 11).astype(np.int32)
    check(f, x, i, mesh=LINE)


def test_grads_of_cumulative_ops():
    def loss(x):
        x = split(x, MESH, "x", "y")
        return (jnp.sum(jnp.cumsum(x, 1) ** 2) + jnp.sum(lax.cumsum(x, 0, reverse=True) * x)
                + jnp.sum(jnp.cumprod(1 + x / 4, 1)) + jnp.sum(lax.cumlogsumexp(x, 0)))
    # (cummax and cummin differentiate as cumprod does: through JAX's associative_scan)

    x = rand(np.random.RandomState(3), 6, 8)
    check(jax.grad(loss), x, mesh=MESH)


def test_grad_of_cumsum_is_a_reverse_scan_without_gathering():
    def loss(x):
        return jnp.sum(jnp.cumsum(split(x, LINE, -1, "x"), axis=1) ** 2)

    x = rand(np.random.RandomState(4), 4, 64)
    low = check(jax.grad(loss), x, mesh=LINE)
    assert max(c.bytes for c in low.report().collectives) <= 4 * 8 * 4, low.report()


def argmax_pairs(x, idx, axis):
    """(max, lowest index holding it) as one variadic reduce."""
    def combine(a, b):
        take_a = (a[0] > b[0]) | ((a[0] == b[0]) & (a[1] < b[1]))
        return jnp.where(take_a, a[0], b[0]), jnp.where(take_a, a[1], b[1])
    return lax.reduce((x, idx), (np.float32(-np.inf), np.int32(2 ** 30)), combine, (axis,))


def test_variadic_reduce_along_split_dims():
    def f(x):
        x = split(x, MESH, "x", "y")
        idx = lax.broadcasted_iota(jnp.int32, x.shape, 1)
        return argmax_pairs(x, idx, 1), argmax_pairs(x, idx, 0), lax.reduce(x, np.float32(0), lambda a, b: a + 2 * b - b,
                                                                           (0, 1))

    x = np.random.RandomState(5).randint(-3, 3, (6, 7)).astype(np.float32)   # ties; uneven over both axes
    low = check(f, x, mesh=MESH)
    assert all(c.kind in ("all-gather", "all-reduce") and c.bytes <= 3 * 4 * 4 for c in low.report().collectives)


def test_reduce_and_or_xor_along_split_dims():
    def f(x):
        x = split(x, MESH, "y", "x")
        i = (x * 3).astype(jnp.int32)
        return (lax.reduce_xor_p.bind(i, axes=(0,)), lax.reduce_and_p.bind(i, axes=(1,)),
                lax.reduce_or_p.bind(i, axes=(0, 1)), jnp.all(x > -1, axis=0), jnp.any(x > 1, axis=1),
                lax.reduce_xor_p.bind(x > 0, axes=(0,)))

    check(f, rand(np.random.RandomState(6), 7, 6), mesh=MESH)


@st.composite
def scan_cases(draw):
    mesh = draw(meshes(shapes=SMALL_MESHES))
    rank = draw(st.integers(1, 3))
    shape = tuple(draw(st.sampled_from([1, 2, 3, 5, 6, 8, 11])) for _ in range(rank))
    out = draw(dims_mappings(mesh, rank)) if draw(st.booleans()) else None
    return (mesh, shape, draw(dims_mappings(mesh, rank)), draw(st.sampled_from(sorted(CUMULATIVE))),
            draw(st.integers(0, rank - 1)), draw(st.booleans()), out, draw(st.integers(0, 99)))


def _check_scan(case):
    mesh, shape, mapping, name, axis, reverse, out, seed = case

    def f(x):
        y = CUMULATIVE[name](gspmd.mesh_split(x, mesh, mapping), axis, reverse)
        return y if out is None else gspmd.mesh_split(y, mesh, out)

    x = np.random.RandomState(seed).uniform(0.5, 1.5, shape).astype(np.float32)   # products stay tame
    check(f, x, mesh=mesh)


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(scan_cases())
def test_random_scans(case):
    _check_scan(case)


@pytest.mark.slow
@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(scan_cases())
def test_random_scans_slow(case):
    _check_scan(case)


@st.composite
def reduce_cases(draw):
    mesh = draw(meshes(shapes=SMALL_MESHES))
    rank = draw(st.integers(1, 3))
    shape = tuple(draw(st.sampled_from([1, 2, 3, 5, 6, 8])) for _ in range(rank))
    dims = tuple(sorted(draw(st.sets(st.integers(0, rank - 1), min_size=1))))
    return mesh, shape, draw(dims_mappings(mesh, rank)), dims, draw(st.sampled_from(["pairs", "xor", "and", "or"]))


def _check_reduce(case):
    mesh, shape, mapping, dims, name = case

    def f(x):
        x = gspmd.mesh_split(x, mesh, mapping)
        if name == "pairs":
            idx = lax.broadcasted_iota(jnp.int32, x.shape, dims[-1])
            return argmax_pairs(x, idx, dims[-1])
        bits = x.astype(jnp.int32)
        return getattr(lax, f"reduce_{name}_p").bind(bits, axes=dims), getattr(lax, f"reduce_{name}_p").bind(
            bits > 0, axes=dims)

    check(f, np.random.RandomState(7).randint(-3, 4, shape).astype(np.float32), mesh=mesh)


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(reduce_cases())
def test_random_reductions(case):
    _check_reduce(case)


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(reduce_cases())
def test_random_reductions_slow(case):
    _check_reduce(case)
