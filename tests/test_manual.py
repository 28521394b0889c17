"""gspmd.manual: per-device subgraphs with JAX collectives over named mesh axes, inside an
otherwise automatically partitioned program (paper 3.4)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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


def _check_ragged_all_to_all(shape, axis: int, per_member: int, gaps: bool, seed: int) -> gspmd.Lowered:
    """lax.ragged_all_to_all along mesh axis `axis` of a `shape` mesh ("x", "y"), in a
    shard_map over both axes, `per_member` slices to each member of a group, received
    packed or with a gap after each slice: results and gradients as NumPy says, on both
    backends (jax.jit cannot run it on CPU)."""
    rng = np.random.default_rng(seed)
    others, k = shape[1 - axis], shape[axis]
    n, width = k * per_member, 3
    rows, out_rows = 2 * n + 1, 3 * n + 2        # room for slices of up to 2 rows, gaps of 1
    # [other, sender, slice]: rows sent, none empty (jax's transpose masks the output's
    # gradient by a cumulative sum that an empty slice starting where another does upsets:
    # there we equal jax's rule, not the gradient below)
    sizes = rng.integers(1, 3, (others, k, n))
    to = np.arange(n) // per_member                             # slice -> receiving member
    input_offsets = np.cumsum(sizes, -1) - sizes
    output_offsets, recv_sizes = np.zeros_like(sizes), np.zeros_like(sizes)
    for o in range(others):
        filled = np.zeros(k, np.int64)          # each receiver takes its senders' slices in order
        for s in range(k):
            for i in range(n):
                output_offsets[o, s, i] = filled[to[i]]
                filled[to[i]] += sizes[o, s, i] + gaps
                recv_sizes[o, to[i], s * per_member + i % per_member] = sizes[o, s, i]
    operand = rng.standard_normal((others, k, rows, width)).astype(np.float32)
    output = np.full((others, k, out_rows, width), -1.0, np.float32)
    cotangent = rng.standard_normal(output.shape).astype(np.float32)
    expected, operand_grad, output_grad = output.copy(), np.zeros_like(operand), cotangent.copy()
    for o in range(others):
        for s in range(k):
            for i in range(n):
                at, start, size = output_offsets[o, s, i], input_offsets[o, s, i], sizes[o, s, i]
                expected[o, to[i], at:at + size] = operand[o, s, start:start + size]
                operand_grad[o, s, start:start + size] = cotangent[o, to[i], at:at + size]
                output_grad[o, to[i], at:at + size] = 0
    # arrays over the mesh: [x, y, ...], the exchange along `axis`
    on_mesh = (lambda a: a) if axis == 1 else (lambda a: np.swapaxes(a, 0, 1))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:others * k]).reshape(shape), ("x", "y"))
    spec = jax.sharding.PartitionSpec("x", "y")

    def exchange(operand, output, *vectors):
        def body(operand, output, *vectors):
            squeeze = lambda v: v[0, 0]
            moved = jax.lax.ragged_all_to_all(squeeze(operand), squeeze(output), *map(squeeze, vectors),
                                              axis_name=("x", "y")[axis])
            return moved[None, None]
        return jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 6, out_specs=spec)(operand, output, *vectors)

    def loss(operand, output, *vectors):
        return jnp.sum(exchange(operand, output, *vectors) * on_mesh(cotangent))

    args = [on_mesh(a) for a in (operand, output)] + [on_mesh(v.astype(np.int32))
                                                      for v in (input_offsets, sizes, output_offsets, recv_sizes)]
    for backend in ("sim", "jax"):
        np.testing.assert_array_equal(gspmd.jit(exchange, backend=backend)(*args), on_mesh(expected))
        grads = gspmd.jit(jax.grad(loss, (0, 1)), backend=backend)(*args)
        np.testing.assert_allclose(grads[0], on_mesh(operand_grad), rtol=1e-6)
        np.testing.assert_allclose(grads[1], on_mesh(output_grad), rtol=1e-6)
    return gspmd.jit(exchange).lower(*args)


@pytest.mark.parametrize("per_member", [1, 2])
def test_ragged_all_to_all_and_its_gradient(per_member):
    """Over "y" of a 2x4 mesh (MaxText's expert parallelism sends each expert's tokens so)."""
    lowered = _check_ragged_all_to_all((2, 4), 1, per_member, gaps=False, seed=per_member)
    (moved,) = lowered.report().collectives
    assert moved.kind == "ragged-all-to-all" and moved.groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    rows = 2 * 4 * per_member + 1
    assert moved.bytes == rows * 3 * 4     # what a device holds to send: less than its receive buffer


RAGGED_CASES = (st.sampled_from([(2, 4), (4, 2), (2, 2)]), st.sampled_from([0, 1]), st.sampled_from([1, 2, 3]),
                st.booleans(), st.integers(0, 2 ** 16))


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(*RAGGED_CASES)
def test_random_ragged_all_to_all(shape, axis, per_member, gaps, seed):
    _check_ragged_all_to_all(shape, axis, per_member, gaps, seed)


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(*RAGGED_CASES)
def test_random_ragged_all_to_all_slow(shape, axis, per_member, gaps, seed):
    _check_ragged_all_to_all(shape, axis, per_member, gaps, seed)


def test_pbroadcast():
    """lax.pbroadcast over "y" from member 2 (jax lowers it for GPUs only): every member of
    a row gets member 2's value. (jax's transpose rule for it takes only scalars.)"""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 4, 5)).astype(np.float32)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("x", "y"))
    spec = jax.sharding.PartitionSpec("x", "y")
    broadcast = jax.shard_map(lambda v: jax.lax.pbroadcast(v, "y", 2), mesh=mesh, in_specs=spec, out_specs=spec)
    for backend in ("sim", "jax"):
        np.testing.assert_array_equal(gspmd.jit(broadcast, backend=backend)(x), np.repeat(x[:, 2:3], 4, 1))


def test_ragged_all_to_all_in_a_shard_map_over_some_axes():
    """Manual over "y" only: the exchange's rows are whole, its other dims follow the
    automatic layout (a width split over "x" by an annotation outside)."""
    rng = np.random.default_rng(4)
    k, rows, width = 4, 8, 6
    sizes = rng.integers(1, 3, (k, k))                      # [sender, receiver]
    input_offsets, output_offsets = np.cumsum(sizes, 1) - sizes, np.cumsum(sizes, 0) - sizes
    operand = rng.standard_normal((k * rows, width)).astype(np.float32)
    output = np.full((k * rows, width), -1.0, np.float32)
    expected = output.copy()
    for s in range(k):
        for r in range(k):
            at, start = r * rows + output_offsets[s, r], s * rows + input_offsets[s, r]
            expected[at:at + sizes[s, r]] = operand[start:start + sizes[s, r]]
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("x", "y"))
    spec = jax.sharding.PartitionSpec("y")

    def f(operand, output, *vectors):
        operand = gspmd.mesh_split(operand, mesh, [None, "x"])
        body = lambda o, u, *v: jax.lax.ragged_all_to_all(o, u, *[x[0] for x in v], axis_name="y")
        return jnp.tanh(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 6, out_specs=spec,
                                      axis_names={"y"})(operand, output, *vectors))

    vectors = [v.astype(np.int32) for v in (input_offsets, sizes, output_offsets, sizes.T)]
    for backend in ("sim", "jax"):
        np.testing.assert_allclose(gspmd.jit(f, backend=backend)(operand, output, *vectors), np.tanh(expected),
                                   rtol=1e-6)
