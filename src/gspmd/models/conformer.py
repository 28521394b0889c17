"""A Conformer block (Gulati et al. 2020), the speech model the paper pipelines (Section
5.3, Table 5): half a feed-forward, self-attention, a convolution module, half another
feed-forward, then a layer norm. The convolution module is a pointwise convolution to
2M channels, a gated linear unit, a depthwise convolution over time, layer norm (the
paper's batch norm, whose statistics span the batch), swish and a pointwise convolution
back to M. Attention and the feed-forwards are the Transformer's (gspmd.models.transformer).

Dims: B batch, S time steps, M model, H feed-forward hidden, N heads, D head size,
K depthwise kernel width.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gspmd.models import transformer
from gspmd.models.transformer import Annotate, layer_norm


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
