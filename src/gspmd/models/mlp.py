"""A 2-layer MLP train step with data- and model-parallel annotations (paper 3.2)."""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from gspmd.frontend import mesh_split
from gspmd.mesh import Mesh


def annotations(data_axis: str, model_axis: str) -> dict[str, list]:
    """dims_mapping per annotated tensor, for printing and for the step."""
    return {"x": [data_axis, -1], "w1": [-1, model_axis], "h": [data_axis, model_axis],
            "w2": [model_axis, -1]}


def make_train_step(mesh: Optional[Mesh], data_axis: str = "data", model_axis: str = "model", lr: float = 0.1):
    """The annotated step; with mesh None, the same step without annotations (for gspmd.auto)."""
    spec = annotations(data_axis, model_axis)

    def split(x, name):
        return x if mesh is None else mesh_split(x, mesh, spec[name])

    def loss(params, x, y):
        w1, w2 = params
        x, w1, w2 = split(x, "x"), split(w1, "w1"), split(w2, "w2")
        h = split(jax.nn.relu(x @ w1), "h")
        return jnp.mean((h @ w2 - y) ** 2)

    def train_step(params, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        new_params = jax.tree_util.tree_map(lambda p, g: p - lr * g, params, grads)
        return new_params, value

    return train_step


def example_inputs(batch: int = 16, d_in: int = 32, hidden: int = 64, d_out: int = 8, seed: int = 0):
    rng = np.random.RandomState(seed)
    params = (rng.standard_normal((d_in, hidden)).astype(np.float32) / np.sqrt(d_in),
              rng.standard_normal((hidden, d_out)).astype(np.float32) / np.sqrt(hidden))
    x = rng.standard_normal((batch, d_in)).astype(np.float32)
    y = rng.standard_normal((batch, d_out)).astype(np.float32)
    return params, x, y
