"""An Equinox Transformer block (eqx.nn.LayerNorm, eqx.nn.MultiheadAttention, an MLP
with eqx.nn.Dropout) applied per example with jax.vmap; a mean-squared-error loss,
eqx.filter_value_and_grad and optax.adam; one dropout key per example.

Annotations: the batch (6) over "data"; the attention heads (the rows of the query, key
and value projections, the columns of the output projection) and the MLP's hidden units
(20) over "model", Megatron-style."""
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import gspmd

MESH = gspmd.Mesh(np.arange(8).reshape(2, 4), ("data", "model"))
BATCH, SEQ, WIDTH, HEADS, HIDDEN, DROPOUT = 6, 5, 8, 4, 20, 0.2
BATCH_SPEC = P("data")
OPTIMIZER = optax.adam(1e-2)


class Block(eqx.Module):
    norm1: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    hidden: eqx.nn.Linear
    dropout: eqx.nn.Dropout
    out: eqx.nn.Linear

    def __init__(self, dropout: float, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.norm1, self.norm2 = eqx.nn.LayerNorm(WIDTH), eqx.nn.LayerNorm(WIDTH)
        self.attention = eqx.nn.MultiheadAttention(HEADS, WIDTH, key=k1)
        self.hidden, self.out = eqx.nn.Linear(WIDTH, HIDDEN, key=k2), eqx.nn.Linear(HIDDEN, WIDTH, key=k3)
        self.dropout = eqx.nn.Dropout(dropout)

    def __call__(self, x, key):
        """x: [seq, width] (one example). Returns the output and the dropout's keep mask."""
        y = jax.vmap(self.norm1)(x)
        x = x + self.attention(y, y, y)
        h = jax.nn.gelu(jax.vmap(self.hidden)(jax.vmap(self.norm2)(x)))
        h = self.dropout(h, key=key)
        return x + jax.vmap(self.out)(h), h != 0


def megatron_layout(block: Block) -> Block:
    """The block with its weights annotated: heads and hidden units over "model"."""
    weights = lambda b: (b.attention.query_proj.weight, b.attention.key_proj.weight, b.attention.value_proj.weight,
                         b.attention.output_proj.weight, b.hidden.weight, b.hidden.bias, b.out.weight)
    specs = (P("model", None), P("model", None), P("model", None), P(None, "model"), P("model", None), P("model"),
             P(None, "model"))
    return eqx.tree_at(weights, block, [gspmd.mesh_split(w, MESH, s) for w, s in zip(weights(block), specs)])


def make_train_step(dropout: float = DROPOUT):
    """The step returns the dropout's keep mask too (to compare it bit for bit). The
    dropout rate is a static field: the block's arrays are the same for every rate."""
    static = eqx.partition(Block(dropout, jax.random.key(0)), eqx.is_array)[1]

    def loss_fn(block, x, y, keys):
        out, kept = jax.vmap(block)(x, keys)
        return jnp.mean((out - y) ** 2), kept

    def train_step(params, opt_state, x, y, key):
        block = megatron_layout(eqx.combine(params, static))
        x = gspmd.mesh_split(x, MESH, BATCH_SPEC)
        keys = jax.random.split(key, BATCH)    # one per example, split like them
        (loss, kept), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(block, x, y, keys)
        updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
        return eqx.filter(eqx.apply_updates(block, updates), eqx.is_array), opt_state, loss, kept
    return train_step


train_step = make_train_step()


def example_inputs(seed: int = 0):
    rng = np.random.RandomState(seed)
    params = eqx.filter(Block(DROPOUT, jax.random.key(0)), eqx.is_array)
    x, y = (rng.standard_normal((BATCH, SEQ, WIDTH)).astype(np.float32) for _ in range(2))
    return params, OPTIMIZER.init(params), x, y, jax.random.key(seed)
