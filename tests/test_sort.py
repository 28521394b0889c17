"""sort, argsort, top_k, approx_max_k/min_k, argmax/argmin: equal to one device (NaN,
-0.0 and ties ordered as XLA orders them), local along whole dims, and along a split dim
an all-to-all there and back (or, for top-k, a small gather of k candidates per shard)
instead of gathering the tensor; where no other dim can take the split, sorted shards
merged over the devices, however many (rounds of collective-permutes), where that is
cheaper or the whole dim would not fit a device, the results keeping the split."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax import lax

import gspmd
from gspmd.ops import sort as sort_ops
from strategies import dims_mappings, meshes
from util import BANDWIDTH_BOUND, BYTES_RECEIVED, check

MESH = gspmd.Mesh(np.arange(8).reshape(2, 4), ("x", "y"))
LINE = gspmd.Mesh(np.arange(8), ("x",))
SMALL_MESHES = [(2,), (4,), (8,), (3,), (5,), (6,), (2, 2), (2, 4), (4, 2), (3, 2), (2, 2, 2)]
SPECIAL = np.array([0.0, -0.0, 1.0, -1.0, 2.0, 0.5, np.nan, -np.nan, np.inf, -np.inf], np.float32)


def split(x, mesh, *dims):
    return gspmd.mesh_split(x, mesh, list(dims))


def special_values(seed: int, *shape) -> np.ndarray:
    """Values full of ties, NaNs of both signs, zeros of both signs and infinities."""
    return np.random.RandomState(seed).choice(SPECIAL, shape)


def largest_collective(low) -> int:
    return max((c.bytes for c in low.report().collectives), default=0)


def test_order_of_nans_zeros_and_ties_matches_xla():
    def f(x, y):
        x = split(x, MESH, "x", "y")
        return (jnp.sort(x, axis=1), jnp.argsort(x, axis=1), jnp.argsort(x, axis=0, descending=True),
                lax.sort((x, y), dimension=1, num_keys=2), lax.sort((y, x), dimension=0, num_keys=1),
                lax.sort(x, dimension=1, is_stable=False), lax.top_k(x, 5), lax.top_k(x, 3, axis=0),
                jnp.argmax(x, axis=1), jnp.argmin(x, axis=0))

    x, y = special_values(0, 6, 8), special_values(1, 6, 8)
    check(f, x, y, mesh=MESH)


def test_approx_max_and_min_k_are_exact():
    def f(x):
        x = split(x, MESH, "x", "y")
        return lax.approx_max_k(x, 3), lax.approx_min_k(x, 2), lax.approx_max_k(x, 2, reduction_dimension=0)

    x = np.random.RandomState(2).randint(-4, 4, (6, 8)).astype(np.float32)   # ties, no NaN
    check(f, x, mesh=MESH)


def test_integer_and_boolean_keys():
    def f(i, b):
        i = split(i, MESH, "y", "x")
        return jnp.sort(i, axis=0), lax.top_k(i, 2), jnp.argsort(b, axis=1), lax.sort((b, i), dimension=0)

    rng = np.random.RandomState(3)
    check(f, rng.randint(-3, 3, (8, 6)).astype(np.int32), rng.rand(8, 6) > 0.5, mesh=MESH)


@pytest.mark.parametrize("shape", [(16, 32), (10, 30), (9, 32), (16, 27)])
def test_sort_along_a_split_dim_moves_the_split_by_one_all_to_all(shape):
    """The split moves onto the other dim (padded where uneven) and the results stay
    there: one all-to-all of x serves sort, argsort (its iota is made in the moved
    layout) and a sort of two operands together (y, given no layout, arrives in it),
    where gathering took one [B, N] per operand (two 2 KB all-gathers for argsort)."""
    def f(x, y):
        x = split(x, LINE, -1, "x")
        return jnp.sort(x, axis=1), jnp.argsort(x, axis=1), lax.sort((x, y), dimension=1, num_keys=1)

    x, y = special_values(4, *shape), special_values(5, *shape)
    low = check(f, x, y, mesh=LINE)
    report = low.report()
    assert report.counts() == {"all-to-all": 1}, report
    rows, columns = -(-shape[0] // 8), 8 * -(-shape[1] // 8)   # the sorted dim's padding is cut after
    assert all(c.bytes == rows * columns * 4 for c in report.collectives), report
    moved = gspmd.Sharding.from_mesh(LINE, ["x", -1], shape)
    assert all(low.sharding_of(i) == moved for i in range(4)), [low.sharding_of(i) for i in range(4)]


def test_sort_on_a_2d_mesh_moves_the_sorted_dims_split_onto_the_split_batch():
    def f(x):
        return jnp.argsort(split(x, MESH, "x", "y"), axis=1)

    x = special_values(6, 16, 20)
    low = check(f, x, mesh=MESH)
    (c,) = low.report().collectives
    assert c.kind == "all-to-all" and c.groups == ((0, 1, 2, 3), (4, 5, 6, 7)) and c.bytes == 2 * 20 * 4, c
    assert low.sharding_of(0) == gspmd.Sharding.from_mesh(MESH, [("x", "y"), -1], x.shape)


def test_sort_whose_result_keeps_the_split_moves_it_there_and_back():
    def f(x):
        return split(jnp.sort(split(x, LINE, -1, "x"), axis=1), LINE, -1, "x")

    x = np.random.RandomState(4).standard_normal((16, 30)).astype(np.float32)
    low = check(f, x, mesh=LINE, hardware=BANDWIDTH_BOUND)   # 2 KB: with latency, one gather is cheaper
    assert low.report().counts() == {"all-to-all": 2}, low.report()     # there and back, nothing gathered
    assert low.sharding_of(0) == gspmd.Sharding.from_mesh(LINE, [-1, "x"], x.shape)


def test_sort_of_a_split_vector_gathers_it_and_keeps_its_result_split():
    """No other dim can take the split: over 8 devices (30 elements: latency) one
    gather beats 6 merge rounds; nothing asks for another layout, so each device keeps
    its slice of the sorted vector, as the operand was split."""
    def f(x):
        return jnp.sort(split(x, LINE, "x")), jnp.argsort(split(x, LINE, "x"))

    low = check(f, special_values(7, 30), mesh=LINE)
    report = low.report()
    assert report.counts() == {"all-gather": 1} and not report.fallbacks, report   # argsort's iota: made whole
    assert [c.bytes for c in report.collectives] == [32 * 4], report
    assert low.sharding_of(0) == low.sharding_of(1) == gspmd.Sharding.from_mesh(LINE, ["x"], (30,))


def test_sort_of_a_split_vector_merges_with_no_layout_asked_for_its_result():
    """Where merging is the cheaper (integer keys over 12 devices, priced by the bytes
    each receives: 10 rounds of bitonic's network, run as over 16 devices, against 11
    shards gathered), a result nobody gives a layout stays split, merged."""
    mesh = gspmd.Mesh(np.arange(12), ("x",))

    def f(x):
        return jnp.sort(split(x, mesh, "x"))

    x = np.random.RandomState(14).randint(-9, 9, 1200).astype(np.int32)
    low = check(f, x, mesh=mesh, hardware=BYTES_RECEIVED, backends=("sim",))
    report = low.report()
    assert report.counts() == {"collective-permute": 10} and not report.fallbacks, report
    assert {c.bytes for c in report.collectives} == {100 * 4}, report
    assert low.sharding_of(0) == gspmd.Sharding.from_mesh(mesh, ["x"], x.shape)


def test_split_vector_whose_result_stays_split_merges_sorted_shards():
    """Bitonic merge-splits over 8 devices: 6 rounds of one shard (2 KB) each against
    the 14 KB a gather receives; integer keys need no positions to break ties."""
    def f(x):
        return split(jnp.sort(split(x, LINE, "x")), LINE, "x")

    x = np.random.RandomState(9).randint(-50, 50, 4096).astype(np.int32)
    report = check(f, x, mesh=LINE, hardware=BYTES_RECEIVED).report()
    assert report.counts() == {"collective-permute": 6}, report
    assert all(c.bytes == 512 * 4 for c in report.collectives), report


def test_floats_merge_with_their_positions_where_that_moves_fewer_bytes():
    """Stable float sorts carry each element's position (int16 here) to break ties of
    -0.0/+0.0 and NaNs as one device does: over 32 devices 15 rounds of 6 bytes an
    element against a 31-shard gather of 4; uneven (padding sorts after +NaN)."""
    mesh = gspmd.Mesh(np.arange(32), ("x",))

    def f(x):
        return split(jnp.sort(split(x, mesh, "x")), mesh, "x")

    report = check(f, special_values(10, 1000), mesh=mesh, hardware=BYTES_RECEIVED, backends=("sim",)).report()
    assert report.counts() == {"collective-permute": 30}, report
    assert sorted({c.bytes for c in report.collectives}) == [32 * 2, 32 * 4], report


def test_sort_merges_where_the_whole_dim_would_not_fit_a_device():
    """Priced on time alone a gather wins here; but 8 whole copies of x and the sorted x
    do not fit in 48 KB a device: the merge holds two shards at a time. Odd-even
    transposition's 8 rounds of one shard, stable with no positions, move fewer bytes
    than bitonic's 6 rounds of the shard and its positions."""
    small = dataclasses.replace(gspmd.analysis.PROFILES["tpu-v3"], memory_bytes=48 << 10, reserved_bytes=0)

    def f(x):
        return split(jnp.sort(split(x, LINE, "x")), LINE, "x")

    x = np.random.RandomState(13).standard_normal(8192).astype(np.float32)
    assert check(f, x, mesh=LINE).report().counts() == {"all-gather": 1}
    report = check(f, x, mesh=LINE, hardware=small).report()
    assert report.counts() == {"collective-permute": 8}, report
    assert {c.bytes for c in report.collectives} == {1024 * 4}, report


