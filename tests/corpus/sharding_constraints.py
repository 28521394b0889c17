"""A train step written for jax.jit and annotated only with
jax.lax.with_sharding_constraint: the parameters by NamedSharding over a jax Mesh, the
activations by bare PartitionSpecs that refer to the mesh set by jax.set_mesh. There is
no gspmd in this file: gspmd.jit runs it unchanged (under `with jax.set_mesh(MESH)`).

A two-layer MLP with layer norm, trained with optax.adamw; the batch (6) over "data"
(2), the hidden units (20, over 4: uneven) over "model"."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

MESH = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
BATCH, FEATURES, HIDDEN, OUT = 6, 9, 20, 4
PARAMS = {"w1": NamedSharding(MESH, P(None, "model")), "b1": NamedSharding(MESH, P("model")),
          "w2": NamedSharding(MESH, P("model", None)), "scale": NamedSharding(MESH, P())}
OPTIMIZER = optax.adamw(1e-2)


def loss_fn(params, x, y):
    x = jax.lax.with_sharding_constraint(x, P("data", None))
    h = jax.nn.silu(x @ params["w1"] + params["b1"])
    h = jax.lax.with_sharding_constraint(h, P("data", "model"))
    h = h * jax.lax.rsqrt(jnp.mean(h ** 2, axis=-1, keepdims=True) + 1e-6) * params["scale"]
    return jnp.mean((h @ params["w2"] - y) ** 2)


def train_step(params, opt_state, x, y):
    params = jax.tree_util.tree_map(jax.lax.with_sharding_constraint, params, PARAMS)
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def example_inputs(seed: int = 0):
    rng = np.random.RandomState(seed)

    def normal(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(np.float32)
    params = {"w1": normal(FEATURES, HIDDEN, scale=0.3), "b1": normal(HIDDEN, scale=0.1),
              "w2": normal(HIDDEN, OUT, scale=0.3), "scale": np.ones(HIDDEN, np.float32)}
    return params, OPTIMIZER.init(params), normal(BATCH, FEATURES), normal(BATCH, OUT)
