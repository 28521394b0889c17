"""Loop-invariant collective motion: sums of all-reduced values that only the code after
a loop reads are carried unreduced and all-reduced once after the loop."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gspmd
from strategies import meshes
from util import check, rand

MESH = gspmd.Mesh(np.arange(8).reshape(2, 4), ("x", "y"))


def _grad_of(w, x):
    """A data-parallel weight gradient: the batch dim is split over "x"."""
    x = gspmd.mesh_split(x, MESH, ["x", -1])
    return jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w)


def _all_reduces(low):
    return [c for c in low.report().collectives if c.kind == "all-reduce"]


def test_accumulated_gradient_is_reduced_once_after_the_loop():
    def f(w, xs, acc):
        def step(acc, x):
            return acc + _grad_of(w, x), None
        return jax.lax.scan(step, acc, xs)[0]

    rng = np.random.RandomState(0)
    w, xs = rand(rng, 8, 6), rand(rng, 5, 6, 8)
    for acc in (np.zeros((8, 6), np.float32), rand(rng, 8, 6)):      # a zero start, and one to carry over
        low = check(f, w, xs, acc, mesh=MESH)
        (reduction,) = _all_reduces(low)
        assert reduction.executions == 1 and "deferred past the loop" in reduction.origin


def test_linear_accumulation_through_other_ops_is_deferred_too():
    """acc = 0.9 * acc + transpose(g): still linear in the partial sums."""
    def f(w, xs):
        def step(acc, x):
            return 0.9 * acc + _grad_of(w, x).T, None
        return jax.lax.scan(step, jnp.ones((6, 8)), xs)[0]

    rng = np.random.RandomState(1)
    low = check(f, rand(rng, 8, 6), rand(rng, 3, 6, 8), mesh=MESH)
    assert [c.executions for c in _all_reduces(low)] == [1]


def test_an_accumulator_read_inside_the_loop_keeps_its_reduction():
    def f(w, xs):
        def step(carry, x):
            acc, total = carry
            acc = acc + _grad_of(w, x)
            return (acc, total + jnp.sum(acc)), None      # the running sum is read every step
        return jax.lax.scan(step, (jnp.zeros((8, 6)), 0.0), xs)[0]

    rng = np.random.RandomState(2)
    low = check(f, rand(rng, 8, 6), rand(rng, 4, 6, 8), mesh=MESH)
    assert any(c.executions == 4 for c in _all_reduces(low))


def test_loops_accumulating_one_gradient_in_turn_reduce_it_once():
    """A pipeline's phases: a second loop carries on the first one's sum. Its deferred
    partial sums enter the second loop as they are (no all-reduce between the loops, no
    zeros kept for it), and only the last loop's result is reduced."""
    def f(w, xs, ys):
        def step(acc, x):
            return acc + _grad_of(w, x), None
        acc = jax.lax.scan(step, jnp.zeros((8, 6)), xs)[0]
        return jax.lax.scan(step, acc, ys)[0]

    rng = np.random.RandomState(3)
    low = check(f, rand(rng, 8, 6), rand(rng, 3, 6, 8), rand(rng, 2, 6, 8), mesh=MESH)
    (reduction,) = _all_reduces(low)
    assert reduction.executions == 1 and "deferred past the loop" in reduction.origin


@pytest.mark.parametrize("rows", [6, 7])
def test_a_loop_in_a_loop_adding_into_the_outer_accumulator_reduces_it_once(rows):
    """A 1F1B pipeline's backward slots: each outer step's inner scan adds one gradient
    per layer into the outer loop's accumulator, in place. The inner loop's partial sums
    start from the outer accumulator's own (not from a copy whole on one device of each
    group and zero on the others), so the sum waits until after the outer loop; also
    with a batch (7) that "x" does not divide."""
    def f(w, xs, acc):
        def layer(acc, k_x):
            k, x = k_x
            return acc.at[k].add(_grad_of(w, x)), None

        def step(acc, x_layers):
            return jax.lax.scan(layer, acc, (jnp.arange(3), x_layers))[0], None
        return jax.lax.scan(step, acc, xs)[0]

    rng = np.random.RandomState(4)
    w, xs = rand(rng, 8, 6), rand(rng, 4, 3, rows, 8)
    for acc in (np.zeros((3, 8, 6), np.float32), rand(rng, 3, 8, 6)):
        low = check(f, w, xs, acc, mesh=MESH)
        (reduction,) = _all_reduces(low)
        assert reduction.executions == 1 and "deferred past the loop" in reduction.origin


