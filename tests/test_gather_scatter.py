"""Embedding lookups and their gradients: gather and scatter-add with the table split on
its vocab or model dim and the ids split on batch, vs one device (sim and jax)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gspmd
from strategies import dims_mappings, meshes
from util import check, rand

MESH = gspmd.Mesh(np.arange(8).reshape(2, 4), ("x", "y"))
TABLE_LAYOUTS = [["x", -1], [-1, "y"], [("x", "y"), -1], ["y", "x"], [-1, -1]]


def lookup(table_map, ids_map):
    def f(table, ids):
        table = gspmd.mesh_split(table, MESH, table_map)
        return table[gspmd.mesh_split(ids, MESH, ids_map)]
    return f


def train_step(table_map, ids_map):
    def step(table, ids):
        loss = lambda t: jnp.sum(jnp.tanh(lookup(table_map, ids_map)(t, ids)) ** 2)
        return table - 0.1 * jax.grad(loss)(table)
    return step


@pytest.mark.parametrize("table_map", TABLE_LAYOUTS)
def test_embedding_lookup_and_gradient(table_map):
    rng = np.random.RandomState(0)
    table, ids = rand(rng, 11, 6), rng.randint(0, 11, (4, 3)).astype(np.int32)   # 11 rows: uneven
    check(lookup(table_map, ["x", -1]), table, ids, mesh=MESH)
    low = check(train_step(table_map, ["x", -1]), table, ids, mesh=MESH)
    assert low.sharding_of(0) == gspmd.Sharding.from_mesh(MESH, table_map, table.shape)


def test_vocab_split_table_answers_locally_and_sums():
    """Megatron-style vocab-parallel embedding: no table movement, one all-reduce."""
    rng = np.random.RandomState(1)
    table, ids = rand(rng, 16, 8), rng.randint(0, 16, (4, 6)).astype(np.int32)
    low = check(lookup(["y", "x"], [-1, -1]), table, ids, mesh=MESH)
    (c,) = low.report().collectives
    assert c.kind == "all-reduce" and c.bytes == 4 * 6 * (8 // 2) * 4   # output [B, S, M/x] summed over y
    assert set(c.groups) == {(0, 1, 2, 3), (4, 5, 6, 7)}


def test_model_split_table_gradient_all_reduces_over_batch_only():
    rng = np.random.RandomState(2)
    table, ids = rand(rng, 10, 8), rng.randint(0, 10, (4, 3)).astype(np.int32)
    low = check(train_step([-1, "y"], ["x", -1]), table, ids, mesh=MESH)
    (c,) = low.report().collectives
    assert c.kind == "all-reduce" and set(c.groups) == {(0, 4), (1, 5), (2, 6), (3, 7)}


def test_take_modes_and_scatter_variants():
    rng = np.random.RandomState(3)
    table = rand(rng, 10, 6)
    idx = np.array([[0, 5, 7], [1, 2, 9]], np.int32)
    check(lambda t, i: jnp.take(gspmd.mesh_split(t, MESH, [-1, "y"]), i, axis=1), table, idx, mesh=MESH)
    check(lambda t, i: jnp.take(gspmd.mesh_split(t, MESH, ["x", -1]), i, axis=0, mode="clip"), table, idx + 3,
          mesh=MESH)
    rows = np.array([1, 2, 9, 2], np.int32)
    check(lambda t, i: gspmd.mesh_split(t, MESH, ["x", -1]).at[i].add(1.0), table, rows, mesh=MESH)
    check(lambda t, i: gspmd.mesh_split(t, MESH, ["x", "y"]).at[i].max(0.5), table, rows, mesh=MESH)
    check(lambda t, i: gspmd.mesh_split(t, MESH, ["y", -1]).at[i[:3]].set(2.0), table, rows, mesh=MESH)


@st.composite
def lookup_cases(draw):
    mesh = draw(meshes(shapes=[(2, 4), (4, 2), (8,), (2, 2, 2)]))
    vocab, width = draw(st.sampled_from([3, 8, 13])), draw(st.sampled_from([1, 4, 6]))
    ids_shape = tuple(draw(st.sampled_from([1, 2, 5, 8])) for _ in range(draw(st.integers(1, 2))))
    return mesh, vocab, width, ids_shape, draw(dims_mappings(mesh, 2)), draw(dims_mappings(mesh, len(ids_shape)))


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(lookup_cases())
def test_random_lookups_and_gradients(case):
    mesh, vocab, width, ids_shape, table_map, ids_map = case
    rng = np.random.RandomState(4)
    table, ids = rand(rng, vocab, width), rng.randint(0, vocab, ids_shape).astype(np.int32)

    def step(t, i):
        def loss(t):
            e = gspmd.mesh_split(t, mesh, table_map)[gspmd.mesh_split(i, mesh, ids_map)]
            return jnp.sum(e * e)
        return t - 0.1 * jax.grad(loss)(t)

    got = gspmd.jit(step, mesh=mesh)(table, ids)
    np.testing.assert_allclose(got, jax.jit(step)(table, ids), rtol=1e-5, atol=1e-5)
