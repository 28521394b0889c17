"""Pipelining reduced to sharding: GPipe and circular schedules equal the layers applied
in order, forward and backward."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gspmd
from util import check, rand

MESH = gspmd.Mesh(np.arange(8).reshape(4, 2), ("p", "d"))


def stage_fn(w, x):
    return jnp.tanh(x @ w)


def sequential(ws, xs):
    def one(x):
        for w in ws:
            x = stage_fn(w, x)
        return x
    return jnp.stack([one(x) for x in xs])


@pytest.mark.parametrize("schedule,repeats,microbatches", [("gpipe", 1, 6), ("gpipe", 1, 3), ("circular", 2, 8)])
def test_pipeline_equals_layers_in_order(schedule, repeats, microbatches):
    rng = np.random.RandomState(0)
    ws, xs = rand(rng, 4 * repeats, 8, 8) / 3, rand(rng, microbatches, 2, 8)

    def f(ws, xs):
        return gspmd.pipeline(stage_fn, ws, xs, mesh=MESH, stage_axis="p", schedule=schedule, repeats=repeats)

    np.testing.assert_allclose(jax.jit(f)(ws, xs), sequential(ws, xs), rtol=1e-5, atol=1e-5)
    low = check(f, ws, xs, mesh=MESH)
    if repeats == 1:   # the layer stack stays split by stage: no device holds another stage's layers
        assert low.program.params[0].sharding.tiles[0] == 4


def test_pipeline_gradients():
    rng = np.random.RandomState(1)
    ws, xs = rand(rng, 4, 8, 8) / 3, rand(rng, 4, 2, 8)

    def step(ws, xs):
        loss = lambda w: jnp.sum(gspmd.pipeline(stage_fn, w, xs, mesh=MESH, stage_axis="p") ** 2)
        return ws - 0.1 * jax.grad(loss)(ws)

    check(step, ws, xs, mesh=MESH)


def test_pipeline_rejects_bad_configurations():
    ws, xs = np.zeros((8, 4, 4), np.float32), np.zeros((6, 2, 4), np.float32)
    with pytest.raises(gspmd.ShardingError, match="repeats"):
        gspmd.pipeline(stage_fn, ws, xs, mesh=MESH, stage_axis="p", schedule="gpipe", repeats=2)
    with pytest.raises(gspmd.ShardingError, match="multiple of 4"):
        gspmd.pipeline(stage_fn, ws, xs, mesh=MESH, stage_axis="p", schedule="circular", repeats=2)
    with pytest.raises(gspmd.ShardingError, match="leading layer dim"):
        gspmd.pipeline(stage_fn, ws[:5], xs, mesh=MESH, stage_axis="p")
    with pytest.raises(gspmd.ShardingError, match="schedule"):
        gspmd.pipeline(stage_fn, ws[:4], xs, mesh=MESH, stage_axis="p", schedule="1f1b")


def test_shift_is_one_collective_permute_per_step():
    rng = np.random.RandomState(2)
    ws, xs = rand(rng, 4, 8, 8) / 3, rand(rng, 6, 2, 8)
    f = lambda ws, xs: gspmd.pipeline(stage_fn, ws, xs, mesh=MESH, stage_axis="p")   # noqa: E731
    report = gspmd.jit(f, mesh=MESH).lower(ws, xs).report()
    permutes = [c for c in report.collectives if c.kind == "collective-permute"]
    assert len(permutes) == 1 and permutes[0].executions == 6 + 4 - 1, report
    assert permutes[0].bytes == 2 * 8 * 4                      # one microbatch per device
    assert "all-gather" not in report.counts(), report
    # The ring: the device of stage s sends to the device of stage s+1 (same "d" column).
    assert {(int(a), int(b)) for a, b in permutes[0].groups} == {(0, 2), (2, 4), (4, 6), (6, 0), (1, 3), (3, 5),
                                                                 (5, 7), (7, 1)}


def test_pipelined_transformer_train_step():
    from gspmd.models import pipelined, transformer
    mesh = gspmd.Mesh(np.arange(8).reshape(4, 2), ("p", "x"))
    cfg = transformer.Config(layers=4)
    low = check(pipelined.make_train_step(mesh, cfg), *pipelined.example_inputs(cfg, microbatches=4), mesh=mesh,
                rtol=1e-3, atol=1e-4)
    report = low.report()
    shifts = [c for c in report.collectives if c.kind == "collective-permute"]
    assert shifts and all(c.executions == 4 + 4 - 1 for c in shifts)   # forward and backward shifts
    assert "all-gather" not in report.counts(), report                  # no stage ever gathers the buffer
    assert low.program.params[0].sharding.tiles[0] == 4    # each stage holds only its layer
