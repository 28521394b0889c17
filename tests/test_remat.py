"""Rematerialization (jax.checkpoint): the backward pass recomputes what the policy does
not save; recomputed values and their reshards are not merged with the forward pass's,
so activations die early and the memory report shows the saving."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name

import gspmd
from gspmd import recipes
from util import check, rand

MESH = gspmd.Mesh(np.arange(8).reshape(2, 4), ("x", "y"))
POLICIES = {
    "none": None,
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "everything_saveable": jax.checkpoint_policies.everything_saveable,
    "save_only_these_names": jax.checkpoint_policies.save_only_these_names("hidden"),
}


def _layer(x, w1, w2):
    w1 = gspmd.mesh_split(w1, MESH, [-1, "y"])
    h = checkpoint_name(jax.nn.gelu(x @ w1), "hidden")
    return x + jnp.tanh(h @ w2)


def _stack_loss(policy, layers_remat=True):
    """A scan over stacked layers (batch over x, hidden over y), remat per layer."""
    def loss(x, w1s, w2s):
        x = gspmd.mesh_split(x, MESH, ["x", -1])
        layer = _layer if not layers_remat else jax.checkpoint(_layer, policy=policy)

        def step(carry, ws):
            return layer(carry, *ws), None
        y, _ = jax.lax.scan(step, x, (w1s, w2s))
        return jnp.mean(y ** 2)
    return loss


def _args(rng, batch=16, model=8, hidden=32, layers=3):
    return rand(rng, batch, model), rand(rng, layers, model, hidden) * 0.3, rand(rng, layers, hidden, model) * 0.3


@pytest.mark.parametrize("policy", list(POLICIES))
def test_remat_policies_through_scan_and_grad(policy):
    rng = np.random.RandomState(0)
    grad = jax.grad(_stack_loss(POLICIES[policy]), argnums=(0, 1, 2))
    check(grad, *_args(rng, batch=13), mesh=MESH)   # 13: uneven over x


def test_recomputed_values_are_not_merged_with_the_forward_pass():
    """With remat the forward all-reduce of the second matmul runs again in the backward
    pass (recomputation), instead of being shared with the forward."""
    rng = np.random.RandomState(1)
    x, w1, w2 = rand(rng, 16, 8), rand(rng, 8, 32), rand(rng, 32, 8)

    def loss(remat):
        def f(x, w1, w2):
            x = gspmd.mesh_split(x, MESH, ["x", -1])
            layer = jax.checkpoint(_layer) if remat else _layer
            return jnp.sum(layer(x, w1, w2) ** 2)
        return jax.grad(f, argnums=(1, 2))

    plain = gspmd.jit(loss(False), mesh=MESH).lower(x, w1, w2).report().counts()
    remat = check(loss(True), x, w1, w2, mesh=MESH).report().counts()
    assert remat["all-reduce"] == plain["all-reduce"] + 1


def test_remat_lowers_peak_memory():
    rng = np.random.RandomState(2)
    args = _args(rng, batch=256, model=16, hidden=256, layers=6)
    peaks = {}
    for name, remat in [("saved", False), ("recomputed", True)]:
        grad = jax.grad(_stack_loss(jax.checkpoint_policies.nothing_saveable, layers_remat=remat), argnums=(1, 2))
        peaks[name] = gspmd.jit(grad, mesh=MESH).lower(*args).report().peak_memory_bytes
    assert peaks["recomputed"] < 0.75 * peaks["saved"], peaks


def test_offload_policies_are_a_clear_error():
    policy = jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host")
    grad = jax.grad(_stack_loss(policy), argnums=(1, 2))
    with pytest.raises(gspmd.ShardingError, match="offload"):
        gspmd.jit(grad, mesh=MESH).lower(*_args(np.random.RandomState(3)))


def _rerun_stack_loss(rerun):
    """_stack_loss's layers with dropout on the hidden units, each layer its own key."""
    def layer(x, xs):
        w1, w2, key = xs
        w1 = gspmd.mesh_split(w1, MESH, [-1, "y"])
        h = jax.nn.gelu(x @ w1) * jax.random.bernoulli(key, 0.9, (x.shape[0], w1.shape[1]))
        return x + h @ w2, None

    def loss(x, w1s, w2s, key):
        x = gspmd.mesh_split(x, MESH, ["x", -1])
        keys = jax.random.split(key, w1s.shape[0])
        y, _ = jax.lax.scan(recipes.rerun_forward(layer) if rerun else jax.checkpoint(layer), x, (w1s, w2s, keys))
        return jnp.mean(y ** 2)
    return jax.grad(loss, argnums=(0, 1, 2))


def test_rerun_forward_recomputes_the_whole_layer_as_torch_checkpoint_does():
    """recipes.rerun_forward (--remat rerun, Megatron-LM's --checkpoint-activations):
    the gradient of jax.checkpoint's, and the backward pass recomputes the layer's last
    matmul too, which jax.checkpoint leaves out (the gradient does not need its output)."""
    batch, model, hidden, layers = 13, 8, 32, 3      # 13: uneven over x
    args = (*_args(np.random.RandomState(4), batch, model, hidden, layers), jax.random.key(5))
    rerun = check(_rerun_stack_loss(True), *args, mesh=MESH).report()
    remat = gspmd.jit(_rerun_stack_loss(False), mesh=MESH).lower(*args).report()
    last_matmul, residual_add = 2 * 7 * (hidden // 4) * model, 7 * model   # per device: 7 rows of 13 (x)
    assert rerun.recompute_flops - remat.recompute_flops == layers * (last_matmul + residual_add)
    assert rerun.counts()["all-reduce"] == remat.counts()["all-reduce"] + 1   # so does its sum over y
