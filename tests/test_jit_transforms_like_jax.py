"""JAX's transformations around gspmd.jit differentiate only what they are asked to, as
around jax.jit, side by side with jax.jit: grad(argnums=...) and jvp perturb the chosen
arguments only (symbolic zeros for the others), so an op on the others need not be
differentiable (a fori_loop with a dynamic trip count, a reduce_window from an argument's
init value), and the backward program computes the requested cotangents alone; explicit
sharding mode too (vmap of random draws in a switch, gradients of explicitly sharded inputs)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import gspmd
from util import BACKENDS, assert_close

MESH = gspmd.Mesh(np.arange(8).reshape(4, 2), ("x", "y"))
RNG = np.random.default_rng(0)
X = RNG.standard_normal((6, 4)).astype(np.float32)     # 6 rows: x (4) does not divide them
W = RNG.standard_normal((4, 3)).astype(np.float32)
B = RNG.standard_normal((3,)).astype(np.float32)


def layer(x, w, b):
    x = gspmd.mesh_split(x, MESH, ["x", None])
    return jnp.sum(jnp.tanh(x @ w + b) ** 2)


def side_by_side(transform, fn, *args, backend="sim"):
    """transform(jit(fn))(*args) with gspmd.jit and with jax.jit: equal values."""
    expected = transform(jax.jit(fn))(*args)
    ours = transform(gspmd.jit(fn, mesh=MESH, backend=backend))(*args)
    assert_close(ours, expected, rtol=1e-3, atol=1e-4)
    return ours


@pytest.mark.parametrize("argnums", [0, 2, (2, 1)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_grad_of_argnums_subsets(argnums, backend):
    side_by_side(lambda f: jax.grad(f, argnums=argnums), layer, X, W, B, backend=backend)


def _vmapped_over_two(f):
    return lambda x, *a: jax.vmap(f, in_axes=(0, None, None))(np.stack([x, -x]), *a)


@pytest.mark.parametrize("transform", [jax.grad, _vmapped_over_two,
                                       lambda f: lambda *a: jax.jvp(f, a, tuple(np.ones_like(x) for x in a))])
def test_the_sim_backend_simulates_more_devices_than_jax_has(transform):
    """16 simulated devices on jax's 8: under a transformation the program runs as a host
    callback whose results stay where jax puts them (no mesh of jax devices to lay them on)."""
    mesh = gspmd.Mesh(np.arange(16).reshape(4, 4), ("x", "y"))

    def wide(x, w, b):
        return jnp.sum(jnp.tanh(gspmd.mesh_split(x, mesh, ["x", "y"]) @ w + b) ** 2)
    expected = transform(jax.jit(wide))(X, W, B)
    assert_close(transform(gspmd.jit(wide, backend="sim"))(X, W, B), expected, rtol=1e-3, atol=1e-4)


def test_the_backward_program_computes_the_requested_cotangents_only():
    f = gspmd.jit(layer, mesh=MESH)
    jax.grad(f, argnums=2)(X, W, B)
    transforms = f.lower(X, W, B).transforms
    assert list(transforms._pullbacks) == [((2,), (0,))]       # one pullback: of b alone
    (backward,) = transforms.pullback((2,), (0,))._cache.values()
    assert [v.shape for v in backward.program.outputs] == [B.shape]
    jax.grad(f, argnums=(0, 1, 2))(X, W, B)
    (everything,) = transforms.pullback((0, 1, 2), (0,))._cache.values()
    assert [v.shape for v in everything.program.outputs] == [X.shape, W.shape, B.shape]
    # b's cotangent is a sum over the rows: x's and w's need two matmuls more
    assert backward.report().flops < everything.report().flops
    jax.grad(f, argnums=2)(X, W, B)
    assert len(transforms._pullbacks) == 2                     # one program per set of arguments


def looped(x, scale, n):
    y = lax.fori_loop(0, n, lambda i, c: c * 1.5 + 0.25, gspmd.mesh_split(x, MESH, ["x", None]))
    return jnp.sum(y * scale) + scale ** 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_grad_past_a_fori_loop_with_a_trip_count_from_an_argument(backend):
    """Reverse mode cannot go through the loop; jax.jit needs it only for x's cotangent."""
    side_by_side(lambda f: jax.grad(f, argnums=1), looped, X, np.float32(2.0), np.int32(3), backend=backend)

    def counted_by_a_float(x, scale, steps):
        return looped(x, scale, steps.astype(np.int32)) + steps
    side_by_side(lambda f: jax.grad(f, argnums=(1, 2)), counted_by_a_float, X, np.float32(2.0), np.float32(2.0),
                 backend=backend)


