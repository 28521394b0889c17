"""gspmd.jit keeps jax.jit's documented behaviour, checked side by side with jax.jit on
the same calls: result values, the `.sharding` of every result (jax backend), which
donated inputs are deleted, and the transformations around and inside it (jvp, jacfwd,
jacrev, hessian, grad of grad, vmap's in_axes/out_axes, nested jits). Meshes of 1, 2,
4 and 8 devices; shapes that do not divide the mesh too (sim: values and shapes)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import gspmd
from gspmd.frontend.annotation import unpartitioned
from util import BACKENDS, assert_close

DEVICES = np.array(jax.devices()[:8])
MESHES = {
    "1": jax.sharding.Mesh(DEVICES[:1].reshape(1), ("x",)),
    "2": jax.sharding.Mesh(DEVICES[:2].reshape(2), ("x",)),
    "4": jax.sharding.Mesh(DEVICES[:4].reshape(4), ("x",)),
    "2x2": jax.sharding.Mesh(DEVICES[:4].reshape(2, 2), ("x", "y")),
    "8": jax.sharding.Mesh(DEVICES.reshape(8), ("x",)),
    "2x4": jax.sharding.Mesh(DEVICES.reshape(2, 4), ("x", "y")),
    "4x2": jax.sharding.Mesh(DEVICES.reshape(4, 2), ("x", "y")),
}
RNG = np.random.default_rng(0)


def _specs(mesh) -> list:
    """Layouts of a rank-2 value over `mesh`: each axis on each dim, both axes, none."""
    axes = mesh.axis_names
    specs = [P(), P(axes[0]), P(None, axes[0])]
    if len(axes) == 2:
        specs += [P(*axes), P(axes[1], axes[0]), P(axes)]
    return specs


CASES = [(name, spec) for name, mesh in MESHES.items() for spec in _specs(mesh)]


def _data(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _committed(mesh, spec, shape=(8, 8), seed=0):
    return jax.device_put(_data(shape, seed), NamedSharding(mesh, spec))


def _same_layouts(ours, theirs):
    for a, b in zip(jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(theirs)):
        assert a.sharding.is_equivalent_to(b.sharding, b.ndim), (a.sharding, b.sharding)


def side_by_side(fn, *args, backend="jax", layouts=True, jit_kwargs=None, **kwargs):
    """fn through gspmd.jit and jax.jit: equal values; on the jax backend, equal result
    layouts (when `layouts`)."""
    jit_kwargs = jit_kwargs or {}
    theirs = jax.jit(fn, **jit_kwargs)(*args, **kwargs)
    ours = gspmd.jit(fn, backend=backend, **jit_kwargs)(*args, **kwargs)
    assert_close(ours, theirs, rtol=2e-4, atol=2e-4)
    if backend == "jax" and layouts:
        _same_layouts(ours, theirs)
    return ours


# -- committed inputs: their layouts are annotations, results follow them --------------------
ELEMENTWISE = {
    "identity": lambda x: x,
    "affine": lambda x: 2 * x + 1,
    "sin": jnp.sin,
    "relu": jax.nn.relu,
    "square_plus_self": lambda x: x * x + x,
}


@pytest.mark.parametrize("fn", list(ELEMENTWISE))
@pytest.mark.parametrize("mesh,spec", CASES, ids=[f"{m}-{s}" for m, s in CASES])
def test_elementwise_results_keep_the_input_layout(mesh, spec, fn):
    side_by_side(ELEMENTWISE[fn], _committed(MESHES[mesh], spec))


REDUCTIONS = {
    "sum0": lambda x: jnp.sum(x, axis=0),
    "sum1": lambda x: jnp.sum(x, axis=1),
    "max0": lambda x: jnp.max(x, axis=0),
    "mean": jnp.mean,
}


@pytest.mark.parametrize("fn", list(REDUCTIONS))
@pytest.mark.parametrize("mesh,spec", CASES, ids=[f"{m}-{s}" for m, s in CASES])
def test_reductions_keep_the_unreduced_dims_layout(mesh, spec, fn):
    side_by_side(REDUCTIONS[fn], _committed(MESHES[mesh], spec))


@pytest.mark.parametrize("mesh,spec", CASES, ids=[f"{m}-{s}" for m, s in CASES])
def test_transpose_moves_the_layout_with_the_dims(mesh, spec):
    side_by_side(lambda x: x.T, _committed(MESHES[mesh], spec))


@pytest.mark.parametrize("mesh", ["2", "4", "2x2", "2x4", "4x2"])
def test_matmul_of_committed_operands(mesh):
    m = MESHES[mesh]
    axes = m.axis_names
    x = _committed(m, P(axes[0]), (8, 16))
    w = _committed(m, P(None, axes[-1]), (16, 8), seed=1)
    side_by_side(jnp.matmul, x, w)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mesh,spec", CASES, ids=[f"{m}-{s}" for m, s in CASES])
def test_in_and_out_shardings_none_follow_the_input(mesh, spec, backend):
    side_by_side(lambda x: x * 3, _committed(MESHES[mesh], spec), backend=backend,
                 jit_kwargs=dict(in_shardings=None, out_shardings=None))


@pytest.mark.parametrize("shape", [(6, 5), (10, 3), (7, 9)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_uneven_shapes_with_committed_inputs(shape, backend):
    m = MESHES["2x4"]
    x = jax.device_put(_data(shape), NamedSharding(m, P()))    # jax commits uneven dims whole
    side_by_side(lambda a: jnp.cumsum(a * 2, axis=0), x, backend=backend)
    even = (shape[0] - shape[0] % 2, shape[1])
    side_by_side(lambda a: jnp.tanh(a).sum(1), _committed(m, P("x"), even), backend=backend)


@pytest.mark.parametrize("mesh,spec", CASES, ids=[f"{m}-{s}" for m, s in CASES])
def test_an_elementwise_step_on_sharded_inputs_moves_nothing(mesh, spec):
    x = _committed(MESHES[mesh], spec)
    low = gspmd.jit(lambda a, b: a * b + 1, backend="jax").lower(x, x)
    assert low.report().collectives == []


# -- donation ----------------------------------------------------------------------------------
@pytest.mark.parametrize("how", [dict(donate_argnums=0), dict(donate_argnames="w"), dict(donate_argnums=(0, 1)),
                                 dict(donate_argnames=("w", "g"))])
@pytest.mark.parametrize("mesh", ["1", "2", "4", "8", "2x4"])
def test_donated_inputs_are_deleted_as_under_jax_jit(mesh, how):
    def step(w, g):
        return w - 0.1 * g
    m = MESHES[mesh]
    spec = P(m.axis_names[0])
    theirs_in = [_committed(m, spec), _committed(m, spec, seed=1)]
    ours_in = [_committed(m, spec), _committed(m, spec, seed=1)]
    theirs = jax.jit(step, **how)(*theirs_in)
    ours = gspmd.jit(step, backend="jax", **how)(*ours_in)
    assert_close(ours, theirs)
    _same_layouts(ours, theirs)
    assert [x.is_deleted() for x in ours_in] == [x.is_deleted() for x in theirs_in]


def test_donation_by_keyword_argument():
    m = MESHES["2x4"]

    def step(w, *, g):
        return w - g
    w, g = _committed(m, P("x")), _committed(m, P("x"), seed=1)
    out = gspmd.jit(step, backend="jax", donate_argnames="g")(w, g=g)
    assert g.is_deleted() and not w.is_deleted()
    assert out.sharding.is_equivalent_to(NamedSharding(m, P("x")), 2)


def test_donate_argnames_must_name_parameters():
    with pytest.raises(gspmd.ShardingError, match="donate_argnames names 'v'"):
        gspmd.jit(lambda w, g: w, donate_argnames="v")


# -- nesting -------------------------------------------------------------------------------------
MESH = gspmd.Mesh(np.arange(8).reshape(2, 4), ("x", "y"))
X, W = _data((8, 16)), _data((16, 8), seed=1)


def _reference(fn, *args):
    with unpartitioned():
        return fn(*args)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nested_gspmd_jit_inlines_with_closures(backend):
    inner = gspmd.jit(lambda a: gspmd.mesh_split(a, MESH, ["x", None]) * 2, backend=backend)

    def outer(a, b):
        c = jnp.sin(b)
        add_c = gspmd.jit(lambda z: z + c, backend=backend)    # closes over an outer tracer
        return add_c(inner(a)) + 1
    f = gspmd.jit(outer, mesh=MESH, backend=backend)
    assert_close(f(X, X), _reference(outer, X, X))
    assert_close(jax.grad(lambda a: f(a, X).sum())(X), _reference(jax.grad(lambda a: outer(a, X).sum()), X))
    assert "manual" not in f.lower(X, X).as_text()


@pytest.mark.parametrize("backend", BACKENDS)
def test_nested_with_static_arguments_and_jax_jit_between(backend):
    inner = gspmd.jit(lambda a, n: a ** n, backend=backend, static_argnums=1)

    def outer(a):
        return jax.jit(lambda b: inner(b, 3))(gspmd.mesh_split(a, MESH, [None, "y"]))
    assert_close(gspmd.jit(outer, backend=backend)(X), X ** 3, rtol=1e-4)


# -- autodiff of every order -----------------------------------------------------------------------
def loss(x, w):
    x = gspmd.mesh_split(x, MESH, ["x", None])
    return jnp.sum(jnp.tanh(x @ w) ** 2)


SMALL_X, SMALL_W = _data((8, 4)), _data((4, 2), seed=1)
TRANSFORMS = {
    "grad": lambda f: jax.grad(f, argnums=(0, 1)),
    "jvp": lambda f: lambda x, w: jax.jvp(f, (x, w), (x, w)),
    "jvp_of_one_arg": lambda f: lambda x, w: jax.jvp(lambda v: f(x, v), (w,), (w,)),
    "linearize": lambda f: lambda x, w: jax.linearize(lambda v: f(x, v), w)[1](w),
    "vjp": lambda f: lambda x, w: jax.vjp(f, x, w)[1](np.float32(1)),
    "jacfwd": lambda f: jax.jacfwd(f, argnums=1),
    "jacrev": lambda f: jax.jacrev(f, argnums=1),
    "hessian": lambda f: jax.hessian(f, argnums=1),
    "grad_of_grad": lambda f: jax.grad(lambda x, w: jax.grad(f, argnums=1)(x, w).sum()),
    "jit_of_jvp": lambda f: jax.jit(lambda x, w: jax.jvp(f, (x, w), (x, w))),
    "jvp_of_grad": lambda f: lambda x, w: jax.jvp(lambda v: jax.grad(f, argnums=1)(x, v), (w,), (w,)),
}


@pytest.mark.parametrize("transform", list(TRANSFORMS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_autodiff_equals_jax(transform, backend):
    f = gspmd.jit(loss, mesh=MESH, backend=backend)
    t = TRANSFORMS[transform]
    assert_close(t(f)(SMALL_X, SMALL_W), _reference(t(loss), SMALL_X, SMALL_W), rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_jvp_with_integer_inputs_and_outputs(backend):
    def f(x, n):
        return x * n, n + 1
    g = gspmd.jit(f, mesh=MESH, backend=backend)
    n = np.arange(8, dtype=np.int32)
    x = _data((8,))
    (y, m), (ty, tm) = jax.jvp(lambda v: g(v, n), (x,), (x,))
    assert_close((y, m, ty), (x * n.astype(np.float32), n + 1, x * n.astype(np.float32)))
    assert tm.dtype == jax.dtypes.float0


# -- vmap: in_axes and out_axes in all forms ----------------------------------------------------------
def pair(x, w):
    return jnp.tanh(gspmd.mesh_split(x, MESH, ["x", None]) @ w), w * 2


VMAPS = {
    "batch_x": dict(in_axes=(0, None), out_axes=(0, None)),
    "batch_x_out0": dict(in_axes=(0, None), out_axes=0),
    "batch_both": dict(in_axes=0, out_axes=0),
    "batch_w_dim1": dict(in_axes=(None, 1), out_axes=(1, 1)),
    "out_axes_last": dict(in_axes=(0, None), out_axes=(-1, None)),
}


def _batched_args(in_axes):
    axes = in_axes if isinstance(in_axes, tuple) else (in_axes, in_axes)
    xs = SMALL_X if axes[0] is None else np.stack([SMALL_X, 2 * SMALL_X, -SMALL_X], axes[0])
    ws = SMALL_W if axes[1] is None else np.stack([SMALL_W, SMALL_W + 1, -SMALL_W], axes[1])
    return xs, ws


@pytest.mark.parametrize("vmap", list(VMAPS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_vmap_axes_equal_jax(vmap, backend):
    kw = VMAPS[vmap]
    args = _batched_args(kw["in_axes"])
    f = gspmd.jit(pair, mesh=MESH, backend=backend)
    assert_close(jax.vmap(f, **kw)(*args), _reference(jax.vmap(pair, **kw), *args))


@pytest.mark.parametrize("backend", BACKENDS)
def test_vmap_of_vmap_and_vmap_of_grad(backend):
    f = gspmd.jit(loss, mesh=MESH, backend=backend)
    xs = np.stack([np.stack([SMALL_X, -SMALL_X])] * 2)
    assert_close(jax.vmap(jax.vmap(f, (0, None)), (0, None))(xs, SMALL_W),
                 _reference(jax.vmap(jax.vmap(loss, (0, None)), (0, None)), xs, SMALL_W))
    assert_close(jax.vmap(jax.grad(f, 1), (0, None))(xs[0], SMALL_W),
                 _reference(jax.vmap(jax.grad(loss, 1), (0, None)), xs[0], SMALL_W), rtol=1e-3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_vmap_and_grad_of_committed_inputs_in_another_layout(backend):
    m = MESHES["2x4"]
    f = gspmd.jit(lambda a: jnp.sum(gspmd.mesh_split(a, m, P(None, "y")) ** 2), backend=backend)
    x = _committed(m, P("x"), (8, 4))
    assert_close(jax.grad(f)(x), 2 * np.asarray(x))
    xs = jax.device_put(np.stack([np.asarray(x)] * 2), NamedSharding(m, P(None, "x")))
    assert_close(jax.vmap(f)(xs), np.sum(np.asarray(xs) ** 2, axis=(1, 2)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_bare_partition_spec_under_set_mesh_inside_vmap(backend):
    m = MESHES["2x4"]

    def f(a):
        return jax.lax.with_sharding_constraint(a * 2, P("x"))
    xs = np.stack([SMALL_X, SMALL_X])
    with jax.set_mesh(m):
        assert_close(jax.vmap(gspmd.jit(f, backend=backend))(xs), 2 * xs)


# -- keys ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_typed_keys_as_shard_map_operands(backend):
    m = MESHES["2x4"]

    def f(key, a):
        def body(k, b):
            return b + jax.random.uniform(k, b.shape)
        return jax.shard_map(body, mesh=m, in_specs=(P(), P("x")), out_specs=P("x"))(key, a)
    side_by_side(f, jax.random.key(0), _data((8, 4)), backend=backend, layouts=False)


# -- explicit sharding mode: every result's layout is what jax's types say -----------------------
EXPLICIT = {name: jax.make_mesh(shape, axes, axis_types=(jax.sharding.AxisType.Explicit,) * len(axes),
                                devices=DEVICES[:int(np.prod(shape))])
            for name, shape, axes in [("4", (4,), ("x",)), ("2x4", (2, 4), ("x", "y")), ("2x2", (2, 2), ("x", "y"))]}


def _explicit_programs(mesh):
    a0, a1 = mesh.axis_names[0], (mesh.axis_names[1:] or (None,))[0]
    reshard = jax.sharding.reshard
    return {
        "sum0": (lambda a: jnp.sum(a, 0), P(a0, a1)),
        "sum1": (lambda a: jnp.sum(a, 1), P(a0, a1)),
        "elementwise": (lambda a: jnp.exp(a) * 2, P(a0)),
        "transpose": (lambda a: a.T + 1, P(a0, None)),
        "reshard": (lambda a: reshard(a, P(None, a0)) * 2, P(a0)),
        "grad_through_reshard": (jax.grad(lambda a: jnp.sum(reshard(a, P(None, a1)) ** 2)), P(a0)),
        "grad": (jax.grad(lambda a: jnp.sum(jnp.sin(a))), P(a0, a1)),
        "fsdp_dot": (lambda a: jnp.dot(a, reshard(a, P()), out_sharding=P(a0, None)), P(a0)),
        # partial sums over a0 kept as such (unreduced), then summed by the reshard
        "unreduced_dot": (lambda a: reshard(jnp.dot(a, a.T, out_sharding=P(None, None, unreduced={a0})), P()) + 1,
                          P(None, a0)),
        "grad_unreduced_dot": (jax.grad(lambda a: jnp.sum(reshard(jnp.dot(a, a.T, out_sharding=P(
            None, None, unreduced={a0})), P()) ** 2)), P(None, a0)),
        "scan": (lambda a: jax.lax.scan(lambda c, r: (c + r, c * r), jnp.zeros(8, out_sharding=P(a1)), a),
                 P(None, a1)),
        "cond": (lambda a: jax.lax.cond(a.sum() > 0, lambda b: b * 2, lambda b: b - 1, a), P(a0, a1)),
        "fori_loop": (lambda a: jax.lax.fori_loop(0, 3, lambda i, c: c * 2 + i, a), P(a0)),
        "zeros_out_sharding": (lambda a: jnp.zeros((8, 4), out_sharding=P(a0)) + a[:, :4], P(a0)),
        "uniform_out_sharding": (lambda a: jax.random.uniform(jax.random.key(0), (8, 4), out_sharding=P(a0)) + 0 * a[:, :4],
                                 P()),
    }


EXPLICIT_CASES = [(m, p) for m in EXPLICIT for p in _explicit_programs(EXPLICIT[m])]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mesh,program", EXPLICIT_CASES, ids=[f"{m}-{p}" for m, p in EXPLICIT_CASES])
def test_explicit_mode_results_have_their_types_layouts(mesh, program, backend):
    m = EXPLICIT[mesh]
    fn, spec = _explicit_programs(m)[program]
    with jax.set_mesh(m):
        side_by_side(fn, jax.device_put(_data((8, 8)), spec), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rng_bit_generator_out_sharding(backend):
    m = EXPLICIT["2x4"]
    with jax.set_mesh(m):
        out = side_by_side(lambda k: jax.lax.rng_bit_generator(k, (8, 4), out_sharding=P("x"))[1],
                           np.zeros(4, np.uint32), backend=backend)
    if backend == "jax":
        assert out.sharding.is_equivalent_to(NamedSharding(m, P("x")), 2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("program", ["sum0", "transpose", "grad"])
def test_explicit_mode_inside_jax_jit_mixes_with_jax_values(program, backend):
    """Traced inside jax.jit, arguments' types give their layouts and results come back
    typed as jax's own, so they combine with the caller's values."""
    m = EXPLICIT["2x4"]
    fn, spec = _explicit_programs(m)[program]
    ours = gspmd.jit(fn, backend=backend)
    with jax.set_mesh(m):
        x = jax.device_put(_data((8, 8)), spec)
        got = jax.jit(lambda a: ours(a) + fn(a))(x)
        want = jax.jit(lambda a: 2 * fn(a))(x)
    assert_close(got, want)
    assert got.sharding.is_equivalent_to(want.sharding, want.ndim)
