"""Resharding between any two layouts of a value, and the collective each classic
transition must produce."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gspmd
from gspmd.spmd import cost as cm
from gspmd.spmd import reshard as rs
from gspmd.spmd.context import Why
from gspmd.spmd.reshard_steps import AllToAllStep, ExchangeStep, GatherStep, SliceStep
from strategies import dims_mappings, meshes
from util import BYTES_RECEIVED

MESH = gspmd.Mesh(np.arange(8).reshape(2, 4), ("x", "y"))


def reshard_program(src_mesh, src_map, dst_mesh, dst_map):
    def f(a):
        a = gspmd.mesh_split(a, src_mesh, src_map)
        return gspmd.mesh_split(a * 1.0, dst_mesh, dst_map)
    return f


def lower_and_check(f, x, mesh=MESH):
    """Partitioned on a network where only bytes count (the strategies tested pay off in
    bandwidth; these arrays are small)."""
    partitioned = gspmd.jit(f, mesh=mesh, hardware=BYTES_RECEIVED)
    np.testing.assert_array_equal(partitioned(x), np.asarray(x) * 1.0)
    return partitioned.lower(x)


def kinds(lowered):
    return [c.kind for c in lowered.report().collectives]


X = np.arange(8 * 12 * 4, dtype=np.float32).reshape(8, 12, 4)


def test_move_split_to_other_dim_is_one_all_to_all():
    low = lower_and_check(reshard_program(MESH, ["y", -1, -1], MESH, [-1, "y", -1]), X)
    assert kinds(low) == ["all-to-all"]


@pytest.mark.parametrize("mesh_shape, axes, shape", [
    ((4,), "x", (10, 14)), ((8,), "x", (10, 14)), ((3,), "x", (10, 14)), ((2,), "x", (3, 3)),
    ((2, 4), "x", (5, 7)), ((2, 3), "y", (7, 5)), ((2, 2, 2), ("x", "z"), (13, 10)),
])
def test_uneven_dim_to_dim_move_is_one_all_to_all(mesh_shape, axes, shape):
    """Sizes that do not divide: the source shards are padded to whole pieces, moved by
    one all-to-all and cut back; the sim backend fills the arguments' padding with NaN,
    which the exact comparison would see. A 2-way move priced equal to one
    collective-permute is still the all-to-all (the exchange's bound was below its cost)."""
    names = ("x", "y", "z")[:len(mesh_shape)]
    mesh = gspmd.Mesh(np.arange(int(np.prod(mesh_shape))).reshape(mesh_shape), names)
    x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    partitioned = gspmd.jit(reshard_program(mesh, [axes, -1], mesh, [-1, axes]), mesh=mesh)
    np.testing.assert_array_equal(partitioned(x), x)
    (c,) = partitioned.lower(x).report().collectives
    sizes = dict(zip(names, mesh_shape))
    pieces = int(np.prod([sizes[a] for a in ([axes] if isinstance(axes, str) else axes)]))
    rows, cols = -(-shape[0] // pieces), -(-shape[1] // pieces)
    assert c.kind == "all-to-all" and c.bytes == pieces * rows * cols * 4, c


def test_device_order_change_is_one_collective_permute():
    other = gspmd.Mesh(np.arange(8)[::-1].reshape(2, 4), ("x", "y"))
    low = lower_and_check(reshard_program(MESH, ["x", "y", -1], other, ["x", "y", -1]), X)
    assert kinds(low) == ["collective-permute"]


def test_replicated_to_tiled_is_a_local_slice():
    low = lower_and_check(reshard_program(MESH, [-1, -1, -1], MESH, ["y", "x", -1]), X)
    assert kinds(low) == []


def test_partial_gather_of_a_minor_factor():
    # dim 0 over (x, y) -> over x only: gather among the 4 devices of each x row.
    low = lower_and_check(reshard_program(MESH, [("x", "y"), -1, -1], MESH, ["x", -1, -1]), X)
    (c,) = low.report().collectives
    assert c.kind == "all-gather" and len(c.groups[0]) == 4 and c.bytes == 4 * 12 * 4 * 4


def test_minor_factor_moves_to_another_dim_by_all_to_all():
    low = lower_and_check(reshard_program(MESH, [("x", "y"), -1, -1], MESH, ["x", "y", -1]), X)
    assert kinds(low) == ["all-to-all"]


def test_uneven_transitions_stay_exact():
    x = np.arange(7 * 5, dtype=np.float32).reshape(7, 5)
    for src, dst in [(["x", "y"], ["y", "x"]), ([("x", "y"), -1], [-1, ("y", "x")]), (["y", -1], [-1, -1]),
                     ([-1, -1], [("x", "y"), -1])]:
        lower_and_check(reshard_program(MESH, src, MESH, dst), x)


def test_x_to_y_on_one_dim_is_a_cut_and_one_permute_on_a_switched_network():
    # Each device cuts a quarter of its half and sends it: a quarter's bytes through one
    # port, less than gathering the half (on a torus the gather's two-way ring can win).
    partitioned = gspmd.jit(reshard_program(MESH, ["x", -1, -1], MESH, ["y", -1, -1]), mesh=MESH, hardware="a100")
    np.testing.assert_array_equal(partitioned(X), X)
    low = partitioned.lower(X)
    assert kinds(low) == ["collective-permute"] and not low.report().fallbacks


def test_gathering_a_dim_the_target_splits_again_is_reported_as_fallback():
    # 3 column pieces -> 2, on other devices: every device would need pieces from 5
    # others; gathering the columns (then one all-to-all) is cheaper and is reported.
    mesh = gspmd.Mesh(np.arange(6).reshape(2, 3), ("a", "b"))
    x = np.arange(64, dtype=np.float32).reshape(8, 8)
    low = lower_and_check(reshard_program(mesh, ["a", "b"], mesh, [-1, "a"]), x, mesh=mesh)
    (fallback,) = low.report().fallbacks
    assert fallback.kind == "all-gather" and "all-gather then slice" in fallback.origin


@pytest.fixture
def tiny_search_budget(monkeypatch):
    """The reshard search allowed one expansion (as a 2048-device search runs out of
    its budget), with plans memoized before and after forgotten."""
    monkeypatch.setattr(rs, "MAX_EXPANSIONS", 1)
    rs._plan.cache_clear(), rs._cost.cache_clear()
    yield
    rs._plan.cache_clear(), rs._cost.cache_clear()


@st.composite
def reshard_cases(draw):
    src_mesh = draw(meshes())
    n = src_mesh.size
    dst_mesh = draw(meshes(shapes=[s for s in [(n,), (2, n // 2), (n // 2, 2), (2, 2, n // 4)]
                                   if all(d >= 1 for d in s) and int(np.prod(s)) == n]))
    rank = draw(st.integers(1, 3))
    shape = tuple(draw(st.sampled_from([1, 2, 3, 4, 5, 7, 8, 12, 16])) for _ in range(rank))
    return src_mesh, draw(dims_mappings(src_mesh, rank)), dst_mesh, draw(dims_mappings(dst_mesh, rank)), shape


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(reshard_cases())
def test_random_reshards(case):
    src_mesh, src_map, dst_mesh, dst_map, shape = case
    x = np.random.RandomState(0).standard_normal(shape).astype(np.float32)
    low = lower_and_check(reshard_program(src_mesh, src_map, dst_mesh, dst_map), x, mesh=src_mesh)
    src = gspmd.Sharding.from_mesh(src_mesh, src_map, shape)
    dst = gspmd.Sharding.from_mesh(dst_mesh, dst_map, shape)
    if dst.refines(src):
        assert kinds(low) == []   # replicated/partial -> tiled needs no communication
    assert bool(low.report().fallbacks) == any(getattr(s, "why", None) is Why.FALLBACK
                                               for s in rs.plan(src, dst, shape, 4, BYTES_RECEIVED))
    _no_dearer_than_the_oracle(src, dst, shape, BYTES_RECEIVED)
    # One cost model: what the planner estimated is what the report prices.
    planned = rs.cost(src, dst, shape, 4, BYTES_RECEIVED)
    assert low.report(hardware=BYTES_RECEIVED).communication_seconds == pytest.approx(planned, rel=1e-9, abs=1e-15)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=reshard_cases())
def test_a_search_out_of_budget_still_plans_exactly(tiny_search_budget, case):
    """It settles for a partial plan finished by gathers and a cut: still exact, and no
    dearer than gathering everything from the source."""
    src_mesh, src_map, dst_mesh, dst_map, shape = case
    x = np.random.RandomState(1).standard_normal(shape).astype(np.float32)
    lower_and_check(reshard_program(src_mesh, src_map, dst_mesh, dst_map), x, mesh=src_mesh)
    src, dst = gspmd.Sharding.from_mesh(src_mesh, src_map, shape), gspmd.Sharding.from_mesh(dst_mesh, dst_map, shape)
    everything = tuple(GatherStep(d, t) for d, t in enumerate(src.tiles) if t > 1) + (SliceStep(dst),)
    assert rs.cost(src, dst, shape, 4, BYTES_RECEIVED) <= \
        rs._chain_cost(everything, src, shape, 4, BYTES_RECEIVED) * (1 + 1e-9) + 1e-15


# -- the oracle: reference plans built from the layouts alone, priced by the cost model -----
def _nested(size, tiles, coarse):
    return coarse == 1 or -(-size // coarse) == (tiles // coarse) * -(-size // tiles)


def _to_common_layout(cur, dst, shape):
    """Gathers that take cur down, dim by dim, to the finest split that dst refines
    device by device (shards nesting), and the layout they reach."""
    steps = []
    for d in range(cur.rank):
        ts, td = cur.tiles[d], dst.tiles[d]
        m = max(m for m in range(1, min(ts, td) + 1) if m == 1 or (
            ts % m == 0 and td % m == 0 and _nested(shape[d], ts, m) and _nested(shape[d], td, m)
            and np.array_equal(cur.coords()[:, d] // (ts // m), dst.coords()[:, d] // (td // m))))
        if ts > m:
            steps.append(GatherStep(d, ts // m))
    common = cur
    for step in steps:
        common = step.result(common)
    return steps, common


def _finishes(cur, dst, shape):
    """(steps, uses a fallback) ending at dst from cur: a permute of whole tiles, or
    gathers to the common layout and a cut (a fallback where the cut splits a gathered
    dim again)."""
    if cur == dst:
        return [([], False)]
    options = [([ExchangeStep(dst)], False)] if cur.tile_assignment.shape == dst.tile_assignment.shape else []
    gathers, common = _to_common_layout(cur, dst, shape)
    resplit = any(dst.tiles[g.dim] > common.tiles[g.dim] for g in gathers)
    return options + [(gathers + ([SliceStep(dst)] if common != dst else []), resplit)]


def _all_to_all_moves(s, shape):
    """Single all-to-alls between evenly dividing dims."""
    for a in range(s.rank):
        for k in range(2, s.tiles[a] + 1):
            if s.tiles[a] % k or shape[a] % s.tiles[a]:
                continue
            for b in range(s.rank):
                if b != a and shape[b] % (s.tiles[b] * k) == 0:
                    coords = s.coords().copy()
                    coords[:, b] = coords[:, b] * k + coords[:, a] % k
                    coords[:, a] //= k
                    tiles = list(s.tiles)
                    tiles[a], tiles[b] = tiles[a] // k, tiles[b] * k
                    yield AllToAllStep(((a, b, k),), gspmd.Sharding.from_coords(coords, tiles))


def _references(src, dst, shape, hw):
    """(seconds, uses a fallback) of the reference plans: up to two all-to-alls, then a
    permute or partial gathers and a cut."""
    starts = [([], src)]
    for first in _all_to_all_moves(src, shape):
        starts.append(([first], first.target))
        starts += [([first, second], second.target) for second in _all_to_all_moves(first.target, shape)]
    return [(rs._chain_cost(steps + rest, src, shape, 4, hw), fallback)
            for steps, cur in starts for rest, fallback in _finishes(cur, dst, shape)]


def _no_dearer_than_the_oracle(src, dst, shape, hw):
    planned, plan = rs.cost(src, dst, shape, 4, hw), rs.plan(src, dst, shape, 4, hw)
    references = _references(src, dst, shape, hw)
    slack = 1e-9 * planned + 1e-15
    assert planned <= min(r[0] for r in references) + slack, (src, dst, shape, plan, planned, references)
    if any(getattr(s, "why", None) is Why.FALLBACK for s in plan):
        clean = [seconds for seconds, fallback in references if not fallback]
        assert not clean or planned <= min(clean) + slack, (src, dst, shape, plan)


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(reshard_cases(), st.sampled_from([None, BYTES_RECEIVED, "a100"]))
def test_plans_cost_no_more_than_the_oracles_reference_plans(case, hardware):
    src_mesh, src_map, dst_mesh, dst_map, shape = case
    _no_dearer_than_the_oracle(gspmd.Sharding.from_mesh(src_mesh, src_map, shape),
                               gspmd.Sharding.from_mesh(dst_mesh, dst_map, shape), shape, cm.profile(hardware))


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(reshard_cases(), st.sampled_from([None, BYTES_RECEIVED, "a100"]))
def test_the_lower_bound_the_partitioner_prunes_with_never_exceeds_the_plan(case, hardware):
    # factors.cheapest_space skips candidates whose bound cannot beat the best so far:
    # a bound above a plan's cost would skip the cheapest.
    src_mesh, src_map, dst_mesh, dst_map, shape = case
    src, dst = gspmd.Sharding.from_mesh(src_mesh, src_map, shape), gspmd.Sharding.from_mesh(dst_mesh, dst_map, shape)
    hw = cm.profile(hardware)
    assert cm.rounded(cm.at_least(src, dst, shape, 4, hw)) <= cm.rounded(rs.cost(src, dst, shape, 4, hw))


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(reshard_cases(), st.sampled_from([None, BYTES_RECEIVED, "a100"]))
def test_the_quick_cost_is_the_searched_cost_where_one_collective_does_it(case, hardware):
    """Completion and the partition rules price hypothetical layouts without searching:
    never below the searched plan, and equal to it where the searched plan is a single
    collective (a gather, one all-to-all, one exchange), maybe with a cut."""
    src_mesh, src_map, dst_mesh, dst_map, shape = case
    src, dst = gspmd.Sharding.from_mesh(src_mesh, src_map, shape), gspmd.Sharding.from_mesh(dst_mesh, dst_map, shape)
    hw = cm.profile(hardware)
    searched, quick = cm.rounded(rs.cost(src, dst, shape, 4, hw)), cm.rounded(rs.quick_cost(src, dst, shape, 4, hw))
    assert quick >= searched
    collectives = [s for s in rs.plan(src, dst, shape, 4, hw) if not isinstance(s, SliceStep)]
    if len(collectives) == 1 and type(collectives[0]) in (GatherStep, AllToAllStep, ExchangeStep):
        assert quick == searched, (src, dst, shape, rs.plan(src, dst, shape, 4, hw))


def test_only_the_reshards_a_program_runs_are_searched(monkeypatch):
    """Choosing layouts (completion's conflicts, the candidate layouts of dots and
    element-wise ops) prices many reshards that never run; only those that
    run are searched for their cheapest plan (a search costs milliseconds even on 8
    devices)."""
    searched, ran = set(), set()
    search, reshard = rs._search, rs.reshard
    monkeypatch.setattr(rs, "_search", lambda src, dst, shape, *a: searched.add((src, dst, shape)) or search(src, dst, shape, *a))
    monkeypatch.setattr(rs, "reshard", lambda ctx, pv, dst: ran.add((pv.sharding, dst, tuple(pv.shape))) or reshard(ctx, pv, dst))
    rs._plan.cache_clear(), rs._cost.cache_clear()

    def f(x, w1, w2):
        x = gspmd.mesh_split(x, MESH, ["x", -1, "y"])
        h = jnp.tanh(jnp.einsum("bsd,df->bsf", x, gspmd.mesh_split(w1, MESH, ["y", "x"])))
        return jnp.einsum("bsf,fd->bsd", h, gspmd.mesh_split(w2, MESH, ["x", "y"])).sum()
    rng = np.random.RandomState(0)
    args = [rng.standard_normal(s).astype(np.float32) for s in [(4, 6, 16), (16, 24), (24, 16)]]
    gspmd.jit(jax.grad(f, argnums=(1, 2))).lower(*args)
    assert searched and searched <= ran


@pytest.mark.parametrize("hardware, src_mesh, src_map, dst_mesh, dst_map, shape", [
    # A settled search finishes an expanded all-to-all by gathering only what dst lacks.
    ("a100", gspmd.Mesh(np.array([0, 1, 3, 2, 4, 5, 6, 8, 7, 9, 10, 11, 12, 13, 14, 15]).reshape(4, 4), ("a", "b")),
     ["b", "a", -1], gspmd.Mesh(np.arange(16).reshape(2, 8), ("a", "b")), [("a", "b"), -1, -1], (3, 4, 16)),
    # An all-to-all first beats the direct gathers: the gathers then run on shorter rings.
    ("a100", gspmd.Mesh(np.arange(16).reshape(2, 2, 4), ("a", "b", "c")), ["a", ("b", "c")],
     gspmd.Mesh(np.arange(16), ("a",)), [-1, -1], (4, 8)),
    (None, gspmd.Mesh(np.arange(16).reshape(4, 4), ("a", "b")), [-1, "a", "b"],
     gspmd.Mesh(np.arange(16).reshape(2, 8), ("a", "b")), [-1, "a", -1], (1, 4, 8)),
    # Two 2-way all-to-alls beat one 4-way all-to-all across hosts: four steps deep.
    ("a100", gspmd.Mesh(np.array([0, 1, 2, 3, 4, 5, 6, 8, 7, 9, 10, 11, 12, 13, 14, 15]).reshape(4, 4), ("a", "b")),
     ["a", "b"], gspmd.Mesh(np.arange(16), ("a",)), [-1, -1], (4, 16)),
])
def test_plans_the_oracle_found_dearer_once(hardware, src_mesh, src_map, dst_mesh, dst_map, shape):
    _no_dearer_than_the_oracle(gspmd.Sharding.from_mesh(src_mesh, src_map, shape),
                               gspmd.Sharding.from_mesh(dst_mesh, dst_map, shape), shape, cm.profile(hardware))


@pytest.mark.slow
@settings(max_examples=5000, deadline=None, suppress_health_check=list(HealthCheck))
@given(reshard_cases(), st.sampled_from([None, BYTES_RECEIVED, "a100"]))
def test_plans_cost_no_more_than_the_oracles_reference_plans_slow(case, hardware):
    test_plans_cost_no_more_than_the_oracles_reference_plans.hypothesis.inner_test(case, hardware)


def test_sum_max_min_prod_argmax_over_uneven_sharded_dims():
    def f(a):
        a = gspmd.mesh_split(a, MESH, ["y", "x"])
        return (a.sum(0), a.max(0), a.min(1), jnp.prod(a * 0.1 + 1, axis=0), jnp.argmax(a, axis=0),
                jnp.argmin(a, axis=1), jnp.argmax(a.reshape(-1)))

    x = np.random.RandomState(1).standard_normal((7, 5)).astype(np.float32)
    from util import check
    check(f, x, mesh=MESH)


def test_argmax_prefers_the_first_nan_like_jax():
    def f(a):
        a = gspmd.mesh_split(a, MESH, ["y", "x"])
        return jnp.argmax(a, axis=0), jnp.argmin(a, axis=1)

    x = np.random.RandomState(2).standard_normal((7, 5)).astype(np.float32)
    x[5, 1] = x[6, 1] = x[3, 4] = np.nan
    from util import check
    check(f, x, mesh=MESH)


def test_moving_two_splits_moves_no_more_than_two_all_to_alls():
    low = lower_and_check(reshard_program(MESH, ["x", "y", -1], MESH, [-1, "x", "y"]), X)
    local = X.nbytes // 8
    assert "all-gather" not in kinds(low) and low.report().collective_bytes <= 2 * local


def test_rotation_is_collective_permutes_only():
    for shift, permutes in [(2, 1), (3, 2), (-6, 1)]:   # whole shards: one; part of a shard: two
        def f(a):
            return gspmd.mesh_split(jnp.roll(gspmd.mesh_split(a, MESH, ["y", "x", -1]), shift, axis=0), MESH,
                                    ["y", "x", -1])
        partitioned = gspmd.jit(f, mesh=MESH, hardware=BYTES_RECEIVED)
        np.testing.assert_array_equal(partitioned(X), np.roll(X, shift, axis=0))
        low = partitioned.lower(X)
        assert kinds(low) == ["collective-permute"] * permutes, low.report()


def test_partially_replicated_to_more_or_fewer_pieces_on_the_same_dim():
    x = np.arange(24, dtype=np.float32)
    two, four = gspmd.Mesh(np.arange(8).reshape(2, 4), ("a", "b")), gspmd.Mesh(np.arange(8).reshape(4, 2), ("a", "b"))
    assert kinds(lower_and_check(reshard_program(two, ["a"], four, ["a"]), x, mesh=two)) == []   # 2 -> 4: a cut
    three, pair = gspmd.Mesh(np.arange(6).reshape(3, 2), ("a", "b")), gspmd.Mesh(np.arange(6).reshape(2, 3), ("a", "b"))
    report = lower_and_check(reshard_program(three, ["a"], pair, ["a"]), x, mesh=three).report()
    # 3 -> 2: each device cuts its part of the target and gathers the 2 others': half a shard each.
    assert not report.fallbacks and len(report.collectives) == 1 and report.collective_bytes <= 12 * 4, str(report)


@pytest.mark.parametrize("hardware", ["tpu-v3", "a100"])
def test_the_planners_estimate_is_the_reports_communication_time(hardware):
    shape = X.shape
    for src_map, dst_map in [(["x", -1, -1], ["y", -1, -1]), (["y", -1, -1], [-1, "y", -1]),
                             ([("x", "y"), -1, -1], ["x", -1, -1]), (["y", "x", -1], ["x", "y", -1])]:
        low = gspmd.jit(reshard_program(MESH, src_map, MESH, dst_map), mesh=MESH, hardware=hardware).lower(X)
        planned = rs.cost(gspmd.Sharding.from_mesh(MESH, src_map, shape),
                          gspmd.Sharding.from_mesh(MESH, dst_map, shape), shape, 4, cm.profile(hardware))
        assert planned > 0
        assert low.report(hardware=hardware).communication_seconds == pytest.approx(planned, rel=1e-9)
