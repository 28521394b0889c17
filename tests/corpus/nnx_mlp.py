"""A Flax NNX multi-layer perceptron with dropout (nnx.Rngs, nnx.Dropout), trained by
nnx.Optimizer with optax.adamw, in NNX's functional style: the model, the optimizer and
the dropout stream's counter go in and come out as one state.

Annotations: the batch over "data"; the hidden units (18, over 4: uneven) over "model",
carried by the parameters (nnx.with_partitioning) and applied at the start of the step."""
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

import gspmd
from corpus import constrain

MESH = gspmd.Mesh(np.arange(8).reshape(2, 4), ("data", "model"))
BATCH, FEATURES, HIDDEN, CLASSES, DROPOUT = 6, 10, 18, 5, 0.4
INPUTS = P("data", None)


def partitioned(init, *axes):
    """An initializer whose parameter carries a PartitionSpec (mesh axis names per dim)."""
    return nnx.with_partitioning(init, axes)


class MLP(nnx.Module):
    def __init__(self, dropout: float, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(FEATURES, HIDDEN, rngs=rngs,
                                 kernel_init=partitioned(nnx.initializers.lecun_normal(), None, "model"),
                                 bias_init=partitioned(nnx.initializers.zeros_init(), "model"))
        self.dropout = nnx.Dropout(dropout, rngs=rngs)
        self.out = nnx.Linear(HIDDEN, CLASSES, rngs=rngs,
                              kernel_init=partitioned(nnx.initializers.lecun_normal(), "model", None))

    def __call__(self, x):
        h = self.dropout(nnx.gelu(self.hidden(x)))
        return self.out(h), h != 0


def model_and_optimizer(dropout: float):
    """(graphdef, state) of the model and its optimizer, and the parameters' specs. The
    dropout rate lives in the graphdef: the state is the same for every rate."""
    with nnx.use_eager_sharding(False):   # created on the host; gspmd lays them out
        model = MLP(dropout, nnx.Rngs(params=0, dropout=1))
    graphdef, state = nnx.split((model, nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)))
    return graphdef, state, nnx.get_partition_spec(nnx.state(model, nnx.Param))


def make_train_step(dropout: float = DROPOUT):
    """The step returns the dropout's keep mask too (to compare it bit for bit)."""
    graphdef, _, param_specs = model_and_optimizer(dropout)

    def train_step(state, x, labels):
        model, optimizer = nnx.merge(graphdef, state)
        nnx.update(model, constrain(nnx.state(model, nnx.Param), MESH, param_specs))

        def loss_fn(model):
            logits, kept = model(gspmd.mesh_split(x, MESH, INPUTS))
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), kept

        (loss, kept), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss, kept
    return train_step


train_step = make_train_step()


def example_inputs(seed: int = 0):
    rng = np.random.RandomState(seed)
    return (model_and_optimizer(DROPOUT)[1], rng.standard_normal((BATCH, FEATURES)).astype(np.float32),
            rng.randint(0, CLASSES, BATCH).astype(np.int32))
