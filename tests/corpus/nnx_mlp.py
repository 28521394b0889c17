"""A Flax NNX multi-layer perceptron with dropout (nnx.Rngs, nnx.Dropout), trained by
nnx.Optimizer with optax.adamw, in NNX's functional style: the model, the optimizer and
the dropout stream's counter go in and come out as one state.

Annotations: the batch over "data"; the hidden units (18, over 4: uneven) over "model",
carried by the parameters (nnx.with_partitioning) and applied at the start of the step."""
import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

import gspmd
from corpus import constrain

MESH = gspmd.Mesh(np.arange(8).reshape(2, 4), ("data", "model"))
BATCH, FEATURES, HIDDEN, CLASSES, DROPOUT = 6, 10, 18, 5, 0.4
INPUTS = P("data", None)


def split_over_model(init, *axes):
    return nnx.with_partitioning(init, axes)


class MLP(nnx.Module):
    def __init__(self, dropout: float, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(FEATURES, HIDDEN, rngs=rngs,
                                 kernel_init=split_over_model(nnx.initializers.lecun_normal(), None, "model"),
                                 bias_init=split_over_model(nnx.initializers.zeros_init(), "model"))
        self.dropout = nnx.Dropout(dropout, rngs=rngs)
        self.out = nnx.Linear(HIDDEN, CLASSES, rngs=rngs,
                              kernel_init=split_over_model(nnx.initializers.lecun_normal(), "model", None))

    def __call__(self, x):
        h = self.dropout(nnx.gelu(self.hidden(x)))
        return self.out(h), h != 0


def make_train_step(dropout: float = DROPOUT):
    """Returns (train_step, its initial state). The step returns the keep mask too."""
    with nnx.use_eager_sharding(False):   # created on the host; gspmd lays them out
        model = MLP(dropout, nnx.Rngs(params=0, dropout=1))
    graphdef, state = nnx.split((model, nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)))
    param_specs = nnx.get_partition_spec(nnx.state(model, nnx.Param))

    def train_step(state, x, labels):
        model, optimizer = nnx.merge(graphdef, state)
        nnx.update(model, constrain(nnx.state(model, nnx.Param), MESH, param_specs))

        def loss_fn(model):
            logits, kept = model(gspmd.mesh_split(x, MESH, INPUTS))
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), kept

        (loss, kept), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss, kept
    return train_step, state


train_step, _state = make_train_step()


def example_inputs(seed: int = 0):
    rng = np.random.RandomState(seed)
    return (_state, rng.standard_normal((BATCH, FEATURES)).astype(np.float32),
            rng.randint(0, CLASSES, BATCH).astype(np.int32))
