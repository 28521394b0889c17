"""A pipelined stack of Transformer layers (paper 3.3 and 5.3): L layers over L stages
of mesh axis "p", data parallel over "x" inside every stage, microbatches streamed
through `gspmd.pipeline`. Per step, the only communication of the forward pass is the
stage shift (one collective-permute) and the finished microbatch leaving the last stage."""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from gspmd.mesh import Mesh
from gspmd.models import transformer
from gspmd.models.optimizers import Optimizer, make_step
from gspmd.pipeline import pipeline


def make_train_step(mesh: Mesh, cfg: transformer.Config, stage_axis: str = "p", data_axis: str = "x",
                    schedule: str = "gpipe", repeats: int = 1, optimizer: Optional[Optimizer] = None):
    """step(stacked params, microbatches [M, B, S, M], targets) -> (new params, loss) with
    plain SGD; with an optimizer, step(stacked params, optimizer state, microbatches,
    targets) -> (new params, new state, loss)."""
    annotate = transformer.gspmd_annotate(mesh)
    strategy = {"x": [data_axis, -1, -1]}

    def stage_fn(params, x):
        return transformer.layer(params, x, annotate, strategy, cfg)

    def loss(stacked, microbatches, targets):
        ys = pipeline(stage_fn, stacked, microbatches.astype(cfg.dtype), mesh=mesh, stage_axis=stage_axis, schedule=schedule,
                      repeats=repeats)
        return jnp.mean((ys.astype(np.float32) - targets) ** 2)

    return make_step(loss, optimizer, cfg.lr)


def example_inputs(cfg: transformer.Config, microbatches: int, seed: int = 0):
    """Stacked layer params (leading layer dim), microbatches and targets."""
    params, x, _ = transformer.example_inputs(cfg, seed)
    stacked = jax.tree_util.tree_map(lambda *p: np.stack(p), *params)
    rng = np.random.RandomState(seed + 1)
    xs = rng.standard_normal((microbatches,) + x.shape).astype(np.float32)
    return stacked, xs, rng.standard_normal(xs.shape).astype(np.float32)
