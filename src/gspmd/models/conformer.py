"""A Conformer block (Gulati et al. 2020), the speech model the paper pipelines (Section
5.3, Table 5): half a feed-forward, self-attention, a convolution module, half another
feed-forward, then a layer norm. The convolution module is a pointwise convolution to
2M channels, a gated linear unit, a depthwise convolution over time, layer norm (the
paper's batch norm, whose statistics span the batch), swish and a pointwise convolution
back to M. Attention and the feed-forwards are the Transformer's (gspmd.models.transformer).

`make_train_step` pipelines a stack of blocks over the stage axis with
`gspmd.pipeline_loss` (GPipe, circular or 1F1B), batch over a data axis inside every
stage and, on a 3-D mesh, the feed-forward hidden dim and the heads over a model axis.

Dims: B batch, S time steps, M model, H feed-forward hidden, N heads, D head size,
K depthwise kernel width.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gspmd.mesh import Mesh
from gspmd.models import transformer
from gspmd.models.optimizers import Optimizer, make_step
from gspmd.models.transformer import Annotate, layer_norm
from gspmd.pipeline import pipeline_loss, stage_major_order


@dataclass(frozen=True)
class Config(transformer.Config):
    kernel: int = 5      # depthwise convolution width


def shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
    m, h, n, d = cfg.model, cfg.hidden, cfg.heads, cfg.head_dim
    return {"ffn1_in": (m, h), "ffn1_out": (h, m), "wq": (m, n, d), "wk": (m, n, d), "wv": (m, n, d),
            "wo": (n, d, m), "conv_in": (m, 2 * m), "conv_depthwise": (cfg.kernel, 1, m), "conv_out": (m, m),
            "ffn2_in": (m, h), "ffn2_out": (h, m)}


def convolution(w: dict, x, cfg: Config):
    h = jax.nn.glu(jnp.einsum("bsm,mk->bsk", layer_norm(x), w["conv_in"]), axis=-1)
    h = lax.conv_general_dilated(h, w["conv_depthwise"], (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC"),
                                 feature_group_count=cfg.model)
    return jnp.einsum("bsm,mn->bsn", jax.nn.swish(layer_norm(h)), w["conv_out"])


def layer(params: dict, x, annotate: Annotate, strategy: dict, cfg: Config):
    """One Conformer block. Annotates each tensor that `strategy` names ("x": its input)."""
    at = transformer.annotator(annotate, strategy)
    w = {name: at(name, p).astype(cfg.dtype) for name, p in params.items()}
    x = at("x", x.astype(cfg.dtype))
    x = x + 0.5 * transformer.feed_forward(w["ffn1_in"], w["ffn1_out"], x, at, cfg)
    x = x + transformer.attention(w, x, at, cfg)
    x = x + convolution(w, x, cfg)
    x = x + 0.5 * transformer.feed_forward(w["ffn2_in"], w["ffn2_out"], x, at, cfg)
    return at("out", layer_norm(x))


def example_inputs(cfg: Config, seed: int = 0):
    """(per-layer params, x, target) as NumPy arrays."""
    rng = np.random.RandomState(seed)
    params = [{name: (rng.standard_normal(shape) / np.sqrt(np.prod(shape[:-1]))).astype(np.float32)
               for name, shape in shapes(cfg).items()} for _ in range(cfg.layers)]
    act = (cfg.batch, cfg.seq, cfg.model)
    return params, rng.standard_normal(act).astype(np.float32), rng.standard_normal(act).astype(np.float32)


# -- pipelined (Table 5) ----------------------------------------------------------------------
def pipeline_strategy(data_axis: Optional[str] = "x", model_axis: Optional[str] = None) -> dict[str, list]:
    """In-stage annotations: batch over the data axis; with a model axis also the
    feed-forward hidden dims and the heads (Megatron style)."""
    plan = {} if data_axis is None else {"x": [data_axis, -1, -1]}
    if model_axis is not None:
        plan.update({"ffn1_in": [-1, model_axis], "ffn1_out": [model_axis, -1], "ffn2_in": [-1, model_axis],
                     "ffn2_out": [model_axis, -1], "wq": [-1, model_axis, -1], "wk": [-1, model_axis, -1],
                     "wv": [-1, model_axis, -1], "wo": [model_axis, -1, -1]})
    return plan


def microbatch_loss(y, target):
    return jnp.mean((y.astype(np.float32) - target) ** 2)


def make_train_step(mesh: Mesh, cfg: Config = Config(), stage_axis: str = "p", data_axis: Optional[str] = "x",
                    model_axis: Optional[str] = None, schedule: str = "gpipe", repeats: int = 1,
                    optimizer: Optional[Optimizer] = None):
    """step(stacked params (stage-major, leading dim L*R: gspmd.stage_major_order),
    microbatches [M, B, S, M], targets) -> (new params, loss) on the summed microbatch
    losses, with plain SGD or `optimizer` (gspmd.models.optimizers.make_step)."""
    annotate, plan = transformer.gspmd_annotate(mesh), pipeline_strategy(data_axis, model_axis)

    def loss(stacked, xs, targets):
        return pipeline_loss(lambda p, x: layer(p, x, annotate, plan, cfg), microbatch_loss, stacked, xs, targets,
                             mesh=mesh, stage_axis=stage_axis, schedule=schedule, repeats=repeats, stage_major=True)

    return make_step(loss, optimizer, cfg.lr)


def reference_step(cfg: Config = Config()):
    """The same SGD step on one device, layers in order (stacks in layer order)."""
    def loss(stacked, xs, targets):
        def one(x):
            return lax.scan(lambda x, p: (layer(p, x, lambda v, _: v, {}, cfg), None), x, stacked)[0]
        return jnp.sum(jax.vmap(microbatch_loss)(jax.vmap(one)(xs), targets))

    return make_step(loss, None, cfg.lr)


def stacked_inputs(cfg: Config, microbatches: int, seed: int = 0):
    """(params stacked in layer order [layers, ...], microbatches, targets)."""
    params, _, _ = example_inputs(cfg, seed)
    rng = np.random.RandomState(seed + 1)
    act = (microbatches, cfg.batch, cfg.seq, cfg.model)
    return ({name: np.stack([p[name] for p in params]) for name in params[0]},
            rng.standard_normal(act).astype(np.float32), rng.standard_normal(act).astype(np.float32))


def stage_major(params, stages: int, repeats: int):
    """Layer-ordered stacks as make_train_step takes them."""
    return jax.tree_util.tree_map(np.asarray, stage_major_order(params, stages, repeats))