def test_an_inner_loop_whose_outer_accumulator_is_read_keeps_a_correct_sum():
    """The outer carry read every step, not linearly (not deferrable): the inner loop still
    starts from it as partial sums whole on one device of each group; values stay right."""
    def f(w, xs):
        def layer(acc, x):
            return acc + _grad_of(w, x), None

        def step(carry, x_layers):
            acc, total = carry
            acc = jax.lax.scan(layer, acc, x_layers)[0]
            return (acc, total + jnp.max(acc)), None
        return jax.lax.scan(step, (jnp.zeros((8, 6)), 0.0), xs)[0]

    rng = np.random.RandomState(5)
    low = check(f, rand(rng, 8, 6), rand(rng, 3, 2, 6, 8), mesh=MESH)
    assert any(c.executions == 3 for c in _all_reduces(low))


def test_a_gradient_taken_on_some_steps_only_is_reduced_once_after_the_loop():
    """A pipeline's loss gradient, taken under a condition the same on every device (the
    steps that finish a microbatch), zeros otherwise: each branch returns its partial sums
    (through the cast), the conditional's result is summed after it, and the loop around
    it defers that sum too."""
    def f(w, xs, acc):
        def step(acc, t_x):
            t, x = t_x
            g = jax.lax.cond(t % 3 == 0, lambda x: _grad_of(w, x).astype(jnp.bfloat16),
                             lambda x: jnp.zeros((8, 6), jnp.bfloat16), x)
            return acc + g.astype(jnp.float32), None
        return jax.lax.scan(step, acc, (jnp.arange(5), xs))[0]

    rng = np.random.RandomState(6)
    low = check(f, rand(rng, 8, 6), rand(rng, 5, 6, 8), rand(rng, 8, 6), mesh=MESH, rtol=1e-2, atol=1e-2)
    (reduction,) = _all_reduces(low)
    assert reduction.executions == 1 and "deferred past the loop" in reduction.origin


@pytest.mark.parametrize("rows", [6, 7])    # 7 rows over "x"'s 2: uneven
def test_a_conditional_adding_to_its_accumulator_argument_in_a_loop_reduces_once(rows):
    """A pipeline's loss gradient added in the branch that takes it, the other branch
    returning the accumulator as it is (no table-sized add of zeros every step): the
    accumulator enters the conditional as partial sums and the loop reduces once."""
    def f(w, xs, acc):
        def step(acc, t_x):
            t, x = t_x
            return jax.lax.cond(t % 3 == 0, lambda acc, x: acc + _grad_of(w, x), lambda acc, x: acc, acc, x), None
        return jax.lax.scan(step, acc, (jnp.arange(5), xs))[0]

    rng = np.random.RandomState(8)
    w, xs = rand(rng, 8, 6), rand(rng, 5, rows, 8)
    for acc in (np.zeros((8, 6), np.float32), rand(rng, 8, 6)):
        (reduction,) = _all_reduces(check(f, w, xs, acc, mesh=MESH))
        assert reduction.executions == 1 and "deferred past the loop" in reduction.origin


def test_a_loop_in_a_conditional_in_a_loop_adding_to_one_accumulator_reduces_once():
    """The branch adds through a loop of its own: that inner loop starts from the
    accumulator's partial sums as the outer loop carries them, not from them masked to
    one device a group (which dropped the others' sums). 7 rows over "x"'s 2."""
    def f(w, xss, acc):
        def adds(acc, xs):
            return jax.lax.scan(lambda a, x: (a + _grad_of(w, x), None), acc, xs)[0]

        def step(acc, t_xs):
            t, xs = t_xs
            return jax.lax.cond(t % 2 == 0, adds, lambda acc, xs: acc, acc, xs), None
        return jax.lax.scan(step, acc, (jnp.arange(4), xss))[0]

    rng = np.random.RandomState(3)
    (reduction,) = _all_reduces(check(f, rand(rng, 8, 6), rand(rng, 4, 3, 7, 8), rand(rng, 8, 6), mesh=MESH))
    assert reduction.executions == 1 and "deferred past the loop" in reduction.origin


def test_a_conditional_adding_to_its_accumulator_argument_sums_once_after_it():
    """Alone, the conditional sums after itself; a branch that reads the accumulator
    other than linearly, or for another result too, keeps its own reduction."""
    def adds(w, x, acc, p):
        return jax.lax.cond(p, lambda acc: 0.5 * _grad_of(w, x) + acc, lambda acc: acc, acc)

    def reads(w, x, acc, p):
        return jax.lax.cond(p, lambda acc: _grad_of(w, x) + jnp.tanh(acc), lambda acc: acc, acc)

    def twice(w, x, acc, p):
        return jax.lax.cond(p, lambda acc: (acc + _grad_of(w, x), 2.0 * acc), lambda acc: (acc, 2.0 * acc), acc)

    def passed_and_read(w, x, acc, p):     # the branch that adds nothing reads it too
        return jax.lax.cond(p, lambda acc: (acc + _grad_of(w, x), jnp.zeros_like(acc)),
                            lambda acc: (acc, jnp.tanh(acc)), acc)

    rng = np.random.RandomState(9)
    w, x, acc = rand(rng, 8, 6), rand(rng, 7, 8), rand(rng, 8, 6)
    for p in (True, False):
        (reduction,) = _all_reduces(check(adds, w, x, acc, p, mesh=MESH))
        assert "deferred past the conditional" in reduction.origin
        for kept in (reads, twice, passed_and_read):
            assert all("deferred" not in c.origin for c in _all_reduces(check(kept, w, x, acc, p, mesh=MESH)))


