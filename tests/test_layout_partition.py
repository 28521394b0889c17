"""Reduce, reshape, transpose and broadcast under random operand/result shardings,
with sizes that do not divide the mesh: equal to one device (sim backend)."""
import itertools

import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gspmd
from strategies import dims_mappings, meshes
from util import check

SIZES = st.sampled_from([1, 2, 3, 4, 5, 6, 7, 8, 12])
REDUCERS = {"sum": jnp.sum, "max": jnp.max, "min": jnp.min, "prod": jnp.prod}


def run(fn, x, mesh, in_map, out_map, expected):
    def f(a):
        return gspmd.mesh_split(fn(gspmd.mesh_split(a, mesh, in_map)), mesh, out_map)
    got = gspmd.jit(f, mesh=mesh)(x)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


@st.composite
def reduce_cases(draw):
    shape = tuple(draw(SIZES) for _ in range(draw(st.integers(1, 3))))
    dims = tuple(sorted(draw(st.sets(st.integers(0, len(shape) - 1), min_size=1))))
    mesh = draw(meshes())
    out_rank = len(shape) - len(dims)
    return shape, dims, draw(st.sampled_from(sorted(REDUCERS))), mesh, draw(dims_mappings(mesh, len(shape))), \
        draw(dims_mappings(mesh, out_rank))


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(reduce_cases())
def test_random_reductions(case):
    shape, dims, name, mesh, in_map, out_map = case
    x = (np.random.RandomState(0).standard_normal(shape) * 0.5 + 1).astype(np.float32)
    fn = REDUCERS[name]
    run(lambda a: fn(a, axis=dims), x, mesh, in_map, out_map, fn(x.astype(np.float64), axis=dims))


@st.composite
def reshape_cases(draw):
    """Split one dim into two factors, or merge two adjacent dims."""
    factors = [draw(st.sampled_from([1, 2, 3, 4])) for _ in range(draw(st.integers(2, 4)))]
    split_at = draw(st.integers(1, len(factors) - 1))
    src = tuple(factors[:split_at - 1]) + (factors[split_at - 1] * factors[split_at],) + tuple(factors[split_at + 1:])
    dst = tuple(factors)
    if draw(st.booleans()):
        src, dst = dst, src
    mesh = draw(meshes())
    return src, dst, mesh, draw(dims_mappings(mesh, len(src))), draw(dims_mappings(mesh, len(dst)))


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(reshape_cases())
def test_random_reshapes(case):
    src, dst, mesh, in_map, out_map = case
    x = np.arange(int(np.prod(src)), dtype=np.float32).reshape(src)
    run(lambda a: a.reshape(dst), x, mesh, in_map, out_map, x.reshape(dst))


@st.composite
def transpose_broadcast_cases(draw):
    shape = tuple(draw(SIZES) for _ in range(draw(st.integers(1, 3))))
    perm = tuple(draw(st.permutations(range(len(shape)))))
    new = draw(SIZES)
    mesh = draw(meshes())
    return shape, perm, new, mesh, draw(dims_mappings(mesh, len(shape))), draw(dims_mappings(mesh, len(shape) + 1))


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(transpose_broadcast_cases())
def test_random_transpose_then_broadcast(case):
    shape, perm, new, mesh, in_map, out_map = case
    x = np.random.RandomState(1).standard_normal(shape).astype(np.float32)
    expected = np.broadcast_to(np.transpose(x, perm)[None], (new,) + tuple(shape[p] for p in perm))
    run(lambda a: jnp.broadcast_to(jnp.transpose(a, perm)[None], expected.shape) * 2, x, mesh, in_map, out_map,
        expected * 2)


def _held(s: gspmd.Sharding, shape) -> list:
    """Per device, the row-major indices of the elements of its shard (even splits)."""
    flat, n = np.arange(int(np.prod(shape))).reshape(shape), s.shard_shape(shape)
    return [set(flat[tuple(slice(c * k, (c + 1) * k) for c, k in zip(coords, n))].ravel()) for coords in s.coords()]


def test_reshaped_layout_keeps_every_devices_elements_and_misses_no_tiling():
    from gspmd.ops.shape import reshaped_layout
    rng = np.random.RandomState(0)
    for _ in range(300):
        dims = [int(d) for d in rng.choice([1, 2, 3, 4, 6, 8], rng.randint(2, 5))]
        src, dst = [tuple(int(np.prod(g)) for g in np.split(dims, sorted(set(rng.randint(1, len(dims), 2)))))
                    for _ in range(2)]
        tiles, left = [], 8
        for d in src:
            tiles.append(int(rng.choice([t for t in (1, 2, 4, 8) if d % t == 0 and left % t == 0])))
            left //= tiles[-1]
        s = gspmd.Sharding(rng.permutation(8).reshape(tuple(tiles) + (left,)))
        got, held = reshaped_layout(s, src, dst), _held(s, src)
        if got is not None:
            assert _held(got, dst) == held, (src, dst, s, got)
            continue
        for candidate in itertools.product(*[[t for t in (1, 2, 4, 8) if d % t == 0] for d in dst]):
            if np.prod(candidate) == np.prod(tiles):    # the same tiles, in dst's dims: none holds the same
                assert _held(gspmd.Sharding(s.tile_assignment.reshape(candidate + (left,))), dst) != held


def test_reshape_spreads_and_merges_a_split_without_communication():
    """[16] split 8 ways is [2, 8] split (2, 4): each device's rows stay where they are,
    both ways, also when the other side is annotated."""
    mesh = gspmd.Mesh(np.arange(8).reshape(2, 4), ("x", "y"))

    def f(a):
        a = gspmd.mesh_split(a, mesh, [("x", "y"), -1])
        b = gspmd.mesh_split(jnp.tanh(a.reshape(2, 8, 5)), mesh, ["x", "y", -1])
        return (b * 2).reshape(16, 5)

    x = np.random.RandomState(2).standard_normal((16, 5)).astype(np.float32)
    low = check(f, x, mesh=mesh)
    assert low.sharding_of(0) == gspmd.Sharding.from_mesh(mesh, [("x", "y"), -1], (16, 5))
    assert not low.report().collectives


def test_reshape_carries_a_split_through_merge_and_split_without_communication():
    mesh = gspmd.Mesh(np.arange(8).reshape(2, 4), ("x", "y"))

    def f(a):
        a = gspmd.mesh_split(a, mesh, ["x", -1, "y"])
        return a.reshape(8, 3 * 4).reshape(2, 4, 12)

    low = gspmd.jit(f, mesh=mesh).lower(np.zeros((8, 3, 4), np.float32))
    assert low.sharding_of(0) == gspmd.Sharding.from_mesh(mesh, ["x", -1, -1], (2, 4, 12))
    # Merging (3, 4) whose minor dim is split needs the split gathered; nothing else moves.
    assert [c.kind for c in low.report().collectives] == ["all-gather"]
