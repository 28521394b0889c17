"""A pipeline's stages (gspmd.pipeline): all L stages run as one vectorized computation
(a vmap of the stage function, or a manual region over the stage axis), on each stage's
layer for the repeat it works on, with bubble slots masked; and the gpipe and circular
schedules' loop (shifting the state one stage along the ring every step)."""
from __future__ import annotations

from typing import Callable, Optional, Union

import jax
import jax.numpy as jnp

from gspmd.checks import count, flag, function
from gspmd.errors import ShardingError
from gspmd.frontend import manual
from gspmd.mesh import Mesh, as_mesh
from gspmd.pipeline_1f1b import OneFOneB
from gspmd.pipeline_buffers import (StageBuffers, Timing, add_tree, check_leading, expand, index, inner_layers, mask,
                                    mask_tree, microbatch_count, pick, pick_at, tree_index)

SCHEDULES = ("gpipe", "circular", "1f1b")


class Pipeline(StageBuffers, OneFOneB):
    """One call's pipeline: its stages run at once over the stage axis, and the gpipe
    and circular schedules' loop (the 1f1b loop: OneFOneB)."""

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
        m = microbatch_count(microbatches)
        check_leading(stacked_params, stages * repeats, "Stacked parameter",
                      f"{stages} stages x {repeats} repeats (stage axis {stage_axis!r} of {mesh})")
        # (K,): with scan_layers the stash keeps each of a stage's K layers' inputs
        self.inner = inner_layers(stacked_params) if self.scan_layers else ()
        # (with one repeat both orders are one)
        super().__init__(mesh, stage_axis, stages, repeats, stage_major or repeats == 1, scatter_axis)
        self.stage_fn, self.manual_stages = stage_fn, manual_stages
        self.timing = Timing(stages, m, repeats)

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
        return jax.tree_util.tree_map(lambda p: pick(p, r), per_stage)

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
            return jax.tree_util.tree_map(lambda p: index(p, k, axis=2)[:, 0], per_stage)
        return jax.tree_util.tree_map(lambda p: pick_at(p, r, k), per_stage)

    # -- pieces of a step -------------------------------------------------------------
    def stage_inputs(self, t, read, previous):
        """What each stage's forward slot reads at step t: stage 0 a fresh microbatch
        (read(m)) on its first repeat, every other slot what the stage before produced."""
        _, r0, m0 = self.timing.forward(t, 0)
        fresh = read(m0)
        take_fresh = (self.stage == 0) & (r0 == 0)
        return jnp.where(expand(take_fresh, previous), fresh, previous)

    def all_stages(self):
        """(layers [L, ...], inputs [L, ...]) -> outputs [L, ...]: every stage at once
        (with scan_layers, each of its K layers in turn)."""
        if not self.scan_layers:
            return self.one_layer()
        return lambda layer, x, keys=None: self.scan_forward(lambda k: tree_index(layer, k, axis=1), x, keys)[0]

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
            return (self.split(d_x), add_tree(grads, d_p)), None
        (d_x, grads), _ = jax.lax.scan(back, (ct, grads), (jnp.arange(self.inner[0]), inputs), reverse=True)
        return grads, d_x

    @staticmethod
    def placed(grads, select, valid, d_part):
        """d_part, the gradient of select(stack) (masked where the slot is not valid),
        widened to the accumulator's dtype and shape `grads`: zeros but at its place, so
        that its sum with the accumulator is an update made in place (passes.accumulate)
        where the whole stack would be added every step."""
        _, place = jax.vjp(select, grads)
        (widened,) = place(jax.tree_util.tree_map(lambda g, a: mask(valid, g).astype(a.dtype), d_part,
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
            x = self.split(self.stage_inputs(t, lambda m: index(inputs, m, axis=1), shift_right(state)))
            state = self.split(run(per_stage, r, x, valid, self.keys(key, r, m)))
            done, r_last, m_last = self.timing.forward(t, last)
            return (state, self.store(outputs, m_last, done & (r_last == self.R - 1), state)), None

        state = self.split(jnp.zeros((self.L,) + jnp.shape(microbatches)[1:], microbatches.dtype))
        steps = jnp.arange(self.timing.forward_steps)
        (_, outputs), _ = jax.lax.scan(step, (state, self.split(jnp.zeros_like(inputs))), steps)
        return self.from_stage(outputs, last)


def _fold(keys, k):
    """Per stage, its key folded with k (None: no keys)."""
    return None if keys is None else jax.vmap(jax.random.fold_in, (0, None))(keys, k)


def _masked_stages(run):
    """run (all stages at once) with bubble slots masked: inputs and outputs, and in the
    backward pass the cotangents of the parameters and inputs too, since the stage's
    vjp on a bubble slot may be NaN (0 * inf) even for a zero cotangent."""

    def primal(layer, x, valid, keys):
        return mask(valid, run(layer, mask(valid, x), keys))

    def fwd(layer, x, valid, keys):
        y, vjp = jax.vjp(lambda layer, x: run(layer, x, keys), layer, mask(valid, x))
        return mask(valid, y), (vjp, valid)

    def bwd(res, ct):
        vjp, valid = res
        d_layer, d_x = vjp(mask(valid, ct))
        return mask_tree(valid, d_layer), mask(valid, d_x), None, None

    masked = jax.custom_vjp(primal)
    masked.defvjp(fwd, bwd)
    return masked
