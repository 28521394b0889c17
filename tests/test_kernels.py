"""Pallas kernels (pallas_call) run as they are: gathered and run whole under automatic
sharding (as XLA runs a custom call), per device inside a shard_map; priced by their
grid's matmuls."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.experimental import pallas as pl

import gspmd
from util import BACKENDS, assert_close, check, rand

MESH = gspmd.Mesh(np.arange(8).reshape(2, 4), ("x", "y"))
P = jax.sharding.PartitionSpec


def _matmul_kernel(x_ref, w_ref, o_ref):
    o_ref[...] = jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32)


def _tanh_matmul_kernel(x_ref, w_ref, o_ref):
    o_ref[...] = jnp.tanh(jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32))


def tanh_matmul(x, w, block: int = 2, interpret: bool = True, kernel=_tanh_matmul_kernel):
    """tanh(x @ w), a block of `block` rows of x per step of the kernel's grid."""
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32),
        grid=(x.shape[0] // block,), in_specs=[pl.BlockSpec((block, x.shape[1]), lambda i: (i, 0)),
                                               pl.BlockSpec(w.shape, lambda i: (0, 0))],
        out_specs=pl.BlockSpec((block, w.shape[1]), lambda i: (i, 0)), interpret=interpret)(x, w)


@jax.custom_vjp
def kernel_layer(x, w):
    """tanh_matmul (a row a step, for any rows) with a gradient: a custom_vjp whose
    backward is a kernel too."""
    return tanh_matmul(x, w, block=1)


def _kernel_layer_forward(x, w):
    y = tanh_matmul(x, w, block=1)
    return y, (x, w, y)


def _kernel_layer_backward(res, g):
    x, w, y = res
    d = g * (1 - y ** 2)
    return tanh_matmul(d, w.T, block=1, kernel=_matmul_kernel), x.T @ d


kernel_layer.defvjp(_kernel_layer_forward, _kernel_layer_backward)


def _jax_mesh():
    return jax.sharding.Mesh(np.asarray(jax.devices()[:8]).reshape(2, 4), ("x", "y"))


@pytest.mark.parametrize("rows,block", [(8, 2), (7, 1)])     # 7 rows over "x"'s 2: uneven
def test_a_kernel_under_automatic_sharding_runs_whole_on_gathered_operands(rows, block):
    """As XLA runs a custom call it has no rule for, on both backends (the jax backend
    binds a kernel traced with automatic axes in its per-device program)."""
    def f(x, w):
        x = gspmd.mesh_split(x, MESH, ["x", -1])
        return tanh_matmul(x, w, block=block) * 2

    rng = np.random.RandomState(0)
    x, w = rand(rng, rows, 6), rand(rng, 6, 5)
    low = check(f, x, w, mesh=MESH)
    assert [c.kind for c in low.report().collectives] == ["all-gather"]     # x's rows, before the kernel

    def layer(x, w):
        return kernel_layer(gspmd.mesh_split(x, MESH, ["x", -1]), w)
    check(jax.grad(lambda x, w: jnp.sum(layer(x, w) ** 2), argnums=(0, 1)), x, w, mesh=MESH)


def test_a_kernel_in_a_shard_map_over_some_axes_gathers_over_the_others():
    """Manual over "x", automatic over "y": each "x" half runs the kernel on its rows,
    replicated over "y"."""
    def f(x, w):
        return jax.shard_map(lambda x, w: tanh_matmul(x, w), mesh=_jax_mesh(), in_specs=(P("x"), P()),
                             out_specs=P("x"), axis_names={"x"}, check_vma=False)(x, w)

    rng = np.random.RandomState(2)
    x, w = rand(rng, 8, 6), rand(rng, 6, 5)
    check(f, x, w, mesh=MESH)


@pytest.mark.parametrize("manual", [None, {"x"}, {"x", "y"}])
def test_a_kernel_runs_under_the_users_context_mesh(manual):
    """Under jax.set_mesh (as MaxText's train loop calls its step): the sim backend ran the
    kernel under the user's automatic axes, which a body traced in a shard_map refused."""
    def f(x, w):
        if manual is None:
            return tanh_matmul(jax.lax.with_sharding_constraint(x, P("x")), w)
        return jax.shard_map(tanh_matmul, in_specs=(P("x"), P()), out_specs=P("x"), axis_names=manual,
                             check_vma=False)(x, w)

    rng = np.random.RandomState(3)
    x, w = rand(rng, 8, 6), rand(rng, 6, 5)
    with jax.set_mesh(_jax_mesh()):
        expected = jax.jit(f)(x, w)
        for backend in BACKENDS:
            assert_close(gspmd.jit(f, backend=backend)(x, w), expected)


