"""The stage axis of a pipeline (gspmd.pipeline): which microbatch and repeat each stage
works on when (Timing), and the values laid out over the stage axis: the state that
shifts along the ring, the [L, R, ...] stacks of each stage's layers (moved from layer
order into stage order where the stacks come in layer order), per-stage buffers and
copies; the checks of what a pipeline is given, and the small array helpers its
schedules share."""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from gspmd.checks import array_shape, describe
from gspmd.errors import ShardingError
from gspmd.frontend import mesh_split
from gspmd.ir.schedule import PipelineSchedule
from gspmd.mesh import Mesh
from gspmd.sharding import UNSPECIFIED


def schedule_steps(stages: int, microbatches: int, repeats: int = 1) -> int:
    """Steps of a gpipe (repeats 1) or circular schedule: M + L - 1, or M*R + L - 1
    where L divides M (a short last round of microbatches is padded)."""
    last = microbatches - 1
    return (last // stages) * stages * repeats + last % stages + stages * repeats


class Timing:
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


def expand(valid, like):
    """A [L] mask broadcastable against [L, ...] values."""
    return jnp.reshape(valid, valid.shape + (1,) * (like.ndim - valid.ndim))


def mask(valid, x):
    """x where the stage's slot is valid, else exactly zero (NaN and Inf included)."""
    return jnp.where(expand(valid, x), x, jnp.zeros_like(x))


def mask_tree(valid, tree):
    return jax.tree_util.tree_map(lambda x: mask(valid, x), tree)


class StageBuffers:
    """Values laid out over the stage axis `axis` of `mesh` (L stages, R repeats)."""

    def __init__(self, mesh: Mesh, axis: str, stages: int, repeats: int, in_stage_order: bool,
                 scatter_axis: Optional[str]):
        self.mesh, self.axis, self.scatter_axis = mesh, axis, scatter_axis
        self.L, self.R = stages, repeats
        self.in_stage_order = in_stage_order
        self.stage = jnp.arange(stages)

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
        reshape; in layer order each stage's layers are exchanged: one all-to-all where L
        divides R, an all-to-all and a collective-permute where R divides L (below), else
        one-layer pieces (`_in_order`)."""
        rest = jnp.shape(p)[1:]
        if self.in_stage_order:
            return self.split(jnp.reshape(self.split(p), (self.L, self.R) + rest))
        if self.L % self.R == 0:
            return self._by_stage_in_pieces(p)
        if self.R % self.L == 0:
            return self.split(jnp.swapaxes(jnp.reshape(self.split(p), (self.R, self.L) + rest), 0, 1))
        return self.split(jnp.reshape(self._in_order(self.split(p), _stage_major(self.L, self.R)),
                                      (self.L, self.R) + rest))

    def from_stages(self, p):
        """Inverse of by_stage."""
        rest = jnp.shape(p)[2:]
        if self.in_stage_order:
            return self.split(jnp.reshape(p, (self.L * self.R,) + rest))
        if self.L % self.R == 0:
            return self._from_stages_in_pieces(p)
        if self.R % self.L == 0:
            return self.split(jnp.reshape(jnp.swapaxes(p, 0, 1), (self.L * self.R,) + rest))
        order = np.argsort(_stage_major(self.L, self.R))
        return self.split(self._in_order(self.split(jnp.reshape(p, (self.L * self.R,) + rest)), order))

    def _in_order(self, x, order):
        """x[order] along its split leading dim, one layer a piece: the partitioner moves
        only the layers that change device, in rounds of one-layer collective-permutes
        (data formatting). Its gradient is the inverse reorder, not a sum of pads."""
        @jax.custom_vjp
        def reordered(x):
            return _pieces_in_order(x, order)
        reordered.defvjp(lambda x: (reordered(x), None),
                         lambda _, ct: (self.split(_pieces_in_order(ct, np.argsort(order))),))
        return self.split(reordered(x))

    # Where R divides L, stage s = a*(L/R) + g holds layers l = s*R + i = a*L + g*R + i of a
    # layer-ordered stack: repeat a of stage t = g*R + i. Seen as [a, g, i], the move into
    # stage order is one all-to-all (a's part of the stage axis moves from a onto i) and
    # one collective-permute (devices relabelled: the holder of (g, i) is i*(L/R) + g),
    # written as annotations over the mesh with the stage axis factored, each step one
    # reshard the partitioner finds by itself. Before each change of layout the value is
    # annotated as it is laid out: the dims no annotation names (a tensor-parallel split
    # of the layers' own dims) pass through annotations, but not through an op whose
    # result two neighbours want laid out differently.
    def _pieces_mesh(self) -> Mesh:
        """The mesh with the stage axis factored into (repeat part, group part)."""
        return self.mesh.factor_axis(self.axis, self._pieces_axes(), (self.R, self.L // self.R))

    def _pieces_axes(self) -> tuple[str, str]:
        return f"{self.axis}/repeat", f"{self.axis}/group"

    def _pieces(self, x, mapping):
        return mesh_split(x, self._pieces_mesh(), list(mapping) + [UNSPECIFIED] * (jnp.ndim(x) - len(mapping)))

    def _moved(self, x, before, after):
        """x annotated as it is laid out (`before`), then as it is wanted (`after`)."""
        return self._pieces(self._pieces(x, before), after)

    def _by_stage_in_pieces(self, p):
        rest, (a, g) = jnp.shape(p)[1:], self._pieces_axes()
        x = jnp.reshape(self.split(p), (self.R, self.L // self.R, self.R) + rest)    # [a, g, i]
        x = jnp.transpose(self._moved(x, [a, g, -1], [-1, g, a]), _leading((1, 2, 0), x))    # [g, i, a]
        x = jnp.reshape(self._pieces(x, [g, a, -1]), (self.L, self.R) + rest)        # [t = (g, i), a]
        return self.split(self._pieces(x, [(g, a), -1]))

    def _from_stages_in_pieces(self, p):
        rest, (a, g) = jnp.shape(p)[2:], self._pieces_axes()
        x = self._pieces(self.split(p), [(g, a), -1])                                # [t = (g, i), a]
        x = self._pieces(jnp.reshape(x, (self.L // self.R, self.R, self.R) + rest), [g, a, -1])
        x = self._moved(jnp.transpose(x, _leading((2, 0, 1), x)), [-1, g, a], [a, g, -1])     # [a, g, i]
        return self.split(jnp.reshape(x, (self.L * self.R,) + rest))

    def per_stage_buffer(self, xs):
        """[M, ...] -> [L, M, ...] split by stage: every stage holds the whole array, and
        reading or writing one microbatch of it is local."""
        return self.split(jnp.broadcast_to(xs[None], (self.L,) + jnp.shape(xs)))

    def per_stage_copy(self, tree):
        """A pytree's leaves as [L, ...] split by stage: each stage its own copy, whose
        gradient it accumulates locally (summed over the stages once, after the loop)."""
        return jax.tree_util.tree_map(lambda p: self.split(jnp.broadcast_to(p[None], (self.L,) + jnp.shape(p))), tree)

    def store(self, buffer, m, keep, value):
        """buffer[:, m] = value where keep (a scalar or [L] mask), a local update."""
        current = index(buffer, m, axis=1)
        new = jnp.where(expand(jnp.broadcast_to(keep, (self.L,)), value), value, current)
        return jax.lax.dynamic_update_index_in_dim(buffer, new, m, axis=1)

    def from_stage(self, buffer, s: int):
        """buffer[s] of a per-stage buffer, as one reduction over the stages (an all-reduce,
        or a reduce-scatter if the result is wanted split), once after the loop. The sum
        stays in the buffer's dtype (jnp.sum would reduce bfloat16 in float32): one stage
        holds the value, the others exact zeros."""
        return jax.lax.reduce(mask(self.stage == s, buffer), np.zeros((), buffer.dtype), jax.lax.add, (0,))


def microbatch_count(microbatches) -> int:
    """M: the leading dim of the microbatches array, at least 1."""
    shape = array_shape(microbatches, "microbatches of gspmd.pipeline")
    if not shape or shape[0] < 1:
        raise ShardingError(f"A pipeline needs at least one microbatch (the leading dim of microbatches of shape "
                            f"{shape}); stack them as [M, *microbatch].")
    return shape[0]


def check_leading(tree, size: int, what: str, why: str, dim: str = "layer dim") -> None:
    """Every leaf of `tree` an array whose leading dim (layers, or microbatches) is `size`."""
    for leaf in jax.tree_util.tree_leaves(tree):
        shape = array_shape(leaf, what)
        if shape[:1] != (size,):
            given = f"of shape {shape}" if hasattr(leaf, "shape") else describe(leaf)
            raise ShardingError(f"{what} {given} must have a leading {dim} of {why} = {size}.")


def inner_layers(stacked_params) -> tuple[int]:
    """scan_layers: (K,), every leaf being [L*R, K, ...] with one K."""
    inner = {array_shape(leaf, "Stacked parameter")[1:2] for leaf in jax.tree_util.tree_leaves(stacked_params)}
    if len(inner) != 1 or () in inner:
        raise ShardingError(f"gspmd.pipeline(scan_layers=True) needs every stacked parameter as [layers, K, ...] "
                            f"with one K (the layers each scans in turn); got second dims {sorted(inner)}.")
    return inner.pop()


def index(x, m, axis: int = 0):
    return jax.lax.dynamic_index_in_dim(x, m, axis=axis, keepdims=False)


def tree_index(tree, m, axis: int):
    return jax.tree_util.tree_map(lambda x: index(x, m, axis), tree)


# Per stage s, buffer[s, index[s]]: a gather local to each stage (its batch dim is the
# stage dim) that reads one entry, where a one-hot masked sum would read them all.
pick = jax.vmap(lambda buffer, i: jax.lax.dynamic_index_in_dim(buffer, i, 0, keepdims=False))
# Per stage s, stack[s, index[s], k]: likewise, one entry of a [R, K, ...] stack.
pick_at = jax.vmap(lambda stack, i, k: jax.lax.dynamic_slice(stack, (i, k) + (0,) * (stack.ndim - 2),
                                                               (1, 1) + stack.shape[2:])[0, 0], in_axes=(0, 0, None))


def accumulated(p):
    """The dtype a parameter's gradient is summed in over the microbatches: at least
    float32 (low-precision weights, as Megatron-LM's main_grad)."""
    return jnp.promote_types(jnp.result_type(p), jnp.float32)


def add_tree(a, b):
    return jax.tree_util.tree_map(jnp.add, a, b)


def _leading(order: tuple[int, ...], x) -> tuple[int, ...]:
    """A transpose's permutation of x's leading dims in `order`, its other dims kept."""
    return order + tuple(range(len(order), jnp.ndim(x)))


def _stage_major(stages: int, repeats: int) -> np.ndarray:
    """The layer at each index of a stage-ordered stack: s*R + r holds layer r*L + s."""
    return np.arange(stages * repeats).reshape(repeats, stages).T.ravel()


def _pieces_in_order(x, order):
    return jnp.concatenate([jax.lax.slice_in_dim(x, int(i), int(i) + 1) for i in order])
