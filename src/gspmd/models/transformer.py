"""A dense Transformer train step annotated as in the paper's Table 1 (Section 5.1).

Dims: B batch, S sequence (T when attended to), M model, H feed-forward hidden,
N heads, D head size. Per layer, only the six weights and the layer's input activation
are annotated; every other tensor's sharding (including the whole backward pass) is
left to sharding completion.

The annotation function is a parameter so the same step can be handed to XLA's own
partitioner (jax.lax.with_sharding_constraint) for side-by-side comparisons.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from gspmd.checks import count
from gspmd.errors import ShardingError
from gspmd.frontend import mesh_split
from gspmd.mesh import Mesh
from gspmd.models.optimizers import Optimizer, make_step

WEIGHTS = ("wq", "wk", "wv", "wo", "w_in", "w_out")

# Table 1, "2D finalized": weights are split on M over X (weight-update sharding, gathered
# on demand) and on N/H over Y (in-layer model parallelism); activations on B over X and
# M over Y (gathered on demand before each einsum).
FINALIZED_2D = {
    "wq": ["x", "y", -1], "wk": ["x", "y", -1], "wv": ["x", "y", -1],   # M N D
    "wo": ["y", -1, "x"],                                               # N D M
    "w_in": ["x", "y"], "w_out": ["y", "x"],                           # M H, H M
    "x": ["x", -1, "y"],                                                # B S M
}

# Megatron-LM's tensor parallelism: weights split over Y only (heads, the feed-forward
# hidden dim) and replicated over X, where the batch is split (data parallel, gradients
# all-reduced); each layer's input and output replicated over Y.
MEGATRON = {
    "wq": [-1, "y", -1], "wk": [-1, "y", -1], "wv": [-1, "y", -1], "wo": ["y", -1, -1],
    "w_in": [-1, "y"], "w_out": ["y", -1], "x": ["x", -1, -1],
}

# Optional annotation points beyond the seven above (for robustness experiments): the
# einsum outputs and the layer's output, with the layouts completion infers for them.
ACTIVATIONS_2D = {"q": ["x", -1, "y", -1], "k": ["x", -1, "y", -1], "v": ["x", -1, "y", -1],
                  "hidden": ["x", -1, "y"], "attention_out": ["x", -1, "y"], "ffn_out": ["x", -1, "y"],
                  "out": ["x", -1, "y"]}

Annotate = Callable[[jax.Array, list], jax.Array]


@dataclass(frozen=True)
class Config:
    batch: int = 2
    seq: int = 8
    model: int = 16
    heads: int = 4
    head_dim: int = 4
    hidden: int = 32
    layers: int = 1
    layer_norm: bool = True
    lr: float = 0.1
    # Mixed precision (the paper's): parameters stored in param_dtype, activations and
    # matmuls in dtype (e.g. jnp.bfloat16); layer norm, softmax and the loss in float32.
    param_dtype: Any = np.float32
    dtype: Any = np.float32
    # Queries attended per block (None: all at once). A block's [B, N, block, T] scores
    # are recomputed for the backward pass, so no [B, N, S, T] is ever held: the memory
    # of a flash-attention kernel (which also keeps the block on chip; this does not).
    attention_block: Optional[int] = None
    # Dropout (Megatron-LM's GPT: 0.1) on the attention probabilities and on each
    # sublayer's output before its residual add, drawn from a key per layer.
    dropout: float = 0.0
    # The softmax a kernel of its own, as Megatron-LM's fused scale-mask-softmax is: its
    # probabilities go through HBM before the dropout or the matmul reads them (an
    # optimization barrier; otherwise they fuse, as XLA fuses them).
    softmax_kernel: bool = False


def gspmd_annotate(mesh: Mesh) -> Annotate:
    return lambda x, spec: mesh_split(x, mesh, spec)


def xla_annotate(mesh: jax.sharding.Mesh) -> Annotate:
    """The same annotations for XLA's partitioner: with_sharding_constraint."""
    from jax.sharding import NamedSharding, PartitionSpec

    def annotate(x, spec):
        entries = [None if e in (-1, None) else e for e in spec]
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(*entries)))
    return annotate


