"""A small 3D U-Net train step with spatial partitioning (paper 5.6): conv, max-pool,
conv, transposed-conv upsample, concatenated skip connection, conv head. Only the input
image is annotated (its depth/height/width split over mesh axes); propagation carries
the split through every layer, and convolutions and pooling exchange halos."""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gspmd.frontend import mesh_split
from gspmd.mesh import Mesh

DN = ("NCDHW", "OIDHW", "NCDHW")


def init_params(rng: np.random.RandomState, channels: int = 2, width: int = 4) -> dict[str, np.ndarray]:
    def conv(cout, cin, k=3):
        return (rng.standard_normal((cout, cin, k, k, k)) / np.sqrt(cin * k ** 3)).astype(np.float32)
    return {"enc1": conv(width, channels), "enc2": conv(2 * width, width), "up": conv(width, 2 * width),
            "dec": conv(width, 2 * width), "head": conv(1, width, 1)}


def forward(params: dict, x, mesh: Optional[Mesh], spatial_axes, batch_axis=-1) -> jax.Array:
    """x: [batch, channels, depth, height, width]; spatial_axes: mesh axes (or -1) for
    depth, height and width; batch_axis: the mesh axis of data parallelism (or -1).
    With mesh None, no annotation (for gspmd.auto)."""
    if mesh is not None:
        x = mesh_split(x, mesh, [batch_axis, -1, *spatial_axes])

    def conv(x, w, **kw):
        return lax.conv_general_dilated(x, w, (1, 1, 1), kw.pop("padding", "SAME"), dimension_numbers=DN, **kw)
    e1 = jax.nn.relu(conv(x, params["enc1"]))
    pooled = lax.reduce_window(e1, -jnp.inf, lax.max, (1, 1, 2, 2, 2), (1, 1, 2, 2, 2), "VALID")
    e2 = jax.nn.relu(conv(pooled, params["enc2"]))
    # Transposed convolution: base dilation 2 doubles each spatial dim back.
    up = jax.nn.relu(conv(e2, params["up"], padding=((1, 2),) * 3, lhs_dilation=(2, 2, 2)))
    d = jax.nn.relu(conv(jnp.concatenate([up, e1], axis=1), params["dec"]))
    return conv(d, params["head"])


def make_train_step(mesh: Optional[Mesh], spatial_axes=(-1, -1, -1), lr: float = 0.1):
    def loss(params, x, y):
        return jnp.mean((forward(params, x, mesh, spatial_axes) - y) ** 2)

    def train_step(params, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        return value, jax.tree_util.tree_map(lambda p, g: p - lr * g, params, grads)
    return train_step
