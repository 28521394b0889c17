"""A Llama-style train step to plan with `gspmd plan` on abstract inputs, at any size:

    gspmd plan examples/llama_train_step.py:make --devices 256 --hardware tpu-v5p
    gspmd plan examples/llama_train_step.py:make --devices 2048 --hardware tpu-v5p --json

`make(devices)` is a factory: it returns the train step (with its mesh_split annotations
over a (fsdp, tensor) mesh of that many devices, as MaxText shards a Llama) and its
arguments as jax.ShapeDtypeStructs, so nothing is allocated. The model: RMSNorm,
rotary position embeddings, grouped-query causal attention, a SwiGLU feed-forward,
untied input embedding and output projection, layers stacked under one lax.scan with
each layer rematerialized; AdamW.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

import gspmd


@dataclass(frozen=True)
class Llama:
    layers: int = 32
    model: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    ffn: int = 14336
    vocab: int = 128256
    seq: int = 8192
    batch_per_device: int = 1
    tensor: int = 8          # the mesh's tensor axis; the rest is FSDP (and data)


def rms_norm(x, scale):
    y = x.astype(jnp.float32)
    y = y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + 1e-6)
    return (y * scale).astype(x.dtype)


def rope(x):
    """Rotary position embeddings over [B, S, N, D]."""
    s, d = x.shape[1], x.shape[-1]
    freqs = 1.0 / (10000.0 ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    angles = jnp.arange(s, dtype=jnp.float32)[:, None] * freqs[None, :]
    sin, cos = jnp.sin(angles)[None, :, None, :], jnp.cos(angles)[None, :, None, :]
    a, b = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1).astype(x.dtype)


def make(devices: int = 256, cfg: Llama = Llama()):
    """(train step, abstract arguments) for `devices` devices."""
    if devices % cfg.tensor:
        raise gspmd.ShardingError(f"--devices {devices} must be a multiple of the tensor axis ({cfg.tensor}).")
    mesh = gspmd.Mesh(np.arange(devices).reshape(devices // cfg.tensor, cfg.tensor), ("fsdp", "tensor"))

    def split(x, *spec):
        return gspmd.mesh_split(x, mesh, list(spec))

    def layer(x, w):
        h = rms_norm(x, w["attn_norm"])
        q = rope(jnp.einsum("bsm,mnd->bsnd", h, split(w["wq"], "fsdp", "tensor", -1).astype(x.dtype)))
        k = rope(jnp.einsum("bsm,mnd->bsnd", h, split(w["wk"], "fsdp", "tensor", -1).astype(x.dtype)))
        v = jnp.einsum("bsm,mnd->bsnd", h, split(w["wv"], "fsdp", "tensor", -1).astype(x.dtype))
        group = cfg.heads // cfg.kv_heads
        k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
        logits = jnp.einsum("bsnd,btnd->bnst", q, k).astype(jnp.float32) / np.sqrt(cfg.head_dim)
        causal = jnp.arange(cfg.seq)[:, None] >= jnp.arange(cfg.seq)[None, :]
        probs = jax.nn.softmax(jnp.where(causal, logits, -1e9), axis=-1).astype(x.dtype)
        out = jnp.einsum("bnst,btnd->bsnd", probs, v)
        x = x + jnp.einsum("bsnd,ndm->bsm", out, split(w["wo"], "tensor", -1, "fsdp").astype(x.dtype))
        h = rms_norm(x, w["ffn_norm"])
        gate = jnp.einsum("bsm,mf->bsf", h, split(w["w_gate"], "fsdp", "tensor").astype(x.dtype))
        up = jnp.einsum("bsm,mf->bsf", h, split(w["w_up"], "fsdp", "tensor").astype(x.dtype))
        x = x + jnp.einsum("bsf,fm->bsm", jax.nn.silu(gate) * up, split(w["w_down"], "tensor", "fsdp").astype(x.dtype))
        return split(x, "fsdp", -1, "tensor"), None

    def loss(params, tokens, labels):
        table = split(params["embedding"], "tensor", "fsdp")
        x = split(jnp.take(table, split(tokens, "fsdp", -1), axis=0).astype(jnp.bfloat16), "fsdp", -1, "tensor")
        policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
        x, _ = jax.lax.scan(jax.checkpoint(layer, policy=policy), x, params["layers"])
        x = rms_norm(x, params["final_norm"])
        logits = jnp.einsum("bsm,mv->bsv", x, split(params["output"], "fsdp", "tensor").astype(x.dtype))
        logp = jax.nn.log_softmax(split(logits, "fsdp", -1, "tensor").astype(jnp.float32), axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))

    def train_step(params, moments, tokens, labels, lr=1e-4, b1=0.9, b2=0.95, decay=0.1):
        """One AdamW step (bias correction left out: it scales the update, not the plan)."""
        value, grads = jax.value_and_grad(loss)(params, tokens, labels)
        m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, moments[0], grads)
        v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, moments[1], grads)
        params = jax.tree.map(lambda p, m, v: p - lr * (m * jax.lax.rsqrt(v + 1e-16) + decay * p), params, m, v)
        return params, (m, v), value

    def f32(*shape):
        return jax.ShapeDtypeStruct(shape, jnp.float32)

    n, kv, d, m, L = cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.model, cfg.layers
    params = {"embedding": f32(cfg.vocab, m), "output": f32(m, cfg.vocab), "final_norm": f32(m),
              "layers": {"attn_norm": f32(L, m), "ffn_norm": f32(L, m), "wq": f32(L, m, n, d),
                         "wk": f32(L, m, kv, d), "wv": f32(L, m, kv, d), "wo": f32(L, n, d, m),
                         "w_gate": f32(L, m, cfg.ffn), "w_up": f32(L, m, cfg.ffn), "w_down": f32(L, cfg.ffn, m)}}
    tokens = jax.ShapeDtypeStruct((cfg.batch_per_device * devices, cfg.seq), jnp.int32)
    return train_step, (params, (params, params), tokens, tokens)
