"""All-reduce reassociation: a sum of values each all-reduced over the same groups is
all-reduced once, after the sum; all-reduces read elsewhere or over other groups, and
reduce-scatters, stay as they are."""
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings, strategies as st

import gspmd
from util import check, rand

MESH = gspmd.Mesh(np.arange(8).reshape(2, 4), ("x", "y"))


def _split_contracting(x, *ws):
    """x's contracting dim is split over "y", as each w's: every product is partial over "y"."""
    x = gspmd.mesh_split(x, MESH, ["x", "y"])
    return [x @ gspmd.mesh_split(w, MESH, ["y", -1]) for w in ws]


def _reductions(low, kind="all-reduce"):
    return [c for c in low.report().collectives if c.kind == kind]


def test_three_partial_products_summed_are_all_reduced_once():
    def f(x, a, b, c):
        pa, pb, pc = _split_contracting(x, a, b, c)
        return pa + pb - pc

    rng = np.random.RandomState(0)
    x, a, b, c = rand(rng, 6, 8), rand(rng, 8, 5), rand(rng, 8, 5), rand(rng, 8, 5)
    low = check(f, x, a, b, c, mesh=MESH)
    (reduction,) = _reductions(low)
    assert reduction.bytes == 3 * 5 * 4   # one [6/2, 5] float32 result


def test_a_reduction_also_read_elsewhere_is_kept():
    def f(x, a, b):
        pa, pb = _split_contracting(x, a, b)
        return pa + pb, jnp.tanh(pa)

    rng = np.random.RandomState(1)
    low = check(f, rand(rng, 6, 8), rand(rng, 8, 5), rand(rng, 8, 5), mesh=MESH)
    assert len(_reductions(low)) == 2


def test_reductions_over_different_groups_are_not_merged():
    def f(x, a, y, b):
        (pa,) = _split_contracting(x, a)
        y = gspmd.mesh_split(y, MESH, ["y", "x"])
        pb = y @ gspmd.mesh_split(b, MESH, ["x", -1])   # partial over "x"
        return pa + gspmd.mesh_split(pb, MESH, ["x", -1])

    rng = np.random.RandomState(2)
    low = check(f, rand(rng, 8, 8), rand(rng, 8, 4), rand(rng, 8, 6), rand(rng, 6, 4), mesh=MESH)
    # (pb's partial sums may be reduce-scattered, then gathered, where that is cheaper.)
    reductions = _reductions(low) + _reductions(low, "reduce-scatter")
    assert len({tuple(map(tuple, np.asarray(c.groups).tolist())) for c in reductions}) == 2


def test_reduce_scatters_are_not_merged():
    """Their partial sums are larger than their results by the group size: held for one
    sum, they would raise the peak."""
    def f(x, a, b):
        pa, pb = _split_contracting(x, a, b)
        return gspmd.mesh_split(pa + pb, MESH, ["x", "y"])

    rng = np.random.RandomState(3)
    low = check(f, rand(rng, 6, 8), rand(rng, 8, 8), rand(rng, 8, 8), mesh=MESH)
    assert len(_reductions(low, "reduce-scatter")) == 2 and not _reductions(low)


@settings(max_examples=15, deadline=None)
@given(terms=st.integers(2, 4), rows=st.integers(1, 9), signs=st.lists(st.booleans(), min_size=4, max_size=4))
def test_sums_of_partial_products_equal_one_device(terms, rows, signs):
    def f(x, *ws):
        products = _split_contracting(x, *ws)
        total = products[0]
        for p, plus in zip(products[1:], signs):
            total = total + p if plus else total - p
        return total

    rng = np.random.RandomState(terms * 10 + rows)
    ws = [rand(rng, 7, 3) for _ in range(terms)]     # 7 does not divide over "y"
    low = check(f, rand(rng, rows, 7), *ws, mesh=MESH, backends=("sim",))
    assert len(_reductions(low)) == 1
