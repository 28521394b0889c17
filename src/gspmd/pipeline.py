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
import numpy as np
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

from gspmd.checks import array_shape, count, describe, flag, function
from gspmd.errors import ShardingError
from gspmd.frontend import manual, mesh_split, record_schedule
from gspmd.ir.schedule import PipelineSchedule
from gspmd.mesh import Mesh, as_mesh
from gspmd.ops.convert import is_key
from gspmd.sharding import UNSPECIFIED

SCHEDULES = ("gpipe", "circular", "1f1b")


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
    run = _Pipeline(stage_fn, stacked_params, microbatches, mesh, stage_axis, schedule, repeats, stage_major,
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
    _check_leading(targets, _microbatch_count(microbatches), "targets of gspmd.pipeline_loss", "one per microbatch",
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
    run = _Pipeline(stage_fn, stacked_params, microbatches, mesh, stage_axis, schedule, repeats, stage_major,
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
    _check_leading(stacked_params, stages * repeats, "Stacked parameter", f"{stages} stages x {repeats} repeats")

    def reorder(p):
        shape = jnp.shape(p)
        return jnp.reshape(jnp.swapaxes(jnp.reshape(p, (repeats, stages) + shape[1:]), 0, 1), shape)
    return jax.tree_util.tree_map(reorder, stacked_params)


def schedule_steps(stages: int, microbatches: int, repeats: int = 1) -> int:
    """Steps of a gpipe (repeats 1) or circular schedule: M + L - 1, or M*R + L - 1
    where L divides M (a short last round of microbatches is padded)."""
    last = microbatches - 1
    return (last // stages) * stages * repeats + last % stages + stages * repeats


class _Timing:
    """Which microbatch and repeat each stage works on at each step. Microbatches enter
    in rounds of L, one per step; a round goes R times around the ring before the next
    enters. The forward of layer l = r*L + s of microbatch m runs on stage s at step
    enter(m) + l, enter(m) = (m // L)*L*R + m % L. Its backward (1f1b) runs at step
    enter(m) + 2(L*R - 1) - l: the last layer's in the step of its forward, each
    earlier layer one step after the next one."""

    def __init__(self, stages: int, microbatches: int, repeats: int):
        self.L, self.M, self.R = stages, microbatches, repeats
        self.layers = stages * repeats
        self.forward_steps = schedule_steps(stages, microbatches, repeats)

    def forward(self, t, s):
        """(valid, repeat, microbatch) of stage s's forward slot at step t."""
        u = t - s
        w = u % self.layers
        m = (u // self.layers) * self.L + w % self.L
        return (u >= 0) & (m < self.M), w // self.L, jnp.clip(m, 0, self.M - 1)

    def backward(self, t, s):
        """(valid, repeat, microbatch) of stage s's backward slot at step t: the forward
        slot pattern over the layers in reverse, L*R - 1 steps later."""
        valid, r, m = self.forward(t - (self.layers - 1), self.L - 1 - s)
        return valid, self.R - 1 - r, m

    def schedule(self, name: str) -> PipelineSchedule:
        return PipelineSchedule(name, self.L, self.M, self.R, self.forward_steps)


def _expand(mask, like):
    """A [L] mask broadcastable against [L, ...] values."""
    return jnp.reshape(mask, mask.shape + (1,) * (like.ndim - mask.ndim))


def _mask(valid, x):
    """x where the stage's slot is valid, else exactly zero (NaN and Inf included)."""
    return jnp.where(_expand(valid, x), x, jnp.zeros_like(x))


def _mask_tree(valid, tree):
    return jax.tree_util.tree_map(lambda x: _mask(valid, x), tree)


class _Pipeline:
    def __init__(self, stage_fn, stacked_params, microbatches, mesh: Mesh, stage_axis: str, schedule: str,
                 repeats: int, stage_major: bool, manual_stages: bool, scan_layers: bool, keyed: bool = False,
                 scatter_axis: Optional[str] = None):
        if not isinstance(schedule, str) or schedule not in SCHEDULES:
            raise ShardingError(f"Unknown pipeline schedule {schedule!r}; choose one of {SCHEDULES}.")
        function(stage_fn, f"gspmd.pipeline's stage_fn (it gets (params_i, x{', key' * keyed}))", arity=2 + keyed)
        repeats = count(repeats, "gspmd.pipeline(repeats=...)")
        stage_major, manual_stages = flag(stage_major, "gspmd.pipeline(stage_major=...)"), \
            flag(manual_stages, "gspmd.pipeline(manual_stages=...)")
        self.scan_layers = flag(scan_layers, "gspmd.pipeline(scan_layers=...)")
        if schedule == "gpipe" and repeats != 1:
            raise ShardingError(f"The gpipe schedule runs each layer once (repeats=1), got repeats={repeats}; "
                                "use schedule='circular' (or '1f1b') for repeats > 1.")
        mesh = as_mesh(mesh, "for gspmd.pipeline")
        try:
            stages = mesh.shape[mesh.axis_index(stage_axis)]
        except ShardingError as e:
            raise ShardingError(f"gspmd.pipeline(stage_axis={stage_axis!r}): {e}") from None
        if scatter_axis is not None and (scatter_axis == stage_axis or scatter_axis not in mesh.axis_names):
            raise ShardingError(f"gspmd.pipeline(scatter_axis={scatter_axis!r}) needs an axis of {mesh} other than "
                                f"the stage axis {stage_axis!r}: the one stage outputs are replicated over "
                                "(tensor parallelism's), e.g. scatter_axis='model'.")
        m = _microbatch_count(microbatches)
        _check_leading(stacked_params, stages * repeats, "Stacked parameter",
                       f"{stages} stages x {repeats} repeats (stage axis {stage_axis!r} of {mesh})")
        # (K,): with scan_layers the stash keeps each of a stage's K layers' inputs
        self.inner = _inner_layers(stacked_params) if self.scan_layers else ()
        self.stage_fn, self.mesh, self.axis, self.scatter_axis = stage_fn, mesh, stage_axis, scatter_axis
        self.in_stage_order = stage_major or repeats == 1     # (with one repeat both orders are one)
        self.manual_stages = manual_stages
        self.L, self.R = stages, repeats
        self.timing = _Timing(stages, m, repeats)
        self.stage = jnp.arange(stages)

    # -- layouts --------------------------------------------------------------------
    def split(self, x):
        """x with its leading dim split over the stage axis, the rest left to propagation."""
        return mesh_split(x, self.mesh, [self.axis] + [UNSPECIFIED] * (jnp.ndim(x) - 1))

    def shift(self, x, step: int):
        """x [L, ...] moved `step` stages along the ring (a collective-permute). With
        scatter_axis, the last dim whole on both sides (pinned, so that the split on the
        way does not propagate into the stages) and split over that axis as it moves."""
        if self.scatter_axis is None or jnp.ndim(x) < 2:     # (a microbatch of scalars: nothing to split)
            return jnp.roll(x, step, 0)

        def last(v, how):
            return mesh_split(v, self.mesh, [self.axis] + [UNSPECIFIED] * (jnp.ndim(v) - 2) + [how])
        return last(jnp.roll(last(last(x, -1), self.scatter_axis), step, 0), -1)

    def shift_right(self):
        """shift(x, 1) whose gradient is shift(ct, -1): one collective-permute each way, where
        a roll's own transpose would be two halo exchanges."""
        @jax.custom_vjp
        def shifted(x):
            return self.shift(x, 1)
        shifted.defvjp(lambda x: (self.shift(x, 1), None), lambda _, ct: (self.shift(ct, -1),))
        return shifted

    def by_stage(self, p):
        """A [L*R, ...] stack as [L, R, ...]: stage s holds layers s, L+s, 2L+s, ...
        The stack is split in blocks over the stage axis. In stage order that is a local
        reshape; in layer order a local reshape and transpose, then one exchange of each
        stage's layers (an all-to-all or R one-layer collective-permutes) where one of L
        and R divides the other (else a gather)."""
        rest = jnp.shape(p)[1:]
        if self.in_stage_order:
            return self.split(jnp.reshape(self.split(p), (self.L, self.R) + rest))
        if self.L % self.R == 0:
            return self._by_stage_in_pieces(p)
        return self.split(jnp.swapaxes(jnp.reshape(self.split(p), (self.R, self.L) + rest), 0, 1))

    def from_stages(self, p):
        """Inverse of by_stage."""
        rest = jnp.shape(p)[2:]
        if not self.in_stage_order and self.L % self.R == 0:
            return self._from_stages_in_pieces(p)
        if not self.in_stage_order:
            p = jnp.swapaxes(p, 0, 1)
        return self.split(jnp.reshape(p, (self.L * self.R,) + rest))

    # Where R divides L, stage s = a*(L/R) + g holds layers l = s*R + i = a*L + g*R + i of a
    # layer-ordered stack: repeat a of stage t = g*R + i. Seen as [a, g, i], the move into
    # stage order is one all-to-all (a's part of the stage axis moves from a onto i) and
    # one collective-permute (devices relabelled: the holder of (g, i) is i*(L/R) + g).
    # Written as those two steps, each one reshard the partitioner finds by itself.
    def _pieces_mesh(self) -> Mesh:
        """The mesh with the stage axis factored into (repeat part, group part)."""
        return self.mesh.factor_axis(self.axis, self._pieces_axes(), (self.R, self.L // self.R))

    def _pieces_axes(self) -> tuple[str, str]:
        return f"{self.axis}/repeat", f"{self.axis}/group"

    def _pieces(self, x, mapping):
        return mesh_split(x, self._pieces_mesh(), list(mapping) + [UNSPECIFIED] * (jnp.ndim(x) - len(mapping)))

    def _by_stage_in_pieces(self, p):
        rest, (a, g) = jnp.shape(p)[1:], self._pieces_axes()
        x = jnp.reshape(self.split(p), (self.R, self.L // self.R, self.R) + rest)    # [a, g, i]
        x = jnp.transpose(self._pieces(x, [-1, g, a]), (1, 2, 0) + tuple(range(3, jnp.ndim(x))))
        return self.split(jnp.reshape(x, (self.L, self.R) + rest))                   # [t = (g, i), a]

    def _from_stages_in_pieces(self, p):
        rest, (a, g) = jnp.shape(p)[2:], self._pieces_axes()
        x = self._pieces(jnp.reshape(self.split(p), (self.L // self.R, self.R, self.R) + rest), [g, a, -1])
        x = jnp.transpose(x, (2, 0, 1) + tuple(range(3, jnp.ndim(x))))              # [a, g, i]
        return self.split(jnp.reshape(self._pieces(x, [a, g, -1]), (self.L * self.R,) + rest))

    def per_stage_buffer(self, xs):
        """[M, ...] -> [L, M, ...] split by stage: every stage holds the whole array, and
        reading or writing one microbatch of it is local."""
        return self.split(jnp.broadcast_to(xs[None], (self.L,) + jnp.shape(xs)))

    def layer(self, per_stage, r):
        """Per stage, its layer for repeat r[s]: a gather of that one layer, local to each
        stage (its batch dim is the stage dim), reading one layer, not all R (as a masked
        sum would), and no matmul, which remat policies that save matmuls would hold once
        per step. Its gradient scatters into the stage's R layers, linear in what it adds,
        so the data-parallel reduction still waits until after the loop. With one repeat
        the layer is the same at every step: no selection, so the layers stay
        loop-invariant and autodiff saves them once, not once per step."""
        if self.R == 1:
            return jax.tree_util.tree_map(lambda p: p[:, 0], per_stage)
        return jax.tree_util.tree_map(lambda p: _pick(p, r), per_stage)

    def keys(self, key, r, m):
        """Per stage [L], the key of the layer it runs for repeat r[s] on microbatch m[s]
        (None without a key): fold_in(fold_in(key, m), i), layer i = r*L + s."""
        if key is None:
            return None
        fold = jax.vmap(lambda m, i: jax.random.fold_in(jax.random.fold_in(key, m), i))
        return self.split(fold(m, r * self.L + self.stage))

    def layer_at(self, per_stage, r, k):
        """With scan_layers, per stage, the k-th of its layers for repeat r[s]: a gather of
        that one layer, local to each stage, where selecting the repeat's K layers first
        would copy them all every slot (and their gradients back)."""
        if self.R == 1:     # the layer's slice taken first: its gradient is then an update of the stack
            return jax.tree_util.tree_map(lambda p: _index(p, k, axis=2)[:, 0], per_stage)
        return jax.tree_util.tree_map(lambda p: _pick_at(p, r, k), per_stage)

    # -- pieces of a step -------------------------------------------------------------
    def stage_inputs(self, t, read, previous):
        """What each stage's forward slot reads at step t: stage 0 a fresh microbatch
        (read(m)) on its first repeat, every other slot what the stage before produced."""
        _, r0, m0 = self.timing.forward(t, 0)
        fresh = read(m0)
        take_fresh = (self.stage == 0) & (r0 == 0)
        return jnp.where(_expand(take_fresh, previous), fresh, previous)

    def store(self, buffer, m, keep, value):
        """buffer[:, m] = value where keep (a scalar or [L] mask), a local update."""
        current = _index(buffer, m, axis=1)
        new = jnp.where(_expand(jnp.broadcast_to(keep, (self.L,)), value), value, current)
        return jax.lax.dynamic_update_index_in_dim(buffer, new, m, axis=1)

    def all_stages(self):
        """(layers [L, ...], inputs [L, ...]) -> outputs [L, ...]: every stage at once
        (with scan_layers, each of its K layers in turn)."""
        if not self.scan_layers:
            return self.one_layer()
        return lambda layer, x, keys=None: self.scan_forward(lambda k: _tree_index(layer, k, axis=1), x, keys)[0]

    def one_layer(self):
        """(a layer per stage [L, ...], inputs [L, ...]) -> outputs [L, ...]; a layer must
        return its input's shape and dtype (it feeds the next)."""
        stages = jax.vmap(self.stage_fn) if not self.manual_stages else self.manual_region()

        def checked(layer, x, keys=None):
            y = stages(layer, x) if keys is None else stages(layer, x, keys)
            if (jnp.shape(y), jnp.result_type(y)) != (jnp.shape(x), jnp.result_type(x)):
                raise ShardingError(f"gspmd.pipeline: stage_fn maps a microbatch of shape {jnp.shape(x)[1:]} and "
                                    f"dtype {jnp.result_type(x)} to shape {jnp.shape(y)[1:]} and dtype "
                                    f"{jnp.result_type(y)}; a stage must return a value of its input's shape and "
                                    "dtype, which the next stage takes.")
            return y
        return checked

    def manual_region(self):
        """All stages as a manual region over the stage axis (paper 3.4)."""
        def run(layer, x, keys=None):
            leaves, structure = jax.tree_util.tree_flatten(layer)
            # Keys enter as their key data, wrapped again inside (typed keys do not cross the region).
            words = () if keys is None else (jax.random.key_data(keys),)

            def one_stage(*a):    # a stage's piece, with its unit stage dim
                layer = jax.tree_util.tree_map(lambda p: p[0], jax.tree_util.tree_unflatten(structure, a[:len(leaves)]))
                key = [jax.random.wrap_key_data(w[0], impl=jax.random.key_impl(keys)) for w in a[len(leaves) + 1:]]
                return self.stage_fn(layer, a[len(leaves)][0], *key)[None]
            specs = [[self.axis] + [-1] * (jnp.ndim(v) - 1) for v in (*leaves, x, *words)]
            region = manual(one_stage, self.mesh, in_specs=specs, out_specs=specs[len(leaves)],
                            manual_axes=(self.axis,))
            return region(*leaves, x, *words)
        return run

    def scan_forward(self, layer_at, x, keys=None):
        """(outputs, each of the K layers' inputs [K, L, ...]); layer_at(k): every
        stage's k-th layer [L, ...]; keys: the stages' keys, folded with k."""
        one = self.one_layer()
        return jax.lax.scan(lambda x, k: (self.split(one(layer_at(k), x, _fold(keys, k))), x), x,
                            jnp.arange(self.inner[0]))

    def scan_backward(self, per_stage, r, inputs, ct, valid, grads, keys=None):
        """(grads, d x): the K layers of repeat r last first, each recomputed from its input
        [K, L, ...] as its gradient is taken, so one layer's intermediates live; each
        layer's gradient (masked where the slot is not valid) added in place to its entry
        of the stage's accumulator `grads`. (Its sum over data-parallel devices still waits
        until after the pipeline's loop: loop motion defers it past both loops.)"""
        one = self.one_layer()

        def back(carry, k_x):
            ct, grads = carry
            k, x = k_x
            layer = jax.checkpoint(lambda p, x: one(p, x, _fold(keys, k)))      # (its forward marked as recomputed)
            _, vjp = jax.vjp(layer, self.layer_at(per_stage, r, k), x)
            d_p, d_x = vjp(ct)
            d_p = self.placed(grads, lambda g: self.layer_at(g, r, k), valid, d_p)
            return (self.split(d_x), _add_tree(grads, d_p)), None
        (d_x, grads), _ = jax.lax.scan(back, (ct, grads), (jnp.arange(self.inner[0]), inputs), reverse=True)
        return grads, d_x

    @staticmethod
    def placed(grads, select, valid, d_part):
        """d_part, the gradient of select(stack) (masked where the slot is not valid),
        widened to the accumulator's dtype and shape `grads`: zeros but at its place, so
        that its sum with the accumulator is an update made in place (passes.accumulate)
        where the whole stack would be added every step."""
        _, place = jax.vjp(select, grads)
        (widened,) = place(jax.tree_util.tree_map(lambda g, a: _mask(valid, g).astype(a.dtype), d_part,
                                                  select(grads)))
        return widened

    def run_stages(self, per_stage, r, x, valid, keys=None):
        """All stages' forward slots at once, bubble slots masked in value and gradient."""
        return _masked_stages(self.all_stages())(self.layer(per_stage, r), x, valid, keys)

    # -- gpipe and circular -------------------------------------------------------------
    def forward(self, stacked_params, microbatches, remat: Union[bool, Callable], key=None):
        per_stage = jax.tree_util.tree_map(self.by_stage, stacked_params)
        inputs = self.per_stage_buffer(microbatches)
        run = jax.checkpoint(self.run_stages, policy=None if remat is True else remat) if remat else self.run_stages
        last, shift_right = self.L - 1, self.shift_right()

        def step(carry, t):
            state, outputs = carry
            valid, r, m = self.timing.forward(t, self.stage)
            x = self.split(self.stage_inputs(t, lambda m: _index(inputs, m, axis=1), shift_right(state)))
            state = self.split(run(per_stage, r, x, valid, self.keys(key, r, m)))
            done, r_last, m_last = self.timing.forward(t, last)
            return (state, self.store(outputs, m_last, done & (r_last == self.R - 1), state)), None

        state = self.split(jnp.zeros((self.L,) + jnp.shape(microbatches)[1:], microbatches.dtype))
        steps = jnp.arange(self.timing.forward_steps)
        (_, outputs), _ = jax.lax.scan(step, (state, self.split(jnp.zeros_like(inputs))), steps)
        return self.from_stage(outputs, last)

    def from_stage(self, buffer, s: int):
        """buffer[s] of a per-stage buffer, as one reduction over the stages (an all-reduce,
        or a reduce-scatter if the result is wanted split), once after the loop. The sum
        stays in the buffer's dtype (jnp.sum would reduce bfloat16 in float32): one stage
        holds the value, the others exact zeros."""
        return jax.lax.reduce(_mask(self.stage == s, buffer), np.zeros((), buffer.dtype), jax.lax.add, (0,))

    # -- 1f1b -----------------------------------------------------------------------
    def one_f_one_b(self, loss_fn, first_fn, stacked_params, ends, microbatches, targets, key=None):
        """The summed loss. Its gradient comes from the fused forward-backward loop, scaled
        by the incoming cotangent; without differentiation only the forward runs."""
        def primal(params, ends, xs, ys, key):
            xs = jax.vmap(first_fn, (None, 0))(ends, xs)
            return jnp.sum(jax.vmap(loss_fn, (0, 0, None))(self.forward(params, xs, False, key), ys, ends))

        def fwd(params, ends, xs, ys, key):
            values = [jax.tree_util.tree_map(lambda a: a.value, x, is_leaf=_is_primal)
                      for x in (params, ends, xs, ys, key)]
            wanted = [any(a.perturbed for a in jax.tree_util.tree_leaves(x, is_leaf=_is_primal)) for x in (xs, ys)]
            return self.fused(loss_fn, first_fn, *values, *wanted)

        def bwd(grads, ct):
            ct = jnp.zeros(()) if isinstance(ct, SymbolicZero) else ct
            return tuple(None if g is None else jax.tree_util.tree_map(lambda g: (ct * g).astype(g.dtype), g)
                         for g in grads) + (None,)   # (the key's)

        run = jax.custom_vjp(primal)
        run.defvjp(fwd, bwd, symbolic_zeros=True)
        return run(stacked_params, ends, microbatches, targets, key)

    def per_stage_copy(self, tree):
        """A pytree's leaves as [L, ...] split by stage: each stage its own copy, whose
        gradient it accumulates locally (summed over the stages once, after the loop)."""
        return jax.tree_util.tree_map(lambda p: self.split(jnp.broadcast_to(p[None], (self.L,) + jnp.shape(p))), tree)

    def fused(self, loss_fn, first_fn, stacked_params, ends, xs, ys, key, want_d_xs: bool, want_d_ys: bool):
        """(loss, (d params, d ends, d xs, d ys)) from one loop in three phases: forward
        slots only, both, backward slots only. Besides parameters and their gradients, a
        stage holds its in-flight inputs (the stash) and per-microbatch buffers only for
        the gradients asked for. Every stage embeds and takes the loss of the microbatch
        of the step (bubble slots masked) with its own copy of the ends' parameters, so
        that their gradients stay local until the loop ends."""
        per_stage = jax.tree_util.tree_map(self.by_stage, stacked_params)
        timing, L, R = self.timing, self.L, self.R
        depth = 2 * timing.layers - 1          # stash slots: a stage input lives < 2LR - 1 steps
        run_stages, run_loss = self.all_stages(), jax.vmap(loss_fn)
        ends_by_stage = self.per_stage_copy(ends)
        stage_input = jax.eval_shape(first_fn, ends, xs[0])
        state = self.split(jnp.zeros((L,) + stage_input.shape, stage_input.dtype))
        last_stage = self.stage == L - 1     # where the last layer of a repeat runs

        def embed(e, m):
            """Every stage's first_fn of microbatch m: [L, *stage input]."""
            return jax.vmap(first_fn)(e, jnp.broadcast_to(_index(xs, m), (L,) + jnp.shape(xs)[1:]))

        def forward_slot(t, c):
            valid, r, m = timing.forward(t, self.stage)
            keys = self.keys(key, r, m)
            fresh = lambda m: embed(ends_by_stage, m)   # noqa: E731
            x = _mask(valid, self.split(self.stage_inputs(t, fresh, self.shift(c["act"], 1))))
            if self.scan_layers:     # each layer's input kept
                y, inputs = self.scan_forward(lambda k: self.layer_at(per_stage, r, k), x, keys)
                kept = jnp.moveaxis(inputs, 0, 1)
            else:
                y, kept = run_stages(self.layer(per_stage, r), x, keys), x
            c["stash"] = jax.lax.dynamic_update_index_in_dim(c["stash"], kept, t % depth, axis=1)
            y = self.split(_mask(valid, y))
            # The last layer's output meets its loss in this very step: taken in the steps
            # where the last stage runs its last repeat (one in R with interleaving), a
            # condition the same on every device.
            last = valid & last_stage & (r == R - 1)
            done, r_last, m = timing.forward(t, L - 1)
            target = jnp.broadcast_to(_index(ys, m), (L,) + jnp.shape(ys)[1:])

            # The ends' gradient is added in the branch: a table-sized add every step
            # would otherwise add the other branch's zeros.
            def take_loss(y, target, e, d_ends):
                loss, loss_vjp = (jax.vjp(run_loss, y, target, e) if want_d_ys else
                                  jax.vjp(lambda y, e: run_loss(y, target, e), y, e))
                loss, (d_y, *d_rest) = _mask_tree(last, (loss, loss_vjp(jnp.ones_like(loss))))
                return loss, d_y, d_rest[:-1], _add_tree(d_ends, d_rest[-1])

            loss, d_y, d_ys, c["d_ends"] = jax.lax.cond(done & (r_last == R - 1), take_loss, _passing(take_loss),
                                                        y, target, ends_by_stage, c["d_ends"])
            c["loss"] = c["loss"] + loss
            if want_d_ys:
                c["d_ys"] = self.store(c["d_ys"], m, last & done, d_ys[0])
            c["act"], c["d_last"] = y, d_y
            return c

        def backward_slot(t, c):
            valid, r, m = timing.backward(t, self.stage)
            keys = self.keys(key, r, m)
            ct = jnp.where(_expand(last_stage & (r == R - 1), state), c["d_last"], self.shift(c["ct"], -1))
            stashed = (t - 2 * (timing.layers - 1) + 2 * (self.stage + r * L)) % depth   # the step it was stashed
            ct_in = _mask(valid, self.split(ct))
            if self.scan_layers:
                c["grads"], d_x = self.scan_backward(per_stage, r, jnp.moveaxis(_pick(c["stash"], stashed), 1, 0),
                                                     ct_in, valid, c["grads"], keys)
            else:
                _, vjp = jax.vjp(jax.checkpoint(lambda p, x: run_stages(p, x, keys)), self.layer(per_stage, r),
                                 _pick(c["stash"], stashed))
                d_layer, d_x = vjp(ct_in)
                c["grads"] = _add_tree(c["grads"], self.placed(c["grads"], lambda p: self.layer(p, r), valid, d_layer))
            c["ct"] = self.split(_mask(valid, d_x))
            # The first layer's input gradient, through first_fn (recomputed, as cheap as
            # an embedding lookup), to the ends' parameters and the microbatch, in the
            # steps where the first stage's slot takes a microbatch's first layer (the same
            # on every device): zero off that stage, whose cotangent alone is not masked
            # (first_fn reads a real microbatch, so no 0 * inf there), and added to the
            # ends' gradient as it is (an embedding's scatter updates its rows in place).
            valid0, r0, m0 = timing.backward(t, 0)
            entered = valid & (self.stage == 0) & (r == 0)

            def enter(ct, d_ends):
                if want_d_xs:
                    x0 = jnp.broadcast_to(_index(xs, m0), (L,) + jnp.shape(xs)[1:])
                    _, embed_vjp = jax.vjp(jax.vmap(first_fn), ends_by_stage, x0)
                    d_e, d_x0 = embed_vjp(ct)
                else:
                    _, embed_vjp = jax.vjp(lambda e: embed(e, m0), ends_by_stage)
                    (d_e,), d_x0 = embed_vjp(ct), None
                return d_x0, _add_tree(d_ends, d_e)
            d_x0, c["d_ends"] = jax.lax.cond(valid0 & (r0 == 0), enter, _passing(enter), _mask(entered, c["ct"]),
                                             c["d_ends"])
            if want_d_xs:
                c["d_xs"] = self.store(c["d_xs"], m0, entered, d_x0)
            return c

        def phase(forward: bool, backward: bool):
            def step(t, c):
                c = forward_slot(t, dict(c)) if forward else c
                return backward_slot(t, dict(c)) if backward else c
            return step

        loss_type = jax.eval_shape(loss_fn, stage_input, ys[0], ends)
        accumulator = lambda p: self.split(jnp.zeros(jnp.shape(p), _accumulated(p)))   # noqa: E731
        carry = {"act": state, "ct": state, "d_last": state,
                 "stash": self.split(jnp.zeros((L, depth) + self.inner + stage_input.shape,
                                               stage_input.dtype)),
                 "loss": self.split(jnp.zeros((L,), loss_type.dtype)),
                 "grads": jax.tree_util.tree_map(accumulator, per_stage),
                 "d_ends": jax.tree_util.tree_map(accumulator, ends_by_stage)}
        if want_d_xs:
            carry["d_xs"] = self.split(jnp.zeros((L,) + jnp.shape(xs), xs.dtype))
        if want_d_ys:
            carry["d_ys"] = self.split(jnp.zeros((L,) + jnp.shape(ys), ys.dtype))
        first_backward, last_forward = timing.layers - 1, timing.forward_steps
        for start, stop, f, b in ((0, first_backward, True, False), (first_backward, last_forward, True, True),
                                  (last_forward, last_forward + timing.layers - 1, False, True)):
            carry = jax.lax.fori_loop(start, stop, phase(f, b), carry)
        grads = (jax.tree_util.tree_map(lambda g, p: self.from_stages(g).astype(p.dtype), carry["grads"],
                                        stacked_params),
                 jax.tree_util.tree_map(lambda g, p: jnp.sum(g, axis=0).astype(jnp.result_type(p)), carry["d_ends"],
                                        ends),
                 self.from_stage(carry["d_xs"], 0) if want_d_xs else None,
                 self.from_stage(carry["d_ys"], L - 1) if want_d_ys else None)
        return jnp.sum(carry["loss"]), grads


def _microbatch_count(microbatches) -> int:
    """M: the leading dim of the microbatches array, at least 1."""
    shape = array_shape(microbatches, "microbatches of gspmd.pipeline")
    if not shape or shape[0] < 1:
        raise ShardingError(f"A pipeline needs at least one microbatch (the leading dim of microbatches of shape "
                            f"{shape}); stack them as [M, *microbatch].")
    return shape[0]


def _check_leading(tree, size: int, what: str, why: str, dim: str = "layer dim") -> None:
    """Every leaf of `tree` an array whose leading dim (layers, or microbatches) is `size`."""
    for leaf in jax.tree_util.tree_leaves(tree):
        shape = array_shape(leaf, what)
        if shape[:1] != (size,):
            given = f"of shape {shape}" if hasattr(leaf, "shape") else describe(leaf)
            raise ShardingError(f"{what} {given} must have a leading {dim} of {why} = {size}.")


def _inner_layers(stacked_params) -> tuple[int]:
    """scan_layers: (K,), every leaf being [L*R, K, ...] with one K."""
    inner = {array_shape(leaf, "Stacked parameter")[1:2] for leaf in jax.tree_util.tree_leaves(stacked_params)}
    if len(inner) != 1 or () in inner:
        raise ShardingError(f"gspmd.pipeline(scan_layers=True) needs every stacked parameter as [layers, K, ...] "
                            f"with one K (the layers each scans in turn); got second dims {sorted(inner)}.")
    return inner.pop()


def _index(x, m, axis: int = 0):
    return jax.lax.dynamic_index_in_dim(x, m, axis=axis, keepdims=False)


def _fold(keys, k):
    """Per stage, its key folded with k (None: no keys)."""
    return None if keys is None else jax.vmap(jax.random.fold_in, (0, None))(keys, k)


def _tree_index(tree, m, axis: int):
    return jax.tree_util.tree_map(lambda x: _index(x, m, axis), tree)


# Per stage s, buffer[s, index[s]]: a gather local to each stage (its batch dim is the
# stage dim) that reads one entry, where a one-hot masked sum would read them all.
_pick = jax.vmap(lambda buffer, i: jax.lax.dynamic_index_in_dim(buffer, i, 0, keepdims=False))
# Per stage s, stack[s, index[s], k]: likewise, one entry of a [R, K, ...] stack.
_pick_at = jax.vmap(lambda stack, i, k: jax.lax.dynamic_slice(stack, (i, k) + (0,) * (stack.ndim - 2),
                                                               (1, 1) + stack.shape[2:])[0, 0], in_axes=(0, 0, None))


def _accumulated(p):
    """The dtype a parameter's gradient is summed in over the microbatches: at least
    float32 (low-precision weights, as Megatron-LM's main_grad)."""
    return jnp.promote_types(jnp.result_type(p), jnp.float32)


def _add_tree(a, b):
    return jax.tree_util.tree_map(jnp.add, a, b)


def _passing(branch):
    """The other branch of a conditional whose `branch(*args, acc)` adds to an
    accumulator: zeros for its results but the last, and `acc` as it is (so the add runs
    only in the steps that take `branch`)."""
    def passing(*args):
        zeros = jax.tree_util.tree_map(jnp.zeros_like, jax.eval_shape(branch, *args))
        return (*zeros[:-1], args[-1])
    return passing


def _is_primal(x) -> bool:
    return isinstance(x, CustomVJPPrimal)



def _masked_stages(run):
    """run (all stages at once) with bubble slots masked: inputs and outputs, and in the
    backward pass the cotangents of the parameters and inputs too, since the stage's
    vjp on a bubble slot may be NaN (0 * inf) even for a zero cotangent."""

    def primal(layer, x, valid, keys):
        return _mask(valid, run(layer, _mask(valid, x), keys))

    def fwd(layer, x, valid, keys):
        y, vjp = jax.vjp(lambda layer, x: run(layer, x, keys), layer, _mask(valid, x))
        return _mask(valid, y), (vjp, valid)

    def bwd(res, ct):
        vjp, valid = res
        d_layer, d_x = vjp(_mask(valid, ct))
        return _mask_tree(valid, d_layer), _mask(valid, d_x), None, None

    masked = jax.custom_vjp(primal)
    masked.defvjp(fwd, bwd)
    return masked
