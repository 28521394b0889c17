"""Random programs (200 in CI, 3000 with -m slow): chains of ops with annotations
sprinkled at random, partitioned on random meshes and compared with one device (sim
backend). They exercise propagation and partitioning together, where the per-op suites
test each op alone."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gspmd
from gspmd.runtime import sim
from strategies import dims_mappings, meshes


def _ops(draw, rank):
    """One random op on a rank-2 or rank-3 value, returning a same-rank value."""
    kind = draw(st.sampled_from(["tanh", "transpose", "reduce", "dot", "slice", "pad", "concat", "roll",
                                 "cumsum", "softmax", "reshape", "take", "scan", "mask", "argmax"]))
    axis = draw(st.integers(0, rank - 1))
    if kind == "tanh":
        return kind, jnp.tanh
    if kind == "transpose":
        perm = tuple(draw(st.permutations(range(rank))))
        return kind, lambda x: jnp.transpose(x, perm)
    if kind == "reduce":
        return kind, lambda x: x - jnp.max(x, axis=axis, keepdims=True) + jnp.mean(x, axis=axis, keepdims=True)
    if kind == "dot":
        n = draw(st.sampled_from([1, 3, 4, 6]))
        return kind, lambda x: x @ (jnp.arange(x.shape[-1] * n, dtype=x.dtype).reshape(x.shape[-1], n) / 10.0)
    if kind == "slice":
        return kind, lambda x: jax.lax.slice_in_dim(x, min(1, x.shape[axis] - 1), x.shape[axis], axis=axis)
    if kind == "pad":
        lo, hi = draw(st.integers(0, 2)), draw(st.integers(-1, 2))
        return kind, lambda x: jax.lax.pad(x, 0.5, [(lo, hi if x.shape[d] + lo + hi > 0 else 0, 0) if d == axis
                                                    else (0, 0, 0) for d in range(x.ndim)])
    if kind == "concat":
        return kind, lambda x: jnp.concatenate([x, 2 * x], axis=axis)
    if kind == "roll":
        shift = draw(st.integers(-3, 3))
        return kind, lambda x: jnp.roll(x, shift, axis=axis)
    if kind == "cumsum":
        return kind, lambda x: jnp.cumsum(x, axis=axis)
    if kind == "take":
        picks = draw(st.lists(st.integers(0, 7), min_size=1, max_size=4))
        return kind, lambda x: jnp.take(x, jnp.asarray(picks) % x.shape[axis], axis=axis)
    if kind == "scan":   # a running state along dim 0, as a loop
        return kind, lambda x: jax.lax.scan(lambda c, row: (jnp.tanh(c + row), c * row), jnp.zeros_like(x[0]), x)[1]
    if kind == "mask":   # partition-dependent offsets: a triangular mask from iotas
        return kind, lambda x: jnp.where(jax.lax.broadcasted_iota(jnp.int32, x.shape, axis)
                                         >= jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1 - axis), x, -x)
    if kind == "argmax":
        return kind, lambda x: x + jnp.argmax(x, axis=axis, keepdims=True).astype(x.dtype)
    if kind == "softmax":
        return kind, lambda x: jax.nn.softmax(x, axis=axis)
    # reshape: the first two dims' sizes swapped (elements re-flow across rows)
    return kind, lambda x: x.reshape((x.shape[1], x.shape[0]) + x.shape[2:])


@st.composite
def programs(draw):
    mesh = draw(meshes(shapes=[(2,), (4,), (8,), (2, 2), (2, 4), (4, 2), (2, 2, 2)]))
    rank = draw(st.integers(2, 3))
    shape = tuple(draw(st.sampled_from([1, 2, 3, 5, 6, 8])) for _ in range(rank))
    steps = []
    for _ in range(draw(st.integers(1, 5))):
        name, op = _ops(draw, rank)
        note = draw(dims_mappings(mesh, rank)) if draw(st.booleans()) else None
        steps.append((name, op, note))
    return mesh, shape, draw(dims_mappings(mesh, rank)), steps


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(programs())
def test_random_programs(case):
    mesh, shape, first, steps = case

    def f(x):
        x = gspmd.mesh_split(x, mesh, first)
        for _, op, note in steps:
            x = op(x)
            if note is not None and x.ndim == len(note):
                x = gspmd.mesh_split(x, mesh, note)
        return x

    x = np.random.RandomState(0).standard_normal(shape).astype(np.float32)
    partitioned = gspmd.jit(f, mesh=mesh)
    # The reference is the unpartitioned program on gspmd's own one-device interpreter:
    # argmax after tanh hits exact ties, and numpy's and XLA's tanh differ in the last ulp.
    # (Every op's semantics are checked against jax.jit by the per-op suites.)
    expected = sim.evaluate(partitioned.lower(x).program, [x])[0]
    np.testing.assert_allclose(partitioned(x), expected, rtol=1e-4, atol=1e-4, err_msg=str([s[0] for s in steps]))


@pytest.mark.slow
@settings(max_examples=3000, deadline=None, suppress_health_check=list(HealthCheck))
@given(programs())
def test_random_programs_slow(case):
    test_random_programs.hypothesis.inner_test(case)


def test_roll_along_a_unit_dim_concatenates_an_empty_slice():
    """Found by the random suite: jnp.roll on a size-1 dim slices an empty piece."""
    mesh = gspmd.Mesh(np.array([7, 5, 4, 2, 3, 0, 6, 1]).reshape(2, 4), ("a", "b"))

    def f(x):
        return gspmd.mesh_split(jnp.roll(gspmd.mesh_split(x, mesh, ["b", "a"]), 1, axis=1), mesh, ["a", "b"])

    x = np.arange(5, dtype=np.float32).reshape(5, 1)
    np.testing.assert_array_equal(gspmd.jit(f, mesh=mesh)(x), x)
