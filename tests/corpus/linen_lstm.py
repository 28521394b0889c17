"""A Flax linen LSTM sequence classifier, initialized inside the step (a sharded init:
the parameters are made where they will live), its recurrent kernels by Flax's default
orthogonal initializer (a QR decomposition), then one optax.adam step on
integer-label cross-entropy.

Annotations: the sequences' batch (6) over "data" (4, uneven); the dense classifier's
classes over "model"."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import gspmd

MESH = gspmd.Mesh(np.arange(8).reshape(4, 2), ("data", "model"))
BATCH, STEPS, FEATURES, HIDDEN, CLASSES = 6, 5, 3, 8, 4
OPTIMIZER = optax.adam(1e-2)


class Classifier(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.RNN(nn.OptimizedLSTMCell(HIDDEN))(x)
        return nn.Dense(CLASSES, kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(),
                                                                   (None, "model")))(h[:, -1])


def train_step(key, x, labels):
    x = gspmd.mesh_split(x, MESH, P("data", None, None))
    model = Classifier()
    params = nn.unbox(model.init(key, x))["params"]

    def loss_fn(params):
        return optax.softmax_cross_entropy_with_integer_labels(model.apply({"params": params}, x), labels).mean()

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, _ = OPTIMIZER.update(grads, OPTIMIZER.init(params), params)
    return optax.apply_updates(params, updates), loss


def example_inputs():
    rng = np.random.RandomState(0)
    return (jax.random.key(0), rng.standard_normal((BATCH, STEPS, FEATURES)).astype(np.float32),
            jnp.asarray(rng.randint(0, CLASSES, BATCH), jnp.int32))
