"""gspmd.jit behaves like jax.jit: grad/jit/vmap around it, keyword, static and donated
arguments, non-array leaves (a whole Equinox module), in_shardings/out_shardings, jax
meshes, PartitionSpecs and NamedShardings, and outputs laid out over the user's mesh."""
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import gspmd
from gspmd.frontend.annotation import unpartitioned
from util import BACKENDS, assert_close, rand

MESH = gspmd.Mesh(np.arange(8).reshape(2, 4), ("x", "y"))
RNG = np.random.RandomState(0)
X, W = rand(RNG, 8, 16), rand(RNG, 16, 8)


def loss(x, w):
    x = gspmd.mesh_split(x, MESH, ["x", None])
    w = gspmd.mesh_split(w, MESH, [None, "y"])
    return jnp.sum(jnp.tanh(x @ w) ** 2)


def reference(fn, *args, **kwargs):
    with unpartitioned():
        return fn(*args, **kwargs)


# -- composition with JAX transformations ----------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_grad_and_value_and_grad(backend):
    f = gspmd.jit(loss, mesh=MESH, backend=backend)
    assert_close(jax.grad(f, argnums=(0, 1))(X, W), reference(jax.grad(loss, argnums=(0, 1)), X, W))
    assert_close(jax.value_and_grad(f)(X, W), reference(jax.value_and_grad(loss), X, W))
    # The backward pass is a partitioned program too, with the forward's annotations.
    (backward,) = f.lower(X, W).transforms.pullback((0, 1), (0,))._cache.values()
    assert backward.sharding_of("result[0]") == gspmd.Sharding.from_mesh(MESH, ["x", None], X.shape)
    assert backward.report().counts()["all-reduce"] >= 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_inside_jax_jit_and_jit_of_grad(backend):
    f = gspmd.jit(loss, mesh=MESH, backend=backend)
    assert_close(jax.jit(lambda x, w: 2 * f(x, w))(X, W), 2 * reference(loss, X, W))
    assert_close(jax.jit(jax.grad(f))(X, W), reference(jax.grad(loss), X, W))


@pytest.mark.parametrize("backend", BACKENDS)
def test_vmap_over_it_and_grad_of_vmap(backend):
    f = gspmd.jit(loss, mesh=MESH, backend=backend)
    xs = np.stack([X, 2 * X, -X])
    assert_close(jax.vmap(f, in_axes=(0, None))(xs, W), reference(jax.vmap(loss, in_axes=(0, None)), xs, W))

    def total(w):
        return jax.vmap(f, in_axes=(0, None))(xs, w).sum()
    assert_close(jax.grad(total)(W), reference(jax.grad(lambda w: jax.vmap(loss, in_axes=(0, None))(xs, w).sum()), W))


def test_integer_inputs_get_zero_gradients():
    def f(x, n):
        return gspmd.mesh_split(x, MESH, ["x", None]).sum() * n
    g = jax.grad(gspmd.jit(f, mesh=MESH))(X, np.int32(3))
    assert_close(g, np.full_like(X, 3))


# -- arguments ----------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_keyword_and_static_arguments(backend):
    def f(x, w, *, scale, activation="tanh"):
        y = gspmd.mesh_split(x, MESH, ["x", None]) @ w
        return getattr(jnp, activation)(y) * scale

    g = gspmd.jit(f, mesh=MESH, backend=backend, static_argnames="activation")
    assert_close(g(X, w=W, scale=np.float32(2)), reference(f, X, W, scale=np.float32(2)))
    assert_close(g(X, W, scale=np.float32(2), activation="sin"), reference(f, X, W, scale=2.0, activation="sin"))
    h = gspmd.jit(lambda x, n: gspmd.mesh_split(x, MESH, ["x", None]) * n, mesh=MESH, backend=backend,
                  static_argnums=1)
    assert_close(h(X, 3), X * 3)
    assert len(h._cache) == 1 and h.lower(X, 3) is h.lower(X, 3) and h.lower(X, 4) is not h.lower(X, 3)


def test_python_numbers_and_functions_are_static_like_filter_jit():
    def f(x, p):
        return p["act"](gspmd.mesh_split(x, MESH, ["x", None])) * p["scale"]
    g = gspmd.jit(f, mesh=MESH)
    assert_close(g(X, {"act": jnp.tanh, "scale": 2.0}), np.tanh(X) * 2)
    low = g.lower(X, {"act": jnp.tanh, "scale": 2.0})
    assert len(low.program.params) == 1
    assert g.lower(X, {"act": jnp.tanh, "scale": 3.0}) is not low


