"""The programs common JAX models emit: layers, losses, initializers and optimizers of
jax.numpy, jax.nn, jax.random, optax, Flax (linen and NNX) and Equinox, in training and
inference. `emitted()` traces each (jax.make_jaxpr, into every sub-jaxpr) and returns
the JAX primitives they use, each with the first equation that used it."""
from __future__ import annotations

import functools
from typing import Callable, Iterator

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.extend.core import jaxprs_in_params

B, T, D, H, V = 2, 4, 8, 2, 16   # batch, sequence, features, heads, vocabulary
# Everything is abstract (shapes only): tracing compiles and runs nothing, so it is fast.
KEY = jax.ShapeDtypeStruct((2,), jnp.uint32)
TYPED_KEY = jax.eval_shape(jax.random.key, 0)


def f32(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def ids(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.int32)


# -- jax.numpy, jax.nn, jax.lax ------------------------------------------------------------
def _numpy_cases() -> Iterator[tuple[str, Callable, tuple]]:
    x, i = f32(B, V), ids(B)
    yield "jnp.take (fill), take(clip), x[ids]", lambda t, k: (jnp.take(t, k, axis=0), jnp.take(t, k, axis=0, mode="clip"),
                                                           t[k]), (f32(V, D), i)
    yield "jnp.take_along_axis", lambda x, k: jnp.take_along_axis(x, k[:, None], axis=1), (x, i)
    yield "jnp.where, clip, maximum", lambda x: jnp.clip(jnp.where(x > 0, x, -x), -1, 1), (x,)
    yield "cumsum, cumprod, cummax, cummin, cumlogsumexp", lambda x: (
        jnp.cumsum(x, 1), jnp.cumprod(x, 1), jax.lax.cummax(x, 1), jax.lax.cummin(x, 1), jax.lax.cumlogsumexp(x, 1)), (x,)
    yield "sort, argsort, top_k, argmax, argmin", lambda x: (jnp.sort(x, 1), jnp.argsort(x, 1), jax.lax.top_k(x, 2),
                                                             jnp.argmax(x, 1), jnp.argmin(x, 1)), (x,)
    yield "softmax, log_softmax, logsumexp, one_hot", lambda x, k: (
        jax.nn.softmax(x), jax.nn.log_softmax(x), jax.nn.logsumexp(x, 1), jax.nn.one_hot(k, V)), (x, i)
    yield "activations", lambda x: (jax.nn.gelu(x, approximate=False), jax.nn.gelu(x), jax.nn.relu(x), jax.nn.silu(x),
                                    jax.nn.sigmoid(x), jax.nn.softplus(x), jax.nn.elu(x), jnp.tanh(x)), (x,)
    yield "mean, var, rsqrt, einsum", lambda x: (jnp.var(x, 0), jax.lax.rsqrt(jnp.mean(x ** 2) + 1e-6),
                                                 jnp.einsum("bd,bd->b", x, x)), (x,)
    yield "cond, switch", lambda x, k: (jax.lax.cond(k[0] > 0, jnp.sin, jnp.cos, x),
                                        jax.lax.switch(k[0], [jnp.sin, jnp.cos, jnp.tanh], x)), (x, i)
    yield "scan, fori_loop, while_loop", lambda x: (
        jax.lax.scan(lambda c, r: (c + r, c * r), x[0], x)[1],
        jax.lax.fori_loop(0, 3, lambda j, c: c * 2, x),
        jax.lax.while_loop(lambda c: c.sum() < 100, lambda c: c * 2, x)), (x,)
    yield "jax.checkpoint, checkpoint_name", jax.grad(lambda x: jax.checkpoint(
        lambda y: checkpoint_name(jnp.sin(y), "h").sum(),
        policy=jax.checkpoint_policies.save_only_these_names("h"))(x)), (x,)
    yield "stop_gradient, integer_pow, reductions", lambda x: (
        jax.lax.stop_gradient(x) ** 3, jnp.max(x), jnp.min(x), jnp.prod(x), jnp.any(x > 0), jnp.all(x > 0)), (x,)
    yield "jax.nn.dot_product_attention", lambda q: jax.nn.dot_product_attention(q, q, q, is_causal=True), \
        (f32(B, T, H, D),)
    yield "bfloat16 matmul, float32 accumulation", lambda x: jnp.dot(x.astype(jnp.bfloat16), x.T.astype(jnp.bfloat16),
                                                                     preferred_element_type=jnp.float32), (x,)
    yield "lax.ragged_dot (grouped matmul) and its gradients", jax.grad(
        lambda x, w, s: jnp.sum(jax.lax.ragged_dot(x, w, s) ** 2), (0, 1)), (x, f32(H, V, D), ids(H))
    yield "complex rotary embedding, jnp.fft", lambda x: (
        jnp.real(jax.lax.complex(x, x) * jnp.exp(1j * x)), jnp.conj(jnp.fft.rfft(x)), jnp.imag(jnp.fft.fft(x))), (x,)
    yield "jax.debug.print, callbacks", lambda x: _callbacks(x), (x,)
    yield "jnp.linalg", lambda a: (jnp.linalg.qr(a), jnp.linalg.eigh(a), jnp.linalg.svd(a), jnp.linalg.cholesky(a),
                                   jnp.linalg.solve(a, a), jax.scipy.linalg.solve_triangular(a, a)), (f32(D, D),)


def _callbacks(x):
    jax.debug.print("x {}", x)
    jax.debug.callback(lambda v: None, x)
    y = jax.pure_callback(lambda v: v, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
    return jax.experimental.io_callback(lambda v: v, jax.ShapeDtypeStruct(x.shape, x.dtype), y)


# -- code annotated for jax.jit ----------------------------------------------------------------
def _sharding_cases() -> Iterator[tuple[str, Callable, tuple]]:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("x", "y"))   # any device count
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))

    def body(a):
        a = jax.lax.all_gather(a, "y", axis=1, tiled=True) + jax.lax.axis_index("x")
        a = jax.lax.ppermute(jax.lax.psum_scatter(a, "y", scatter_dimension=1, tiled=True), "x", [(0, 0)])
        return jax.lax.pmax(jax.lax.all_to_all(a, "y", 1, 0, tiled=True), "x"), jax.lax.psum(a, ("x", "y"))

    def annotated(x):
        x = jax.jit(jnp.sin, in_shardings=spec, out_shardings=spec)(jax.lax.with_sharding_constraint(x, spec))
        return jax.shard_map(body, mesh=mesh, in_specs=jax.sharding.PartitionSpec("x", "y"),
                             out_specs=(jax.sharding.PartitionSpec("x", "y"), jax.sharding.PartitionSpec()))(x)
    yield "with_sharding_constraint, jit shardings, shard_map", annotated, (f32(B, D),)


