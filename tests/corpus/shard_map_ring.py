"""A data-parallel train step whose gradient all-reduce is written by hand: a
jax.shard_map computes each data shard's gradients and sums them around a ring of
devices with jax.lax.ppermute; the rest of the step is partitioned automatically: the
parameters and adamw's moments are kept split over "model" (ZeRO-style), gathered for
the manual region and updated shard by shard.

Annotations: the parameters and optimizer state over "model" (with_sharding_constraint
under jax.set_mesh); the shard_map's in_specs and out_specs."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

MESH = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
BATCH, FEATURES, HIDDEN, OUT = 6, 5, 12, 3
DATA_SHARDS = MESH.shape["data"]
OPTIMIZER = optax.adamw(1e-2)


def loss_fn(params, x, y):
    h = jnp.tanh(x @ params["w1"])
    return jnp.sum((h @ params["w2"] - y) ** 2) / BATCH


def ring_sum(tree, axis: str, size: int):
    """The sum over `axis` of every device's tree: pass a buffer around the ring size-1
    times, adding what arrives."""
    ring = [(i, (i + 1) % size) for i in range(size)]

    def one(x):
        total, passing = x, x
        for _ in range(size - 1):
            passing = jax.lax.ppermute(passing, axis, ring)
            total = total + passing
        return total
    return jax.tree_util.tree_map(one, tree)


def data_parallel_grads(params, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    return ring_sum((loss, grads), "data", DATA_SHARDS)


def zero_split(tree):
    return jax.tree_util.tree_map(lambda p: jax.lax.with_sharding_constraint(p, P(*[None] * (p.ndim - 1), "model"))
                                  if p.ndim else p, tree)


def train_step(params, opt_state, x, y):
    params, opt_state = zero_split(params), zero_split(opt_state)
    loss, grads = jax.shard_map(data_parallel_grads, mesh=MESH, in_specs=(P(), P("data"), P("data")),
                                out_specs=(P(), P()), check_vma=False)(params, x, y)   # jax cannot see that
    # the ring's sums are equal on every data shard
    updates, opt_state = OPTIMIZER.update(zero_split(grads), opt_state, params)
    return zero_split(optax.apply_updates(params, updates)), opt_state, loss


def example_inputs(seed: int = 0):
    rng = np.random.RandomState(seed)

    def normal(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(np.float32)
    params = {"w1": normal(FEATURES, HIDDEN, scale=0.4), "w2": normal(HIDDEN, OUT, scale=0.4)}
    return params, OPTIMIZER.init(params), normal(BATCH, FEATURES), normal(BATCH, OUT)
