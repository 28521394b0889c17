"""Reshape along split dims whose shards do not line up (paper Figure 5): uneven sizes,
or runs that both merge and split dims. Elements are realigned by halo exchange between
neighbours instead of gathering; differential against one device."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import meshes
from util import check, rand

import gspmd

SMALL_MESHES = [(2,), (4,), (8,), (3,), (2, 2), (2, 4), (4, 2), (3, 2), (2, 2, 2)]   # jax has 8 devices
SETTINGS = dict(deadline=None, suppress_health_check=list(HealthCheck))


def _chunks(draw, factors):
    """The factors cut into consecutive runs: one dim per run."""
    cuts = [i for i in range(1, len(factors)) if draw(st.booleans())]
    bounds = [0] + cuts + [len(factors)]
    return [int(np.prod(factors[a:b])) for a, b in zip(bounds, bounds[1:])]


@st.composite
def reshape_cases(draw):
    """Runs of equal element count, each a product of small factors chunked into dims two
    ways; mesh axes split some runs' major dims on both sides (the aligned case) or
    anything (the random case)."""
    mesh = draw(meshes(SMALL_MESHES))
    src, dst, ins, outs = [], [], [], []
    for _ in range(draw(st.integers(1, 2))):
        factors = draw(st.lists(st.integers(2, 7), min_size=1, max_size=3))
        a, b = _chunks(draw, factors), _chunks(draw, factors)
        ins += [None] * len(a)
        outs += [None] * len(b)
        ins[len(src)], outs[len(dst)] = "major", "major"
        src += a
        dst += b
    axes = list(mesh.axis_names)
    majors = [(i, j) for i, j in zip([k for k, m in enumerate(ins) if m], [k for k, m in enumerate(outs) if m])]
    in_map, out_map = [-1] * len(src), [-1] * len(dst)
    for axis in draw(st.permutations(axes)):
        choice = draw(st.integers(-1, len(majors) - 1))
        if choice >= 0:
            i, j = majors[choice]
            if in_map[i] == -1:
                in_map[i], out_map[j] = axis, axis
    aligned = draw(st.booleans())
    if not aligned:
        in_map = [draw(st.sampled_from([-1] + axes)) for _ in src]
        in_map = [m if m == -1 or in_map.index(m) == i else -1 for i, m in enumerate(in_map)]
        out_map = None
    return mesh, src, dst, in_map, out_map


@settings(max_examples=25, **SETTINGS)
@given(reshape_cases(), st.integers(0, 2**31 - 1))
def test_random_uneven_reshape(case, seed):
    mesh, src, dst, in_map, out_map = case
    x = rand(np.random.RandomState(seed), *src)

    def reshape(x):
        y = gspmd.mesh_split(x, mesh, in_map).reshape(dst)
        return y if out_map is None else gspmd.mesh_split(y, mesh, out_map)
    lowered = check(reshape, x, mesh=mesh)
    if out_map is not None:
        assert "all-gather" not in lowered.report().counts(), str(lowered.report())


def test_figure_5():
    """[3, 2] split 2 ways -> [6] split 2 ways: the element in the second shard's padding
    region belongs to the first after the reshape; one element moves."""
    mesh = gspmd.Mesh(np.arange(2), ("a",))

    def f(x):
        return gspmd.mesh_split(gspmd.mesh_split(x, mesh, ["a", -1]).reshape(6), mesh, ["a"])
    report = check(f, rand(np.random.RandomState(0), 3, 2), mesh=mesh).report()
    assert [(c.kind, c.bytes) for c in report.collectives] == [("collective-permute", 4)], str(report)


def test_uneven_split_propagates_and_realigns():
    """[15] split 4 ways -> [5, 3]: propagation keeps dim 0 split; partitions trade halos."""
    mesh = gspmd.Mesh(np.arange(4), ("a",))
    lowered = check(lambda x: gspmd.mesh_split(x, mesh, ["a"]).reshape(5, 3), rand(np.random.RandomState(1), 15),
                    mesh=mesh)
    assert set(lowered.report().counts()) == {"collective-permute"}, str(lowered.report())


def test_split_onto_a_shorter_dim_when_asked():
    """[15] split 4 ways -> [3, 5] with dim 0 split 4 ways (one partition empty): not
    proposed by propagation, but realigned when annotated."""
    mesh = gspmd.Mesh(np.arange(4), ("a",))

    def f(x):
        return gspmd.mesh_split(gspmd.mesh_split(x, mesh, ["a"]).reshape(3, 5), mesh, ["a", -1])
    report = check(f, rand(np.random.RandomState(2), 15), mesh=mesh).report()
    assert report.counts() == {"collective-permute": 1}, str(report)


@pytest.mark.slow
def test_random_uneven_reshape_many():
    run = given(reshape_cases(), st.integers(0, 2**31 - 1))(test_random_uneven_reshape.hypothesis.inner_test)
    settings(max_examples=300, **SETTINGS)(run)()