# -- jax.random and initializers -------------------------------------------------------------
def _random_cases() -> Iterator[tuple[str, Callable, tuple]]:
    def sample(key):
        k1, k2 = jax.random.split(key)
        k3 = jax.random.fold_in(k1, 3)
        return (jax.random.normal(k1, (B, D)), jax.random.uniform(k2, (B, D)), jax.random.bernoulli(k3, 0.5, (B, D)),
                jax.random.categorical(k1, jnp.zeros((B, V))), jax.random.randint(k2, (B,), 0, V),
                jax.random.truncated_normal(k3, -2, 2, (B, D)), jax.random.permutation(k1, V),
                jax.random.choice(k2, V, (B,), p=jax.nn.softmax(jnp.arange(V, dtype=jnp.float32))))
    yield "jax.random (raw uint32 key)", sample, (KEY,)
    yield "jax.random (typed key)", sample, (TYPED_KEY,)
    yield "jax.random.key from a seed", lambda s: jax.random.key_data(jax.random.key(s)), (ids(),)
    init = jax.nn.initializers
    yield "jax.nn.initializers", lambda key: [f(key, (D, D)) for f in (
        init.lecun_normal(), init.glorot_uniform(), init.he_normal(), init.normal(0.02), init.zeros,
        init.truncated_normal(0.02), init.variance_scaling(1.0, "fan_avg", "uniform"))], (KEY,)
    yield "orthogonal initializer (Flax's LSTM default)", lambda key: init.orthogonal()(key, (D, D)), (KEY,)


