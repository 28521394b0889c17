"""dot_general under any combination of operand and result shardings, vs one device."""
import string
from collections import Counter

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gspmd
from strategies import dims_mappings, meshes

SIZES = st.sampled_from([1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 16])


@st.composite
def einsum_cases(draw):
    nb, nc = draw(st.integers(0, 3)), draw(st.integers(0, 2))
    nl, nr = draw(st.integers(0, 2)), draw(st.integers(0, 2))
    letters = iter(string.ascii_lowercase)
    batch = [next(letters) for _ in range(nb)]
    contract = [next(letters) for _ in range(nc)]
    lfree = [next(letters) for _ in range(nl)]
    rfree = [next(letters) for _ in range(nr)]
    lhs = draw(st.permutations(batch + contract + lfree))
    rhs = draw(st.permutations(batch + contract + rfree))
    out = draw(st.permutations(batch + lfree + rfree))
    sizes = {c: draw(SIZES) for c in batch + contract + lfree + rfree}
    spec = f"{''.join(lhs)},{''.join(rhs)}->{''.join(out)}"
    mesh = draw(meshes())
    maps = [draw(dims_mappings(mesh, len(t))) for t in (lhs, rhs, out)]
    return spec, sizes, mesh, maps


def run_case(spec, sizes, mesh, maps, seed=0):
    lhs_s, rest = spec.split(",")
    rhs_s, out_s = rest.split("->")
    rng = np.random.RandomState(seed)
    lhs = rng.standard_normal([sizes[c] for c in lhs_s]).astype(np.float32)
    rhs = rng.standard_normal([sizes[c] for c in rhs_s]).astype(np.float32)

    def f(a, b):
        a = gspmd.mesh_split(a, mesh, maps[0])
        b = gspmd.mesh_split(b, mesh, maps[1])
        return gspmd.mesh_split(jnp.einsum(spec, a, b), mesh, maps[2])

    partitioned = gspmd.jit(f, mesh=mesh)
    got = partitioned(lhs, rhs)
    want = np.einsum(spec, lhs.astype(np.float64), rhs.astype(np.float64))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    return partitioned.lower(lhs, rhs)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(einsum_cases())
def test_random_einsum_shardings(case):
    run_case(*case)


@pytest.mark.slow
@settings(max_examples=5000, deadline=None, suppress_health_check=list(HealthCheck))
@given(einsum_cases())
def test_random_einsum_shardings_slow(case):
    run_case(*case)


MESH = gspmd.Mesh(np.arange(8).reshape(2, 4), ("x", "y"))


def collectives_of(spec, lhs_map, rhs_map, out_map, shapes=((8, 16), (16, 12))):
    sizes = {}
    lhs_s, rest = spec.split(",")
    rhs_s, _ = rest.split("->")
    for letters, shape in zip((lhs_s, rhs_s), shapes):
        sizes.update(zip(letters, shape))
    low = run_case(spec, sizes, MESH, [lhs_map, rhs_map, out_map])
    return [(c.kind, c.bytes) for c in low.report().collectives]


def test_contracting_split_gives_one_all_reduce():
    assert collectives_of("bk,kn->bn", [-1, "y"], ["y", -1], [-1, -1]) == [("all-reduce", 8 * 12 * 4)]


def test_contracting_split_with_split_result_gives_one_reduce_scatter():
    assert collectives_of("bk,kn->bn", [-1, "y"], ["y", -1], [-1, "y"]) == [("reduce-scatter", 8 * 3 * 4)]


def test_batch_split_needs_no_communication():
    assert collectives_of("bmk,bkn->bmn", ["x", -1, "y"], ["x", "y", -1], ["x", -1, -1],
                          shapes=((4, 6, 8), (4, 8, 5))) == [("all-reduce", 2 * 6 * 5 * 4)]
    assert collectives_of("bmk,bkn->bmn", [("x", "y"), -1, -1], [("x", "y"), -1, -1], [("x", "y"), -1, -1],
                          shapes=((8, 6, 8), (8, 8, 5))) == []


def test_moe_einsum_with_expert_split():
    # MoE: experts on x, batch on y, model dim unsplit -> purely local.
    assert collectives_of("ebd,edf->ebf", ["x", "y", -1], ["x", -1, -1], ["x", "y", -1],
                          shapes=((4, 8, 6), (4, 6, 10))) == []


def test_conflicting_operands_reshard_the_cheaper_one():
    # lhs is small (2 x 16), rhs large (16 x 64): move lhs, never gather rhs.
    out = collectives_of("bk,kn->bn", ["x", "y"], [-1, "x"], [-1, "x"], shapes=((2, 16), (16, 64)))
    assert all(nbytes <= 2 * 16 * 4 for _, nbytes in out), out


def _projections(n: int, model: int = 64, heads: int = 4, backend: str = "sim"):
    """n projections of one activation whose model dim is split over "x", by weights split
    (model over "y", heads over "x") as keras-hub's Llama lays them out, equal to one
    device's: the collectives that run."""
    rng = np.random.RandomState(0)
    act = rng.standard_normal((8, 16, model)).astype(np.float32)
    weights = [rng.standard_normal((model, heads, 16)).astype(np.float32) for _ in range(n)]

    def f(a, *ws):
        a = gspmd.mesh_split(a, MESH, [-1, -1, "x"])
        return [gspmd.mesh_split(jnp.einsum("bsm,mhd->bshd", a, gspmd.mesh_split(w, MESH, ["y", "x", -1])),
                                 MESH, [-1, -1, "x", -1]) for w in ws]

    partitioned = gspmd.jit(f, mesh=MESH, backend=backend)
    for got, w in zip(partitioned(act, *weights), weights):
        np.testing.assert_allclose(got, np.einsum("bsm,mhd->bshd", act, w), rtol=1e-4, atol=1e-4)
    return Counter(c.kind for c in partitioned.lower(act, *weights).report().collectives)


def test_projections_of_one_activation_share_its_reshard():
    # Alone, a projection moves its weight (gathered over "y", moved to the model dim over
    # "x") rather than the larger activation. Q, K and V of one activation share its
    # reshard (made once: common-subexpression elimination), so between them they move it
    # once, over "x" to the weights' model split, and no weight moves: XLA's choice.
    assert _projections(1)["all-to-all"] == 1
    kinds = _projections(3)
    assert kinds == Counter({"all-reduce": 3, "all-gather": 1}), kinds


@pytest.mark.parametrize("backend", ["sim", "jax"])
def test_projections_sharing_a_reshard_over_dims_that_do_not_divide(backend):
    # A model dim of 62 over "y" (4) and "x" (2), 3 heads over "x": padded shards, and
    # still the activation moved once for all three.
    kinds = _projections(3, model=62, heads=3, backend=backend)
    assert kinds == Counter({"all-reduce": 3, "all-gather": 1}), kinds
