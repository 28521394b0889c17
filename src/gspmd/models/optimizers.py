"""Optimizers for the case studies' train steps, in plain jax (the base install): SGD,
AdamW, and Adafactor with factored second moments (what the paper trains with).

Each is a pair of pure functions over parameter pytrees, as optax's are:
`init(params) -> state` and `update(grads, state, params) -> (new params, new state)`.
The state needs no annotations: propagation gives every moment the layout of the
parameter it belongs to. Updates run in float32 whatever the compute dtype.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

import jax
import jax.numpy as jnp

from gspmd.errors import ShardingError
from gspmd.ops.convert import is_key


class Optimizer(Protocol):
    def init(self, params) -> Any: ...

    def update(self, grads, state, params) -> tuple[Any, Any]: ...


@dataclass(frozen=True)
class SGD:
    lr: float = 0.1

    def init(self, params) -> tuple:
        return ()

    def update(self, grads, state, params):
        return jax.tree_util.tree_map(lambda p, g: p - self.lr * g, params, grads), state


@dataclass(frozen=True)
class AdamW:
    """Adam with decoupled weight decay (Loshchilov & Hutter)."""
    lr: float = 1e-3
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01

    def init(self, params) -> dict:
        zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
        return {"count": jnp.zeros((), jnp.int32), "mu": zeros, "nu": zeros}

    def update(self, grads, state, params):
        count = state["count"] + 1
        t = count.astype(jnp.float32)
        mu = jax.tree_util.tree_map(lambda m, g: self.b1 * m + (1 - self.b1) * g, state["mu"], grads)
        nu = jax.tree_util.tree_map(lambda v, g: self.b2 * v + (1 - self.b2) * g * g, state["nu"], grads)

        def step(p, m, v):
            m_hat, v_hat = m / (1 - self.b1 ** t), v / (1 - self.b2 ** t)
            return p - self.lr * (m_hat / (jnp.sqrt(v_hat) + self.eps) + self.weight_decay * p)
        return jax.tree_util.tree_map(step, params, mu, nu), {"count": count, "mu": mu, "nu": nu}


@dataclass(frozen=True)
class Adafactor:
    """Adafactor (Shazeer & Stern): second moments of a matrix (the last two dims of a
    parameter of rank 2 or more) kept as their row and column means only, decay
    1 - t^-0.8, updates clipped to RMS `clip`; no momentum."""
    lr: float = 1e-2
    decay: float = 0.8
    eps: float = 1e-30
    clip: float = 1.0

    def init(self, params) -> dict:
        def moments(p):
            if p.ndim >= 2:
                return {"row": jnp.zeros(p.shape[:-1], jnp.float32),
                        "col": jnp.zeros(p.shape[:-2] + p.shape[-1:], jnp.float32)}
            return {"v": jnp.zeros(p.shape, jnp.float32)}
        return {"count": jnp.zeros((), jnp.int32), "v": [moments(p) for p in jax.tree_util.tree_leaves(params)]}

    def update(self, grads, state, params):
        count = state["count"] + 1
        beta = 1 - count.astype(jnp.float32) ** -self.decay
        leaves, tree = jax.tree_util.tree_flatten(params)
        stepped = [self._step(p, g, v, beta)
                   for p, g, v in zip(leaves, jax.tree_util.tree_leaves(grads), state["v"])]
        return (jax.tree_util.tree_unflatten(tree, [p for p, _ in stepped]),
                {"count": count, "v": [v for _, v in stepped]})

    def _step(self, p, g, v, beta):
        g2 = g * g + self.eps
        if "row" in v:   # 1/sqrt(v) ~ rsqrt(row / mean(row)) x rsqrt(col), each factor on its own
            row = beta * v["row"] + (1 - beta) * jnp.mean(g2, axis=-1)
            col = beta * v["col"] + (1 - beta) * jnp.mean(g2, axis=-2)
            row_factor = jax.lax.rsqrt(row / jnp.mean(row, axis=-1, keepdims=True))
            u = g * row_factor[..., :, None] * jax.lax.rsqrt(col)[..., None, :]
            moments = {"row": row, "col": col}
        else:
            moments = {"v": beta * v["v"] + (1 - beta) * g2}
            u = g * jax.lax.rsqrt(moments["v"])
        u = u / jnp.maximum(1.0, jnp.sqrt(jnp.mean(u * u)) / self.clip)
        return p - self.lr * u, moments


def make_step(loss: Callable, optimizer: Optional[Optimizer], lr: float, microbatches: int = 1,
              batched: Optional[int] = None) -> Callable:
    """A train step of `loss(params, *batch)`. Without an optimizer, plain SGD at `lr`:
    step(params, *batch) -> (new params, loss). With one:
    step(params, optimizer state, *batch) -> (new params, new state, loss).
    microbatches > 1: gradient accumulation (`accumulated`) over the first `batched`
    batch arguments (default: all)."""
    value_and_grad = jax.value_and_grad(loss) if microbatches == 1 else accumulated(loss, microbatches, batched)
    if optimizer is None:
        def sgd_step(params, *batch):
            value, grads = value_and_grad(params, *batch)
            return SGD(lr).update(grads, (), params)[0], value
        return sgd_step

    def step(params, state, *batch):
        value, grads = value_and_grad(params, *batch)
        params, state = optimizer.update(grads, state, params)
        return params, state, value
    return step


def accumulated(loss: Callable, microbatches: int, batched: Optional[int] = None) -> Callable:
    """jax.value_and_grad(loss) over the batch as `microbatches` steps of gradient
    accumulation: the mean loss's value and gradients, one microbatch at a time (a scan),
    summed in float32. The first `batched` batch arguments (default: all) split along
    their leading dim, sequence j of microbatch i being sequence j * microbatches + i (so
    that a batch split over devices splits each microbatch alike); the others (a PRNG
    key) reach every microbatch, a key folded with the microbatch's index."""
    def value_and_grad(params, *batch):
        count = len(batch) if batched is None else batched
        data, shared = batch[:count], batch[count:]
        for x in data:
            if not jnp.ndim(x) or x.shape[0] % microbatches:
                raise ShardingError(f"Gradient accumulation over {microbatches} microbatches needs a batch "
                                    f"that divides into them along its leading dim; got shape {tuple(jnp.shape(x))}"
                                    f" (pass batched=... to leave arguments without a batch dim, as a key, whole).")
        split = [jnp.swapaxes(x.reshape(x.shape[0] // microbatches, microbatches, *x.shape[1:]), 0, 1)
                 for x in data]

        def one(total, xs):
            index, microbatch = xs
            extra = [jax.random.fold_in(k, index) if is_key(k.dtype) else k for k in shared]
            value, grads = jax.value_and_grad(loss)(params, *microbatch, *extra)
            return jax.tree_util.tree_map(lambda t, g: t + g.astype(jnp.float32), total, (value, grads)), None

        zeros = jax.tree_util.tree_map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), (0.0, params))
        (value, grads), _ = jax.lax.scan(one, zeros, (jnp.arange(microbatches), split))
        return value / microbatches, jax.tree_util.tree_map(lambda g, p: (g / microbatches).astype(p.dtype),
                                                            grads, params)
    return value_and_grad
