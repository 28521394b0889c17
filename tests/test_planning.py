"""Planning at paper scale: 2048 devices, abstract inputs, no execution."""
import jax
import numpy as np
import pytest

import gspmd
from gspmd.analysis import PROFILES
from gspmd.models import transformer as T


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
