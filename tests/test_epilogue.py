"""The jax backend runs a program's element-wise tail (an optimizer's update) after its
shard_map, on global arrays (runtime/epilogue.py): XLA's sharding passes take time
quadratic in a shard_map's operands and results. The results equal the single-device
program's, XLA adds no collective for the tail, and what must stay per device (uneven
layouts, per-device scalars, collectives) stays inside the shard_map."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
from hypothesis import given, settings, strategies as st

import gspmd
from gspmd.analysis import xla
from gspmd.ir import Builder, Program, Value
from gspmd.runtime import epilogue, jax_backend, sim
from gspmd.sharding import Sharding
from gspmd.spmd.context import DeviceContext
from util import assert_close, rand

MESH = gspmd.Mesh(np.arange(8).reshape(2, 4), ("data", "tensor"))
OPTIMIZER = optax.adamw(1e-2, weight_decay=0.1)


def _train_step(params, opt_state, x, y):
    def loss(p):
        h = jnp.tanh(gspmd.mesh_split(x, MESH, ["data", None]) @ p["w1"] + p["b1"])
        h = gspmd.mesh_split(h, MESH, ["data", "tensor"])
        return jnp.mean((h @ p["w2"] - y) ** 2)
    value, grads = jax.value_and_grad(loss)(params)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value


def _inputs(rows=8, hidden=16):
    rng = np.random.RandomState(0)
    params = {"w1": rand(rng, 6, hidden), "b1": rand(rng, hidden), "w2": rand(rng, hidden, 3)}
    params = {"w1": gspmd.mesh_split(params["w1"], MESH, [None, "tensor"]),
              "b1": gspmd.mesh_split(params["b1"], MESH, ["tensor"]),
              "w2": gspmd.mesh_split(params["w2"], MESH, ["tensor", None])}
    return params, OPTIMIZER.init(params), rand(rng, rows, 6), rand(rng, rows, 3)


def _step_and_executable(*args, **jit_kwargs):
    step = gspmd.jit(_train_step, mesh=MESH, backend="jax", **jit_kwargs)
    return step, step.lower(*args).jax_executable()


def test_an_optimizers_update_runs_after_the_shard_map_as_jax_jit_computes_it():
    args = _inputs()
    step, exe = _step_and_executable(*args)
    assert exe.epilogue.instrs, "AdamW's update is element-wise"
    # Arguments: 3 parameters, the step count, 3 + 3 moments, x, y. The moments enter the
    # shard_map no more; the data and the parameters (the forward pass reads them) do.
    assert set(range(4, 10)).isdisjoint(exe.epilogue.arguments)
    assert {0, 1, 2, 10, 11} <= set(exe.epilogue.arguments)
    # New parameters and moments come from the tail: the shard_map hands out gradients.
    assert {exe.spmd.outputs[k] for k in (0, 1, 2, 4, 5, 6, 7, 8, 9)} <= exe.epilogue.made
    for _ in range(2):
        got, want = step(*args), jax.jit(_train_step)(*args)
        assert_close(got, want, rtol=1e-5, atol=1e-6)
        args = (*got[:2], *args[2:])


def test_xla_adds_no_collective_for_the_tail(monkeypatch):
    args = _inputs()
    with_tail = _step_and_executable(*args)[1].compiled.as_text()
    monkeypatch.setattr(epilogue, "liftable", lambda instr: False)      # every instruction per device
    _, inside = _step_and_executable(*args)
    assert not inside.epilogue.instrs
    assert xla.hlo_collective_bytes(with_tail) == xla.hlo_collective_bytes(inside.compiled.as_text())


def test_donated_state_is_updated_in_place():
    args = _inputs()
    step, exe = _step_and_executable(*args, donate_argnums=(0, 1))
    want = jax.jit(_train_step)(*args)
    placed = exe.place(jax.tree_util.tree_leaves(args)) or jax.tree_util.tree_leaves(args)
    treedef = jax.tree_util.tree_structure(args)
    got = step(*jax.tree_util.tree_unflatten(treedef, placed))
    assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert "input_output_alias" in exe.compiled.as_text()


def test_uneven_layouts_stay_inside_the_shard_map():
    """A hidden width of 10 over 4 devices has padded shards: their update stays per
    device (masked where it must be), the even ones leave."""
    args = _inputs(hidden=10)
    step, exe = _step_and_executable(*args)
    for i in exe.epilogue.instrs:
        assert all(exe.epilogue.global_of[i.outputs[0]].shape[d] % t == 0
                   for d, t in enumerate(exe.epilogue.global_of[i.outputs[0]].sharding.tiles))
    assert_close(step(*args), jax.jit(_train_step)(*args), rtol=1e-5, atol=1e-6)


def test_a_per_device_scalar_keeps_its_reader_inside():
    """x + (this device's id): per device, each shard gets its own id; after the
    shard_map the scalar would be one device's."""
    n = 8
    spmd = Program("case")
    b = Builder(spmd)
    ctx = DeviceContext(b, n)
    x = b.param((2, 3), np.float32)
    offset = b.add1("convert", [ctx.table_lookup(np.arange(n))], (), np.float32)
    twice = b.add1("multiply", [x, b.add1("broadcast", [ctx.constant(2.0, np.float32)], (2, 3), np.float32, dims=())],
                   (2, 3), np.float32)
    spmd.outputs = [b.add1("add", [twice, offset], (2, 3), np.float32)]
    tiled = Sharding.tiled(np.arange(n).reshape(n, 1))
    param, result = Value("x", (2 * n, 3), np.float32), Value("y", (2 * n, 3), np.float32)
    param.sharding = result.sharding = tiled
    exe = jax_backend.Executable(spmd, [param], [result], gspmd.Mesh(np.arange(n), ("d",)))
    assert [i.opcode for i in exe.epilogue.instrs] == []
    data = np.arange(2 * n * 3, dtype=np.float32).reshape(2 * n, 3)
    want = data * 2 + np.repeat(np.arange(n, dtype=np.float32), 2)[:, None]
    np.testing.assert_array_equal(np.asarray(exe([data])[0]), want)
    per_device = sim.run(spmd, [[s] for s in np.split(data, n)], n)
    np.testing.assert_array_equal(np.concatenate([r[0] for r in per_device]), want)


@settings(max_examples=12, deadline=None)
@given(rows=st.sampled_from([4, 6, 8, 12]), cols=st.sampled_from([3, 4, 8]),
       spec_a=st.sampled_from([("data", "tensor"), ("tensor", None), (None, "data"), (None, None)]),
       spec_b=st.sampled_from([("data", None), (None, "tensor"), ("tensor", "data")]))
def test_random_element_wise_tails_equal_numpy(rows, cols, spec_a, spec_b):
    """Two differently laid out inputs meet in an element-wise tail behind a matmul, on
    shapes that divide and that do not."""
    def f(a, b, s):
        a = gspmd.mesh_split(a, MESH, list(spec_a))
        b = gspmd.mesh_split(b, MESH, list(spec_b))
        m = (a @ b.T).sum()
        return a * 0.5 + b * s - m, jnp.exp(b) / (1.0 + a * a), s * 3
    rng = np.random.RandomState(rows * cols)
    a, b = rand(rng, rows, cols), rand(rng, rows, cols)
    s = np.float32(1.5)
    got = gspmd.jit(f, mesh=MESH, backend="jax")(a, b, s)
    want = (a * 0.5 + b * s - (a @ b.T).sum(), np.exp(b) / (1 + a * a), s * 3)
    assert_close(got, want, rtol=1e-5, atol=1e-5)