MERGE_CASES = [   # mesh shape, dims mapping, shape, op, permutes: rounds x tensors carried
    ((8,), [0], (37,), "sort", 8 * 1),                  # odd-even: stable, no positions (bitonic's: 6 * 2)
    ((4,), [0], (16,), "argsort", 3 * 2),               # argsort's iota breaks ties itself
    ((2,), [0], (5,), "sort", 1 * 1),
    ((2, 4), [0, 1], (4, 30), "two_keys", 1 * 3),       # three operands
    ((4, 2), [None, 0], (3, 9), "unstable", 4 * 1),     # replicated over the other mesh dim
    ((2, 2, 2), [(0, 2), None, 1], (7, 2, 6), "argsort", 3 * 2),
    ((8,), [0], (5,), "int_pairs", 6 * 2),              # integer keys: no positions
    # Not a power of 2: odd-even transposition (P rounds) or bitonic's network run as
    # over the next power of 2, whichever is cheaper (3: 3 rounds either, 5: 5, 6: 6).
    ((3,), [0], (17,), "sort", 3 * 1),                  # uneven: 6, 6, 5
    ((5,), [0], (23,), "argsort", 5 * 2),
    ((6,), [0], (31,), "two_keys", 6 * 3),
    ((6,), [0], (4,), "unstable", 6 * 1),               # two shards all padding
    ((5,), [0], (9,), "int_pairs", 5 * 2),
    ((3, 2), [0, 1], (13, 2), "sort", 3 * 1),           # 2 columns cannot take the 3-way split
    ((2, 3), [None, 1], (3, 10), "by_key", 3 * 2),      # keys and values
    ((6,), [0], (20,), "sort_descending", 6 * 1 + 1),   # sort, then a mirrored reverse
]


