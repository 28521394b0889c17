"""Pipelining reduced to sharding (paper Section 3.3).

L stages run as ONE vectorized computation over a stage dim split on a mesh axis: a
state buffer [L, *microbatch] holds what each stage works on. Every step all stages run
at once (vmap of the stage function), then the buffer shifts by one stage along the ring
(a rotation: one collective-permute between neighbours, and one for its gradient);
stage 0 takes a new microbatch in.

Schedules, for L stages, M microbatches and R repeats:
- gpipe: each microbatch runs through the L stages once, M + L - 1 steps.
- circular: layer i runs on stage i % L; microbatches enter in rounds of L and go R
  times around the ring (a short last round is padded): M*R + L - 1 steps when L
  divides M. gpipe and circular keep every step's stage inputs for the backward pass,
  which recomputes the stage (remat), so activation memory grows with M.
- 1f1b (`pipeline_loss`): forward and backward slots of different microbatches run in
  the same loop, the backward written with jax.vjp of the stage; a stage holds at most
  2*L*R - 1 stage inputs whatever M. With repeats > 1 it is the interleaved variant:
  R times more steps of useful work for the same L - 1 steps of bubble.

Slots where a stage has no microbatch (the bubble) compute on zeros; their results and
gradients are masked to exactly zero, whatever the stage computes there. Inputs and
outputs live in per-stage buffers [L, M, ...] split like the state, so that reading a
fresh microbatch and storing a finished one stay local: the only per-step collective is
the shift. Parameters are [L*R, ...] stacks in layer order, or with `stage_major=True`
in stage order (index s*R + r holds layer r*L + s, see `stage_major_order`). Either way
they, their gradients and optimizer state are split in blocks over the stage axis; a
circular schedule moves a layer-ordered stack into stage order once per call (one
exchange of each stage's layers, and one back for the gradient), which stage order
saves.
"""
from __future__ import annotations

from typing import Callable, Optional, Union

import jax
import jax.numpy as jnp

from gspmd.checks import count, describe, function
from gspmd.errors import ShardingError
from gspmd.frontend import record_schedule
from gspmd.mesh import Mesh
from gspmd.ops.convert import is_key
from gspmd.pipeline_buffers import check_leading, microbatch_count
from gspmd.pipeline_stages import SCHEDULES, Pipeline

__all__ = ["SCHEDULES", "pipeline", "pipeline_loss", "stage_major_order"]


def pipeline(stage_fn: Callable, stacked_params, microbatches, *, mesh: Mesh, stage_axis: str,
             schedule: str = "gpipe", repeats: int = 1, stage_major: bool = False,
             remat: Union[bool, Callable] = True, manual_stages: bool = False, scan_layers: bool = False,
             key=None, scatter_axis: Optional[str] = None):
    """Apply the L*R layers of `stacked_params` (a pytree whose leaves have a leading
    layer dim) to each of the M microbatches (leading dim of `microbatches`):
    ys[m] == layer_{LR-1}(... layer_0(microbatches[m])), layer_i(x) = stage_fn(params_i, x).
    L = the size of `stage_axis` of `mesh` (a gspmd.Mesh or jax Mesh). remat: the backward pass recomputes each stage from
    its kept input instead of keeping the stage's intermediates; or a jax.checkpoint policy
    (jax.checkpoint_policies.dots_saveable, ...): it keeps what the policy saves. manual_stages: the
    stages run as a manual region over the stage axis (paper 3.4) instead of a vmap;
    stage_fn's annotations over the other axes partition it inside. stage_major: the
    stacks are in stage order (`stage_major_order`), which saves moving a circular
    schedule's layers into it. scan_layers: each of the L*R layers is K layers in turn,
    the leaves [L*R, K, ...], stage_fn one of them (params_i[k], x): the pipeline scans
    them itself. key: a PRNG key (jax.random.key) for layers that draw random values
    (dropout): layer_i(x) = stage_fn(params_i, x, key_mi) on microbatch m, key_mi =
    fold_in(fold_in(key, m), i), the same when the backward pass recomputes the layer;
    with scan_layers the k-th of them gets fold_in(key_mi, k). scatter_axis: a mesh axis
    over which stage outputs are replicated (tensor parallelism's): each device sends the
    next stage its 1/n of the output's last dim and the next stage gathers it back over
    that axis (Megatron-LM's scatter/gather of stage boundaries), so the shift between
    stages moves 1/n of the bytes and the gather runs on the axis's own links."""
    _check_remat(remat, "gspmd.pipeline")
    _check_key(key, "gspmd.pipeline")
    if schedule == "1f1b":
        raise ShardingError(_one_f_one_b_rewrite(stage_axis, repeats, stage_major=stage_major,
                                                 manual_stages=manual_stages, scan_layers=scan_layers))
    run = Pipeline(stage_fn, stacked_params, microbatches, mesh, stage_axis, schedule, repeats, stage_major,
                    manual_stages, scan_layers, keyed=key is not None, scatter_axis=scatter_axis)
    record_schedule(run.timing.schedule(schedule))
    return run.forward(stacked_params, microbatches, remat, key)


