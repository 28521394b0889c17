"""Pipelining reduced to sharding (paper Section 3.3).

L stages run as ONE vectorized computation over a stage dim split on a mesh axis: a
state buffer [L, *microbatch] holds what each stage works on. Every step all stages run
at once (vmap of the stage function), then the buffer shifts by one stage along the ring
(a rotation, which partitions into a collective-permute between neighbours); stage 0
takes a new microbatch in. GPipe runs each microbatch through the L stages once; the
circular schedule sends it R times around the ring, stage s holding layers s, L+s, ...
Both are a single loop of M*R + L - 1 steps.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from gspmd.errors import ShardingError
from gspmd.frontend import mesh_split
from gspmd.mesh import Mesh, as_mesh
from gspmd.sharding import UNSPECIFIED

SCHEDULES = ("gpipe", "circular")


def pipeline(stage_fn: Callable, stacked_params, microbatches, *, mesh: Mesh, stage_axis: str,
             schedule: str = "gpipe", repeats: int = 1):
    """Apply the L*R layers of `stacked_params` (a pytree whose leaves have a leading
    layer dim, layers in order) to each of the M microbatches (leading dim of
    `microbatches`): ys[m] == layer_{LR-1}(... layer_0(microbatches[m])), where
    layer_i(x) = stage_fn(params_i, x). L = the size of `stage_axis`. `mesh`: a
    gspmd.Mesh or jax Mesh."""
    mesh = as_mesh(mesh, "for gspmd.pipeline")
    stages = mesh.shape[mesh.axis_index(stage_axis)]
    m = np.shape(microbatches)[0]
    _validate(stacked_params, m, stages, schedule, repeats)
    per_stage = jax.tree_util.tree_map(lambda p: _by_stage(p, stages, repeats, mesh, stage_axis), stacked_params)
    state_spec = [stage_axis] + [UNSPECIFIED] * (np.ndim(microbatches) - 1)
    run_stages = jax.vmap(stage_fn)
    stage = jnp.arange(stages)

    def work(t, s):
        """At step t, stage s runs microbatch `mb` on repeat `r` (if `valid`)."""
        u = t - s                                       # how long ago that work entered
        r = (u % (stages * repeats)) // stages
        mb = (u // (stages * repeats)) * stages + u % stages
        return (u >= 0) & (u < m * repeats), r, jnp.clip(mb, 0, m - 1)

    def step(carry, t):
        state, outputs = carry
        _, r, _ = work(t, stage)
        _, first_r, first_mb = work(t, 0)
        fresh = jnp.take(microbatches, first_mb, axis=0)
        rotated = jnp.roll(state, 1, axis=0)            # stage s takes stage s-1's output
        take_fresh = _expand((stage == 0) & (first_r == 0), state)
        state = mesh_split(jnp.where(take_fresh, fresh[None], rotated), mesh, state_spec)
        layer = jax.tree_util.tree_map(lambda p: _select_repeat(p, r), per_stage)
        state = mesh_split(run_stages(layer, state), mesh, state_spec)
        last_valid, last_r, last_mb = work(t, stages - 1)
        last = jnp.sum(jnp.where(_expand(stage == stages - 1, state), state, 0), axis=0)
        done = last_valid & (last_r == repeats - 1)
        current = jnp.take(outputs, last_mb, axis=0)
        outputs = jax.lax.dynamic_update_index_in_dim(outputs, jnp.where(done, last, current), last_mb, 0)
        return (state, outputs), None

    state = mesh_split(jnp.zeros((stages,) + np.shape(microbatches)[1:], microbatches.dtype), mesh, state_spec)
    steps = jnp.arange(m * repeats + stages - 1)
    (_, outputs), _ = jax.lax.scan(step, (state, jnp.zeros_like(microbatches)), steps)
    return outputs


def _validate(stacked_params, m: int, stages: int, schedule: str, repeats: int) -> None:
    if schedule not in SCHEDULES:
        raise ShardingError(f"Unknown pipeline schedule {schedule!r}; choose one of {SCHEDULES}.")
    if schedule == "gpipe" and repeats != 1:
        raise ShardingError(f"The gpipe schedule runs each layer once (repeats=1), got repeats={repeats}; "
                            "use schedule='circular' for repeats > 1.")
    if repeats > 1 and m % stages:
        raise ShardingError(f"The circular schedule feeds microbatches in rounds of {stages} (one per stage): "
                            f"{m} microbatches is not a multiple of {stages}; pad the microbatch count.")
    for leaf in jax.tree_util.tree_leaves(stacked_params):
        if np.shape(leaf)[:1] != (stages * repeats,):
            raise ShardingError(f"Stacked parameter of shape {np.shape(leaf)} must have a leading layer dim of "
                                f"{stages} stages x {repeats} repeats = {stages * repeats}.")


def _by_stage(p, stages: int, repeats: int, mesh: Mesh, stage_axis: str):
    """[L*R, ...] in layer order -> [L, R, ...]: stage s holds layers s, L+s, 2L+s, ..."""
    p = jnp.swapaxes(jnp.reshape(p, (repeats, stages) + np.shape(p)[1:]), 0, 1)
    return mesh_split(p, mesh, [stage_axis] + [UNSPECIFIED] * (p.ndim - 1))


def _select_repeat(p, r):
    """Per stage, its layer for repeat r[s] (a one-hot contraction keeps it local)."""
    onehot = jax.nn.one_hot(r, p.shape[1], dtype=p.dtype)
    return jnp.einsum("lr...,lr->l...", p, onehot)


def _expand(mask, like):
    return jnp.reshape(mask, mask.shape + (1,) * (like.ndim - 1))
