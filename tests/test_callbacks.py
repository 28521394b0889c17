"""Host callbacks see the global values they see under jax.jit, once per execution, on
both backends: jax.debug.print, jax.debug.callback, jax.pure_callback, io_callback."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.experimental import io_callback

import gspmd
from strategies import dims_mappings, meshes
from util import BACKENDS, assert_close, in_a_fresh_process, rand

MESH = gspmd.Mesh(np.arange(8).reshape(2, 4), ("x", "y"))


def run_each(fn, *args, mesh=MESH):
    """fn under jax.jit, then partitioned on each backend: yields (name, result) after
    each run, its callbacks done."""
    for name, compiled in [("jax.jit", jax.jit(fn))] + [(b, gspmd.jit(fn, mesh=mesh, backend=b)) for b in BACKENDS]:
        out = compiled(*args)
        jax.effects_barrier()
        yield name, out


def test_debug_print_prints_the_global_value_once(capsys):
    def f(x):
        x = gspmd.mesh_split(x, MESH, ["x", "y"])
        jax.debug.print("x={x} total={t}", x=x, t=x.sum())
        return x * 2
    x = np.arange(15, dtype=np.float32).reshape(3, 5)   # uneven on both mesh dims
    capsys.readouterr()
    printed = {}
    for name, out in run_each(f, x):
        assert_close(out, x * 2)
        printed[name] = capsys.readouterr().out
    expected = printed.pop("jax.jit")
    assert expected.count("total=") == 1 and "total=105.0" in expected, expected
    assert all(text == expected for text in printed.values()), printed


def test_debug_callback_and_ordered_io_callback_run_once_in_order():
    calls = []

    def f(x, w):
        x = gspmd.mesh_split(x, MESH, ["x", -1])
        h = x @ gspmd.mesh_split(w, MESH, [-1, "y"])
        jax.debug.callback(lambda v: calls.append(("debug", np.asarray(v))), h)
        first = io_callback(lambda v: calls.append(("io 1", np.asarray(v))) or np.float32(1), jax.ShapeDtypeStruct(
            (), jnp.float32), h.sum(0), ordered=True)
        second = io_callback(lambda v: calls.append(("io 2", np.asarray(v))) or np.float32(2), jax.ShapeDtypeStruct(
            (), jnp.float32), h.max(1), ordered=True)
        return h * first + second

    rng = np.random.RandomState(0)
    x, w = rand(rng, 6, 4), rand(rng, 4, 10)
    reference = None
    for name, out in run_each(f, x, w):
        assert [kind for kind, _ in calls] == ["debug", "io 1", "io 2"], (name, [kind for kind, _ in calls])
        if reference is None:
            reference = (out, calls[:])
        assert_close(out, reference[0])
        for (_, got), (_, want) in zip(calls, reference[1]):
            assert_close(got, want)
        calls.clear()


@pytest.mark.parametrize("ordered", [False, True])
def test_an_io_callback_that_raises_fails_the_call_as_under_jax_jit(ordered):
    """Device 0 alone calls it and sends its results to the others; had its error stopped
    device 0 alone, they would wait for them forever. Every device raises it instead: the
    call fails as under jax.jit (a JaxRuntimeError holding the host's exception), and the
    next call, whose callback does not raise, runs (but after an ordered one: jax's token
    of the ordered effect, which the failed run returned, holds the error on the jax
    backend, as in any multi-device program of jax's). In a process of its own, where a
    hang is a timeout, not a stuck pytest."""
    run = in_a_fresh_process(f"""
        import jax, jax.numpy as jnp, numpy as np
        from jax.experimental import io_callback
        import gspmd
        mesh = gspmd.Mesh(np.arange(8).reshape(2, 4), ("x", "y"))

        def check(v):
            if v < 0:
                raise ValueError("a negative total")
            return v

        def f(x):
            x = gspmd.mesh_split(x, mesh, ["x", "y"])
            total = io_callback(check, jax.ShapeDtypeStruct((), jnp.float32), x.sum(), ordered={ordered})
            return x * total
        x = np.arange(12, dtype=np.float32).reshape(3, 4)
        for name, fn in [("jax.jit", jax.jit(f)), ("sim", gspmd.jit(f, mesh=mesh)),
                         ("jax", gspmd.jit(f, mesh=mesh, backend="jax"))]:
            try:
                jax.block_until_ready(fn(-x))
                print(name, "returned")
            except Exception as e:
                print(name, type(e).__name__, "a negative total" in str(e))
            try:
                print(name, np.array_equal(np.asarray(fn(x)), x * 66))
            except Exception as e:
                print(name, "next call", type(e).__name__)
    """, timeout=240)
    lines = run.stdout.splitlines()
    for name in ("jax.jit", "sim", "jax"):
        assert f"{name} JaxRuntimeError True" in lines, (run.stdout, run.stderr[-3000:])
        assert f"{name} True" in lines or (ordered and name == "jax"), (run.stdout, run.stderr[-3000:])


def test_pure_callback_results_split_without_communication():
    def f(x):
        x = gspmd.mesh_split(x, MESH, ["x", "y"])
        y = jax.pure_callback(lambda v: np.tanh(v).astype(np.float32), jax.ShapeDtypeStruct(x.shape, x.dtype), x)
        return gspmd.mesh_split(y + 1, MESH, ["x", "y"])
    x = rand(np.random.RandomState(1), 4, 8)
    for name, out in run_each(f, x):
        assert_close(out, np.tanh(x) + 1)
    counts = gspmd.jit(f, mesh=MESH).lower(x).report().counts()
    assert counts == {"all-gather": 2}, counts   # gathering the operand, and nothing after


def test_callbacks_in_a_scan_run_once_per_iteration():
    calls = []

    def f(xs):
        xs = gspmd.mesh_split(xs, MESH, [-1, "x", "y"])

        def step(carry, x):
            carry = carry + x
            jax.debug.callback(lambda c: calls.append(np.asarray(c)), carry)
            return carry, carry.sum()
        return jax.lax.scan(step, jnp.zeros(xs.shape[1:], xs.dtype), xs)

    xs = rand(np.random.RandomState(2), 3, 5, 6)
    results = list(run_each(f, xs))
    per_run = len(xs)
    assert len(calls) == per_run * len(results)
    for k, (name, out) in enumerate(results):
        assert_close(out, results[0][1])
        for got, want in zip(calls[k * per_run:(k + 1) * per_run], calls[:per_run]):
            assert_close(got, want)


def test_side_effects_are_neither_dropped_nor_merged_and_unused_pure_callbacks_go():
    calls = []

    def f(x):
        x = gspmd.mesh_split(x, MESH, ["x", -1])
        jax.debug.callback(lambda v: calls.append(1), x)
        jax.debug.callback(lambda v: calls.append(1), x)
        jax.pure_callback(lambda v: calls.append(2) or v, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
        return x + 1
    for backend in BACKENDS:
        gspmd.jit(f, mesh=MESH, backend=backend)(np.ones((4, 2), np.float32))
        jax.effects_barrier()
        assert calls == [1, 1], (backend, calls)
        calls.clear()


def test_callbacks_in_a_manual_region_run_per_device():
    """As in jax.shard_map: per-device code calls the host once per device, with its shard."""
    calls = []

    def f(x):
        def body(local):
            jax.debug.callback(lambda v: calls.append(np.asarray(v)), local)
            return local * 2
        return gspmd.manual(body, MESH, in_specs=[["x", "y"]], out_specs=["x", "y"])(x)

    x = np.arange(32, dtype=np.float32).reshape(4, 8)
    for backend in BACKENDS:
        assert_close(gspmd.jit(f, mesh=MESH, backend=backend)(x), x * 2)
        jax.effects_barrier()
        assert sorted(c.tolist() for c in calls) == sorted(x[i:i + 2, j:j + 2].tolist() for i in (0, 2)
                                                           for j in (0, 2, 4, 6)), backend
        calls.clear()


def test_ordered_debug_callbacks_keep_order_on_sim_and_say_why_not_on_jax(capsys):
    def f(x):
        x = gspmd.mesh_split(x, MESH, ["x", "y"])
        jax.debug.print("first {}", x.sum(), ordered=True)
        jax.debug.callback(lambda v: print("second", v), x.max(), ordered=True)
        return x
    x = np.arange(15, dtype=np.float32).reshape(3, 5)
    gspmd.jit(f, mesh=MESH)(x)
    assert capsys.readouterr().out.splitlines() == ["first 105.0", "second 14.0"]
    with pytest.raises(gspmd.ShardingError, match="ordered=False"):
        gspmd.jit(f, mesh=MESH, backend="jax")(x)


@st.composite
def callback_cases(draw):
    mesh = draw(meshes(shapes=[(2,), (3,), (2, 4), (4, 2), (8,), (2, 2, 2)]))
    shape = tuple(draw(st.sampled_from([1, 2, 3, 5, 8])) for _ in range(draw(st.integers(1, 3))))
    return mesh, shape, draw(dims_mappings(mesh, len(shape))), draw(dims_mappings(mesh, len(shape)))


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(callback_cases(), st.integers(0, 2**31 - 1))
def test_random_layouts_callbacks_see_the_global_value(case, seed):
    mesh, shape, in_map, out_map = case
    calls = []

    def f(x):
        x = gspmd.mesh_split(x, mesh, in_map)
        jax.debug.callback(lambda v: calls.append(np.asarray(v)), jnp.sin(x))
        y = jax.pure_callback(lambda v: (np.asarray(v) * 3).astype(np.float32), jax.ShapeDtypeStruct(x.shape, x.dtype),
                              x)
        return gspmd.mesh_split(y, mesh, out_map)
    x = rand(np.random.RandomState(seed), *shape)
    for name, out in run_each(f, x, mesh=mesh):
        assert_close(out, x * 3)
        (seen,) = calls
        assert_close(seen, np.sin(x))
        calls.clear()


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(callback_cases(), st.integers(0, 2**31 - 1))
def test_random_layouts_callbacks_see_the_global_value_many(case, seed):
    test_random_layouts_callbacks_see_the_global_value.hypothesis.inner_test(case, seed)


def test_inspect_array_sharding_hears_the_layout_gspmd_chose():
    """jax.debug.inspect_array_sharding under gspmd.jit: the callback gets the value's
    completed layout (here: rows split over x, propagated from the input through the
    matmul) as a jax NamedSharding, once per compilation, as under jax.jit; nothing runs
    per call. A plan for more devices than jax has gets gspmd's own Sharding."""
    mesh = gspmd.Mesh(np.arange(8).reshape(2, 4), ("x", "y"))
    seen = []

    def f(a, w):
        h = jnp.tanh(gspmd.mesh_split(a, mesh, ["x", -1]) @ w)
        jax.debug.inspect_array_sharding(h, callback=seen.append)
        return h * 2
    a, w = np.ones((8, 12), np.float32), np.ones((12, 16), np.float32)
    stepped = gspmd.jit(f, mesh=mesh)
    for _ in range(2):
        np.testing.assert_allclose(stepped(a, w), np.tanh(a @ w) * 2, rtol=1e-6)
    (named,) = seen
    assert isinstance(named, jax.sharding.NamedSharding) and named.spec == jax.sharding.PartitionSpec("d0", None)
    assert gspmd.Sharding.from_named(named, (8, 16)) == gspmd.Sharding.from_mesh(mesh, ["x", -1], (8, 16))
    big = gspmd.Mesh(np.arange(64).reshape(8, 8), ("x", "y"))
    seen.clear()
    gspmd.jit(lambda a: (jax.debug.inspect_array_sharding(gspmd.mesh_split(a, big, ["x", "y"]), callback=seen.append),
                         a)[1], mesh=big).lower(jax.ShapeDtypeStruct((16, 16), np.float32))
    assert seen == [gspmd.Sharding.from_mesh(big, ["x", "y"], (16, 16))]
    # a jax mesh in another device order: the layout names that mesh's devices
    jax_mesh = jax.sharding.Mesh(np.array(jax.devices()[::-1]).reshape(2, 4), ("x", "y"))
    seen.clear()
    gspmd.jit(lambda a: (jax.debug.inspect_array_sharding(gspmd.mesh_split(a, jax_mesh, ["x", -1]),
                                                           callback=seen.append), a)[1], mesh=jax_mesh)(a)
    (named,) = seen
    for row in range(2):   # rows split over x: each half on the devices of one row of jax_mesh
        assert set(named.mesh.devices[row].ravel()) == set(jax_mesh.devices[row])
