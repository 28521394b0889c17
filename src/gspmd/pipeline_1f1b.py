"""The 1f1b schedule (gspmd.pipeline_loss): forward and backward slots of different
microbatches in one loop of three phases, the backward written with jax.vjp of the
stage, the loss taken in the step each microbatch leaves the last stage."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

from gspmd.pipeline_buffers import accumulated, add_tree, expand, index, mask, mask_tree, pick


class OneFOneB:
    """The 1f1b loop of a Pipeline (a mixin: it runs the pipeline's stages)."""

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
            return jax.vmap(first_fn)(e, jnp.broadcast_to(index(xs, m), (L,) + jnp.shape(xs)[1:]))

        def forward_slot(t, c):
            valid, r, m = timing.forward(t, self.stage)
            keys = self.keys(key, r, m)
            fresh = lambda m: embed(ends_by_stage, m)   # noqa: E731
            x = mask(valid, self.split(self.stage_inputs(t, fresh, self.shift(c["act"], 1))))
            if self.scan_layers:     # each layer's input kept
                y, inputs = self.scan_forward(lambda k: self.layer_at(per_stage, r, k), x, keys)
                kept = jnp.moveaxis(inputs, 0, 1)
            else:
                y, kept = run_stages(self.layer(per_stage, r), x, keys), x
            c["stash"] = jax.lax.dynamic_update_index_in_dim(c["stash"], kept, t % depth, axis=1)
            y = self.split(mask(valid, y))
            # The last layer's output meets its loss in this very step: taken in the steps
            # where the last stage runs its last repeat (one in R with interleaving), a
            # condition the same on every device.
            last = valid & last_stage & (r == R - 1)
            done, r_last, m = timing.forward(t, L - 1)
            target = jnp.broadcast_to(index(ys, m), (L,) + jnp.shape(ys)[1:])

            # The ends' gradient is added in the branch: a table-sized add every step
            # would otherwise add the other branch's zeros.
            def take_loss(y, target, e, d_ends):
                loss, loss_vjp = (jax.vjp(run_loss, y, target, e) if want_d_ys else
                                  jax.vjp(lambda y, e: run_loss(y, target, e), y, e))
                loss, (d_y, *d_rest) = mask_tree(last, (loss, loss_vjp(jnp.ones_like(loss))))
                return loss, d_y, d_rest[:-1], add_tree(d_ends, d_rest[-1])

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
            ct = jnp.where(expand(last_stage & (r == R - 1), state), c["d_last"], self.shift(c["ct"], -1))
            stashed = (t - 2 * (timing.layers - 1) + 2 * (self.stage + r * L)) % depth   # the step it was stashed
            ct_in = mask(valid, self.split(ct))
            if self.scan_layers:
                c["grads"], d_x = self.scan_backward(per_stage, r, jnp.moveaxis(pick(c["stash"], stashed), 1, 0),
                                                     ct_in, valid, c["grads"], keys)
            else:
                _, vjp = jax.vjp(jax.checkpoint(lambda p, x: run_stages(p, x, keys)), self.layer(per_stage, r),
                                 pick(c["stash"], stashed))
                d_layer, d_x = vjp(ct_in)
                c["grads"] = add_tree(c["grads"], self.placed(c["grads"], lambda p: self.layer(p, r), valid, d_layer))
            c["ct"] = self.split(mask(valid, d_x))
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
                    x0 = jnp.broadcast_to(index(xs, m0), (L,) + jnp.shape(xs)[1:])
                    _, embed_vjp = jax.vjp(jax.vmap(first_fn), ends_by_stage, x0)
                    d_e, d_x0 = embed_vjp(ct)
                else:
                    _, embed_vjp = jax.vjp(lambda e: embed(e, m0), ends_by_stage)
                    (d_e,), d_x0 = embed_vjp(ct), None
                return d_x0, add_tree(d_ends, d_e)
            d_x0, c["d_ends"] = jax.lax.cond(valid0 & (r0 == 0), enter, _passing(enter), mask(entered, c["ct"]),
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
        accumulator = lambda p: self.split(jnp.zeros(jnp.shape(p), accumulated(p)))   # noqa: E731
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