@pytest.mark.parametrize("mesh_shape, mapping, shape, name, permutes", MERGE_CASES)
def test_merged_sorts_equal_one_device(monkeypatch, mesh_shape, mapping, shape, name, permutes):
    """The merge forced on every split sort (uneven dims, batch dims split, several
    operands, ties, NaNs): nothing gathered, one permute per round per tensor carried."""
    monkeypatch.setattr(sort_ops, "_merge_cost", lambda *args: -1.0)
    mesh = gspmd.Mesh(np.arange(np.prod(mesh_shape)).reshape(mesh_shape), tuple("xyz"[:len(mesh_shape)]))
    dim = next(d for d, m in enumerate(mapping) if m is not None)
    op = _sort_op(name, dim, 1) if name != "int_pairs" else (
        lambda x, y: lax.sort((x.astype(jnp.int8), y.astype(jnp.int32)), dimension=dim, num_keys=2))

    def f(x, y):   # the results kept split as the operand is
        return jax.tree.map(lambda r: gspmd.mesh_split(r, mesh, mapping), op(gspmd.mesh_split(x, mesh, mapping), y))

    low = check(f, special_values(11, *shape), special_values(12, *shape), mesh=mesh)
    report = low.report()
    kinds = report.counts()
    assert kinds["collective-permute"] == permutes and "all-gather" not in kinds and not report.fallbacks, report
    shard = np.prod(gspmd.Sharding.from_mesh(mesh, mapping, shape).shard_shape(shape))   # a shard's elements
    permuted = {c.bytes for c in report.collectives if c.kind == "collective-permute"}
    assert permuted <= {shard * n for n in (1, 2, 4)}, report