def test_an_accumulator_that_does_not_qualify_still_scales_a_deferred_sum():
    """acc is read for a second result, so the first cannot add to it as partial sums;
    it still holds the same values on every device, so the second (a gradient it
    scales) is summed once after the conditional."""
    def f(w, x, acc, p):
        def adds(acc):
            g = _grad_of(w, x)
            return acc + g, g * acc
        # (adds is the false branch: the one looked at first)
        return jax.lax.cond(p, lambda acc: (acc, _grad_of(w, x + 1.0) * acc), adds, acc)

    rng = np.random.RandomState(11)
    w, x, acc = rand(rng, 8, 6), rand(rng, 7, 8), rand(rng, 8, 6)
    for p in (True, False):
        origins = [c.origin for c in _all_reduces(check(f, w, x, acc, p, mesh=MESH))]
        assert sum("deferred past the conditional" in o for o in origins) == 1, origins


@st.composite
def accumulating_loops(draw):
    """A loop adding a data-parallel gradient to its carry in some steps only, through a
    conditional: mesh, the axis the batch is split over, rows (the mesh may not divide
    them), the period of the steps that add, a scale on the way, a start of zeros or not,
    and whether the branch adds through a loop of its own (over 2 sub-batches)."""
    mesh = draw(meshes(shapes=[(2,), (4,), (2, 2), (2, 4), (4, 2)]))
    return (mesh, draw(st.sampled_from(mesh.axis_names)), draw(st.sampled_from([2, 3, 5, 6, 8])),
            draw(st.integers(1, 3)), draw(st.sampled_from([1.0, 0.5])), draw(st.booleans()), draw(st.booleans()),
            draw(st.integers(0, 2 ** 16)))


def _check_accumulating_loop(case):
    """Equal to one device, and every all-reduce runs once (after the loop)."""
    mesh, axis, rows, period, scale, start, inner, seed = case

    def grad_of(w, x):
        x = gspmd.mesh_split(x, mesh, [axis, -1])
        return jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w)

    def f(w, xs, acc):
        def adds(acc, x):
            if inner:
                return jax.lax.scan(lambda a, xi: (a + scale * grad_of(w, xi), None), acc, x)[0]
            return acc + scale * grad_of(w, x)

        def step(acc, t_x):
            t, x = t_x
            return jax.lax.cond(t % period == 0, adds, lambda acc, x: acc, acc, x), None
        return jax.lax.scan(step, acc, (jnp.arange(4), xs))[0]

    rng = np.random.RandomState(seed)
    acc = rand(rng, 8, 6) if start else np.zeros((8, 6), np.float32)
    low = check(f, rand(rng, 8, 6), rand(rng, 4, *((2,) if inner else ()), rows, 8), acc, mesh=mesh)
    assert all(c.executions == 1 for c in _all_reduces(low)), [(c.origin, c.executions) for c in _all_reduces(low)]


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(accumulating_loops())
def test_random_conditional_accumulations(case):
    _check_accumulating_loop(case)


@pytest.mark.slow
@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(accumulating_loops())
def test_random_conditional_accumulations_slow(case):
    _check_accumulating_loop(case)


def test_a_conditional_sums_its_branches_partial_results_once_after_it():
    """Branches that both reduce over the same groups leave the sum to after the
    conditional; one that returns a value of its own keeps its branch's reductions."""
    def both(w, x, p):
        return jax.lax.cond(p, lambda: _grad_of(w, x), lambda: 2.0 * _grad_of(w, x + 1.0))

    def mixed(w, x, p):
        return jax.lax.cond(p, lambda: _grad_of(w, x), lambda: w)

    rng = np.random.RandomState(7)
    w, x = rand(rng, 8, 6), rand(rng, 7, 8)     # a batch of 7 over "x"'s 2: uneven
    for p in (True, False):
        (reduction,) = _all_reduces(check(both, w, x, p, mesh=MESH))
        assert "deferred past the conditional" in reduction.origin
        low = check(mixed, w, x, p, mesh=MESH)
        assert all("deferred" not in c.origin for c in _all_reduces(low))