def pooled(x, init, scale):
    x = gspmd.mesh_split(x, MESH, ["x", None])
    return jnp.sum(lax.reduce_window(x, init, lax.max, (2, 2), (1, 1), "SAME")) * scale + scale ** 2


@pytest.mark.parametrize("init", [-np.inf, 0.25])
@pytest.mark.parametrize("backend", BACKENDS)
def test_grad_past_a_reduce_window_from_an_argument_init_value(init, backend):
    side_by_side(lambda f: jax.grad(f, argnums=2), pooled, X, np.float32(init), np.float32(3.0), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_reduce_window_from_a_traced_init_value(backend):
    def pools(x, init):
        x = gspmd.mesh_split(x, MESH, ["x", None])
        return (lax.reduce_window(x, init, lax.max, (3, 2), (1, 1), "SAME"),
                lax.reduce_window(x, init, lax.min, (2, 2), (2, 1), ((1, 1), (0, 1))),
                lax.reduce_window(x, init, lax.add, (2, 2), (1, 1), "VALID"),
                lax.reduce_window(x, init, lax.mul, (2, 1), (1, 1), "VALID"))
    side_by_side(lambda f: f, pools, X, np.float32(0.5), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_added_init_value_counted_at_padding_runs_as_under_jit(backend):
    """XLA adds the init value once a window, skipping padding: the variadic form's rule."""
    def padded_sum(x, init):
        return lax.reduce_window(x, init, lax.add, (2, 2), (1, 1), "SAME")
    side_by_side(lambda f: f, padded_sum, X, np.float32(1.0), backend=backend)


def two_results(x, w):
    return jnp.tanh(gspmd.mesh_split(x, MESH, ["x", None])) * 2, w @ w.T


@pytest.mark.parametrize("backend", BACKENDS)
def test_jvp_of_one_argument_leaves_the_other_results_tangents_zero(backend):
    def jvp_of_x(f):
        return lambda x, w: jax.jvp(lambda v: f(v, w), (x,), (x,))
    (_, _), (tx, tw) = side_by_side(jvp_of_x, two_results, X, W, backend=backend)
    assert not np.any(tw)
    f = gspmd.jit(two_results, mesh=MESH, backend=backend)
    jvp_of_x(f)(X, W)
    assert list(f.lower(X, W).transforms._tangent_maps) == [((0,), (0,))]


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_vmap_of_grad_and_grad_of_vmap_of_one_argument(backend):
    xs = np.stack([X, -X, 2 * X])
    side_by_side(lambda f: jax.vmap(jax.grad(f, argnums=2), (0, None, None)), layer, xs, W, B, backend=backend)
    side_by_side(lambda f: jax.grad(lambda x, w, b: jax.vmap(f, (0, None, None))(x, w, b).sum(), argnums=1),
                 layer, xs, W, B, backend=backend)
    side_by_side(lambda f: jax.hessian(f, argnums=2), layer, X, W, B, backend=backend)


# -- explicit sharding mode (jax.sharding.AxisType.Explicit): layouts are part of the types -------
EXPLICIT = jax.make_mesh((4, 2), ("x", "y"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)


def explicit_side_by_side(fn, *args, backend):
    """fn through gspmd.jit and jax.jit under jax.set_mesh(EXPLICIT): equal values and
    equal result types (their layouts included), on both backends."""
    with jax.set_mesh(EXPLICIT):
        expected = fn(jax.jit, *args)
        ours = fn(lambda f: gspmd.jit(f, backend=backend), *args)
    assert_close(ours, expected, rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(expected)):
        assert jax.typeof(a) == jax.typeof(b), (jax.typeof(a), jax.typeof(b))


def _switch_drawing(key, x, i):
    return lax.switch(i, [lambda k, v: jax.random.normal(k, v.shape) + v,
                          lambda k, v: jax.random.uniform(k, v.shape) * v], key, x)


@pytest.mark.parametrize("backend", BACKENDS)
def test_vmap_of_a_switch_drawing_random_numbers_on_an_explicit_mesh(backend):
    with jax.set_mesh(EXPLICIT):
        keys = jax.device_put(jax.random.split(jax.random.key(0), 8), P("x"))
        xs = jax.device_put(np.ones((8, 4), np.float32), P("x"))
        idx = jax.device_put(np.arange(8, dtype=np.int32) % 2, P("x"))
        key = jax.random.key(1)
    explicit_side_by_side(lambda jit, k, x, i: jit(jax.vmap(_switch_drawing))(k, x, i), keys, xs, idx,
                          backend=backend)
    explicit_side_by_side(lambda jit, k, x, i: jax.vmap(jit(_switch_drawing))(k, x, i), keys, xs, idx,
                          backend=backend)
    explicit_side_by_side(lambda jit, k, x, i: jit(lambda k, x, i: jax.vmap(lambda y, j: _switch_drawing(k, y, j))(
        x, i))(k, x, i), key, xs, idx, backend=backend)


def _grad_of_product(jit, x, y):
    product = jit(lambda a, b: a * b)
    return (product(x, y), jax.vmap(product)(x, y),
            jax.grad(lambda a, b: jnp.sum(product(a, b)), argnums=(0, 1))(x, y),
            jax.vjp(product, x, y)[1](x),
            jax.jit(jax.grad(lambda a, b: jnp.sum(product(a, b)) ** 2, argnums=1))(x, y))


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradient_of_explicitly_sharded_inputs(backend):
    with jax.set_mesh(EXPLICIT):
        x = jax.device_put(np.arange(16, dtype=np.float32).reshape(8, 2), P("x", "y"))
        y = jax.sharding.reshard(np.linspace(-1, 1, 16, dtype=np.float32).reshape(8, 2), P("x", "y"))
    explicit_side_by_side(_grad_of_product, x, y, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_eager_grad_of_an_argument_committed_over_the_mesh(backend):
    """Fuzzer, seed 40184 shrunk (sim backend): under an eager jax.grad the sim's host
    callback ran on an array committed to 8 devices, and jax laid its result out on
    device 0 alone (a maximal GSPMDSharding) that the loss's next op refused. The
    callback's results are laid out over the mesh, as the jax backend's."""
    m = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("x", "y"))
    x = jax.device_put(np.arange(8, dtype=np.float32), jax.sharding.NamedSharding(m, P("y")))

    def loss(f, a):
        return jnp.sum(jnp.sin(f(a)).astype(jnp.float32))

    grad = jax.grad(loss, argnums=1)
    assert_close(grad(gspmd.jit(lambda a: a * a, mesh=m, backend=backend), x), grad(jax.jit(lambda a: a * a), x))


def test_eager_grad_takes_cotangents_committed_in_another_layout():
    """Found by the fuzzer: under an eager jax.grad, the cotangent of a result laid out
    P(None, 'y') came back committed replicated (through ravel), and the pullback, as the
    transpose of a jit with out_shardings, refused it. Inside a caller's trace the program
    is jitted without layouts, its results constrained inside instead."""
    def split(x):
        return gspmd.mesh_split(x, MESH, [None, "y"])

    weights = np.arange(X.size, dtype=np.float32)

    def loss(f, x):
        return jnp.sum(jnp.tanh(f(x).ravel()) * weights)

    grad = jax.grad(loss, argnums=1)
    assert_close(grad(gspmd.jit(split, mesh=MESH, backend="jax"), X), grad(jax.jit(split), X))