@pytest.mark.parametrize("devices", [3, 5, 6])
def test_sort_over_devices_not_a_power_of_2_merges_where_the_dim_would_not_fit(devices):
    """As over 8 devices: 32 KB of floats and their sorted copy do not fit in 40 KB a
    device, so the sorted shards merge (3, 5 and 6 rounds of odd-even transposition,
    one shard each: no positions), the result kept split with no layout asked for it."""
    small = dataclasses.replace(gspmd.analysis.PROFILES["tpu-v3"], memory_bytes=40 << 10, reserved_bytes=0)
    mesh = gspmd.Mesh(np.arange(devices), ("x",))

    def f(x):
        return jnp.sort(split(x, mesh, "x"))

    x = special_values(15, 8000)
    low = check(f, x, mesh=mesh, hardware=small)
    report = low.report()
    assert report.counts() == {"collective-permute": devices} and not report.fallbacks, report
    shard = -(-8000 // devices)
    assert {c.bytes for c in report.collectives} == {shard * 4}, report
    assert low.sharding_of(0) == gspmd.Sharding.from_mesh(mesh, ["x"], x.shape)


def test_networks_sort_blocks_over_any_number_of_devices():
    """Each network, its comparators merge-splits of blocks, sorts every input over 2
    to 19 positions (the 0-1 principle's inputs of one element a block, and random
    blocks with ties); bitonic's run as over the next power of 2 skips comparators
    with the missing positions."""
    rng = np.random.RandomState(16)
    for p in range(2, 20):
        bitonic, odd_even = sort_ops._networks(p)
        assert len(odd_even) == p - (p == 2) and len(bitonic) == len(sort_ops._network_rounds(1 << (p - 1).bit_length()))
        for rounds in (bitonic, odd_even):
            assert all(np.array_equal(r[r], np.arange(p)) for r in rounds)   # pairs: partners of each other
            inputs = [np.array([[(m >> i) & 1] for i in range(p)]) for m in range(1 << min(p, 10))]
            inputs += [rng.randint(0, 4, (p, rng.randint(1, 4))) for _ in range(20)]
            for x in inputs:
                blocks = [np.sort(b) for b in x]
                for partner in rounds:
                    merged = [np.sort(np.concatenate([blocks[i], blocks[j]])) for i, j in enumerate(partner)]
                    n = x.shape[1]
                    blocks = [blocks[i] if j == i else m[:n] if i < j else m[n:]
                              for i, (j, m) in enumerate(zip(partner, merged))]
                assert np.array_equal(np.concatenate(blocks), np.sort(x.ravel())), (p, x)


def test_merges_of_neighbours_only_keep_equal_keys_in_order():
    """Odd-even transposition merges neighbouring blocks only, each merge a stable sort of
    the lower block then the upper: equal keys keep their order with no positions carried
    (what lets a float sort skip them). Bitonic's network over 4 or more blocks merges
    blocks apart (from 4 blocks on) and reorders ties: it carries positions."""
    rng = np.random.RandomState(17)
    for p in range(2, 12):
        bitonic, odd_even = sort_ops._networks(p)
        assert sort_ops._neighbours_only(odd_even) and sort_ops._neighbours_only(bitonic) == (p <= 3)
        for _ in range(20):
            n = rng.randint(1, 5)
            keys = rng.randint(0, 3, p * n)
            blocks = [b[np.argsort(keys[b], kind="stable")] for b in np.arange(p * n).reshape(p, n)]
            for partner in odd_even:
                merged = {}
                for i, j in enumerate(partner):
                    both = np.concatenate([blocks[min(i, j)], blocks[max(i, j)]])
                    merged[i] = both[np.argsort(keys[both], kind="stable")]
                blocks = [blocks[i] if j == i else merged[i][:n] if i < j else merged[i][n:]
                          for i, j in enumerate(partner)]
            assert np.array_equal(np.concatenate(blocks), np.argsort(keys, kind="stable")), (p, keys)


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.sampled_from([3, 5, 6, 7]), st.integers(1, 40),
       st.sampled_from(["sort", "argsort", "descending", "sort_descending", "two_keys", "by_key", "unstable"]),
       st.integers(0, 99))
