"""Validation of meshes and mesh_split annotations, and mesh_split under JAX transforms.

Every bad annotation must raise gspmd.ShardingError whose message names the value's
shape, the mesh, and says what to do; it must do so from Sharding.from_mesh and from
gspmd.mesh_split both on concrete arrays and while tracing.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gspmd
from gspmd import UNSPECIFIED, Mesh, Sharding, ShardingError

SHAPE = (4, 6)

MESHES = {
    "iota": Mesh(np.arange(8).reshape(2, 4), ("x", "y")),
    "permuted": Mesh(np.array([[0, 2, 4, 6], [1, 3, 5, 7]]), ("data", "model")),
}


def _from_mesh(mesh, dims_mapping):
    return Sharding.from_mesh(mesh, dims_mapping, SHAPE)


def _eager(mesh, dims_mapping):
    return gspmd.mesh_split(jnp.zeros(SHAPE, jnp.float32), mesh, dims_mapping)


def _traced(mesh, dims_mapping):
    return jax.make_jaxpr(lambda v: gspmd.mesh_split(v, mesh, dims_mapping))(
        jnp.zeros(SHAPE, jnp.float32))


def _jitted(mesh, dims_mapping):
    return jax.jit(lambda v: gspmd.mesh_split(v, mesh, dims_mapping))(np.zeros(SHAPE, np.float32))


CALLERS = {"from_mesh": _from_mesh, "eager": _eager, "make_jaxpr": _traced, "jit": _jitted}


def _bad_mappings(a, b):
    """name -> (dims_mapping, substrings the message must hold besides shape and mesh)."""
    twice = [repr(a), "more than once", "at most one"]
    return {
        "name_twice": ([a, a], twice),
        "name_and_int_same_dim": ([a, 0], twice),
        "int_twice": ([0, 0], twice),
        "numpy_int_and_name": ([np.int64(0), a], twice),
        "in_tuple_and_single": ([(a, b), a], twice),
        "twice_inside_one_tuple": ([(a, a), -1], twice),
        "too_short": ([a], ["has 1 entries", "rank 2", "one entry per tensor dim"]),
        "too_long": ([a, -1, -1], ["has 3 entries", "rank 2", "one entry per tensor dim"]),
        "empty_for_rank2": ([], ["has 0 entries", "rank 2", "one entry per tensor dim"]),
        "unknown_axis": (["z", -1], ["'z'", repr((a, b))]),
        "unknown_axis_in_tuple": ([-1, (a, "z")], ["'z'", repr((a, b))]),
        "dim_out_of_range": ([2, -1], ["2", "out of range", "use 0..1", repr((a, b))]),
        "dim_out_of_range_in_tuple": ([-1, (b, 5)], ["5", "out of range", "use 0..1"]),
        "negative_dim": ([-2, -1], ["-2", "out of range", "use 0..1"]),
    }


BAD = [(mesh_name, case, caller)
       for mesh_name in MESHES
       for case in _bad_mappings("x", "y")
       for caller in CALLERS]


@pytest.mark.parametrize("mesh_name,case,caller", BAD)
def test_bad_dims_mapping_raises_helpful_error(mesh_name, case, caller):
    mesh = MESHES[mesh_name]
    a, b = mesh.axis_names
    dims_mapping, needles = _bad_mappings(a, b)[case]
    with pytest.raises(ShardingError) as info:
        CALLERS[caller](mesh, dims_mapping)
    msg = str(info.value)
    assert str(SHAPE) in msg, msg              # the value's shape
    assert repr(mesh) in msg, msg              # the mesh (with its device order when permuted)
    for needle in needles:                     # what is wrong and what to do
        assert needle in msg, (needle, msg)
    if mesh_name == "permuted":
        assert "devices=[0, 2, 4, 6, 1, 3, 5, 7]" in msg


def test_sharding_error_is_a_value_error():
    assert issubclass(ShardingError, ValueError)
    assert gspmd.ShardingError is ShardingError


# ---------------------------------------------------------------------------------------
# randomized: any reuse of a mesh dim is caught, wherever it appears
# ---------------------------------------------------------------------------------------
@st.composite
def reused_mesh_dim(draw):
    ndim = draw(st.integers(1, 3))
    mesh_shape = draw(st.lists(st.sampled_from([1, 2, 3]), min_size=ndim, max_size=ndim))
    n = math.prod(mesh_shape)
    order = draw(st.permutations(range(n)))
    mesh = Mesh(np.array(order).reshape(mesh_shape), ("a", "b", "c")[:ndim])
    rank = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=rank, max_size=rank)))
    slots = [[] for _ in range(rank)]
    for m in draw(st.permutations(range(ndim))):
        t = draw(st.integers(-1, rank - 1))
        if t >= 0:
            slots[t].append(m)
    # Use one mesh dim a second (or third) time, anywhere (maybe inside the same tuple).
    reused = draw(st.integers(0, ndim - 1))
    while sum(s.count(reused) for s in slots) < 2:
        target = draw(st.integers(0, rank - 1))
        slots[target].insert(draw(st.integers(0, len(slots[target]))), reused)

    def spell(m):
        return draw(st.sampled_from([m, mesh.axis_names[m]]))

    mapping = [tuple(spell(m) for m in s) if len(s) != 1 else spell(s[0]) if s else -1
               for s in slots]
    return mesh, mapping, shape, mesh.axis_names[reused]


@settings(max_examples=150, deadline=None)
@given(reused_mesh_dim())
def test_any_reused_mesh_dim_is_rejected(case):
    mesh, mapping, shape, name = case
    with pytest.raises(ShardingError) as info:
        Sharding.from_mesh(mesh, mapping, shape)
    msg = str(info.value)
    assert str(shape) in msg and repr(mesh) in msg and repr(name) in msg, msg


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet="abcdefgxyz_", min_size=1, max_size=4), st.integers(1, 3))
def test_unknown_axis_name_is_rejected(name, rank):
    mesh = Mesh(np.arange(4).reshape(2, 2), ("x", "y"))
    shape = (5,) * rank
    mapping = [-1] * rank
    mapping[rank - 1] = name
    if name in mesh.axis_names:
        assert Sharding.from_mesh(mesh, mapping, shape).tiles[rank - 1] == 2
        return
    with pytest.raises(ShardingError) as info:
        Sharding.from_mesh(mesh, mapping, shape)
    msg = str(info.value)
    assert str(shape) in msg and repr(name) in msg and "('x', 'y')" in msg, msg


# ---------------------------------------------------------------------------------------
# Mesh construction
# ---------------------------------------------------------------------------------------
BAD_MESHES = {
    "duplicate_ids": (lambda: Mesh(np.array([[0, 1], [1, 3]]), ("x", "y")),
                      ["[0, 1, 1, 3]", "duplicates: [1]", "missing: [2]", "np.arange(4)"]),
    "missing_ids": (lambda: Mesh(np.array([1, 2, 3, 4]), ("x",)),
                    ["[1, 2, 3, 4]", "0..3", "missing: [0]", "np.arange(4)"]),
    "too_few_axis_names": (lambda: Mesh(np.arange(8).reshape(2, 4), ("x",)),
                           ["(2, 4)", "2 axis names", "('x',)", "one name per mesh dimension"]),
    "too_many_axis_names": (lambda: Mesh(np.arange(8), ("x", "y")),
                            ["(8,)", "1 axis names", "('x', 'y')", "one name per mesh dimension"]),
    "repeated_axis_names": (lambda: Mesh(np.arange(4).reshape(2, 2), ("x", "x")),
                            ["('x', 'x')", "repeat", "unique"]),
    "float_devices": (lambda: Mesh(np.arange(4.0), ("x",)), ["integer", "float64"]),
}


@pytest.mark.parametrize("case", list(BAD_MESHES))
def test_bad_mesh_raises_helpful_error(case):
    make, needles = BAD_MESHES[case]
    with pytest.raises(ShardingError) as info:
        make()
    msg = str(info.value)
    for needle in needles:
        assert needle in msg, (needle, msg)


def test_mesh_accepts_any_device_order_and_reports_it():
    mesh = Mesh([[3, 1], [0, 2]], ["x", "y"])
    assert mesh.shape == (2, 2) and mesh.axis_names == ("x", "y") and mesh.size == 4
    assert mesh.axis_index("y") == 1 and mesh.axis_index(0) == 0
    assert "devices=[3, 1, 0, 2]" in repr(mesh)
    assert repr(Mesh(np.arange(4).reshape(2, 2), ("x", "y"))) == "Mesh(x=2, y=2)"
    assert Mesh(np.arange(4).reshape(2, 2), ("x", "y")) == Mesh([[0, 1], [2, 3]], ("x", "y"))
    assert Mesh(np.arange(4).reshape(2, 2), ("x", "y")) != mesh


NOT_MESHES = {
    "ndarray": lambda: np.arange(8).reshape(2, 4),
    "list": lambda: [[0, 1, 2, 3], [4, 5, 6, 7]],
    "none": lambda: None,
    "named_sharding_as_mesh": lambda: jax.sharding.PartitionSpec("x"),
}


@pytest.mark.parametrize("kind", list(NOT_MESHES))
def test_mesh_split_rejects_non_mesh(kind):
    not_mesh = NOT_MESHES[kind]()
    for call in (_eager, _traced):
        with pytest.raises(ShardingError) as info:
            call(not_mesh, ["x", -1])
        assert "gspmd.Mesh" in str(info.value)


@pytest.mark.parametrize("kind", list(NOT_MESHES))
def test_mesh_split_non_mesh_message_names_shape(kind):
    with pytest.raises(ShardingError) as info:
        _eager(NOT_MESHES[kind](), ["x", -1])
    assert str(SHAPE) in str(info.value), str(info.value)


@pytest.mark.parametrize("kind", ["ndarray", "list"])
def test_from_mesh_rejects_non_mesh(kind):
    with pytest.raises(ShardingError) as info:
        Sharding.from_mesh(NOT_MESHES[kind](), ["x", -1], SHAPE)
    msg = str(info.value)
    assert str(SHAPE) in msg and "gspmd.Mesh" in msg, msg


# ---------------------------------------------------------------------------------------
# mesh_split under plain JAX
# ---------------------------------------------------------------------------------------
MESH = MESHES["iota"]


def _annotations(jaxpr):
    return [e for e in jaxpr.eqns if e.primitive.name == "mesh_split"]


def test_mesh_split_is_identity_eager_and_jit():
    x = jnp.arange(24.0, dtype=jnp.float32).reshape(SHAPE)
    for mapping in (["x", "y"], [("y", "x"), -1], [None, UNSPECIFIED], [-1, -1]):
        np.testing.assert_array_equal(gspmd.mesh_split(x, MESH, mapping), x)
        out = jax.jit(lambda v: gspmd.mesh_split(v, MESH, mapping) * 2.0)(x)
        np.testing.assert_array_equal(out, x * 2.0)
    ints = jnp.arange(6, dtype=jnp.int32)
    np.testing.assert_array_equal(jax.jit(lambda v: gspmd.mesh_split(v, MESH, ["y"]))(ints), ints)


def test_mesh_split_records_sharding_and_unspecified():
    x = jnp.zeros((4, 6, 8), jnp.float32)
    jaxpr = jax.make_jaxpr(lambda v: gspmd.mesh_split(v, MESH, ["x", UNSPECIFIED, "y"]))(x).jaxpr
    (eqn,) = _annotations(jaxpr)
    assert eqn.params["sharding"] == Sharding.from_mesh(MESH, ["x", -1, "y"], x.shape)
    assert eqn.params["unspecified"] == (1,)
    assert eqn.outvars[0].aval.shape == x.shape


def test_grad_puts_same_annotation_on_cotangent():
    x = jnp.arange(24.0, dtype=jnp.float32).reshape(SHAPE)

    def f(v):
        return jnp.sum(jnp.sin(gspmd.mesh_split(v, MESH, ["x", -1])))

    np.testing.assert_allclose(jax.grad(f)(x), jnp.cos(x), rtol=1e-6)
    want = Sharding.from_mesh(MESH, ["x", -1], SHAPE)
    jaxpr = jax.make_jaxpr(jax.grad(f))(x).jaxpr
    eqns = _annotations(jaxpr)
    forward = [e for e in eqns if e.invars[0] is jaxpr.invars[0]]
    backward = [e for e in eqns if e.invars[0] is not jaxpr.invars[0]]
    assert len(forward) == 1 and len(backward) == 1, jaxpr
    assert forward[0].params["sharding"] == want
    assert backward[0].params["sharding"] == want
    assert backward[0].params["unspecified"] == ()
    # The gradient is the annotated cotangent.
    assert backward[0].outvars[0] is jaxpr.outvars[0]


def test_grad_keeps_each_annotation_and_unspecified_dims():
    def f(a, w):
        a = gspmd.mesh_split(a, MESH, ["x", UNSPECIFIED])
        w = gspmd.mesh_split(w, MESH, [UNSPECIFIED, "y"])
        return jnp.sum(jnp.tanh(a @ w))

    a = jnp.ones((4, 6), jnp.float32)
    w = jnp.ones((6, 8), jnp.float32) * 0.1
    jaxpr = jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(a, w).jaxpr
    by_out = {id(e.outvars[0]): e for e in _annotations(jaxpr)}
    ga, gw = (by_out[id(v)] for v in jaxpr.outvars)
    assert ga.params["sharding"] == Sharding.from_mesh(MESH, ["x", -1], (4, 6))
    assert ga.params["unspecified"] == (1,)
    assert gw.params["sharding"] == Sharding.from_mesh(MESH, [-1, "y"], (6, 8))
    assert gw.params["unspecified"] == (0,)
    ref = jax.grad(lambda a, w: jnp.sum(jnp.tanh(a @ w)), argnums=(0, 1))(a, w)
    for got, exp in zip(jax.jit(jax.grad(f, argnums=(0, 1)))(a, w), ref):
        np.testing.assert_allclose(got, exp, rtol=1e-6)


def test_jvp_annotates_tangent():
    x = jnp.ones(SHAPE, jnp.float32)

    def f(v):
        return gspmd.mesh_split(v, MESH, [-1, "y"])

    primal, tangent = jax.jvp(f, (x,), (x * 3.0,))
    np.testing.assert_array_equal(primal, x)
    np.testing.assert_array_equal(tangent, x * 3.0)
    jaxpr = jax.make_jaxpr(lambda p, t: jax.jvp(f, (p,), (t,)))(x, x).jaxpr
    eqns = _annotations(jaxpr)
    assert {id(e.invars[0]) for e in eqns} == {id(v) for v in jaxpr.invars}
    assert all(e.params["sharding"] == Sharding.from_mesh(MESH, [-1, "y"], SHAPE) for e in eqns)


def test_vmap_adds_unspecified_dim():
    xs = jnp.arange(72.0, dtype=jnp.float32).reshape(3, 4, 6)

    def f(v):
        return gspmd.mesh_split(v, MESH, ["x", -1])

    np.testing.assert_array_equal(jax.vmap(f)(xs), xs)
    jaxpr = jax.make_jaxpr(jax.vmap(f))(xs).jaxpr
    (eqn,) = _annotations(jaxpr)
    assert eqn.params["unspecified"] == (0,)
    assert eqn.params["sharding"] == Sharding.from_mesh(MESH, [-1, "x", -1], xs.shape)


def test_vmap_other_axis_shifts_unspecified_dims():
    xs = jnp.zeros((4, 3, 6), jnp.float32)  # batch dim in the middle

    def f(v):
        return gspmd.mesh_split(v, MESH, ["x", UNSPECIFIED])

    jaxpr = jax.make_jaxpr(jax.vmap(f, in_axes=1))(xs).jaxpr
    (eqn,) = _annotations(jaxpr)
    assert eqn.params["unspecified"] == (1, 2)
    assert eqn.params["sharding"] == Sharding.from_mesh(MESH, ["x", -1, -1], xs.shape)
    np.testing.assert_array_equal(jax.vmap(f, in_axes=1)(xs), jnp.swapaxes(xs, 0, 1))


def test_vmap_of_unbatched_operand_keeps_annotation():
    x = jnp.ones(SHAPE, jnp.float32)

    def f(scale):
        return gspmd.mesh_split(x, MESH, ["x", -1]) * scale

    out = jax.vmap(f)(jnp.arange(3.0))
    np.testing.assert_array_equal(out, jnp.arange(3.0)[:, None, None] * x)
    jaxpr = jax.make_jaxpr(jax.vmap(f))(jnp.arange(3.0)).jaxpr
    (eqn,) = _annotations(jaxpr)
    assert eqn.params["unspecified"] == ()