def pipeline_loss(stage_fn: Callable, loss_fn: Callable, stacked_params, microbatches, targets, *, mesh: Mesh,
                  stage_axis: str, schedule: str = "1f1b", repeats: int = 1, stage_major: bool = False,
                  manual_stages: bool = False, ends=None, first_fn: Optional[Callable] = None,
                  remat: Union[bool, Callable] = True, scan_layers: bool = False, key=None,
                  scatter_axis: Optional[str] = None):
    """sum over m of loss_fn(ys[m], targets[m]) with ys as `pipeline` computes them.
    jax.grad of it (with respect to parameters, microbatches or targets) runs the
    schedule's backward pass; with schedule="1f1b" that is interleaved with the forward
    pass in one loop, whose activation memory does not grow with the microbatches.
    ends: parameters (a pytree) of the pipeline's two ends, as a language model's
    embedding table is: the first stage takes first_fn(ends, microbatches[m]) (default:
    the microbatch itself) and the loss is loss_fn(ys[m], targets[m], ends); the
    gradient reaches them too. With 1f1b each microbatch is embedded in the step it
    enters and its loss taken in the step it leaves, so no [M, ...] stage inputs exist.
    remat: as `pipeline`'s for gpipe and circular; 1f1b's backward slots always
    recompute each stage from its stashed input (remat=True). scan_layers (as
    `pipeline`'s): 1f1b stashes the input of each of a stage's K layers and its backward
    slot recomputes them one at a time, as Megatron-LM does, holding one layer's
    intermediates instead of the stage's. key, scatter_axis: as `pipeline`'s, every
    schedule."""
    _check_remat(remat, "gspmd.pipeline_loss")
    _check_key(key, "gspmd.pipeline_loss")
    if schedule == "1f1b" and remat is not True:
        raise ShardingError(f"gspmd.pipeline_loss(schedule='1f1b', remat={describe(remat)}): 1F1B's backward "
                            "slots always recompute each stage from its stashed input, so remat must stay True; "
                            "for remat=False or a jax.checkpoint policy use schedule='gpipe' or 'circular'.")
    if first_fn is not None and ends is None:
        raise ShardingError("gspmd.pipeline_loss(first_fn=...) embeds each microbatch with the pipeline's end "
                            "parameters: pass them as ends=... (first_fn(ends, microbatch) -> the first "
                            "stage's input).")
    if first_fn is not None:
        function(first_fn, "gspmd.pipeline_loss(first_fn=...) (it gets (ends, microbatches[m]))", arity=2)
    with_ends = ends is not None
    function(loss_fn, "gspmd.pipeline_loss(stage_fn, loss_fn, ...)'s loss_fn (it gets (ys[m], targets[m]"
             + (", ends))" if with_ends else "))"), arity=3 if with_ends else 2)
    check_leading(targets, microbatch_count(microbatches), "targets of gspmd.pipeline_loss", "one per microbatch",
                  "microbatch dim")
    first = first_fn or (lambda _, x: x)
    loss = loss_fn if with_ends else (lambda y, t, _: loss_fn(y, t))
    ends = ends if with_ends else ()
    if schedule != "1f1b":
        xs = jax.vmap(first, (None, 0))(ends, microbatches)
        ys = pipeline(stage_fn, stacked_params, xs, mesh=mesh, stage_axis=stage_axis, schedule=schedule,
                      repeats=repeats, stage_major=stage_major, remat=remat, manual_stages=manual_stages,
                      scan_layers=scan_layers, key=key, scatter_axis=scatter_axis)
        return jnp.sum(jax.vmap(loss, (0, 0, None))(ys, targets, ends))
    run = Pipeline(stage_fn, stacked_params, microbatches, mesh, stage_axis, schedule, repeats, stage_major,
                    manual_stages, scan_layers, keyed=key is not None, scatter_axis=scatter_axis)
    record_schedule(run.timing.schedule(schedule))
    return run.one_f_one_b(loss, first, stacked_params, ends, microbatches, targets, key)


