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
