"""A deep MLP whose layers are one `jax.lax.scan` over stacked weights: the form of
step gspmd.auto may pipeline (autoshard/stacks.py)."""
from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np


def make_train_step(scan: Optional[Callable] = None) -> Callable:
    """step(params, x, y) -> (new params, loss): embed, the scan over the stacked layers
    (tanh(h @ w + b) each), a head, mean squared error; SGD. `scan` stands in for
    jax.lax.scan (looked up when called, as a user's code does): a plan's
    pipelined_layers, say."""
    def layer(h, w):
        return jnp.tanh(h @ w["w"] + w["b"]), None

    def loss(params, x, y):
        h, _ = (scan or jax.lax.scan)(layer, x @ params["embed"], params["layers"])
        return jnp.mean((h @ params["head"] - y) ** 2)

    def step(params, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads), value
    return step


def example_inputs(width: int, layers: int, batch: int, features: int = 8, outputs: int = 4, seed: int = 0,
                   abstract: bool = False) -> tuple:
    """(params, x, y), random (or their jax.ShapeDtypeStructs)."""
    rng = np.random.RandomState(seed)

    def rand(*shape):
        if abstract:
            return jax.ShapeDtypeStruct(shape, jnp.float32)
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
    params = {"embed": rand(features, width), "head": rand(width, outputs),
              "layers": {"w": rand(layers, width, width), "b": rand(layers, width)}}
    return params, rand(batch, features), rand(batch, outputs)
