"""The jax backend: each collective lowering equals the sim's semantics device by device,
outputs carry our sharding as a NamedSharding, inputs in our layout are used in place,
one compile per signature, and a clear error for an opcode it cannot lower."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gspmd
from gspmd import ops
from gspmd.analysis import xla
from gspmd.frontend.annotation import mesh_split_as
from gspmd.ir import Builder, Program, Value
from gspmd.models import mlp
from gspmd.runtime import jax_backend, sim
from gspmd.sharding import Sharding
from gspmd.ir.reducer import ADD, AND, MAX, MIN, MUL, OR
from gspmd.spmd.context import DeviceContext, Why
from util import assert_close, check, rand

N = 8
MESH = gspmd.Mesh(np.arange(N).reshape(2, 4), ("x", "y"))
PAIRED = [[4, 0], [5, 1], [6, 2], [7, 3]]          # non-contiguous, members out of order
QUADS = [[3, 1, 0, 2], [7, 6, 4, 5]]


def _run_both(emit, local_shape=(4, 6), dtype=np.float32, poke_nan=False):
    """Build a one-output SPMD program with emit(ctx, param), run it on the sim and on
    jax devices, and compare every device's result."""
    spmd = Program("case")
    b = Builder(spmd)
    ctx = DeviceContext(b, N)
    out = emit(ctx, b.param(local_shape, dtype))
    spmd.outputs = [out]
    tiled = Sharding.tiled(np.arange(N).reshape((N,) + (1,) * (len(local_shape) - 1)))
    param = Value("x", (N * local_shape[0],) + local_shape[1:], dtype)
    param.sharding = tiled
    result = Value("y", (N * out.shape[0],) + out.shape[1:], out.dtype)
    result.sharding = tiled
    per_device = [rand(np.random.RandomState(d), *local_shape).astype(dtype) for d in range(N)]
    if poke_nan:
        per_device[5][1, 2] = np.nan
    expected = [r[0] for r in sim.run(spmd, [[x] for x in per_device], N)]
    exe = jax_backend.Executable(spmd, [param], [result], gspmd.Mesh(np.arange(N), ("d",)))
    (raw,) = exe([np.concatenate(per_device)])
    for d, (got, want) in enumerate(zip(np.split(np.asarray(raw), N), expected)):
        np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=f"device {d}")


@pytest.mark.parametrize("reducer", [ADD, MAX, MIN, MUL])
@pytest.mark.parametrize("groups", [PAIRED, QUADS, [list(range(N))]])
def test_all_reduce(reducer, groups):
    _run_both(lambda ctx, x: ctx.all_reduce(x, groups, reducer, Why.RESHARD), poke_nan=reducer is MAX)


@pytest.mark.parametrize("reducer", [AND, OR])
def test_all_reduce_booleans(reducer):
    def emit(ctx, x):
        positive = ctx.b.add1("compare", [x, ctx.b.add1("broadcast", [ctx.constant(np.float32(0))], x.shape,
                                                       x.dtype, dims=())], x.shape, np.bool_, direction="GT")
        return ctx.all_reduce(positive, QUADS, reducer, Why.RESHARD)
    _run_both(emit)


@pytest.mark.parametrize("groups", [PAIRED, QUADS])
@pytest.mark.parametrize("dim", [0, 1])
def test_all_gather(groups, dim):
    _run_both(lambda ctx, x: ctx.all_gather(x, dim, groups, Why.RESHARD))


@pytest.mark.parametrize("reducer", [ADD, MAX])
def test_reduce_scatter(reducer):
    _run_both(lambda ctx, x: ctx.reduce_scatter(x, 1, PAIRED, reducer, Why.RESHARD), local_shape=(2, 8))


def test_all_to_all():
    _run_both(lambda ctx, x: ctx.all_to_all(x, 0, 1, QUADS, Why.RESHARD))


@pytest.mark.parametrize("pairs", [[(0, 1), (1, 2), (2, 0), (6, 7)],          # devices 3..6 get zeros
                                   [(0, 1), (0, 2), (3, 0), (3, 5)]])         # sources send twice
def test_collective_permute(pairs):
    _run_both(lambda ctx, x: ctx.collective_permute(x, pairs, Why.RESHARD))


