"""Planning at paper scale: 2048 devices, abstract inputs, no execution; and the
planner's own train steps (gspmd plan), which must compute what one device does."""
import dataclasses

import jax
import numpy as np
import pytest

import gspmd
from gspmd import planning
from gspmd.analysis import PROFILES
from gspmd.models import transformer as T
from gspmd.spmd.cost import profile
from util import check


def test_dense_transformer_on_2048_devices_fits_and_estimates_a_step():
    mesh = gspmd.Mesh(np.arange(2048).reshape(32, 64), ("x", "y"))
    cfg = T.Config(batch=2048, seq=1024, model=8192, heads=128, head_dim=128, hidden=65536, layers=1)
    low = gspmd.jit(T.make_train_step(T.gspmd_annotate(mesh), cfg), mesh=mesh).lower(
        *T.example_inputs(cfg, abstract=True))
    report = low.report(hardware="tpu-v3")
    assert report.fits_in_memory, report.peak_memory_bytes
    assert 0 < report.compute_seconds < 1 and 0 < report.communication_seconds < 1
    # Collectives overlap with independent compute: the step lies between the two.
    assert max(report.compute_seconds, report.communication_seconds) <= report.step_seconds
    assert report.step_seconds <= report.compute_seconds + report.communication_seconds
    assert 0.2 < report.flops_utilization < 1
    # 2D finalized: weights (M over x) are all-gathered and their gradients reduce-scattered.
    assert {"all-gather", "reduce-scatter"} <= set(report.counts())
    assert "on tpu-v3" in str(report)
    # Every weight is split 2048 ways, as annotated.
    for name, shape in [("wq", (8192, 128, 128)), ("w_in", (8192, 65536))]:
        s = gspmd.Sharding.from_mesh(mesh, T.FINALIZED_2D[name], shape)
        assert s.num_replicas == 1


def test_dead_values_are_not_materialized():
    # jax keeps unused intermediates in the trace; they must not become per-device buffers.
    mesh = gspmd.Mesh(np.arange(8), ("x",))

    def f(x):
        _ = jax.numpy.zeros((4096, 4096)) + 1.0   # dead
        return gspmd.mesh_split(x, mesh, ["x"]) * 2

    low = gspmd.jit(f, mesh=mesh).lower(jax.ShapeDtypeStruct((64,), np.float32))
    assert low.report().peak_memory_bytes < 4096


def test_unknown_hardware_is_a_clear_error():
    low = gspmd.jit(lambda a: a + 1).lower(np.ones(4, np.float32))
    with pytest.raises(gspmd.ShardingError, match="tpu-v3"):
        low.report(hardware="abacus")
    with pytest.raises(gspmd.ShardingError, match="hardware"):
        low.report().step_seconds
    assert set(PROFILES) >= {"tpu-v3", "a100", "h100"}


def test_flops_count_dots_and_convolutions():
    x = jax.ShapeDtypeStruct((1, 2, 8, 8), np.float32)
    w = jax.ShapeDtypeStruct((4, 2, 3, 3), np.float32)
    conv = lambda x, w: jax.lax.conv_general_dilated(x, w, (1, 1), "SAME")   # noqa: E731
    assert gspmd.jit(conv).lower(x, w).report().flops == 2 * (4 * 8 * 8) * (2 * 3 * 3)
    a, b = jax.ShapeDtypeStruct((8, 16), np.float32), jax.ShapeDtypeStruct((16, 4), np.float32)
    assert gspmd.jit(lambda a, b: a @ b).lower(a, b).report().flops == 2 * 8 * 4 * 16


def test_peak_memory_counts_what_a_loop_body_holds():
    def f(x):
        return jax.lax.fori_loop(0, 3, lambda i, c: c + jax.numpy.outer(c, c) @ c, x)

    report = gspmd.jit(f).lower(jax.ShapeDtypeStruct((256,), np.float32)).report()
    assert report.peak_memory_bytes >= 256 * 256 * 4   # the [256, 256] outer product the body's dot reads


# -- the planner's train steps (gspmd plan) ---------------------------------------------------
SMALL = dict(layers=4, model_dim=64, ffn_dim=256, heads=4, head_dim=16, seq=32, batch=8, mesh=(2, 4))