class Mlp(eqx.Module):
    layers: list
    activation: callable = eqx.field(static=False)

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.layers = [eqx.nn.Linear(16, 32, key=k1), eqx.nn.Linear(32, 4, key=k2)]
        self.activation = jax.nn.relu      # a non-array leaf: static, as eqx.filter_jit does

    def __call__(self, x):
        return self.layers[1](self.activation(self.layers[0](x)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_equinox_module_passed_whole(backend):
    model = Mlp(jax.random.PRNGKey(0))
    xs = rand(RNG, 8, 16)

    def loss_fn(model, xs):
        return jnp.mean(jax.vmap(model)(gspmd.mesh_split(xs, MESH, ["x", None])) ** 2)
    f = gspmd.jit(loss_fn, mesh=MESH, backend=backend)
    assert_close(f(model, xs), reference(eqx.filter_jit(loss_fn), model, xs))
    grads = eqx.filter_grad(f)(model, xs)
    want = reference(eqx.filter_grad(loss_fn), model, xs)
    assert_close(grads.layers[0].weight, want.layers[0].weight)
    low = f.lower(model, xs)
    assert "model.layers[0].weight" in low.as_text()


def test_donated_buffers_are_reused_on_the_jax_backend():
    def step(w, g):
        return gspmd.mesh_split(w, MESH, [None, "y"]) - 0.1 * g
    f = gspmd.jit(step, mesh=MESH, backend="jax", donate_argnums=0)
    w = jax.device_put(W, f.lower(W, W).jax_executable().input_sharding(0))
    out = f(w, W)
    assert w.is_deleted() and not out.is_deleted()
    assert_close(out, W - 0.1 * W)


@pytest.mark.parametrize("backend", BACKENDS)
def test_in_and_out_shardings_instead_of_annotations(backend):
    def f(x, w):
        return jnp.tanh(x @ w)
    g = gspmd.jit(f, mesh=MESH, backend=backend, in_shardings=(P("x"), P(None, "y")), out_shardings=P("x", "y"))
    assert_close(g(X, W), np.tanh(X @ W), atol=1e-5)
    low = g.lower(X, W)
    assert low.sharding_of("x") == gspmd.Sharding.from_mesh(MESH, ["x", None], X.shape)
    assert low.sharding_of(0) == gspmd.Sharding.from_mesh(MESH, ["x", "y"], (8, 8))
    named = gspmd.jit(f, backend=backend, in_shardings=NamedSharding(MESH.to_jax(), P("x")))
    assert named.lower(X, W).sharding_of("w") == gspmd.Sharding.from_mesh(MESH, ["x", None], W.shape)


# -- jax.sharding spoken natively -----------------------------------------------------------------
@pytest.mark.parametrize("make", ["make_mesh", "Mesh"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_jax_mesh_partition_spec_and_named_sharding(make, backend):
    jmesh = jax.make_mesh((2, 4), ("x", "y")) if make == "make_mesh" else \
        jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("x", "y"))

    def f(x, w):
        x = gspmd.mesh_split(x, jmesh, P("x"))                           # short form: padded with None
        w = gspmd.mesh_split(w, NamedSharding(jmesh, P(None, "y")))
        return jnp.tanh(x @ w)
    g = gspmd.jit(f, mesh=jmesh, backend=backend)
    assert_close(g(X, W), np.tanh(X @ W), atol=1e-5)
    low = g.lower(X, W)
    assert low.mesh == gspmd.Mesh.from_jax(jmesh) == MESH
    assert low.sharding_of(0) == gspmd.Sharding.from_mesh(MESH, ["x", "y"], (8, 8))


@pytest.mark.parametrize("backend", BACKENDS)
def test_device_put_onto_a_named_sharding_is_an_annotation(backend):
    """jax.make_mesh's axes are Explicit: the function is traced under that mesh, as
    jax.jit traces it, and device_put onto a NamedSharding inside it lays the value out
    (here: the result's layout)."""
    jmesh = jax.make_mesh((2, 4), ("x", "y"))

    def f(x, w):
        return jnp.tanh(jax.device_put(x, NamedSharding(jmesh, P("x", "y"))) @ w)
    g = gspmd.jit(f, mesh=jmesh, backend=backend)
    assert_close(g(X, W), np.tanh(X @ W), atol=1e-5)
    assert g.lower(X, W).sharding_of("x") == gspmd.Sharding.from_mesh(MESH, ["x", "y"], X.shape)


def test_results_live_on_the_users_jax_mesh_and_mix_with_jax_arrays():
    """Over a mesh of Explicit axes, results carry that very mesh, so jax combines them
    with its own arrays on it (an Auto twin of the mesh would not be equal to it)."""
    jmesh = jax.make_mesh((2, 4), ("x", "y"))
    f = lambda x: jax.device_put(x, NamedSharding(jmesh, P("x", "y"))) * 2
    ours, theirs = gspmd.jit(f, mesh=jmesh, backend="jax")(X), jax.jit(f)(X)
    assert ours.sharding == theirs.sharding
    assert_close(ours + theirs, 4 * X)


def test_mesh_round_trips_through_jax():
    jmesh = jax.sharding.Mesh(np.array(jax.devices())[[3, 1, 0, 2, 7, 6, 5, 4]].reshape(2, 4), ("a", "b"))
    mesh = gspmd.Mesh.from_jax(jmesh)
    assert mesh.devices.tolist() == [[3, 1, 0, 2], [7, 6, 5, 4]] and mesh.axis_names == ("a", "b")
    assert mesh.to_jax().devices.tolist() == jmesh.devices.tolist()
    assert gspmd.Mesh(jmesh.devices, ("a", "b")) == mesh
    sub = gspmd.Mesh.from_jax(jax.sharding.Mesh(np.array(jax.devices()[4:]), ("z",)))
    assert sub.devices.tolist() == [0, 1, 2, 3] and sub.jax_devices() == jax.devices()[4:]
    assert not sub.same_devices(gspmd.Mesh(np.arange(4), ("z",)))


def test_partition_spec_unconstrained_is_unspecified():
    def f(x):
        return gspmd.mesh_split(gspmd.mesh_split(x, MESH, P("x", P.UNCONSTRAINED)), MESH, [None, "y"]) * 2
    low = gspmd.jit(f, mesh=MESH).lower(X)
    first = [i for i in low.program.instrs if i.opcode == "sharding"][0]
    assert first.attrs["unspecified"] == (1,)
    assert low.sharding_of(0) == gspmd.Sharding.from_mesh(MESH, [None, "y"], X.shape)


def test_outputs_carry_named_shardings_over_the_users_mesh():
    mesh = gspmd.Mesh(np.array([3, 1, 0, 2, 7, 6, 5, 4]).reshape(2, 4), ("data", "model"))

    def f(x, w):
        x = gspmd.mesh_split(x, mesh, ["data", None])
        return x @ gspmd.mesh_split(w, mesh, [None, "model"]), x[:5]     # the second: uneven over "data"
    y, head = gspmd.jit(f, backend="jax")(X, W)          # no jit(mesh=): the annotations' mesh
    assert y.sharding == NamedSharding(mesh.to_jax(), P("data", "model"))
    assert head.sharding.mesh == mesh.to_jax()           # uneven: replicated over that dim, same mesh
    assert_close((y, head), (X @ W, X[:5]), atol=1e-5)


@pytest.mark.parametrize("layout", [P(), P("y"), P(None, ("x", "y"))])
def test_jax_array_inputs_in_any_layout(layout):
    f = gspmd.jit(loss, mesh=MESH, backend="jax")
    x = jax.device_put(X, NamedSharding(MESH.to_jax(), layout))
    assert_close(f(x, W), reference(loss, X, W))
    explicit = jax.device_put(X, NamedSharding(jax.make_mesh((2, 4), ("x", "y")), P("x")))
    assert_close(f(explicit, W), reference(loss, X, W))


def test_arrays_typed_by_an_explicit_mesh_without_set_mesh():
    """Arrays placed over jax.make_mesh's mesh (Explicit axes) carry their layouts in their
    types even where no jax.set_mesh is in effect: an element-wise update of a replicated
    weight by a gradient split over "x" runs, and comes back typed as jax.jit's result."""
    jmesh = jax.make_mesh((2, 4), ("x", "y"))
    w = jax.device_put(np.ones(8, np.float32), NamedSharding(jmesh, P()))
    x = jax.device_put(np.arange(8 * 16 * 8, dtype=np.float32).reshape(8, 16, 8) / 100,
                       NamedSharding(jmesh, P(None, None, "x")))

    def f(w, x):
        return w - 0.1 * jax.grad(lambda w: ((x * w) ** 2).sum())(w)
    theirs = jax.jit(f)(w, x)
    for backend in BACKENDS:     # the simulator's results typed as jax.jit's too
        ours = gspmd.jit(f, backend=backend)(w, x)
        assert_close(ours, theirs, rtol=1e-5)
        assert ours.sharding.is_equivalent_to(theirs.sharding, 1) and jax.typeof(ours) == jax.typeof(theirs)


def _explicitly_placed():
    """A jax.make_mesh mesh (Explicit axes) and two arrays placed over it, no jax.set_mesh."""
    jmesh = jax.make_mesh((2, 4), ("x", "y"))
    v = jax.device_put(np.arange(32, dtype=np.float32).reshape(4, 8), NamedSharding(jmesh, P()))
    u = jax.device_put(np.ones((2, 2), np.float32), NamedSharding(jmesh, P()))
    return jmesh, v, u


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("transform", ["jvp_of_one", "jvp_of_the_other", "vmap"])
def test_transforms_of_arrays_typed_by_an_explicit_mesh_without_set_mesh(transform, backend):
    """Fuzzer, seed 30103 shrunk: jvp (or vmap) perturbs one argument and holds the other,
    both typed by an Explicit mesh. The traced argument keeps its type (so does the
    derived tangent program's trace), else jax refuses an update typed otherwise than its
    operand; the derived programs run over the jit's mesh, which no traced type names."""
    _, v, u = _explicitly_placed()

    def f(v, u):
        return jax.lax.dynamic_update_slice(v, u, (1, 2))
    call = {"jvp_of_one": lambda g: jax.jvp(lambda u: g(v, u), (u,), (u,)),
            "jvp_of_the_other": lambda g: jax.jvp(lambda v: g(v, u), (v,), (v,)),
            "vmap": lambda g: jax.vmap(g, (0, None))(jnp.stack([v, v]), u)}[transform]
    ours, theirs = call(gspmd.jit(f, backend=backend)), call(jax.jit(f))
    assert_close(ours, theirs)
    if backend == "jax":
        for a, b in zip(jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(theirs)):
            assert a.sharding.is_equivalent_to(b.sharding, b.ndim)


@pytest.mark.parametrize("backend", BACKENDS)
def test_vmap_of_an_array_typed_by_an_explicit_mesh_without_set_mesh(backend):
    """Fuzzer, seed 29 shrunk: under vmap the jax backend constrained its results with the
    batch dim UNCONSTRAINED, which a mesh of no Auto axes refuses; traced arguments typed
    by Explicit axes now take the typed path, as in explicit mode."""
    jmesh = jax.make_mesh((2, 4), ("x", "y"))
    x = jax.device_put(np.arange(64, dtype=np.float32).reshape(2, 4, 8), NamedSharding(jmesh, P(None, "y", "x")))
    ours = jax.vmap(gspmd.jit(lambda a: a * 2, mesh=jmesh, backend=backend))(x)
    theirs = jax.vmap(jax.jit(lambda a: a * 2))(x)
    assert_close(ours, theirs)
    if backend == "jax":
        assert ours.sharding.is_equivalent_to(theirs.sharding, 3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_vmap_over_a_dim_split_by_an_explicit_axis_the_function_splits_by(backend):
    """Fuzzer, seed 30637 shrunk: vmap batches a dim split over Explicit "x" and the
    function splits another dim over "x". jax leaves "x" out of a shard_map traced inside
    that vmap, and the jax backend's shard_map read its position ("unbound axis name:
    x"); the program's shard_map now keeps every mesh axis."""
    jmesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
    x = jax.device_put(np.arange(16, dtype=np.float32).reshape(2, 2, 4), NamedSharding(jmesh, P("x")))

    def f(a):
        return gspmd.mesh_split(a, jmesh, [None, "x"]) * 2
    ours = jax.vmap(gspmd.jit(f, mesh=jmesh, backend=backend))(x)
    with unpartitioned():
        theirs = jax.vmap(jax.jit(f))(x)
    assert_close(ours, theirs)
    if backend == "jax":
        assert ours.sharding.is_equivalent_to(theirs.sharding, 3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_jvp_of_a_sort_of_an_array_typed_by_an_explicit_mesh(backend):
    """Fuzzer, seed 40577 shrunk: under the context mesh gspmd traced with (the arguments'
    Explicit mesh), jax's jvp of argsort types the iota it sorts along replicated and
    its sort refuses operands typed otherwise; jax.jit runs it, and gspmd now traces as
    jax.jit does where jax refuses its context."""
    jmesh = jax.make_mesh((8,), ("x",))
    x = jax.device_put(rand(np.random.RandomState(0), 8, 3), NamedSharding(jmesh, P("x")))

    def f(a):
        return jnp.take_along_axis(a, jnp.argsort(a, axis=1), axis=1)
    ours = jax.jvp(gspmd.jit(f, mesh=jmesh, backend=backend), (x,), (x,))
    assert_close(ours, jax.jvp(jax.jit(f), (x,), (x,)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_eager_transforms_of_arrays_typed_by_an_explicit_mesh_find_its_devices(backend):
    """vmap and jvp trace over the arrays they are given; with neither gspmd.jit(mesh=...)
    nor jax.set_mesh, every argument traced and typed by an abstract mesh, gspmd.jit runs
    over the mesh of the arrays under the tracers, as jax.jit does."""
    jmesh = jax.make_mesh((2, 4), ("x", "y"))
    x = jax.device_put(np.arange(64, dtype=np.float32).reshape(2, 4, 8), NamedSharding(jmesh, P(None, "y", "x")))
    f = lambda a: jnp.sin(a) * 2 + a.sum(0, keepdims=True)
    ours, theirs = jax.vmap(gspmd.jit(f, backend=backend))(x), jax.vmap(jax.jit(f))(x)
    assert_close(ours, theirs)
    assert ours.sharding.is_equivalent_to(theirs.sharding, 3), (ours.sharding, theirs.sharding)
    assert_close(jax.jvp(gspmd.jit(f, backend=backend), (x,), (x,)), jax.jvp(jax.jit(f), (x,), (x,)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_inside_another_jit_with_no_mesh_named_it_runs_inline(backend):
    """gspmd.jit of a function that names no mesh, called inside a jax.jit whose
    arguments are placed over 8 devices (Auto axes): nothing to partition, and the
    devices are the outer computation's, so it runs inline as a nested jax.jit does
    (it pinned its program to device 0, which jax refused), under jax.grad too."""
    jmesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("x", "y"))
    x = jax.device_put(np.arange(64, dtype=np.float32).reshape(2, 4, 8), NamedSharding(jmesh, P(None, "y", "x")))
    f = lambda a: jnp.sin(a) * 2 + a.sum(0, keepdims=True)
    g = gspmd.jit(f, backend=backend)
    ours, theirs = jax.jit(lambda a: g(a) * 3)(x), jax.jit(lambda a: jax.jit(f)(a) * 3)(x)
    assert_close(ours, theirs)
    assert ours.sharding.is_equivalent_to(theirs.sharding, 3), (ours.sharding, theirs.sharding)
    loss = lambda h: jax.jit(jax.grad(lambda a: h(a).sum()))(x)
    assert_close(loss(g), loss(jax.jit(f)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("f", [lambda b: b * 2, lambda b: jnp.sin(b) * 2 + b.sum(1, keepdims=True)],
                         ids=["scale", "reduce-split-dim"])
def test_staged_arguments_typed_by_an_explicit_mesh_run_over_its_devices(backend, f):
    """Inside another jax.jit's trace the tracers hold no arrays and their types name an
    abstract mesh only: with neither gspmd.jit(mesh=...) nor jax.set_mesh, the program
    runs over that mesh, on the devices jax takes from the outer call's arguments (here
    in reverse order), as a jax.jit nested in it does; under jax.grad too."""
    jmesh = jax.make_mesh((2, 4), ("x", "y"), devices=jax.devices()[::-1])
    x = jax.device_put(np.arange(64, dtype=np.float32).reshape(2, 4, 8), NamedSharding(jmesh, P(None, "y", "x")))
    out = jax.jit(lambda a: gspmd.jit(f, backend=backend)(a))(x)
    expected = jax.jit(lambda a: jax.jit(f)(a))(x)
    assert_close(out, expected)
    assert out.sharding == expected.sharding
    grad = jax.jit(jax.grad(lambda a: gspmd.jit(f, backend=backend)(a).sum()))(x)
    with jax.set_mesh(jmesh):   # jax's own grad of an Explicit-typed sum wants a context mesh
        expected_grad = jax.jit(jax.grad(lambda a: jax.jit(f)(a).sum()))(x)
    assert_close(grad, expected_grad)
    assert grad.sharding == expected_grad.sharding


@pytest.mark.parametrize("backend", BACKENDS)
def test_repeat_along_a_dim_split_over_an_explicit_axis(backend):
    """Fuzzer seed 60305, shrunk: jnp.repeat asks for an out_sharding to repeat a dim split
    over an Explicit axis under a context mesh; jax.jit traces without one and runs it,
    and so does gspmd.jit."""
    jmesh = jax.make_mesh((2, 4), ("x", "y"))
    x = jax.device_put(np.arange(24, dtype=np.float32).reshape(4, 6), NamedSharding(jmesh, P("x")))
    f = lambda x: jnp.repeat(x, 2, axis=0) * 2
    assert_close(gspmd.jit(f, backend=backend)(x), jax.jit(f)(x))


# -- ahead of time: lower, compile, eval_shape, clear_cache -----------------------------------
def step(w, x):
    """A donated weight updated by a data-parallel gradient (MaxText's train loop
    compiles its step ahead of time for its memory analysis, then calls it)."""
    return w - 0.1 * jax.grad(loss, argnums=1)(x, w), loss(x, w)


@pytest.mark.parametrize("backend", BACKENDS)
def test_lower_then_compile_runs_and_analyses_as_jax_jit(backend):
    f = gspmd.jit(step, mesh=MESH, backend=backend, donate_argnums=0)
    compiled = f.lower(W, X).compile()
    assert_close(compiled(W.copy(), X), reference(step, W, X))
    ours, theirs = compiled.memory_analysis(), jax.jit(step, donate_argnums=0).lower(W, X).compile().memory_analysis()
    # per device: arguments and results as jax.jit's over one device, split over the mesh's 8
    assert ours.argument_size_in_bytes < theirs.argument_size_in_bytes
    assert ours.alias_size_in_bytes > 0 and ours.output_size_in_bytes >= ours.alias_size_in_bytes
    assert compiled.cost_analysis()["flops"] > 0 and compiled.as_text()
    with pytest.raises(gspmd.ShardingError, match="lowered for shape"):
        compiled(W, X[:4])
    uneven = X[:7]    # 7 rows over "x"'s 2
    assert_close(f.lower(W, uneven).compile()(W.copy(), uneven), reference(step, W, uneven))


def test_compile_takes_xla_options_on_the_jax_backend():
    options = {"xla_cpu_enable_fast_math": False}
    compiled = gspmd.jit(step, mesh=MESH, backend="jax").lower(W, X).compile(compiler_options=options)
    assert_close(compiled(W, X), reference(step, W, X))
    with pytest.raises(gspmd.ShardingError, match="sim backend compiles nothing"):
        gspmd.jit(step, mesh=MESH).lower(W, X).compile(compiler_options=options)


def test_trace_gives_the_jaxpr_and_lowers():
    jitted = gspmd.jit(loss, mesh=MESH)
    traced = jitted.trace(X, W)
    assert "tanh" in str(traced.jaxpr) and traced.fun_name == "loss"
    assert traced.out_info == jax.jit(loss).eval_shape(X, W)
    assert traced.lower() is jitted.lower(X, W)


def test_eval_shape_and_clear_cache():
    def f(x, key):
        return {"y": jnp.sin(x), "keys": jax.random.split(key), "total": x.sum()}
    key = jax.random.key(0)
    jitted = gspmd.jit(f, mesh=MESH)
    for x in (X, jax.ShapeDtypeStruct((6, 3), jnp.float32)):
        assert jitted.eval_shape(x, key) == jax.jit(f).eval_shape(x, key)
    lowered = jitted.lower(X, key)
    jitted.clear_cache()
    assert jitted.lower(X, key) is not lowered


def test_decorator_form_and_jax_jits_other_options():
    """gspmd.jit(**options) decorates, as jax.jit(**options) does; keep_unused and inline
    are taken (no result changes), compiler_options go to XLA; one `device` is refused."""
    @gspmd.jit(mesh=MESH, backend="jax", static_argnums=2, keep_unused=True, inline=True,
               compiler_options={"xla_cpu_enable_fast_math": False})
    def scaled(x, w, scale):
        return scale * loss(x, w)
    assert_close(scaled(X, W, 3.0), reference(lambda: 3.0 * loss(X, W)))
    assert_close(jax.grad(scaled)(X, W, 3.0), reference(jax.grad(lambda x: 3.0 * loss(x, W)), X))
    with pytest.raises(gspmd.ShardingError, match="sim backend compiles nothing"):
        gspmd.jit(loss, compiler_options={"xla_cpu_enable_fast_math": False})
    with pytest.raises(gspmd.ShardingError, match="not one `device`"):
        gspmd.jit(loss, device=jax.devices()[0])
    with pytest.raises(gspmd.ShardingError, match="jax.jit's named a platform"):
        gspmd.jit(loss, backend="cpu")