@pytest.mark.parametrize("update", [False, True])
def test_dynamic_slices_clamp_starts_like_hlo(update):
    def emit(ctx, x):
        start = ctx.table_lookup(np.arange(N)[::-1] * 3 - 9)     # some negative, some past the end
        starts = [start, ctx.constant(np.int32(1))]
        if not update:
            return ctx.dynamic_slice(x, starts, (2, 3))
        piece = ctx.b.add1("slice", [x], (2, 3), x.dtype, start=(0, 0), limit=(2, 3), strides=(1, 1))
        return ctx.b.add1("dynamic-update-slice", [x, piece, *starts], x.shape, x.dtype)
    _run_both(emit)


def _mlp(x, w1, w2):
    x = gspmd.mesh_split(x, MESH, ["x", -1])
    w1 = gspmd.mesh_split(w1, MESH, [-1, "y"])
    return jax.nn.relu(x @ w1) @ w2


def _mlp_args(batch=8):
    rng = np.random.RandomState(0)
    return rand(rng, batch, 16), rand(rng, 16, 32), rand(rng, 32, 4)


@pytest.mark.parametrize("pool", [jax.lax.max, jax.lax.min, jax.lax.add])
def test_pooling_and_its_gradient_on_a_split_dim(pool):
    init = {jax.lax.max: -np.inf, jax.lax.min: np.inf, jax.lax.add: 0.0}[pool]

    def loss(x):
        x = gspmd.mesh_split(x, MESH, [-1, "x", "y"])
        y = jax.lax.reduce_window(x, init, pool, (1, 3, 2), (1, 2, 2), ((0, 0), (1, 1), (0, 1)))
        return (y ** 2).sum()
    x = rand(np.random.RandomState(4), 2, 9, 10)
    check(jax.grad(loss), x, mesh=MESH, backends=("jax",))


def test_outputs_carry_our_sharding_and_inputs_in_place():
    step = gspmd.jit(_mlp, mesh=MESH, backend="jax")
    args = _mlp_args()
    out = step(*args)
    low = step.lower(*args)
    assert isinstance(out, jax.Array)
    for shard in out.addressable_shards:
        want = sim.tile_slices(low.sharding_of(0), out.shape, jax.devices().index(shard.device))
        assert [s.indices(n)[:2] for s, n in zip(shard.index, out.shape)] == [(s.start, s.stop) for s in want]
    # A jax.Array already in our layout is used as it is; any other layout is moved once.
    exe = low.jax_executable()
    x = jax.device_put(args[0], exe.input_sharding(0))
    assert exe.place([x, *args[1:]]) is None
    assert_close(step(x, *args[1:]), jax.jit(_mlp)(*args))
    elsewhere = jax.device_put(args[0], jax.devices()[3])
    assert exe.place([elsewhere, *args[1:]])[0].sharding == exe.input_sharding(0)
    assert_close(step(elsewhere, *args[1:]), jax.jit(_mlp)(*args))


def test_uneven_outputs_are_assembled():
    args = _mlp_args(batch=5)
    out = gspmd.jit(_mlp, mesh=MESH, backend="jax")(*args)
    assert out.shape == (5, 4) and out.sharding.is_fully_replicated
    assert_close(out, jax.jit(_mlp)(*args))


def test_uneven_outputs_are_gathered_only_over_their_split():
    """An output split unevenly over "y" only is gathered among the 4 devices of each
    row that hold one copy, not among all 8."""
    a = np.arange(30, dtype=np.float32).reshape(10, 3)
    low = gspmd.jit(lambda x: gspmd.mesh_split(x * 2, MESH, ["y", None]), mesh=MESH, backend="jax").lower(a)
    np.testing.assert_array_equal(low.jax_executable()([a])[0], a * 2)
    assert xla.hlo_collective_bytes(low.jax_executable().compiled.as_text()) == {"all-gather": 4 * 3 * 3 * 4}


def test_compiled_once_per_signature_with_native_collectives():
    step = gspmd.jit(_mlp, mesh=MESH, backend="jax")
    args = _mlp_args()
    step(*args)
    compiled = step.lower(*args).jax_executable().compiled
    step(*(jnp.asarray(a) for a in args))
    assert step.lower(*args).jax_executable().compiled is compiled
    hlo = compiled.as_text()
    assert "replica_groups={{0,1,2,3},{4,5,6,7}}" in hlo
    assert xla.hlo_collective_bytes(hlo) == {"all-reduce": 4 * 4 * 4}   # [8/2, 4] partial sums