def layer_norm(x):
    """In float32 whatever x's dtype, returned in x's dtype."""
    y = x.astype(np.float32)
    mean = jnp.mean(y, axis=-1, keepdims=True)
    var = jnp.mean((y - mean) ** 2, axis=-1, keepdims=True)
    return ((y - mean) * jax.lax.rsqrt(var + 1e-5)).astype(x.dtype)


def annotator(annotate: Annotate, strategy: dict) -> Callable:
    """at(name, value): `value` annotated as `strategy` says for `name` (if it names it)."""
    return lambda name, value: annotate(value, strategy[name]) if name in strategy else value


def attention(w: dict, x, at: Callable, cfg: Config, key=None):
    """Multi-head self-attention of layer-normed x (weights wq, wk, wv, wo); the
    softmax in float32."""
    h = layer_norm(x) if cfg.layer_norm else x
    q, k, v = (at(n, jnp.einsum("bsm,mnd->bsnd", h, w["w" + n])) for n in "qkv")
    context = attend(q, k, v, cfg, key) if cfg.attention_block is None else attend_blockwise(q, k, v, cfg, key)
    return jnp.einsum("bsnd,ndm->bsm", context, w["wo"])


def dropout(x, rate: float, key):
    """x with each element zeroed with probability `rate`, the rest scaled by 1 / (1 - rate)."""
    if not rate:
        return x
    keep = jax.random.bernoulli(key, 1 - rate, x.shape)
    return jnp.where(keep, x / (1 - rate), 0).astype(x.dtype)


def attend(q, k, v, cfg: Config, key=None):
    """Each query's softmax-weighted sum of the values ([B, S, N, D])."""
    logits = jnp.einsum("bsnd,btnd->bnst", q, k) / float(np.sqrt(cfg.head_dim))
    probs = jax.nn.softmax(logits.astype(np.float32), axis=-1).astype(cfg.dtype)
    if cfg.softmax_kernel:
        probs = jax.lax.optimization_barrier(probs)
    return jnp.einsum("bnst,btnd->bsnd", dropout(probs, cfg.dropout, key), v)


