"""Equinox's internal primitives (unvmap_any/all/max, select_if_vmap, maybe_set,
nonbatchable, ...), which eqx.error_if, eqx.internal.while_loop and so every
diffrax.diffeqsolve bind: partitioned and run as jax.jit runs them, on both backends."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_libraries import heat_initial, heat_solve
from util import BACKENDS, assert_close, check, rand

import gspmd
from gspmd.frontend.annotation import unpartitioned

eqx = pytest.importorskip("equinox")

MESH = gspmd.Mesh(np.arange(8).reshape(2, 4), ("x", "y"))
LINE = gspmd.Mesh(np.arange(8), ("x",))


def _checked(x, limit):
    x = gspmd.mesh_split(x, MESH, ["x", "y"])
    return eqx.error_if(x, x.sum() > limit, "sum over the limit") * 2


def test_error_if_passes_values_through_and_raises_as_under_jit():
    """error_if's host callback raises on every device (a pure callback runs on each), so
    no device waits for another's results; its predicate sums the split value."""
    x = rand(np.random.RandomState(0), 4, 7)
    report = check(_checked, x, np.float32(100.0), mesh=MESH).report()
    assert report.counts() == {"all-reduce": 1}, str(report)
    for backend in BACKENDS:
        with pytest.raises(Exception, match="sum over the limit"):
            np.asarray(gspmd.jit(_checked, mesh=MESH, backend=backend)(x, np.float32(-100.0)))


def test_unvmap_reductions_reduce_every_element():
    """unvmap_any/all/max outside vmap are jnp.any/all/max of the whole value; under vmap
    (applied before gspmd traces) of the whole batch, as under jax.jit."""
    rng = np.random.RandomState(1)
    x, k = rand(rng, 3, 6, 7), rng.randint(-9, 9, (6, 7)).astype(np.int32)

    def reductions(x, k):
        x, k = gspmd.mesh_split(x, MESH, [None, "x", "y"]), gspmd.mesh_split(k, MESH, ["y", None])
        per_row = jax.vmap(lambda r: eqx.internal.unvmap_any(r > 2.0))(x)
        return (eqx.internal.unvmap_any(x > 2.0), eqx.internal.unvmap_all(x > -4.0),
                eqx.internal.unvmap_max(k), per_row)
    check(reductions, x, k, mesh=MESH)


def test_error_if_in_a_vmapped_program():
    """jax.vmap around gspmd.jit: error_if's batched predicate is any of the batch."""
    x = rand(np.random.RandomState(4), 3, 6, 7)

    def fn(x):
        x = gspmd.mesh_split(x, MESH, ["x", "y"])
        return eqx.error_if(x, x.sum() > 1e9, "sum over the limit") * 2
    with unpartitioned():
        expected = jax.vmap(jax.jit(fn))(x)
    for backend in BACKENDS:
        assert_close(jax.vmap(gspmd.jit(fn, mesh=MESH, backend=backend))(x), expected)


@pytest.mark.parametrize("kind", ["checkpointed", "bounded"])
def test_equinox_while_loop_and_its_gradient(kind):
    """eqx.internal.while_loop (its saved steps are maybe_set scatters into buffers, its
    steps select_if_vmap): forward and reverse-mode gradient on a split carry."""
    x = rand(np.random.RandomState(2), 6, 7)

    def loop(x):
        x = gspmd.mesh_split(x, MESH, ["x", "y"])
        return eqx.internal.while_loop(lambda c: c[0] < 5, lambda c: (c[0] + 1, jnp.sin(c[1]) * 1.1), (0, x),
                                       max_steps=8, kind=kind)[1]

    def grad(x):
        return jax.grad(lambda x: (loop(x) ** 2).sum())(x)
    for fn in (loop, grad):
        report = check(fn, x, mesh=MESH).report()
        assert not report.collectives, str(report)


def test_noinline_and_guarded_identities():
    """eqx.internal.noinline (its function, looked up by index, partitioned in place),
    forward and under grad; nontraceable and nondifferentiable are identities."""
    x = rand(np.random.RandomState(3), 6, 7)
    scaled_sine = eqx.internal.noinline(lambda a, b: jnp.sin(a) * b)

    def fn(x):
        x = gspmd.mesh_split(x, MESH, ["x", "y"])
        return scaled_sine(x, 2.0) + eqx.internal.nondifferentiable(x) + eqx.internal.nontraceable(x)

    def grad(x):
        return jax.grad(lambda x: (scaled_sine(gspmd.mesh_split(x, MESH, ["x", "y"]), 2.0) ** 2).sum())(x)
    for f in (fn, grad):
        report = check(f, x, mesh=MESH).report()
        assert not report.collectives, str(report)


# A 1-D heat equation u_t = kappa u_xx (test_libraries.heat_solve) on a grid of 30
# points split 8 ways (uneven), solved by diffrax.
GRID = 30


def _heat(kappa, u0, adaptive: bool):
    pytest.importorskip("diffrax")
    return heat_solve(kappa, gspmd.mesh_split(u0, LINE, ["x"]), adaptive)


def _initial():
    return jnp.asarray(heat_initial(GRID))


def test_diffrax_heat_equation_fixed_steps():
    """The grid stays split through the solver's loop: only halos move."""
    report = check(lambda kappa, u0: _heat(kappa, u0, False), np.float32(0.5), _initial(), mesh=LINE,
                   rtol=1e-3).report()
    assert set(report.counts()) == {"collective-permute"}, str(report)


@pytest.mark.slow
@pytest.mark.parametrize("adaptive", [False, True])
def test_diffrax_heat_equation_gradients(adaptive):
    """jax.grad through diffeqsolve (its checkpointed loop's backward pass) with respect to
    the diffusivity and the initial condition; the adaptive controller's error norms are
    all-reduces, never gathers."""
    def grads(kappa, u0):
        return jax.grad(lambda kappa, u0: (_heat(kappa, u0, adaptive) ** 2).sum(), (0, 1))(kappa, u0)
    for fn in (lambda kappa, u0: _heat(kappa, u0, adaptive), grads):
        report = check(fn, np.float32(0.5), _initial(), mesh=LINE, rtol=1e-3).report()
        assert "all-gather" not in report.counts(), str(report)