def test_random_vectors_merged_over_devices_not_a_power_of_2(monkeypatch, devices, size, name, seed):
    """Vectors of any length (shorter than the mesh too) split over 3 to 7 devices,
    merged, the results given no layout: equal to one device, nothing gathered."""
    monkeypatch.setattr(sort_ops, "_merge_cost", lambda *args: -1.0)
    mesh = gspmd.Mesh(np.random.RandomState(seed).permutation(devices), ("x",))
    op = _sort_op(name, 0, 1)
    low = check(lambda x, y: op(split(x, mesh, "x"), y), special_values(seed, size), special_values(seed + 1, size),
                mesh=mesh)
    report = low.report()
    assert set(report.counts()) == {"collective-permute"} and not report.fallbacks, report


def test_sort_gathers_only_the_sorted_dim_when_no_other_dim_can_take_its_split():
    def f(x):
        return jnp.sort(split(x, MESH, "x", "y"), axis=1)

    x = np.random.RandomState(5).standard_normal((6, 8)).astype(np.float32)   # 6 rows: no room for 8 tiles
    low = check(f, x, mesh=MESH)
    gathers = [c for c in low.report().collectives if c.kind == "all-gather"]
    assert len(gathers) == 1 and gathers[0].groups == ((0, 1, 2, 3), (4, 5, 6, 7)), low.report()
    assert gathers[0].bytes == 3 * 8 * 4   # this device's rows, whole along the sorted dim only


def test_split_top_k_dim_gathers_only_candidates():
    def f(x):
        return lax.top_k(split(x, LINE, -1, "x"), 2)

    x = np.random.RandomState(6).standard_normal((6, 256)).astype(np.float32)
    low = check(f, x, mesh=LINE, hardware=BANDWIDTH_BOUND)
    report = low.report()
    assert set(report.counts()) == {"all-gather"}, report
    assert largest_collective(low) == 6 * 8 * 2 * 4, report   # 2 candidates from each of 8 shards


def test_split_top_k_dim_moves_to_another_dim_when_that_is_cheaper():
    def f(x):
        return lax.top_k(split(x, LINE, -1, "x"), 8)

    x = np.random.RandomState(7).standard_normal((64, 32)).astype(np.float32)
    low = check(f, x, mesh=LINE, hardware=BANDWIDTH_BOUND)
    assert "all-to-all" in low.report().counts(), low.report()
    assert largest_collective(low) == 64 * 8 * 4   # the result, gathered: the target is whole