def attend_blockwise(q, k, v, cfg: Config, key=None):
    """`attend`, cfg.attention_block queries at a time (a loop over the blocks), each
    block rematerialized in the backward pass."""
    b, s, n, d = q.shape
    block = count(cfg.attention_block, "Config.attention_block", example="attention_block=512")
    if s % block:
        raise ShardingError(f"attention_block {block} does not divide the sequence ({s} queries).")
    blocks = jnp.moveaxis(q.reshape(b, s // block, block, n, d), 1, 0)
    keys = None if key is None else jax.random.split(key, s // block)
    context = jax.lax.map(jax.checkpoint(lambda xs: attend(xs[0], k, v, cfg, xs[1])), (blocks, keys))
    return jnp.moveaxis(context, 0, 1).reshape(b, s, n, d)


def feed_forward(w_in, w_out, x, at: Callable, cfg: Config):
    """relu(layer-normed x @ w_in) @ w_out."""
    h = layer_norm(x) if cfg.layer_norm else x
    return jnp.einsum("bsh,hm->bsm", at("hidden", jax.nn.relu(jnp.einsum("bsm,mh->bsh", h, w_in))), w_out)


def layer(params: dict, x, annotate: Annotate, strategy: dict, cfg: Config, key=None):
    """One pre-norm Transformer layer. Annotates each tensor that `strategy` names
    (the weights, "x" its input, and optionally the ACTIVATIONS_2D points). With
    cfg.dropout, `key` draws the layer's dropout masks."""
    if cfg.dropout and key is None:
        raise ShardingError(f"Config(dropout={cfg.dropout}) draws its masks from a key: pass the layer one "
                            "(transformer.layer(..., key=jax.random.key(0))).")
    keys = [None] * 3 if key is None else list(jax.random.split(key, 3))
    at = annotator(annotate, strategy)
    w = {name: at(name, params[name]).astype(cfg.dtype) for name in WEIGHTS}
    x = at("x", x.astype(cfg.dtype))
    x = x + dropout(at("attention_out", attention(w, x, at, cfg, keys[0])), cfg.dropout, keys[1])
    ffn = at("ffn_out", feed_forward(w["w_in"], w["w_out"], x, at, cfg))
    return at("out", x + dropout(ffn, cfg.dropout, keys[2]))


def intended_2d(cfg: "Config") -> dict[tuple[int, ...], list]:
    """The layout Table 1's 2D-finalized strategy means for every tensor, by shape (the
    default Config keeps all these shapes distinct): activations split on batch over X
    and on M/H/N over Y, weights and their gradients as annotated, reduced statistics
    (layer norm, softmax) split like the activation they summarize."""
    b, s, m, n, d, h = cfg.batch, cfg.seq, cfg.model, cfg.heads, cfg.head_dim, cfg.hidden
    return {(b, s, m): ["x", -1, "y"], (b, s, h): ["x", -1, "y"], (b, s, n, d): ["x", -1, "y", -1],
            (b, n, s, s): ["x", "y", -1, -1], (b, n, d, s): ["x", "y", -1, -1],
            (b, n, s, d): ["x", "y", -1, -1], (b, n, s): ["x", "y", -1],
            (b, n, s, 1): ["x", "y", -1, -1],
            (b, s): ["x", -1], (b, s, 1): ["x", -1, -1],
            (m, n, d): FINALIZED_2D["wq"], (n, d, m): FINALIZED_2D["wo"],
            (m, h): FINALIZED_2D["w_in"], (h, m): FINALIZED_2D["w_out"]}


def make_train_step(annotate: Annotate, cfg: Config = Config(), strategy: dict = FINALIZED_2D,
                    optimizer: Optional[Optimizer] = None):
    """Squared-error loss. step(params, x, target) -> (new params, loss) with plain SGD;
    with an optimizer (models.optimizers: AdamW, Adafactor),
    step(params, optimizer state, x, target) -> (new params, new state, loss)."""
    def loss(params: Sequence[dict], x, target):
        for p in params:
            x = layer(p, x, annotate, strategy, cfg)
        return jnp.mean((x.astype(np.float32) - target) ** 2)

    return make_step(loss, optimizer, cfg.lr)


def example_inputs(cfg: Config = Config(), seed: int = 0, abstract: bool = False):
    """(params, x, target) with the shapes of `cfg` (jax.ShapeDtypeStruct if abstract)."""
    c = cfg
    shapes = {"wq": (c.model, c.heads, c.head_dim), "wk": (c.model, c.heads, c.head_dim),
              "wv": (c.model, c.heads, c.head_dim), "wo": (c.heads, c.head_dim, c.model),
              "w_in": (c.model, c.hidden), "w_out": (c.hidden, c.model)}
    act = (c.batch, c.seq, c.model)
    if abstract:
        spec = lambda shape, dtype=np.float32: jax.ShapeDtypeStruct(shape, dtype)   # noqa: E731
        return ([{n: spec(s, c.param_dtype) for n, s in shapes.items()} for _ in range(c.layers)],
                spec(act), spec(act))
    rng = np.random.RandomState(seed)
    rand = lambda shape, fan_in: (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)  # noqa: E731
    params = [{n: rand(s, s[0] if n != "wo" else c.heads * c.head_dim).astype(c.param_dtype)
               for n, s in shapes.items()} for _ in range(c.layers)]
    return params, rand(act, 1), rand(act, 1)
