"""End to end: MLP forward and train step equal one device, with the collectives the
strategy implies."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gspmd
from gspmd.models import mlp
from util import BYTES_RECEIVED, check, rand

MESH_SHAPES = [(1, 8), (2, 4), (4, 2), (8, 1)]


def _mesh(shape, permuted=False):
    devices = np.random.RandomState(sum(shape)).permutation(8) if permuted else np.arange(8)
    return gspmd.Mesh(devices.reshape(shape), ("data", "model"))


@pytest.mark.parametrize("shape", MESH_SHAPES)
@pytest.mark.parametrize("permuted", [False, True])
def test_mlp_forward(shape, permuted):
    mesh = _mesh(shape, permuted)
    rng = np.random.RandomState(0)

    def forward(x, w1, w2):
        x = gspmd.mesh_split(x, mesh, ["data", -1])
        w1 = gspmd.mesh_split(w1, mesh, [-1, "model"])
        return jax.nn.relu(x @ w1) @ w2

    # A permuted mesh scatters the model axis's groups over the torus, where tpu-v3's
    # latencies make a whole-mesh gather of these few bytes cheaper than a ring of long
    # hops: priced by bytes, Megatron's plan is the cheapest whatever the device order.
    low = check(forward, rand(rng, 16, 32), rand(rng, 32, 64), rand(rng, 64, 8), mesh=mesh,
                hardware=BYTES_RECEIVED if permuted else None)
    # Megatron: one all-reduce over the model axis, none when that axis has size 1.
    assert low.report().counts() == ({"all-reduce": 1} if shape[1] > 1 else {})


@pytest.mark.parametrize("shape", MESH_SHAPES)
@pytest.mark.parametrize("permuted", [False, True])
def test_mlp_train_step(shape, permuted):
    mesh = _mesh(shape, permuted)
    check(mlp.make_train_step(mesh), *mlp.example_inputs(), mesh=mesh)


def test_data_parallel_gradients_all_reduce_over_data_axis():
    mesh = _mesh((2, 4))
    data_groups = {tuple(int(d) for d in col) for col in mesh.devices.T}   # {0,4}, {1,5}, ...

    def loss(w, x):
        x = gspmd.mesh_split(x, mesh, ["data", -1])
        return jnp.mean(jnp.tanh(x @ w) ** 2)

    def step(w, x):
        return w - 0.1 * jax.grad(loss)(w, x)

    rng = np.random.RandomState(1)
    low = check(step, rand(rng, 32, 8), rand(rng, 16, 32), mesh=mesh)
    # Only "data" splits anything: the weight gradient and the loss's scalar normalizer
    # (jnp.mean's sum) are all-reduced over the data axis, nothing else is communicated.
    collectives = low.report().collectives
    assert {c.kind for c in collectives} == {"all-reduce"}
    for c in collectives:
        assert set(c.groups) == {tuple(sorted(g)) for g in data_groups}
    grad = [c for c in collectives if c.bytes == 32 * 8 * 4]
    assert len(grad) == 1, low.report()


def test_weight_update_sharding_gathers_weight_and_reduce_scatters_gradient():
    """Paper 3.2: x [B,D] split [0,-1], w [D,F] split [0,1]."""
    mesh = gspmd.Mesh(np.arange(8).reshape(2, 4), ("x", "y"))

    def loss(w, x):
        x = gspmd.mesh_split(x, mesh, [0, -1])
        w = gspmd.mesh_split(w, mesh, [0, 1])
        return jnp.sum(jnp.tanh(x @ w))

    def step(w, x):
        return w - 0.1 * jax.grad(loss)(w, x)

    rng = np.random.RandomState(2)
    low = check(step, rand(rng, 16, 32), rand(rng, 8, 16), mesh=mesh)
    kinds = [c.kind for c in low.report().collectives]
    assert kinds.count("all-gather") == 1 and kinds.count("reduce-scatter") == 1, low.report()
    gather = next(c for c in low.report().collectives if c.kind == "all-gather")
    scatter = next(c for c in low.report().collectives if c.kind == "reduce-scatter")
    assert gather.bytes == 16 * 8 * 4          # w gathered along D: [16, 32/4] floats
    assert scatter.bytes == 8 * 8 * 4          # dw scattered back to [16/2, 32/4]
    assert set(gather.groups) == set(scatter.groups) == {(0, 4), (1, 5), (2, 6), (3, 7)}
    assert low.sharding_of(0) == gspmd.Sharding.from_mesh(mesh, [0, 1], (16, 32))


def test_uneven_shapes_pad_and_mask():
    mesh = gspmd.Mesh(np.arange(8).reshape(2, 4), ("x", "y"))

    def f(a, b):
        a = gspmd.mesh_split(a, mesh, ["x", "y"])
        b = gspmd.mesh_split(b, mesh, ["y", -1])
        c = jnp.tanh(a @ b)
        return c, c.sum(0), c.max(1), jnp.mean(c), jnp.min(c, axis=0)

    rng = np.random.RandomState(3)
    check(f, rand(rng, 5, 7), rand(rng, 7, 3), mesh=mesh)