def test_independent_reduce_scatters_run_as_one():
    """Contracting-split dots whose results stay split: two reduce-scatters along
    different dims, each read at once by a transpose, run as one on the jax backend
    (XLA:CPU combines no reduce-scatters itself), their readers after it; the one that
    reads the first's result waits for it. An uneven split (all-reduce) runs alone."""
    def f(a, b, c, d, e, g):
        a, c = (gspmd.mesh_split(v, MESH, [-1, "y"]) for v in (a, c))
        b, d, e, g = (gspmd.mesh_split(v, MESH, ["y", -1]) for v in (b, d, e, g))
        r1 = gspmd.mesh_split(a @ b, MESH, ["y", -1]).T
        r2 = gspmd.mesh_split(c @ d, MESH, ["y", -1]).T
        r3 = gspmd.mesh_split(a @ e, MESH, [-1, "y"]).T * 2.0
        chained = gspmd.mesh_split(gspmd.mesh_split(r1, MESH, [-1, "y"]) @ g, MESH, [-1, "y"])
        return r1, r2, r3, chained
    rng = np.random.RandomState(3)
    args = (rand(rng, 8, 16), rand(rng, 16, 12), rand(rng, 10, 16), rand(rng, 16, 6), rand(rng, 16, 8),
            rand(rng, 8, 12))
    low = check(f, *args, mesh=MESH)
    # (r2's uneven result is all-reduced, or, where the planner's hardware finds that no
    # cheaper, made by resharding its operands: either runs alone.)
    assert low.report().counts()["reduce-scatter"] == 3, low.report()
    hlo = low.jax_executable().compiled.as_text()
    assert len(re.findall(r" reduce-scatter\(", hlo)) == 2, hlo   # r1 and r3 side by side, then the chained one


def test_hlo_collective_bytes_reads_tuples_and_async_pairs_once():
    hlo = """
  %a = (f32[2,4]{1,0}, f32[2,4]{1,0}, f32[2,4]{1,0}, f32[2,4]{1,0}, f32[2,4]{1,0}, /*index=5*/f32[2,4]{1,0}) all-to-all(%x)
  %b = bf16[8]{0} all-gather-start(%y), dimensions={0}
  %c = bf16[8]{0} all-gather-done(%b)
  %d = f32[] all-reduce(%z), to_apply=%add"""
    assert xla.hlo_collective_bytes(hlo) == {"all-to-all": 6 * 8 * 4, "all-gather": 16, "all-reduce": 4}


def test_missing_lowering_names_the_opcode(monkeypatch):
    monkeypatch.setattr(ops.lookup("maximum").semantics, "lower", None)
    with pytest.raises(gspmd.ShardingError, match="no lowering for opcode 'maximum'"):
        gspmd.jit(_mlp, mesh=MESH, backend="jax")(*_mlp_args())


def test_too_few_devices_is_a_clear_error():
    mesh = gspmd.Mesh(np.arange(16).reshape(4, 4), ("x", "y"))
    f = gspmd.jit(lambda a: gspmd.mesh_split(a, mesh, ["x", "y"]) * 2, backend="jax")
    with pytest.raises(gspmd.ShardingError, match="16 devices but jax has 8"):
        f(np.ones((4, 4), np.float32))


def test_outputs_share_the_users_mesh_and_meet_in_one_jax_jit():
    mesh = gspmd.Mesh(np.random.RandomState(0).permutation(N).reshape(2, 4), ("x", "y"))
    step = mlp.make_train_step(mesh, "x", "y")
    args = mlp.example_inputs()
    (w1, w2), loss = gspmd.jit(step, mesh=mesh, backend="jax")(*args)
    assert w1.sharding.mesh.axis_names == ("x", "y") and w1.sharding.spec == jax.sharding.PartitionSpec(None, "y")
    total = jax.jit(lambda a, b: a.sum() + b.sum())(w1, w2)     # same device order: no error
    np.testing.assert_allclose(total, np.asarray(w1).sum() + np.asarray(w2).sum(), rtol=1e-5)


def test_mesh_split_as_hands_the_annotations_to_xla():
    mesh = gspmd.Mesh(np.arange(N)[::-1].reshape(2, 4), ("x", "y"))
    with mesh_split_as(xla.xla_constraint):
        step = jax.jit(mlp.make_train_step(mesh, "x", "y"))
        args = mlp.example_inputs()
        compiled = step.lower(*args).compile()
    (w1, _), _ = compiled.output_shardings
    assert list(w1.mesh.devices.ravel()) == jax.devices()[::-1] and w1.spec == jax.sharding.PartitionSpec(None, "y")
    assert_close(step(*args), jax.jit(mlp.make_train_step(mesh, "x", "y"))(*args))
