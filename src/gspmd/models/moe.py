"""A GShard-style mixture-of-experts layer (paper Section 5.2) and its train step.

Tokens come in G groups of S; a gate picks one expert per token (top-1) and each expert
takes at most C tokens per group. Dispatch and combine are einsums with a one-hot
[G, S, E, C] mask. With groups split over the mesh and experts split over the same axis,
the dispatch einsum's result moves from a G split to an E split: one all-to-all there,
one back after the experts — and nothing else moves.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from gspmd.frontend import mesh_split
from gspmd.mesh import Mesh
from gspmd.models.optimizers import Optimizer, make_step


@dataclass(frozen=True)
class Config:
    groups: int = 8
    group_size: int = 8
    model: int = 16
    hidden: int = 32
    experts: int = 8
    capacity: int = 4
    lr: float = 0.1
    param_dtype: Any = np.float32   # mixed precision: parameters stored in param_dtype,
    dtype: Any = np.float32         # tokens and einsums in dtype, gating and loss in float32


def moe_layer(params: dict, x, mesh: Optional[Mesh], axis: str, cfg: Config, expert_axis: Optional[str] = None):
    """x [G, S, M] -> [G, S, M]; groups and experts split over mesh axis `axis`. The
    hybrid configuration (paper Table 7, Figure 8b) also splits each expert's hidden dim
    H over `expert_axis`, for experts too large for one device, and keeps the tokens' M
    split over it, as the 2D-finalized dense layers keep their activations: the
    all-to-alls move 1/Y of the tokens, the experts' einsum gathers M on demand and its
    partial sums are reduce-scattered back onto M. With mesh None, no annotations (for
    gspmd.auto)."""
    inner = expert_axis if expert_axis is not None else -1

    def split(value, spec):
        return value if mesh is None else mesh_split(value, mesh, spec)

    x = split(x.astype(cfg.dtype), [axis, -1, inner])
    w_in = split(params["w_in"], [axis, -1, inner]).astype(cfg.dtype)      # E M H
    w_out = split(params["w_out"], [axis, inner, -1]).astype(cfg.dtype)    # E H M
    gate_logits = jnp.einsum("gsm,me->gse", x, params["w_gate"].astype(cfg.dtype))
    gates = jax.nn.softmax(gate_logits.astype(np.float32), axis=-1)
    expert = jnp.argmax(gates, axis=-1)
    mask = jax.nn.one_hot(expert, cfg.experts, dtype=x.dtype)                     # G S E
    position = (jnp.cumsum(mask, axis=1) - 1) * mask                              # slot in its expert
    kept = mask * (position < cfg.capacity)
    slots = jax.nn.one_hot(position.astype(jnp.int32), cfg.capacity, dtype=x.dtype)   # G S E C
    dispatch = kept[..., None] * slots
    combine = dispatch * jnp.sum(gates * mask, axis=-1).astype(x.dtype)[..., None, None]
    expert_in = split(jnp.einsum("gsec,gsm->egcm", dispatch, x), [axis, -1, -1, inner])
    hidden = jax.nn.relu(jnp.einsum("egcm,emh->egch", expert_in, w_in))
    expert_out = split(jnp.einsum("egch,ehm->egcm", hidden, w_out), [axis, -1, -1, inner])
    return x + jnp.einsum("gsec,egcm->gsm", combine, expert_out)


def dropless_layer(params: dict, x, mesh: Optional[Mesh], axis: str, cfg: Config, expert_axis: Optional[str] = None):
    """The same layer with no capacity (no token dropped), as Megablocks and MaxText write
    it: each group's tokens sorted by their expert, the experts' matmuls as
    lax.ragged_dot_general over the sorted tokens (the group sizes per token group), then
    unsorted. Groups split over `axis`, the experts' weights over `expert_axis` (None:
    replicated): each device multiplies its own groups' tokens with its own experts."""
    def split(value, spec):
        return value if mesh is None else mesh_split(value, mesh, spec)

    experts = -1 if expert_axis is None else expert_axis
    x = split(x.astype(cfg.dtype), [axis, -1, -1])
    w_in = split(params["w_in"], [experts, -1, -1]).astype(cfg.dtype)      # E M H
    w_out = split(params["w_out"], [experts, -1, -1]).astype(cfg.dtype)    # E H M
    gates = jax.nn.softmax(jnp.einsum("gsm,me->gse", x, params["w_gate"].astype(cfg.dtype)).astype(np.float32), -1)
    expert = jnp.argmax(gates, axis=-1)                                            # G S
    order = jnp.argsort(expert, axis=1)
    sizes = jnp.sum(jax.nn.one_hot(expert, cfg.experts, dtype=jnp.int32), axis=1)   # G E: tokens per expert
    # tokens [G, S, M], ragged along S, sizes per group G: experts' weights [E, K, N]
    numbers = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((2,), (1,)), ((), ())),
                                                lhs_ragged_dimensions=(1,), rhs_group_dimensions=(0,))
    tokens = jnp.take_along_axis(x, order[..., None], axis=1)
    hidden = jax.nn.relu(jax.lax.ragged_dot_general(tokens, w_in, sizes, numbers))
    out = jax.lax.ragged_dot_general(hidden, w_out, sizes, numbers)
    out = jnp.take_along_axis(out, jnp.argsort(order, axis=1)[..., None], axis=1)
    return x + out * jnp.max(gates, axis=-1).astype(x.dtype)[..., None]


def make_train_step(mesh: Optional[Mesh], axis: str = "x", cfg: Config = Config(), expert_axis: Optional[str] = None,
                    optimizer: Optional[Optimizer] = None, dropless: bool = False):
    """step(params, x, target) -> (new params, loss) with plain SGD; with an optimizer,
    step(params, optimizer state, x, target) -> (new params, new state, loss). With mesh
    None, no annotations (for gspmd.auto). dropless: the layer with lax.ragged_dot."""
    layer = dropless_layer if dropless else moe_layer

    def loss(params, x, target):
        y = layer(params, x, mesh, axis, cfg, expert_axis)
        return jnp.mean((y.astype(np.float32) - target) ** 2)

    return make_step(loss, optimizer, cfg.lr)


def example_inputs(cfg: Config = Config(), seed: int = 0):
    rng = np.random.RandomState(seed)
    rand = lambda *shape: (rng.standard_normal(shape) / np.sqrt(shape[-2] if len(shape) > 1 else 1)  # noqa: E731
                           ).astype(np.float32)
    params = {"w_gate": rand(cfg.model, cfg.experts), "w_in": rand(cfg.experts, cfg.model, cfg.hidden),
              "w_out": rand(cfg.experts, cfg.hidden, cfg.model)}
    params = {k: v.astype(cfg.param_dtype) for k, v in params.items()}
    x = rng.standard_normal((cfg.groups, cfg.group_size, cfg.model)).astype(np.float32)
    return params, x, rng.standard_normal(x.shape).astype(np.float32)
