"""A decoder-only Transformer language model, written in plain JAX: a token embedding
table, one block of causal self-attention and an exact-GELU MLP with pre-layer norms,
logits over the vocabulary, integer-label cross-entropy, one optax.adamw step.

Annotations (Megatron-style): the batch over "data"; the heads and the MLP's hidden
units over "model"; the vocabulary over "model" on the embedding table and the logits.
The vocabulary (50) and the batch (6) do not divide the mesh's 4 and 4, and the model
width (12) is left whole."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import gspmd

MESH = gspmd.Mesh(np.arange(8).reshape(2, 4), ("data", "model"))
BATCH, SEQ, VOCAB, WIDTH, HEADS, HEAD_DIM, HIDDEN = 6, 8, 50, 12, 4, 3, 24

ANNOTATIONS = {
    "tokens": P("data", None),
    "embed": P("model", None),                  # vocab-split table
    "wq": P(None, "model", None), "wk": P(None, "model", None), "wv": P(None, "model", None),
    "wo": P("model", None, None),               # heads
    "w_in": P(None, "model"), "w_out": P("model", None),   # hidden units
    "unembed": P(None, "model"),                # vocab-split logits
    "ln1": P(), "ln2": P(), "ln_f": P(),
    "logits": P("data", None, "model"),
}
OPTIMIZER = optax.adamw(1e-2, weight_decay=0.1)


def split(x, name):
    return gspmd.mesh_split(x, MESH, ANNOTATIONS[name])


def layer_norm(x, scale):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * scale


def project(params, x, name):
    return jnp.einsum("bsd,dhk->bhsk", x, split(params[name], name))


def causal_attention(params, x):
    q, k, v = (project(params, x, w) for w in ("wq", "wk", "wv"))
    scores = jnp.einsum("bhqk,bhsk->bhqs", q, k) / np.sqrt(HEAD_DIM)
    causal = jnp.tril(jnp.ones((SEQ, SEQ), bool))          # iota-built lower triangle
    weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
    heads = jnp.einsum("bhqs,bhsk->bhqk", weights, v)
    return jnp.einsum("bhqk,hkd->bqd", heads, split(params["wo"], "wo"))


def mlp(params, x):
    h = jax.nn.gelu(x @ split(params["w_in"], "w_in"), approximate=False)   # erf
    return h @ split(params["w_out"], "w_out")


def logits_of(params, tokens):
    x = jnp.take(split(params["embed"], "embed"), split(tokens, "tokens"), axis=0)   # as nn.Embed
    x = x + causal_attention(params, layer_norm(x, params["ln1"]))
    x = x + mlp(params, layer_norm(x, params["ln2"]))
    logits = layer_norm(x, params["ln_f"]) @ split(params["unembed"], "unembed")
    return split(logits, "logits")


def integer_label_loss(logits, targets):
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def one_hot_loss(logits, targets):
    """The same loss with one-hot targets: what the integer labels are compared with."""
    return optax.softmax_cross_entropy(logits, jax.nn.one_hot(targets, VOCAB)).mean()


def make_train_step(loss_of_logits=integer_label_loss):
    def train_step(params, opt_state, tokens, targets):
        loss, grads = jax.value_and_grad(lambda p: loss_of_logits(logits_of(p, tokens), targets))(params)
        updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    return train_step


train_step = make_train_step()


def example_inputs(seed: int = 0):
    rng = np.random.RandomState(seed)

    def normal(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)
    params = {"embed": normal(VOCAB, WIDTH) * 3, "wq": normal(WIDTH, HEADS, HEAD_DIM), "wk": normal(WIDTH, HEADS, HEAD_DIM),
              "wv": normal(WIDTH, HEADS, HEAD_DIM), "wo": normal(HEADS, HEAD_DIM, WIDTH), "w_in": normal(WIDTH, HIDDEN),
              "w_out": normal(HIDDEN, WIDTH), "unembed": normal(WIDTH, VOCAB),
              "ln1": np.ones(WIDTH, np.float32), "ln2": np.ones(WIDTH, np.float32), "ln_f": np.ones(WIDTH, np.float32)}
    tokens = rng.randint(0, VOCAB, (BATCH, SEQ + 1)).astype(np.int32)
    return params, OPTIMIZER.init(params), tokens[:, :-1], tokens[:, 1:]
