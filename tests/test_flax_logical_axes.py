"""explain() and as_text() speak the logical axis names flax variables declare (issue 24:
MaxText's embed, mlp, heads, ...): nnx metadata (out_sharding) and linen's
LogicallyPartitioned, on arguments and on the results a step returns."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import gspmd
from util import assert_close

nnx = pytest.importorskip("flax.nnx")
nn = pytest.importorskip("flax.linen")

MESH = gspmd.Mesh(np.arange(8).reshape(2, 4), ("data", "tensor"))


def params():
    def param(shape, names):
        return nnx.Param(jnp.asarray(np.random.default_rng(0).normal(size=shape), jnp.float32),
                         out_sharding=names, eager_sharding=False)
    return nnx.State({"wi": param((16, 32), ("embed", "mlp")), "wo": param((32, 16), ("mlp", "embed"))})


def sgd_step(state, x):
    def loss(state):
        return jnp.sum(jnp.tanh(x @ state["wi"][...]) @ state["wo"][...])
    grads = jax.grad(loss)(state)
    return jax.tree.map(lambda p, g: p - 0.1 * g, state, grads)


SHARDINGS = (nnx.State({"wi": P(None, "tensor"), "wo": P("tensor", None)}), P("data", None))


def test_nnx_parameters_and_results_show_their_logical_axes():
    state, x = params(), np.ones((5, 16), np.float32)   # 5 rows: uneven over data=2
    step = gspmd.jit(sgd_step, mesh=MESH, in_shardings=SHARDINGS)
    assert_close(jax.tree.leaves(step(state, x)), jax.tree.leaves(jax.jit(sgd_step)(state, x)))
    low = step.lower(state, x)
    wi = low.explain("state['wi'].value")
    assert "logical axes ('embed', 'mlp')" in wi and "P(None, 'tensor')" in wi, wi
    assert "logical axes ('mlp', 'embed')" in low.explain("result['wo'].value")
    assert "logical axes" not in low.explain("x")   # a plain array declares none
    assert low.as_text().count("logical axes") == 4   # two parameters, two results


def test_linen_logically_partitioned_boxes():
    w = nn.LogicallyPartitioned(jnp.ones((16, 32)), ("embed", "mlp"))
    low = gspmd.jit(lambda w, x: x @ w.unbox(), mesh=MESH, in_shardings=(P(None, "tensor"), None)).lower(
        w, np.ones((4, 16), np.float32))
    assert "logical axes ('embed', 'mlp')" in low.explain("w.value")


def test_names_of_the_wrong_rank_are_not_shown():
    """A variable whose metadata names fewer dims than it has (a stale annotation) shows none."""
    w = nnx.Param(jnp.ones((16, 32)), out_sharding=("embed",), eager_sharding=False)
    low = gspmd.jit(lambda w: w[...] * 2, mesh=MESH).lower(w)
    assert "logical axes" not in low.as_text()


class Boxed:
    """A user's pytree whose get_metadata means something else: never called."""

    def __init__(self, value):
        self.value = value

    def get_metadata(self, key):
        raise AssertionError(f"gspmd called get_metadata({key!r})")


jax.tree_util.register_pytree_node(Boxed, lambda b: ((b.value,), None), lambda _, children: Boxed(*children))


def test_other_pytrees_are_not_asked_for_metadata():
    low = gspmd.jit(lambda b: b.value * 2, mesh=MESH).lower(Boxed(np.ones((8, 4), np.float32)))
    assert "logical axes" not in low.as_text()
