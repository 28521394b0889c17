"""gspmd.manual: per-device subgraphs with JAX collectives over named mesh axes, inside an
otherwise automatically partitioned program (paper 3.4)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gspmd
from util import check, rand

MESH = gspmd.Mesh(np.arange(8).reshape(2, 4), ("x", "y"))


def megatron_body(a, w):
    """Each device multiplies its blocks; the partial sums over "y" are added by hand."""
    return jax.lax.psum(a @ w, "y")


def test_manual_matmul_with_psum_inside_an_annotated_program():
    def f(a, w, bias):
        a = gspmd.mesh_split(a, MESH, ["x", -1])
        y = gspmd.manual(megatron_body, MESH, in_specs=[["x", "y"], ["y", -1]], out_specs=["x", -1])(a, w)
        return jnp.tanh(y + bias)

    rng = np.random.RandomState(0)
    low = check(f, rand(rng, 6, 8), rand(rng, 8, 5), rand(rng, 5), mesh=MESH)
    kinds = [c.kind for c in low.report().collectives]
    assert kinds.count("all-reduce") == 1, low.report()          # the user's psum, nothing added
    assert any("manual" in c.origin for c in low.report().collectives)


def test_collectives_over_named_axes():
    def body(a):
        i = jax.lax.axis_index("y").astype(a.dtype)
        return (jax.lax.pmax(a, "x") + i, jax.lax.all_gather(a, "y", axis=1, tiled=True),
                jax.lax.psum_scatter(a, "y", scatter_dimension=1, tiled=True),
                jax.lax.ppermute(a, "y", [(j, (j + 1) % 4) for j in range(4)]),
                jax.lax.all_to_all(a, "y", 1, 0, tiled=True), jax.lax.all_gather(a, "x", axis=0))

    def f(a):
        return gspmd.manual(body, MESH, in_specs=[["x", "y"]],
                            out_specs=[["x", "y"], ["x", -1], ["x", "y"], ["x", "y"], ["x", "y"], [-1, -1, "y"]])(a)

    rng = np.random.RandomState(1)
    check(f, rand(rng, 4, 16), mesh=MESH)


def test_manual_over_a_subset_of_axes_replicates_over_the_others():
    def f(a):
        return gspmd.manual(lambda v: jax.lax.psum(v.sum(0, keepdims=True), "y"), MESH, in_specs=[[-1, "y"]],
                            out_specs=[[-1, -1]], manual_axes=("y",))(a) * 2

    rng = np.random.RandomState(2)
    check(f, rand(rng, 3, 8), mesh=MESH)


def test_bad_manual_specs_raise():
    a = np.zeros((6, 8), np.float32)
    with pytest.raises(gspmd.ShardingError, match="does not divide"):
        gspmd.jit(lambda v: gspmd.manual(lambda u: u, MESH, [["y", -1]], ["y", -1])(v), mesh=MESH).lower(a)
    with pytest.raises(gspmd.ShardingError, match="not manual"):
        gspmd.manual(lambda u: u, MESH, [["x", -1]], ["x", -1], manual_axes=("y",))(a)
    with pytest.raises(gspmd.ShardingError, match="one entry per dim"):
        gspmd.manual(lambda u: u, MESH, [["x"]], ["x", -1])(a)
    with pytest.raises(gspmd.ShardingError, match="inside gspmd.manual"):
        gspmd.jit(lambda v: jax.vmap(lambda u: jax.lax.psum(u, "i"), axis_name="i")(v)).lower(a)
