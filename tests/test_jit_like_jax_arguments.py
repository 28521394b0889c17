"""gspmd.jit takes jax.jit's arguments as jax.jit does, side by side with jax.jit:
in_shardings/out_shardings together with static and donated arguments (in_shardings
covers the positional arguments with the static ones removed), in every form jax.jit
accepts: one sharding for all, a tuple or list per argument, pytree prefixes, None
entries, NamedShardings, PartitionSpecs under jax.set_mesh."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import gspmd
from test_jit_semantics import MESHES, side_by_side
from util import BACKENDS

JMESH = MESHES["4x2"]
ROWS, COLS = NamedSharding(JMESH, P("x")), NamedSharding(JMESH, P(None, "y"))
X = np.arange(48, dtype=np.float32).reshape(12, 4)    # 12 rows: x (4) divides them, x*y (8) does not
Y = np.linspace(-1, 1, 48, dtype=np.float32).reshape(12, 4)


def step(a, b, n, scale=1.0):
    return a * n + b * scale, a.sum(0)


def step_on_dict(params, n):
    return params["w"] * n, params["b"].T


STATIC_AND_SHARDINGS = {   # jit arguments: those of the EasyDeL Trainer's step and each form jax.jit reads
    "static_argnums, a tuple": dict(static_argnums=(2,), in_shardings=(ROWS, COLS)),
    "static_argnums, an int": dict(static_argnums=2, in_shardings=(ROWS, None)),
    "negative static_argnums": dict(static_argnums=-1, in_shardings=(None, COLS)),
    "static_argnames by position": dict(static_argnames="n", in_shardings=(COLS, ROWS)),
    "one sharding for all": dict(static_argnums=2, in_shardings=ROWS),
    "a list": dict(static_argnums=2, in_shardings=[None, COLS]),
    "with out_shardings": dict(static_argnums=2, in_shardings=(ROWS, COLS), out_shardings=(COLS, None)),
    "out_shardings a prefix": dict(static_argnums=2, in_shardings=(ROWS, ROWS), out_shardings=(COLS, ROWS)),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(STATIC_AND_SHARDINGS))
def test_in_shardings_cover_the_non_static_arguments(case, backend):
    side_by_side(step, X, Y, 3, backend=backend, jit_kwargs=STATIC_AND_SHARDINGS[case])


@pytest.mark.parametrize("backend", BACKENDS)
def test_in_shardings_a_pytree_prefix_with_a_static_argument(backend):
    params = {"w": X, "b": Y}
    side_by_side(step_on_dict, params, 2, backend=backend,
                 jit_kwargs=dict(static_argnums=1, in_shardings=({"w": ROWS, "b": COLS},)))
    side_by_side(step_on_dict, params, 2, backend=backend, jit_kwargs=dict(static_argnums=1, in_shardings=(COLS,)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_partition_specs_under_set_mesh_with_a_static_argument(backend):
    with jax.set_mesh(JMESH):
        side_by_side(step, X, Y, 3, backend=backend,
                     jit_kwargs=dict(static_argnums=2, in_shardings=(P("x"), None), out_shardings=(P(None, "y"), P())))


@pytest.mark.parametrize("donate", [dict(donate_argnums=0), dict(donate_argnames="a")])
def test_donated_and_static_arguments_with_in_shardings(donate):
    """The donated argument's buffer is used (deleted, as under jax.jit); the static one keys the cache."""
    jit_kwargs = dict(static_argnums=2, in_shardings=(ROWS, ROWS), **donate)
    theirs = jax.device_put(X, ROWS)
    expected = jax.jit(step, **jit_kwargs)(theirs, Y, 3)
    f = gspmd.jit(step, backend="jax", **jit_kwargs)
    ours = jax.device_put(X, ROWS)
    out = f(ours, Y, 3)
    np.testing.assert_allclose(out[0], expected[0])
    assert ours.is_deleted() and theirs.is_deleted()
    assert out[0].sharding.is_equivalent_to(expected[0].sharding, 2)
    np.testing.assert_allclose(f(jax.device_put(X, ROWS), Y, 5)[0], X * 5 + Y)
    assert len(f._cache) == 2


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("jit_kwargs, call_kwargs", [
    (dict(static_argnums=2, in_shardings=(ROWS, None)), dict(n=3, scale=2.0)),     # a dynamic one by keyword
    (dict(static_argnames="n", in_shardings=(ROWS, COLS)), dict(n=3)),              # a static one by keyword
    (dict(static_argnums=2, in_shardings=(ROWS, COLS)), dict(n=3)),                 # static by number, given by name
    (dict(static_argnames=("n", "scale"), in_shardings=ROWS), dict(n=3, scale=2.0)),
    (dict(static_argnums=2, in_shardings=(None, None)), dict(n=3)),                 # all None is still given
], ids=["dynamic", "static name", "static number by name", "one for all", "all None"])
def test_any_keyword_argument_with_in_shardings_is_refused_as_by_jax(jit_kwargs, call_kwargs, backend):
    """jax.jit refuses every keyword argument, static ones too, once in_shardings is
    given (pjit's _trace_for_jit); in_shardings=None is not given."""
    with pytest.raises(ValueError, match="kwargs when in_shardings"):
        jax.jit(step, **jit_kwargs)(X, Y, **call_kwargs)
    with pytest.raises(gspmd.ShardingError, match="keyword arguments.*in_shardings"):
        gspmd.jit(step, backend=backend, **jit_kwargs)(X, Y, **call_kwargs)
    side_by_side(step, X, Y, backend=backend, jit_kwargs=dict(jit_kwargs, in_shardings=None), **call_kwargs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("jit_kwargs", [
    dict(static_argnums=2, out_shardings=(None, None)),
    dict(static_argnums=2, out_shardings=(None, ROWS)),
    dict(static_argnums=2, out_shardings=ROWS),
    dict(static_argnames="n", in_shardings=[ROWS, None], out_shardings=(COLS, None)),
], ids=["all None", "None and a sharding", "one for all", "a list in, a tuple out"])
def test_out_shardings_with_none_entries_and_prefixes(jit_kwargs, backend):
    side_by_side(step, X, Y, 3, backend=backend, jit_kwargs=jit_kwargs)


@pytest.mark.parametrize("jit_kwargs", [
    dict(static_argnums=2, out_shardings=[ROWS, None]),       # a list for a tuple of results
    dict(static_argnums=2, out_shardings=(ROWS, None, None)),
    dict(static_argnums=2, in_shardings=([ROWS], None)),     # a list for an array
    dict(static_argnums=2, in_shardings=(ROWS,)),
], ids=["out a list", "out too long", "in a nested list", "in too short"])
def test_structures_jax_refuses_are_refused(jit_kwargs):
    with pytest.raises(ValueError):
        jax.jit(step, **jit_kwargs)(X, Y, 3)
    with pytest.raises(gspmd.ShardingError, match="does not match the structure"):
        gspmd.jit(step, **jit_kwargs)(X, Y, 3)


@pytest.mark.parametrize("donate", [dict(donate_argnums=1), dict(donate_argnames="b")])
def test_donation_by_number_or_name_with_static_arguments_and_out_shardings(donate):
    """Donating b (given by position or by keyword without in_shardings): its buffer goes
    to the results under both jits."""
    jit_kwargs = dict(static_argnames="n", out_shardings=(ROWS, None), **donate)
    results = []
    for jit in (jax.jit, lambda f, **k: gspmd.jit(f, backend="jax", **k)):
        b = jax.device_put(Y, ROWS)
        results.append((jit(step, **jit_kwargs)(X, b=b, n=3) if "donate_argnames" in donate
                        else jit(step, **jit_kwargs)(X, b, 3)))
        assert b.is_deleted()
    np.testing.assert_allclose(results[0][0], results[1][0])
    assert results[1][0].sharding.is_equivalent_to(results[0][0].sharding, 2)


def test_a_tuple_longer_than_the_non_static_arguments_is_a_mistake():
    jit_kwargs = dict(static_argnums=2, in_shardings=(ROWS, COLS, None))
    with pytest.raises(ValueError, match="tree prefix of the positional"):
        jax.jit(step, **jit_kwargs)(X, Y, 3)
    with pytest.raises(gspmd.ShardingError, match=r"does not match the structure of the positional arguments \(static"):
        gspmd.jit(step, **jit_kwargs)(X, Y, 3)


def test_static_arguments_inline_in_another_gspmd_jit():
    inner = gspmd.jit(step, static_argnums=2, in_shardings=(ROWS, COLS))
    outer = gspmd.jit(lambda a, b: inner(a, b, 4)[0] + 1, backend="jax")
    np.testing.assert_allclose(outer(X, Y), X * 4 + Y + 1)
    assert jnp.shape(outer(X, Y)) == X.shape
