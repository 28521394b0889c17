"""A pipelined stack of Transformer layers (paper 3.3 and 5.3): L*R layers over the L
stages of mesh axis "p", data parallel over "x" inside every stage, microbatches
streamed through `gspmd.pipeline_loss` with any of its schedules. Per step the only
communication is the stage shift (one collective-permute each way); the data-parallel
gradient reduction runs once, after the loop."""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from gspmd.mesh import Mesh
from gspmd.models import transformer
from gspmd.models.optimizers import Optimizer, make_step
from gspmd.pipeline import pipeline_loss, stage_major_order


def make_train_step(mesh: Mesh, cfg: transformer.Config, stage_axis: str = "p", data_axis: str = "x",
                    schedule: str = "gpipe", repeats: int = 1, optimizer: Optional[Optimizer] = None,
                    strategy: Optional[dict] = None, layers_per_stage: int = 1):
    """step(stacked params, microbatches [M, B, S, M], targets) -> (new params, loss) with
    plain SGD; with an optimizer, step(stacked params, optimizer state, microbatches,
    targets) -> (new params, new state, loss). Stacks are in stage-major order
    (gspmd.stage_major_order) so that every stage holds only its own layers (and their
    optimizer state), also with repeats > 1. strategy: the in-stage annotations
    (default: batch over `data_axis`; transformer.FINALIZED_2D for Table 4's (L, X, Y)).
    With layers_per_stage > 1 every stacked entry holds that many layers (one more
    leading dim), which a stage applies in order."""
    annotate = transformer.gspmd_annotate(mesh)
    strategy = {"x": [data_axis, -1, -1]} if strategy is None else strategy

    def stage_fn(params, x):
        if layers_per_stage == 1:
            return transformer.layer(params, x, annotate, strategy, cfg)
        for i in range(layers_per_stage):
            x = transformer.layer(jax.tree_util.tree_map(lambda p: p[i], params), x, annotate, strategy, cfg)
        return x

    def loss(stacked, microbatches, targets):
        def microbatch_loss(y, t):
            return jnp.sum((y.astype(np.float32) - t) ** 2) / float(np.prod(np.shape(targets)))
        return pipeline_loss(stage_fn, microbatch_loss, stacked, microbatches.astype(cfg.dtype), targets, mesh=mesh,
                             stage_axis=stage_axis, schedule=schedule, repeats=repeats, stage_major=True)

    return make_step(loss, optimizer, cfg.lr)


def example_inputs(cfg: transformer.Config, microbatches: int, seed: int = 0, stages: int = 0, repeats: int = 1):
    """Stacked layer params (leading layer dim; stage-major for `stages` x `repeats`),
    microbatches and targets."""
    params, x, _ = transformer.example_inputs(cfg, seed)
    stacked = jax.tree_util.tree_map(lambda *p: np.stack(p), *params)
    if repeats > 1:
        stacked = jax.tree_util.tree_map(np.asarray, stage_major_order(stacked, stages, repeats))
    rng = np.random.RandomState(seed + 1)
    xs = rng.standard_normal((microbatches,) + x.shape).astype(np.float32)
    return stacked, xs, rng.standard_normal(xs.shape).astype(np.float32)

