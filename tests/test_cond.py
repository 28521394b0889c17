"""cond and switch over partitioned operands: every branch is partitioned to the same
layouts, the index may come from split data (its reduction makes it whole on every
device), and choosing a branch moves no data."""
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
SMALL_MESHES = [(2,), (4,), (8,), (3,), (2, 2), (2, 4), (4, 2), (3, 2), (2, 2, 2)]


def split(x, *dims):
    return gspmd.mesh_split(x, MESH, list(dims))


def branches_of(low) -> list:
    return [p for p in low.spmd.subprograms() if ".branch" in p.name]


def test_predicate_from_split_data_costs_only_its_reduction():
    def f(x, w):
        x = split(x, "x", "y")
        return lax.cond(x.sum() > 0, lambda a, b: jnp.tanh(a) * b[0], lambda a, b: a - b.sum(), x, w)

    rng = np.random.RandomState(0)
    x, w = rand(rng, 6, 8), rand(rng, 3)
    for sign in (1, -1):   # both branches taken
        low = check(f, sign * x, w, mesh=MESH)
    report = low.report()
    assert [(c.kind, c.bytes) for c in report.collectives] == [("all-reduce", 4)], report
    assert low.sharding_of(0) == gspmd.Sharding.from_mesh(MESH, ["x", "y"], x.shape)
    assert [p.params[0].shape for p in branches_of(low)] == [(3, 2), (3, 2)]


def test_results_take_one_layout_in_every_branch():
    """One branch's annotation decides the result's layout; the other branch is
    partitioned to leave its result the same way."""
    def f(x):
        x = split(x, "x", -1)
        return lax.cond(x[0, 0] > 0, lambda a: split(a * 2, -1, "y"), lambda a: jnp.sin(a), x)

    rng = np.random.RandomState(1)
    x = rand(rng, 6, 7)
    for sign in (1, -1):
        low = check(f, sign * x, mesh=MESH)
    assert low.sharding_of(0).refines(gspmd.Sharding.from_mesh(MESH, [-1, "y"], x.shape))
    local = low.sharding_of(0).shard_shape(x.shape)
    assert [p.outputs[0].shape for p in branches_of(low)] == [local, local]


def test_grad_through_cond():
    def loss(w, x):
        x = split(x, "x", -1)
        w = split(w, -1, "y")
        h = x @ w
        h = lax.cond(jnp.mean(h) > 0, lambda a: jnp.tanh(a), lambda a: a * jax.nn.sigmoid(a), h)
        return jnp.sum(h ** 2)

    rng = np.random.RandomState(2)
    w, x = rand(rng, 5, 8), rand(rng, 6, 5)
    for sign in (1, -1):
        low = check(jax.grad(loss), sign * w, x, mesh=MESH)
    assert low.sharding_of(0) == gspmd.Sharding.from_mesh(MESH, [-1, "y"], w.shape)


def test_residuals_the_backward_pass_never_reads_are_dropped():
    """Under grad, JAX's cond hands the backward pass residuals it never reads (zeros a
    branch makes for relu's derivative); no user gives them a layout, so left in they
    would be whole on every device. The per-device program has none."""
    def loss(w1, w2, x):
        h = split(x, "x", -1) @ split(w1, -1, "y")
        h = lax.cond(jnp.mean(h) > 0, lambda a: jax.nn.relu(a) @ w2, lambda a: a @ w2, h)
        return jnp.sum(h ** 2)

    rng = np.random.RandomState(5)
    low = check(jax.grad(loss), rand(rng, 5, 8), rand(rng, 8, 3), rand(rng, 6, 5), mesh=MESH)
    whole = (6, 8)
    conditionals = [i for i in low.spmd.instrs if i.opcode == "conditional"]
    assert len(conditionals) == 2
    for instr in conditionals:   # every result and operand is a shard, or small
        assert all(v.shape != whole for v in instr.outputs + instr.operands), instr
        assert all(v.shape != whole for b in instr.attrs["branches"] for v in b.params + b.outputs)


def test_switch_on_an_index_from_split_data():
    def f(x):
        x = split(x, "y", "x")
        index = jnp.argmax(x.sum(axis=1)) % 3
        return lax.switch(index, [jnp.tanh, lambda a: a.T.T * 3, lambda a: jnp.cumsum(a, axis=0)], x)

    for seed in range(3):
        check(f, rand(np.random.RandomState(seed), 5, 6), mesh=MESH)


def test_nested_cond_inside_scan():
    def f(xs, c):
        xs = split(xs, -1, "x", "y")

        def step(c, x):
            c = lax.cond(c.sum() > x.sum(), lambda a, b: a * 0.5 + b, lambda a, b: a - b, c, x)
            return c, c.max()
        return lax.scan(step, c, xs)

    rng = np.random.RandomState(4)
    check(f, rand(rng, 4, 6, 8), rand(rng, 6, 8), mesh=MESH)


_BRANCHES = {
    "tanh": jnp.tanh,
    "affine": lambda a: a * 2 + 1,
    "center": lambda a: a - a.mean(axis=0, keepdims=True),
    "cumsum": lambda a: jnp.cumsum(a, axis=1),
    "matmul": lambda a: a @ jnp.arange(a.shape[1] ** 2, dtype=a.dtype).reshape(a.shape[1], -1) / 10,
    "roll": lambda a: jnp.roll(a, 1, axis=0),
}


@st.composite
def cond_cases(draw):
    mesh = draw(meshes(shapes=SMALL_MESHES))
    shape = tuple(draw(st.sampled_from([1, 2, 3, 5, 6, 8])) for _ in range(2))
    names = draw(st.lists(st.sampled_from(sorted(_BRANCHES)), min_size=2, max_size=2))
    out = draw(dims_mappings(mesh, 2)) if draw(st.booleans()) else None
    return mesh, shape, draw(dims_mappings(mesh, 2)), names, out, draw(st.integers(0, 2 ** 16))


def _check_cond(case):
    mesh, shape, mapping, names, out, seed = case

    def f(x):
        x = gspmd.mesh_split(x, mesh, mapping)
        y = lax.cond(x[0].sum() > 0, _BRANCHES[names[0]], _BRANCHES[names[1]], x)
        return y if out is None else gspmd.mesh_split(y, mesh, out)

    check(f, rand(np.random.RandomState(seed), *shape), mesh=mesh)


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(cond_cases())
def test_random_conds(case):
    _check_cond(case)


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(cond_cases())
def test_random_conds_slow(case):
    _check_cond(case)