# -- losses and optimizers ---------------------------------------------------------------------
def _optax_cases() -> Iterator[tuple[str, Callable, tuple]]:
    logits, labels, onehot = f32(B, V), ids(B), f32(B, V)
    yield "optax losses", lambda z, k, p: (
        optax.softmax_cross_entropy(z, p), optax.softmax_cross_entropy_with_integer_labels(z, k),
        optax.sigmoid_binary_cross_entropy(z, p), optax.l2_loss(z, p)), (logits, labels, onehot)
    params = {"w": f32(D, D), "b": f32(D)}
    for name, opt in [("adam", optax.adam(1e-3)), ("adamw", optax.adamw(1e-3)), ("adafactor", optax.adafactor(1e-3)),
                      ("sgd+momentum", optax.sgd(1e-3, momentum=0.9)), ("lion", optax.lion(1e-3)),
                      ("clip_by_global_norm+adam", optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)))]:
        yield f"optax.{name} step", functools.partial(_optimizer_step, opt), (params, params)


def _optimizer_step(opt, params, grads):
    updates, state = opt.update(grads, opt.init(params), params)
    return optax.apply_updates(params, updates), state


# -- Flax linen ------------------------------------------------------------------------------
class ScannedLayer(nn.Module):
    """A layer repeated with nn.scan over remat, as MaxText stacks its decoder layers."""

    @nn.compact
    def __call__(self, x, _):
        return x + nn.Dense(D)(nn.LayerNorm()(x)), None


class LinenBlock(nn.Module):
    """Embedding, causal attention with dropout, LayerNorm/RMSNorm, Dense, Conv, pooling,
    BatchNorm, scanned rematerialized layers."""

    @nn.compact
    def __call__(self, tokens, train: bool):
        x = nn.Embed(V, D)(tokens)
        mask = nn.make_causal_mask(tokens)
        x = x + nn.MultiHeadDotProductAttention(H, dropout_rate=0.1, deterministic=not train)(nn.LayerNorm()(x),
                                                                                               mask=mask)
        x = nn.Dropout(0.1, deterministic=not train)(nn.RMSNorm()(x))
        x = nn.Conv(D, (3,))(x)
        x = nn.max_pool(x, (2,), padding="SAME") + nn.avg_pool(x, (2,), padding="SAME")
        x = nn.BatchNorm(use_running_average=not train)(x)
        x, _ = nn.scan(nn.remat(ScannedLayer), variable_axes={"params": 0}, split_rngs={"params": True},
                       length=2)()(x, None)
        return nn.Dense(V)(jax.nn.gelu(nn.Dense(2 * D)(x), approximate=False))