def test_padding_never_beats_real_elements():
    """Uneven shards (35 over 8: the last one empty) of the lowest values there are,
    with the top-k dim kept split (candidates per shard)."""
    def f(x):
        x = split(x, LINE, -1, "x")
        return lax.top_k(x, 2), lax.top_k(x, 1), jnp.sort(x, axis=1), jnp.argsort(x, axis=1)

    x = np.full((3, 35), -np.inf, np.float32)
    x[0, ::3] = -np.nan
    x[2, -1] = -0.0
    low = check(f, x, mesh=LINE, hardware=BANDWIDTH_BOUND)
    assert any("top-k candidates" in c.origin for c in low.report().collectives), low.report()


def test_grads_of_sort_and_top_k():
    def loss(x):
        x = split(x, MESH, "x", "y")
        return jnp.sum(jnp.sort(x, axis=1) * jnp.arange(8.0)) + jnp.sum(lax.top_k(x, 3)[0] ** 2)

    x = np.random.RandomState(8).standard_normal((6, 8)).astype(np.float32)
    check(jax.grad(loss), x, mesh=MESH)


_OPS = ["sort", "argsort", "descending", "two_keys", "top_k", "argmax", "unstable"]


@st.composite
def sort_cases(draw):
    mesh = draw(meshes(shapes=SMALL_MESHES))
    rank = draw(st.integers(1, 3))
    dim = draw(st.integers(0, rank - 1))
    # A long sorted dim now and then: split top-k dims then take candidates per shard.
    shape = tuple(draw(st.sampled_from([1, 2, 3, 4, 5, 6, 8] + ([19, 35] if d == dim else [])))
                  for d in range(rank))
    k = draw(st.integers(1, shape[dim]))
    return mesh, shape, draw(dims_mappings(mesh, rank)), dim, draw(st.sampled_from(_OPS)), k, draw(st.integers(0, 99))


def _sort_op(name: str, dim: int, k: int):
    if name == "sort":
        return lambda x, y: jnp.sort(x, axis=dim)
    if name == "argsort":
        return lambda x, y: jnp.argsort(x, axis=dim)
    if name == "descending":
        return lambda x, y: jnp.argsort(x, axis=dim, descending=True)
    if name == "two_keys":
        return lambda x, y: lax.sort((x, y, x * 2), dimension=dim, num_keys=2)
    if name == "by_key":
        return lambda x, y: lax.sort((x, y), dimension=dim, num_keys=1)
    if name == "sort_descending":
        return lambda x, y: jnp.sort(x, axis=dim, descending=True)
    if name == "top_k":
        return lambda x, y: lax.top_k(x, k, axis=dim)
    if name == "argmax":
        return lambda x, y: (jnp.argmax(x, axis=dim), jnp.argmin(y, axis=dim))
    return lambda x, y: lax.sort(x, dimension=dim, is_stable=False)


def _check_sort(case):
    mesh, shape, mapping, dim, name, k, seed = case
    op = _sort_op(name, dim, k)
    check(lambda x, y: op(gspmd.mesh_split(x, mesh, mapping), y), special_values(seed, *shape),
          special_values(seed + 1, *shape), mesh=mesh)


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(sort_cases())
def test_random_sorts(case):
    _check_sort(case)


@pytest.mark.slow
@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(sort_cases())
def test_random_sorts_slow(case):
    _check_sort(case)


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(sort_cases())
def test_random_sorts_merged_wherever_they_can_be(monkeypatch, case):
    monkeypatch.setattr(sort_ops, "_merge_cost", lambda *args: -1.0)
    _check_sort(case)


@pytest.mark.slow
@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(sort_cases())
def test_random_sorts_merged_wherever_they_can_be_slow(monkeypatch, case):
    monkeypatch.setattr(sort_ops, "_merge_cost", lambda *args: -1.0)
    _check_sort(case)