def _concrete(case, seed=0):
    """Arrays for a planned case's abstract arguments: parameters and data random (token
    ids below 8: equal ones would leave attention's gradients near zero, which an
    optimizer's normalization amplifies), the optimizer's state positive (second
    moments), its step count zero, a dropout key."""
    rng = np.random.RandomState(seed)

    def fill(path, s):
        if jax.dtypes.issubdtype(s.dtype, jax.dtypes.prng_key):
            return jax.random.key(seed)
        if np.issubdtype(s.dtype, np.integer):
            return rng.randint(0, 8, s.shape).astype(s.dtype) if s.shape else np.zeros(s.shape, s.dtype)
        x = rng.standard_normal(s.shape) * 0.1
        return (np.abs(x) + 0.01 if len(case.args) == 4 and path[0].idx == 1 else x).astype(s.dtype)
    return jax.tree_util.tree_map_with_path(fill, tuple(case.args))


@pytest.mark.parametrize("model, sizes", [
    ("transformer", dict(SMALL, layers=2, seq=16, remat="dots_saveable")),
    ("hybrid-moe", dict(layers=2, model_dim=32, ffn_dim=64, heads=4, head_dim=8, seq=16, experts=2, batch=4,
                        mesh=(2, 4), remat="dots_with_no_batch_dims_saveable")),
    ("transformer", dict(SMALL, layers=4, seq=8, batch=4, mesh=(2, 2, 2), stages=2, microbatches=2,
                         schedule="circular", repeats=2, remat="nothing_saveable")),
    ("transformer", dict(SMALL, layers=4, seq=8, batch=4, mesh=(2, 2, 2), stages=2, microbatches=2,
                         schedule="1f1b", repeats=2, remat="rerun")),
    ("transformer", dict(SMALL, layers=2, seq=16, remat="rerun", microbatches=2)),
    ("transformer", dict(SMALL, layers=4, seq=8, batch=4, mesh=(2, 2, 2), stages=2, microbatches=2,
                         schedule="1f1b", remat="rerun", dropout=0.1, vocab=64, strategy="megatron")),
])
def test_planned_train_steps_equal_the_single_device_step(model, sizes):
    """What `gspmd plan` partitions (rematerialized layers, a circular pipeline with its
    parameters stage by stage, donated parameters) computes the single-device step."""
    case = planning.build(model, planning.Sizes(activation_dtype="float32", **sizes), profile("tpu-v3"))
    check(case.step, *_concrete(case), mesh=case.mesh, rtol=2e-3, atol=2e-4)


def test_planned_train_steps_update_parameters_and_optimizer_state_in_place():
    p = planning.plan("transformer", planning.Sizes(**SMALL))
    updated = sum(v.nbytes for v in p.lowered.spmd.params[:-2])     # all but the data
    assert p.report.memory.aliased_bytes == updated and p.report.memory.results_bytes == 4   # the loss


def test_remat_auto_rematerializes_as_little_as_fits():
    peaks = {policy: planning.plan("transformer", planning.Sizes(**SMALL, remat=policy)).report.peak_memory_bytes
             for policy in planning.FIT_ORDER}
    assert peaks[None] > peaks["dots_saveable"] > peaks["dots_with_no_batch_dims_saveable"] > \
        peaks["nothing_saveable"], peaks
    # the least dots_saveable comes down to where the compiler recomputes all it can to fit
    tiny = dataclasses.replace(profile("tpu-v3"), name="tiny", memory_bytes=1, reserved_bytes=0)
    floor = planning.plan("transformer", planning.Sizes(**SMALL, remat="dots_saveable"), tiny).report.peak_memory_bytes
    assert peaks["dots_saveable"] > floor > peaks["dots_with_no_batch_dims_saveable"]
    limit = (floor + peaks["dots_with_no_batch_dims_saveable"]) // 2
    small = dataclasses.replace(profile("tpu-v3"), name="small", memory_bytes=limit, reserved_bytes=0)
    chosen = planning.plan("transformer", planning.Sizes(**SMALL, remat="auto"), small)
    assert chosen.case.sizes["remat"] == "dots_with_no_batch_dims_saveable" and chosen.report.fits_in_memory
    assert chosen.report.recompute_fraction > 0