def _linen_cases() -> Iterator[tuple[str, Callable, tuple]]:
    model, tokens = LinenBlock(), ids(B, T)
    variables = jax.eval_shape(lambda key: model.init({"params": key, "dropout": key}, tokens, train=False), KEY)
    yield "flax.linen init", lambda key, tokens: model.init({"params": key, "dropout": key}, tokens, train=False), \
        (KEY, tokens)

    def train(variables, key, tokens):
        def loss(params):
            logits, updates = model.apply({**variables, "params": params}, tokens, train=True,
                                          rngs={"dropout": key}, mutable=["batch_stats"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean(), updates
        return jax.grad(loss, has_aux=True)(variables["params"])
    yield "flax.linen train step", train, (variables, KEY, tokens)
    yield "flax.linen inference", lambda v, tokens: model.apply(v, tokens, train=False), (variables, tokens)


# -- Flax NNX --------------------------------------------------------------------------------
class NNXBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(V, D, rngs=rngs)
        self.norm, self.rms = nnx.LayerNorm(D, rngs=rngs), nnx.RMSNorm(D, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(H, D, dropout_rate=0.1, decode=False, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)
        self.conv = nnx.Conv(D, D, (3,), rngs=rngs)
        self.batch_norm = nnx.BatchNorm(D, rngs=rngs)
        self.out = nnx.Linear(D, V, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        x = x + self.attention(self.norm(x), mask=nnx.make_causal_mask(tokens))
        x = self.batch_norm(self.conv(self.dropout(self.rms(x))))
        return self.out(jax.nn.gelu(x))


def _nnx_cases() -> Iterator[tuple[str, Callable, tuple]]:
    tokens = ids(B, T)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: NNXBlock(nnx.Rngs(0))))
    yield "flax.nnx init", lambda: nnx.split(NNXBlock(nnx.Rngs(0)))[1], ()

    def train(state, tokens):
        model = nnx.merge(graphdef, state)
        model.train()

        def loss(model):
            return optax.softmax_cross_entropy_with_integer_labels(model(tokens), tokens).mean()
        return nnx.state(nnx.grad(loss)(model))
    yield "flax.nnx train step", train, (state, tokens)

    def inference(state, tokens):
        model = nnx.merge(graphdef, state)
        model.eval()
        return model(tokens)
    yield "flax.nnx inference", inference, (state, tokens)


# -- Equinox ---------------------------------------------------------------------------------
class EqxBlock(eqx.Module):
    embed: eqx.nn.Embedding
    norm: eqx.nn.LayerNorm
    rms: eqx.nn.RMSNorm
    attention: eqx.nn.MultiheadAttention
    dropout: eqx.nn.Dropout
    conv: eqx.nn.Conv1d
    mlp: eqx.nn.MLP

    def __init__(self, key):
        keys = jax.random.split(key, 4)
        self.embed = eqx.nn.Embedding(V, D, key=keys[0])
        self.norm, self.rms = eqx.nn.LayerNorm(D), eqx.nn.RMSNorm(D)
        self.attention = eqx.nn.MultiheadAttention(H, D, dropout_p=0.1, key=keys[1])
        self.dropout = eqx.nn.Dropout(0.1)
        self.conv = eqx.nn.Conv1d(D, D, 3, padding=1, key=keys[2])
        self.mlp = eqx.nn.MLP(D, V, 2 * D, 1, activation=jax.nn.gelu, key=keys[3])

    def __call__(self, tokens, key):
        k1, k2 = jax.random.split(key)
        x = jax.vmap(self.embed)(tokens)
        y = jax.vmap(self.norm)(x)
        x = x + self.attention(y, y, y, mask=jnp.tril(jnp.ones((T, T), bool)), key=k1)
        x = self.dropout(jax.vmap(self.rms)(x), key=k2)
        x = self.conv(x.T).T
        return jax.vmap(self.mlp)(x)


def _is_abstract_array(x) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct)


def _equinox_cases() -> Iterator[tuple[str, Callable, tuple]]:
    tokens = ids(B, T)
    yield "equinox init", lambda key: eqx.filter(EqxBlock(key), eqx.is_array), (KEY,)
    params, static = eqx.partition(eqx.filter_eval_shape(EqxBlock, KEY), _is_abstract_array)

    def train(params, key, tokens):
        def loss(params):
            model = eqx.combine(params, static)
            logits = jax.vmap(model)(tokens, jax.random.split(key, B))
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean()
        return jax.grad(loss)(params)
    yield "equinox train step", train, (params, KEY, tokens)

    def inference(params, key, tokens):
        model = eqx.nn.inference_mode(eqx.combine(params, static))
        return jax.vmap(model)(tokens, jax.random.split(key, B))
    yield "equinox inference", inference, (params, KEY, tokens)

    def checked_loop(x):     # what every diffrax.diffeqsolve binds
        x = eqx.error_if(x, jnp.isnan(x).any(), "NaN")
        return eqx.internal.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, jnp.sin(c[1])), (0, x), max_steps=4,
                                       kind="checkpointed")[1].sum()
    yield "equinox error_if, internal.while_loop", jax.grad(checked_loop), (f32(B, D),)


def cases() -> Iterator[tuple[str, Callable, tuple]]:
    for family in (_numpy_cases, _sharding_cases, _random_cases, _optax_cases, _linen_cases, _nnx_cases, _equinox_cases):
        yield from family()


def _equations(jaxpr) -> Iterator:
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jaxprs_in_params(eqn.params):
            yield from _equations(sub)


@functools.lru_cache(maxsize=None)
def emitted() -> dict[str, tuple[list[str], object]]:
    """primitive name -> (the cases that emit it, the first equation seen using it)."""
    found: dict[str, tuple[list[str], object]] = {}
    for name, fn, args in cases():
        for eqn in _equations(jax.make_jaxpr(fn)(*args).jaxpr):
            seen = found.setdefault(eqn.primitive.name, ([], eqn))[0]
            if name not in seen:
                seen.append(name)
    return found