@pytest.mark.parametrize("rows", [8, 12])    # 12 rows: a kernel grid of 3 per "x" shard
def test_a_kernel_in_a_shard_map_runs_on_each_devices_block(rows):
    """As MaxText's splash attention: the kernel inside jax.shard_map, each device on its
    own rows, no collective; its gradient by a custom_vjp whose backward is a kernel too."""
    def f(x, w):
        return jax.shard_map(kernel_layer, mesh=_jax_mesh(), in_specs=(P("x"), P()), out_specs=P("x"), check_vma=False)(x, w)

    rng = np.random.RandomState(1)
    x, w = rand(rng, rows, 6), rand(rng, 6, 5)
    low = check(f, x, w, mesh=MESH)
    assert not low.report().collectives
    # one kernel a device: 2 * (rows / 2) * 6 * 5 FLOPs in rows / 2 grid steps
    (kernel,) = [i for i in low.spmd.all_instrs() if i.opcode == "pallas-call"]
    assert kernel.attrs["flops"] == 2 * (rows // 2) * 6 * 5 and low.report(hardware="tpu-v5p").flops > 0
    grad = jax.grad(lambda x, w: jnp.sum(f(x, w) ** 2), argnums=(0, 1))
    check(grad, x, w, mesh=MESH)


def test_a_kernels_flops_count_its_loops_branches_and_calls():
    """A body that loops 3 times over a block matmul, and on the grid's first step only
    (a branch, counted at its dearest: every step) calls a jitted one: 4 matmuls a step."""
    def kernel(x_ref, w_ref, o_ref):
        o_ref[...] = jax.lax.fori_loop(0, 3, lambda i, acc: acc + jnp.dot(x_ref[...], w_ref[...]),
                                       jnp.zeros(o_ref.shape, jnp.float32))

        @pl.when(pl.program_id(0) == 0)
        def _():
            o_ref[...] += jax.jit(jnp.matmul)(x_ref[...], w_ref[...])

    def f(x, w):
        return jax.shard_map(lambda x, w: tanh_matmul(x, w, kernel=kernel), mesh=_jax_mesh(), in_specs=(P("x"), P()),
                             out_specs=P("x"), check_vma=False)(x, w)

    low = gspmd.jit(f, mesh=MESH).lower(np.ones((16, 6), np.float32), np.ones((6, 5), np.float32))
    (call,) = [i for i in low.spmd.all_instrs() if i.opcode == "pallas-call"]
    assert call.attrs["flops"] == 4 * (2 * 2 * 6 * 5) * 4     # 4 matmuls of [2, 6] x [6, 5], 4 grid steps


def test_a_kernel_the_sim_backend_cannot_run_is_refused_clearly():
    """A kernel compiled for other hardware (not interpret=True) still plans; running it
    on the simulator says why it cannot."""
    def f(x, w):
        return tanh_matmul(x, w, interpret=False)

    x, w = np.ones((8, 6), np.float32), np.ones((6, 5), np.float32)
    assert gspmd.jit(f, mesh=MESH).lower(x, w).report(hardware="tpu-v5p").step_seconds > 0
    with pytest.raises(gspmd.ShardingError, match="Pallas kernel .* cannot run on this machine"):
        gspmd.jit(f, mesh=MESH, backend="sim")(x, w)


def test_a_kernel_takes_in_none_of_its_producers():
    """XLA:TPU fuses an element-wise producer into the dot that reads it, never into a
    custom kernel: a softmax before a kernel is timed as a kernel of its own on a TPU as
    on a GPU."""
    import dataclasses

    from gspmd.spmd import cost as cm

    def f(scores, v):
        probabilities = jax.nn.softmax(scores, axis=-1)
        return jax.shard_map(lambda p, v: tanh_matmul(p, v, block=256, kernel=_matmul_kernel), mesh=_jax_mesh(),
                             in_specs=(P("x"), P()), out_specs=P("x"), check_vma=False)(probabilities, v)

    n = 1024
    low = gspmd.jit(f, mesh=MESH).lower(jax.ShapeDtypeStruct((n, n), np.float32),
                                        jax.ShapeDtypeStruct((n, 128), np.float32))
    tpu = cm.PROFILES["tpu-v5p"]
    fusing, not_fusing = low.report(hardware=tpu), low.report(hardware=dataclasses.replace(tpu, fuses_into_matmul=False))
    assert tpu.fuses_into_matmul and fusing.compute_seconds == not_fusing.compute_seconds


@st.composite
def kernels_in_shard_maps(draw):
    """A mesh; the axes a shard_map around the kernel is manual over (None: no shard_map,
    automatic sharding) and those of them its rows are split over; how many blocks each
    device gets, the block, and whether x arrives split otherwise."""
    shape = draw(st.sampled_from([(2,), (4,), (2, 2), (2, 4), (4, 2)]))
    names = ("x", "y")[:len(shape)]
    manual = draw(st.sampled_from([None, names] + ([names[:1], names[1:]] if len(names) > 1 else [])))
    axes = () if manual is None else tuple(draw(st.permutations(manual)))[:draw(st.integers(0, len(manual)))]
    return shape, names, manual, axes, draw(st.integers(1, 3)), draw(st.sampled_from([1, 2])), draw(st.booleans()), \
        draw(st.integers(0, 2 ** 16))


def _check_kernel_in_shard_map(case):
    """Equal to one device on both backends; no collective where x arrives whole."""
    shape, names, manual, axes, blocks, block, presplit, seed = case
    devices = int(np.prod(shape))
    jmesh = jax.sharding.Mesh(np.asarray(jax.devices()[:devices]).reshape(shape), names)
    mesh = gspmd.Mesh(np.arange(devices).reshape(shape), names)
    parts = int(np.prod([jmesh.shape[a] for a in axes]))
    spec = P(axes if axes else None)

    def f(x, w):
        if presplit:
            x = gspmd.mesh_split(x, mesh, [names[-1], -1])
        kernel = functools.partial(tanh_matmul, block=block)
        if manual is not None:
            kernel = jax.shard_map(kernel, mesh=jmesh, in_specs=(spec, P()), out_specs=spec, axis_names=set(manual),
                                   check_vma=False)
        return kernel(x, w) + 1

    rng = np.random.RandomState(seed)
    low = check(f, rand(rng, parts * blocks * block, 4), rand(rng, 4, 3), mesh=mesh)
    if not presplit:
        assert not low.report().collectives


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(kernels_in_shard_maps())
def test_random_kernels_in_shard_maps(case):
    _check_kernel_in_shard_map(case)


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(kernels_in_shard_maps())
def test_random_kernels_in_shard_maps_slow(case):
    _check_kernel_in_shard_map(case)
