"""The Conformer block (convolution module, attention, feed-forwards) partitioned: batch
over one mesh axis and time over the other, so the depthwise convolution exchanges halos;
and pipelined as in the paper's Table 5 (GPipe, circular, 1F1B), equal to one device."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gspmd
from gspmd.models import conformer, transformer
from util import BACKENDS, assert_close, check

MESH = gspmd.Mesh(np.arange(8).reshape(2, 4), ("x", "y"))


def test_conformer_train_step_with_time_split():
    cfg = conformer.Config(batch=4, seq=12, model=8, heads=2, head_dim=4, hidden=16, layers=2, kernel=3)
    params, x, target = conformer.example_inputs(cfg)
    annotate = transformer.gspmd_annotate(MESH)

    def step(params, x, target):
        def loss(params):
            h = x
            for p in params:
                h = conformer.layer(p, h, annotate, {"x": ["x", "y", -1]}, cfg)
            return jnp.mean((h - target) ** 2)
        return jax.value_and_grad(loss)(params)

    counts = check(step, params, x, target, mesh=MESH).report().counts()
    assert counts["collective-permute"] >= 2      # the depthwise convolution's halos, forward and backward
    assert "all-to-all" not in counts


# -- pipelined (Table 5): 2-4 stages on 8 simulated devices ----------------------------------------
PIPELINE_CASES = [   # the first on both backends; compiling the others for jax devices adds minutes, not coverage
    ((4, 2), ("p", "x"), "gpipe", 1, 3, BACKENDS),
    ((2, 4), ("p", "x"), "circular", 2, 3, ("sim",)),
    pytest.param((2, 2, 2), ("p", "x", "y"), "1f1b", 2, 4, ("sim",), marks=pytest.mark.slow),
]


@pytest.mark.parametrize("mesh_shape,axes,schedule,repeats,microbatches,backends", PIPELINE_CASES)
def test_pipelined_conformer_train_step_equals_one_device(mesh_shape, axes, schedule, repeats, microbatches,
                                                          backends):
    mesh = gspmd.Mesh(np.arange(8).reshape(mesh_shape), axes)
    stages = mesh_shape[0]
    cfg = conformer.Config(batch=4, seq=8, model=16, heads=2, head_dim=8, hidden=32, kernel=3, layers=stages * repeats,
                           lr=0.05)
    params, xs, ts = conformer.stacked_inputs(cfg, microbatches)
    step = conformer.make_train_step(mesh, cfg, model_axis="y" if "y" in axes else None, schedule=schedule,
                                     repeats=repeats)
    stacked = conformer.stage_major(params, stages, repeats)
    low = check(step, stacked, xs, ts, mesh=mesh, rtol=1e-4, atol=1e-5, backends=backends)
    report = low.report()
    assert report.pipelines[0].name == schedule and "all-gather" not in report.counts(), report
    assert all(p.sharding.tiles[0] == stages for p in low.program.params[:-2])   # every layer stack split by stage
    if schedule == "gpipe":   # the same training step as the layers applied in order on one device
        new, loss = jax.jit(step)(stacked, xs, ts)
        want_new, want_loss = jax.jit(conformer.reference_step(cfg))(params, xs, ts)
        assert_close((new, loss), (conformer.stage_major(want_new, stages, repeats), want_loss), rtol=1e-4,
                     atol=1e-5)
