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


def test_manual_over_a_subset_of_axes_without_annotations_replicates_over_the_others():
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
    with pytest.raises(gspmd.ShardingError, match="one entry per tensor dim"):
        gspmd.manual(lambda u: u, MESH, [["x"]], ["x", -1])(a)
    with pytest.raises(gspmd.ShardingError, match="inside gspmd.manual"):
        gspmd.jit(lambda v: jax.vmap(lambda u: jax.lax.psum(u, "i"), axis_name="i")(v)).lower(a)


# -- regions that compose (paper 3.4): automatic partitioning inside, gradients ----------------
def _inner_body(a, w):
    """Manual over "x" (each x-partition has its rows of `a`); inside, the contracting
    dim is split over "y" by the body's own annotations."""
    a = gspmd.mesh_split(a, MESH, [-1, "y"])
    w = gspmd.mesh_split(w, MESH, ["y", -1])
    return jnp.tanh(a @ w)


def _region(a, w):
    return gspmd.manual(_inner_body, MESH, in_specs=[["x", -1], [-1, -1]], out_specs=["x", -1],
                        manual_axes=("x",))(a, w)


def _same_without_manual(a, w):
    a = gspmd.mesh_split(a, MESH, ["x", "y"])
    return jnp.tanh(a @ gspmd.mesh_split(w, MESH, ["y", -1]))


def test_region_partitions_its_automatic_axes_as_its_annotations_say():
    rng = np.random.RandomState(3)
    low = check(_region, rand(rng, 6, 8), rand(rng, 8, 5), mesh=MESH)
    report = low.report()
    # Only the partial sums of the y-split contraction move, within each x-partition.
    (reduction,) = report.collectives
    assert reduction.kind == "all-reduce" and set(reduction.groups) == {(0, 1, 2, 3), (4, 5, 6, 7)}, report
    assert reduction.bytes == 6 // 2 * 5 * 4
    # The specs and the inside layouts seed the program: inputs arrive split, nothing is gathered.
    assert low.program.params[0].sharding == gspmd.Sharding.from_mesh(MESH, ["x", "y"], (6, 8))
    assert low.program.params[1].sharding == gspmd.Sharding.from_mesh(MESH, ["y", -1], (8, 5))


def test_gradients_through_a_region_are_a_region_too():
    rng = np.random.RandomState(4)
    a, w = rand(rng, 6, 8), rand(rng, 8, 5)

    def grads(f):
        return jax.grad(lambda a, w: jnp.sum(jnp.sin(f(a, w))), argnums=(0, 1))

    want = jax.jit(grads(_same_without_manual))(a, w)
    for g, e in zip(jax.jit(grads(_region))(a, w), want):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)
    low = check(grads(_region), a, w, mesh=MESH)
    kinds = low.report().counts()
    assert kinds["all-reduce"] >= 2 and "all-gather" not in kinds, low.report()


def test_gradients_of_replicated_arguments_and_results_sum_over_partitions():
    """w is the same in every x-partition (its gradient sums theirs); the psum'd result
    is the same in all of them (each takes a share of its cotangent)."""
    def region(a, w):
        return gspmd.manual(lambda a, w: jax.lax.psum(jnp.tanh(a @ w), "x"), MESH, in_specs=[["x", -1], [-1, -1]],
                            out_specs=[-1, -1], manual_axes=("x",))(a, w)

    def reference(a, w):
        return jnp.sum(jnp.tanh(a.reshape(2, 3, 8) @ w), axis=0)

    rng = np.random.RandomState(5)
    a, w = rand(rng, 6, 8), rand(rng, 8, 5)

    def grads(f):
        return jax.grad(lambda a, w: jnp.sum(f(a, w) ** 2), argnums=(0, 1))
    for g, e in zip(jax.jit(grads(region))(a, w), jax.jit(grads(reference))(a, w)):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5)
    check(grads(region), a, w, mesh=MESH)


def test_shard_map_gradients_convert():
    jmesh = jax.sharding.Mesh(np.asarray(jax.devices()[:8]).reshape(2, 4), ("x", "y"))
    P = jax.sharding.PartitionSpec

    def f(a, w):
        body = jax.shard_map(lambda a, w: jax.lax.psum(jnp.tanh(a @ w), "y"), mesh=jmesh, in_specs=(P(None, "y"),
                             P("y", None)), out_specs=P(), axis_names={"y"}, check_vma=False)
        return jnp.sum(body(a, w) ** 2)

    rng = np.random.RandomState(6)
    check(jax.grad(f, argnums=(0, 1)), rand(rng, 4, 8), rand(rng, 8, 3))


def test_annotation_over_a_manual_axis_inside_the_region_raises():
    def body(a):
        return gspmd.mesh_split(a, MESH, ["x", -1]) * 2

    with pytest.raises(gspmd.ShardingError, match="manual axis"):
        gspmd.jit(lambda a: gspmd.manual(body, MESH, [["x", -1]], ["x", -1], manual_axes=("x",))(a),
                  mesh=MESH).lower(np.zeros((4, 8), np.float32))


def test_a_shard_map_alone_lays_out_its_inputs_and_outputs():
    """No annotation but the region: its specs seed propagation, so the inputs arrive
    split and the result is not gathered after the region."""
    jmesh = jax.sharding.Mesh(np.asarray(jax.devices()[:8]).reshape(2, 4), ("x", "y"))
    P = jax.sharding.PartitionSpec

    def f(a):
        y = jax.shard_map(lambda v: jnp.sin(v) * 2, mesh=jmesh, in_specs=P("x", "y"), out_specs=P("x", "y"))(a)
        return y + 1

    rng = np.random.RandomState(7)
    low = check(f, rand(rng, 4, 8))
    split = gspmd.Sharding.from_mesh(MESH, ["x", "y"], (4, 8))
    assert low.program.params[0].sharding == split and low.program.outputs[0].sharding == split
    assert not low.report().collectives


def test_pipeline_stage_as_a_manual_region_with_automatic_sharding_inside():
    """Each stage is a manual partition over "p"; inside it, the microbatch is split over
    "d" by the stage's own annotation (paper 3.4)."""
    mesh = gspmd.Mesh(np.arange(8).reshape(4, 2), ("p", "d"))

    def stage(w, x):
        x = gspmd.mesh_split(x, mesh, ["d", -1])
        return jnp.tanh(x @ w)

    def loss(ws, xs, ts):
        return gspmd.pipeline_loss(stage, lambda y, t: jnp.mean((y - t) ** 2), ws, xs, ts, mesh=mesh,
                                   stage_axis="p", schedule="gpipe", manual_stages=True)

    rng = np.random.RandomState(8)
    ws, xs, ts = rand(rng, 4, 8, 8) / 3, rand(rng, 6, 4, 8), rand(rng, 6, 4, 8)
    step = jax.grad(loss)
    low = check(step, ws, xs, ts, mesh=mesh)
    data = {(0, 1), (2, 3), (4, 5), (6, 7)}
    reductions = [c for c in low.report().collectives if c.kind == "all-reduce" and set(c.groups) == data]
    assert reductions and all(c.executions == 1 for c in reductions), low.report()
    assert "all-gather" not in low.report().counts()
