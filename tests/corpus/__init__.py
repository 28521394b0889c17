"""A corpus of small, real training programs written the way users of Flax, Equinox,
optax and jax.random write them, annotated for data and model parallelism.

One module per program. Each exposes `MESH`, the annotations it applies (`ANNOTATIONS`
or, for Flax, the partition specs its layers carry), `train_step` (one optimizer step)
and `example_inputs()` (the arguments of one call, sizes that do not all divide the
mesh). tests/test_corpus.py runs every train step under gspmd.jit on both backends,
compares it with one device and asserts its collectives."""
from typing import Any

import jax
from jax.sharding import PartitionSpec

import gspmd


def constrain(tree: Any, mesh: gspmd.Mesh, specs: Any) -> Any:
    """mesh_split each array of `tree` by the PartitionSpec at the same place in `specs`."""
    return jax.tree_util.tree_map(lambda x, spec: gspmd.mesh_split(x, mesh, spec), tree, specs,
                                  is_leaf=lambda s: isinstance(s, PartitionSpec))
