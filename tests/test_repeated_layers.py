"""A program that repeats itself (unrolled layers, their gradients) is partitioned once
per distinct op, layout and shape: the later copies replay the first one's per-device
code on their own operands, collectives and their provenance included."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gspmd
from gspmd.spmd import factors
from util import check, rand

MESH = gspmd.Mesh(np.arange(8).reshape(2, 4), ("data", "model"))


def make_step():
    def loss(ws, x):
        x = gspmd.mesh_split(x, MESH, ["data", -1])
        for w_in, w_out in ws:
            w_in = gspmd.mesh_split(w_in, MESH, [-1, "model"])
            w_out = gspmd.mesh_split(w_out, MESH, ["model", -1])
            x = x + jnp.tanh(x @ w_in) @ w_out     # Megatron's MLP: one all-reduce forward
        return jnp.mean(x ** 2)

    def step(ws, x):
        return jax.tree_util.tree_map(lambda w, g: w - 0.1 * g, ws, jax.grad(loss)(ws, x))
    return step


def inputs(layers: int, hidden: int = 32, batch: int = 8):
    rng = np.random.RandomState(0)
    return [(rand(rng, 16, hidden) * 0.3, rand(rng, hidden, 16) * 0.3) for _ in range(layers)], rand(rng, batch, 16)


def rule_runs(layers: int) -> int:
    """How often the common factor rule made per-device code for the step."""
    calls = []
    original = factors.run

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)
    factors.run = counted
    try:
        gspmd.jit(make_step(), mesh=MESH).lower(*inputs(layers))
    finally:
        factors.run = original
    return len(calls)


def test_more_layers_replay_the_first_layers_code():
    # 4x the layers: the rule runs for what is new (the first and last layers differ
    # from the middle ones: the input, the loss's gradient), not once per copy.
    assert rule_runs(8) <= rule_runs(2) + 4


@pytest.mark.parametrize("hidden, batch", [(32, 8), (30, 7)])   # even, and split unevenly (padded, masked)
def test_replayed_layers_equal_one_device_with_their_own_collectives(hidden, batch):
    layers = 6
    low = check(make_step(), *inputs(layers, hidden, batch), mesh=MESH)
    reduces = [c for c in low.report().collectives if c.kind == "all-reduce"]
    over_model = {tuple(int(d) for d in row) for row in MESH.devices}
    over_data = {tuple(int(d) for d in col) for col in MESH.devices.T}
    tensor = [c for c in reduces if set(c.groups) == over_model]
    weights = [c for c in reduces if set(c.groups) == over_data]
    # per layer the forward's partial sums and the input gradient's (but the first
    # layer's: x's gradient is not asked for); per weight a data-parallel gradient sum
    assert len(tensor) == 2 * layers - 1, low.report()
    assert len(weights) >= 2 * layers, low.report()
    # each replayed collective names its own instruction, not the one first partitioned
    names = [re.match(r"%(\S+) =", c.origin).group(1) for c in tensor]
    assert len(set(names)) == len(names), [c.origin for c in tensor]
    assert all("partial results" in c.origin for c in tensor), [c.origin for c in tensor]
    assert all("test_repeated_layers.py" in c.source for c in tensor), [c.source for c in tensor]
