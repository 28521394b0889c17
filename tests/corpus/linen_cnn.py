"""A Flax linen image classifier: a convolution, average pooling, a hidden dense layer
with dropout and a dense classifier; integer-label cross-entropy and optax.adamw.

Annotations: the images' batch (6) over "data" (4, uneven); the convolution's output
features and the hidden units over "model", carried by the parameters themselves
(nn.with_partitioning) and applied at the start of the step."""
import flax.linen as nn
import jax
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import gspmd
from corpus import constrain

MESH = gspmd.Mesh(np.arange(8).reshape(4, 2), ("data", "model"))
BATCH, SIZE, CHANNELS, FEATURES, HIDDEN, CLASSES, DROPOUT = 6, 8, 3, 4, 20, 10, 0.3
IMAGES = P("data", None, None, None)
OPTIMIZER = optax.adamw(1e-3)


def partitioned(init, *axes):
    """An initializer whose parameter carries a PartitionSpec (mesh axis names per dim)."""
    return nn.with_partitioning(init, axes)


LECUN, ZEROS = nn.initializers.lecun_normal(), nn.initializers.zeros


class Classifier(nn.Module):
    dropout: float

    @nn.compact
    def __call__(self, images, train: bool):
        x = nn.Conv(FEATURES, (3, 3), kernel_init=partitioned(LECUN, None, None, None, "model"),
                    bias_init=partitioned(ZEROS, "model"))(images)
        x = nn.avg_pool(nn.relu(x), (2, 2), strides=(2, 2))
        x = x.reshape(x.shape[0], -1)
        x = nn.Dense(HIDDEN, kernel_init=partitioned(LECUN, None, "model"), bias_init=partitioned(ZEROS, "model"))(x)
        x = nn.Dropout(self.dropout, deterministic=not train)(nn.relu(x))
        return nn.Dense(CLASSES, kernel_init=partitioned(LECUN, "model", None))(x), x != 0


# The parameters, and the PartitionSpecs their initializers carry (nn.with_partitioning).
_boxed = Classifier(DROPOUT).init(jax.random.key(0), np.zeros((BATCH, SIZE, SIZE, CHANNELS), np.float32), train=False)
PARAMS, PARAM_SPECS = nn.unbox(_boxed)["params"], nn.get_partition_spec(_boxed)["params"]


def make_train_step(dropout: float = DROPOUT):
    """The step returns the dropout's keep mask too (to compare it bit for bit)."""
    model = Classifier(dropout)

    def train_step(params, opt_state, images, labels, key):
        params = constrain(params, MESH, PARAM_SPECS)

        def loss_fn(params):
            logits, kept = model.apply({"params": params}, gspmd.mesh_split(images, MESH, IMAGES), train=True,
                                       rngs={"dropout": key})
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), kept

        (loss, kept), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, kept
    return train_step


train_step = make_train_step()


def example_inputs(seed: int = 0):
    rng = np.random.RandomState(seed)
    images = rng.standard_normal((BATCH, SIZE, SIZE, CHANNELS)).astype(np.float32)
    labels = rng.randint(0, CLASSES, BATCH).astype(np.int32)
    return PARAMS, OPTIMIZER.init(PARAMS), images, labels, jax.random.key(seed)