def _check_key(key, caller: str) -> None:
    typed = is_key(getattr(key, "dtype", None))
    if key is None or typed and jnp.shape(key) == ():
        return
    given = f"keys of shape {jnp.shape(key)}" if typed else describe(key)
    raise ShardingError(f"{caller}(key=...) needs one PRNG key (jax.random.key(...)), got {given}; each "
                        "microbatch's layers draw from keys folded in from it (wrap raw uint32 key data with "
                        "jax.random.wrap_key_data).")


def _check_remat(remat, caller: str) -> None:
    if not isinstance(remat, bool) and not callable(remat):
        raise ShardingError(f"{caller}(remat=...) needs True, False or a jax.checkpoint policy, got "
                            f"{describe(remat)}; e.g. remat=jax.checkpoint_policies.dots_saveable.")


def _one_f_one_b_rewrite(stage_axis: str, repeats: int, **flags: bool) -> str:
    """Why gspmd.pipeline refuses schedule="1f1b", and the call to write instead (flags:
    the boolean options given as True)."""
    options = f"mesh=mesh, stage_axis={stage_axis!r}" + (f", repeats={repeats}" if repeats != 1 else "") + \
        "".join(f", {name}=True" for name, on in flags.items() if on is True)
    return ("gspmd.pipeline(..., schedule='1f1b') cannot run 1F1B: its backward slots need each microbatch's "
            "loss gradient while the forward loop still runs, and gspmd.pipeline returns the outputs, not the "
            "loss. Give the loss to gspmd.pipeline_loss; rewrite\n"
            f"    ys = gspmd.pipeline(stage_fn, params, xs, {options}, schedule='1f1b')\n"
            "    loss = jnp.sum(jax.vmap(loss_fn)(ys, targets))\n"
            "as\n"
            f"    loss = gspmd.pipeline_loss(stage_fn, loss_fn, params, xs, targets, {options}, schedule='1f1b')\n"
            "with loss_fn(y, t) one microbatch's loss; jax.grad of it runs forward and backward slots in one "
            "loop. For outputs without a loss keep gspmd.pipeline with schedule='gpipe' or 'circular'.")


def stage_major_order(stacked_params, stages: int, repeats: int):
    """Layer-ordered stacks [L*R, ...] in stage order (index s*R + r holds layer r*L + s),
    as `pipeline(..., stage_major=True)` takes them: a stage's layers are contiguous, so
    splitting the leading dim over the stage axis gives each stage its own."""
    stages, repeats = count(stages, "stage_major_order(stages=...)"), count(repeats, "stage_major_order(repeats=...)")
    check_leading(stacked_params, stages * repeats, "Stacked parameter", f"{stages} stages x {repeats} repeats")

    def reorder(p):
        shape = jnp.shape(p)
        return jnp.reshape(jnp.swapaxes(jnp.reshape(p, (repeats, stages) + shape[1:]), 0, 1), shape)
    return jax.tree_util.tree_map(reorder, stacked_params)


