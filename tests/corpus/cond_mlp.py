"""A model with data-dependent control flow: a residual block applied only when the
batch's activations are large (lax.cond on a predicate computed from split data), then
an activation function chosen by the step counter (lax.switch); trained with optax.sgd
with momentum. The step counter comes in and goes out.

Annotations: the batch (6, over 4: uneven) over "data"; the hidden units over "model"."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

import gspmd

MESH = gspmd.Mesh(np.arange(8).reshape(4, 2), ("data", "model"))
BATCH, FEATURES, WIDTH, HIDDEN, OUT, THRESHOLD = 6, 7, 10, 16, 3, 1.0
ANNOTATIONS = {"x": P("data", None), "w_in": P(), "w1": P(None, "model"), "w2": P("model", None), "w_out": P()}
ACTIVATIONS = (jax.nn.relu, lambda h: jax.nn.gelu(h, approximate=False), jnp.tanh)
OPTIMIZER = optax.sgd(1e-2, momentum=0.9)


def split(x, name):
    return gspmd.mesh_split(x, MESH, ANNOTATIONS[name])


def residual(params, h):
    return jax.nn.relu(h @ split(params["w1"], "w1")) @ split(params["w2"], "w2")


def forward(params, x, step):
    h = split(x, "x") @ split(params["w_in"], "w_in")
    large = jnp.mean(h ** 2) > THRESHOLD
    h = lax.cond(large, lambda h: h + residual(params, h), lambda h: h, h)
    h = lax.switch(step % len(ACTIVATIONS), ACTIVATIONS, h)
    return h @ split(params["w_out"], "w_out"), large


def train_step(params, opt_state, step, x, y):
    def loss_fn(params):
        out, large = forward(params, x, step)
        return jnp.mean((out - y) ** 2), large

    (loss, large), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, step + 1, loss, large


def example_inputs(seed: int = 0):
    """Odd seeds make small activations (the residual block is skipped); the step
    counter is the seed (so seeds 0, 1, 2 use each activation)."""
    rng = np.random.RandomState(seed)

    def normal(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(np.float32)
    params = {"w_in": normal(FEATURES, WIDTH, scale=0.6), "w1": normal(WIDTH, HIDDEN, scale=0.3),
              "w2": normal(HIDDEN, WIDTH, scale=0.3), "w_out": normal(WIDTH, OUT, scale=0.3)}
    x = normal(BATCH, FEATURES, scale=0.2 if seed % 2 else 2.0)
    return params, OPTIMIZER.init(params), np.int32(seed), x, normal(BATCH, OUT)
