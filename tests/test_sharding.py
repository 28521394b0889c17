"""Sharding math: tile coverage, shard shapes, Offset, shard/unshard, merge/refines/remap,
equality and the printed form.

Randomized cases draw meshes of 1-3 dims with up to 16 devices in a random device order,
dims_mappings that use each mesh dim at most once (single dims spelled as int, numpy int
or axis name; tuples major to minor; -1/None for unsplit) and shapes whose sizes need not
divide the tile counts (including sizes smaller than the tile count, down to 1).
"""
from __future__ import annotations

import itertools
import math

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gspmd import Mesh, Sharding
from gspmd.mesh import iota_form
from gspmd.runtime import sim

AXES = ("a", "b", "c")
MAX_DEVICES = 16


# ---------------------------------------------------------------------------------------
# strategies
# ---------------------------------------------------------------------------------------
@st.composite
def meshes(draw, max_devices=MAX_DEVICES):
    ndim = draw(st.integers(1, 3))
    shape, budget = [], max_devices
    for _ in range(ndim):
        size = draw(st.sampled_from([n for n in (2, 1, 3, 4, 8, 16, 5) if n <= budget]))
        shape.append(size)
        budget //= size
    n = math.prod(shape)
    order = draw(st.permutations(range(n)))
    return Mesh(np.array(order, dtype=np.int64).reshape(shape), AXES[:ndim])


@st.composite
def dims_mappings(draw, mesh, rank):
    """(dims_mapping as a user would write it, per tensor dim the tuple of mesh dims)."""
    slots = [[] for _ in range(rank)]
    for m in draw(st.permutations(range(mesh.ndim))):
        target = draw(st.integers(-1, rank - 1))
        if target >= 0:
            slots[target].append(m)

    def spell(m):
        return draw(st.sampled_from([m, np.int64(m), mesh.axis_names[m]]))

    entries = []
    for dims in slots:
        if not dims:
            entries.append(draw(st.sampled_from([-1, None])))
        elif len(dims) == 1 and draw(st.booleans()):
            entries.append(spell(dims[0]))
        else:
            entries.append(tuple(spell(m) for m in dims))
    return entries, [tuple(d) for d in slots]


@st.composite
def cases(draw, max_rank=3):
    mesh = draw(meshes())
    rank = draw(st.integers(0, max_rank))
    mapping, slots = draw(dims_mappings(mesh, rank))
    shape = tuple(draw(st.lists(st.integers(1, 20), min_size=rank, max_size=rank)))
    return mesh, mapping, slots, shape


def tiles_of(mesh, slots):
    return tuple(math.prod(mesh.shape[m] for m in dims) for dims in slots)


def mesh_of(mesh_shape, order=None):
    n = math.prod(mesh_shape)
    devices = np.arange(n) if order is None else np.asarray(order)
    return Mesh(devices.reshape(mesh_shape), AXES[:len(mesh_shape)])


# ---------------------------------------------------------------------------------------
# 1. coverage, shard shapes, Offset, shard/unshard
# ---------------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(cases())
def test_from_mesh_layout_matches_mesh_positions(case):
    """Device at mesh position p holds, along tensor dim i, the tile whose index is p's
    mixed-radix number over the mesh dims splitting dim i (major to minor)."""
    mesh, mapping, slots, shape = case
    s = Sharding.from_mesh(mesh, mapping, shape)
    tiles = tiles_of(mesh, slots)
    assert s.rank == len(shape)
    assert s.tiles == tiles
    assert s.num_devices == mesh.size
    assert s.num_replicas == mesh.size // math.prod(tiles)
    assert sorted(s.tile_assignment.ravel().tolist()) == list(range(mesh.size))
    coords = s.coords()
    for pos in np.ndindex(*mesh.shape):
        d = int(mesh.devices[pos])
        for i, dims in enumerate(slots):
            expect = np.ravel_multi_index(tuple(pos[m] for m in dims),
                                          tuple(mesh.shape[m] for m in dims)) if dims else 0
            assert coords[d, i] == expect, (pos, d, i)


@settings(max_examples=200, deadline=None)
@given(cases())
def test_every_replica_slot_covers_each_element_once(case):
    mesh, mapping, slots, shape = case
    s = Sharding.from_mesh(mesh, mapping, shape)
    groups = s.tile_assignment.reshape(-1, s.num_replicas)
    assert groups.shape == (math.prod(s.tiles), s.num_replicas)
    for r in range(s.num_replicas):
        count = np.zeros(shape, np.int64)
        for d in groups[:, r]:
            count[sim.tile_slices(s, shape, int(d))] += 1
        assert np.all(count == 1), (s, shape, r)
    # Replicas of one tile hold the same index range.
    for row in groups:
        ranges = {tuple((i.start, i.stop) for i in sim.tile_slices(s, shape, int(d))) for d in row}
        assert len(ranges) == 1


@settings(max_examples=200, deadline=None)
@given(cases())
def test_shard_shape_and_offset(case):
    mesh, mapping, slots, shape = case
    s = Sharding.from_mesh(mesh, mapping, shape)
    tiles = tiles_of(mesh, slots)
    assert s.shard_shape(shape) == tuple(-(-d // t) for d, t in zip(shape, tiles))
    local = s.shard_shape(shape)
    for d in range(mesh.size):
        sl = sim.tile_slices(s, shape, d)
        for i, piece in enumerate(sl):
            assert 0 <= piece.start <= piece.stop <= shape[i]
            assert piece.stop - piece.start <= local[i]
            if piece.stop > piece.start:
                assert s.offset(d, i, shape) == piece.start
            # The paper's Offset is coords * shard size, even past the end of the dim.
            assert s.offset(d, i, shape) == int(s.coords()[d, i]) * local[i]


@settings(max_examples=150, deadline=None)
@given(cases(), st.integers(0, 2**32 - 1), st.sampled_from([np.float32, np.int32]))
def test_shard_unshard_roundtrip(case, seed, dtype):
    mesh, mapping, slots, shape = case
    s = Sharding.from_mesh(mesh, mapping, shape)
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * 100).astype(dtype)
    shards = sim.shard(x, s)
    assert len(shards) == mesh.size
    for d, buf in enumerate(shards):
        assert buf.shape == s.shard_shape(shape)
        assert buf.dtype == x.dtype
        piece = x[sim.tile_slices(s, shape, d)]
        np.testing.assert_array_equal(buf[tuple(slice(0, n) for n in piece.shape)], piece)
    np.testing.assert_array_equal(sim.unshard(shards, s, shape), x)


def test_uneven_and_tiny_dims_explicit():
    mesh = mesh_of((4,))
    s = Sharding.from_mesh(mesh, ["a"], (5,))
    assert s.shard_shape((5,)) == (2,)
    assert [sim.tile_slices(s, (5,), d) for d in range(4)] == [
        (slice(0, 2),), (slice(2, 4),), (slice(4, 5),), (slice(5, 5),)]
    s1 = Sharding.from_mesh(mesh, ["a"], (1,))
    assert s1.shard_shape((1,)) == (1,)
    assert [sim.tile_slices(s1, (1,), d) for d in range(4)] == [
        (slice(0, 1),), (slice(1, 1),), (slice(1, 1),), (slice(1, 1),)]
    x = np.array([7.0], np.float32)
    np.testing.assert_array_equal(sim.unshard(sim.shard(x, s1), s1, (1,)), x)


# ---------------------------------------------------------------------------------------
# 2. algebra: merge, refines, remap, keep_dims, insert_dim, equality
# ---------------------------------------------------------------------------------------
@st.composite
def merge_cases(draw):
    mesh = draw(meshes())
    rank = draw(st.integers(0, 3))
    ma, sa = draw(dims_mappings(mesh, rank))
    if draw(st.booleans()):
        mb, sb = draw(dims_mappings(mesh, rank))
    else:
        # Split a common layout between the two (compatible, so the merge is often finer
        # than both, as in Fig. 3), then maybe perturb one dim of b.
        keep_a = draw(st.lists(st.booleans(), min_size=rank, max_size=rank))
        sb = tuple(() if k else dims for k, dims in zip(keep_a, sa))
        sa = tuple(dims if k else () for k, dims in zip(keep_a, sa))
        if rank and draw(st.booleans()):
            i = draw(st.integers(0, rank - 1))
            free = [m for m in range(mesh.ndim) if all(m not in d for d in sa + sb)]
            sb = sb[:i] + (tuple(draw(st.permutations(free))[:draw(st.integers(0, len(free)))]),) + sb[i + 1:]
        ma, mb = list(sa), list(sb)
    shape = tuple(draw(st.lists(st.integers(1, 20), min_size=rank, max_size=rank)))
    return mesh, shape, (ma, sa), (mb, sb)


def _expected_merge(mesh, sa, sb):
    """Mesh-level oracle: the union mapping, or None when the two conflict."""
    def norm(dims):  # size-1 mesh dims do not split anything
        return tuple(m for m in dims if mesh.shape[m] > 1)

    union = []
    for a, b in zip(sa, sb):
        a, b = norm(a), norm(b)
        if a and b and a != b:
            return None
        union.append(a or b)
    used = [m for dims in union for m in dims]
    if len(set(used)) != len(used):
        return None
    return union


@settings(max_examples=200, deadline=None)
@given(merge_cases())
def test_merge_commutes_refines_and_matches_mesh_oracle(case):
    mesh, shape, (ma, sa), (mb, sb) = case
    a = Sharding.from_mesh(mesh, ma, shape)
    b = Sharding.from_mesh(mesh, mb, shape)
    ab, ba = a.merge(b), b.merge(a)
    assert ab == ba
    expected = _expected_merge(mesh, sa, sb)
    if expected is None:
        assert ab is None, (a, b, ab)
    else:
        assert ab == Sharding.from_mesh(mesh, list(expected), shape)
    if ab is not None:
        assert ab.refines(a) and ab.refines(b)
        assert hash(ab) == hash(ba)
    assert a.merge(a) == a
    assert a.refines(a)


@settings(max_examples=150, deadline=None)
@given(cases(), st.data())
def test_merge_of_complementary_parts_rebuilds_whole(case, data):
    """Fig. 3 generalized: split a mapping's dims between two annotations; merging
    them gives back the full sharding."""
    mesh, mapping, slots, shape = case
    whole = Sharding.from_mesh(mesh, mapping, shape)
    to_a = data.draw(st.lists(st.booleans(), min_size=len(shape), max_size=len(shape)))
    a = Sharding.from_mesh(mesh, [d if k else -1 for d, k in zip(slots, to_a)], shape)
    b = Sharding.from_mesh(mesh, [-1 if k else d for d, k in zip(slots, to_a)], shape)
    assert a.merge(b) == whole
    assert b.merge(a) == whole
    assert whole.refines(a) and whole.refines(b)


@settings(max_examples=150, deadline=None)
@given(cases())
def test_merge_with_replicated_returns_other(case):
    mesh, mapping, slots, shape = case
    s = Sharding.from_mesh(mesh, mapping, shape)
    rep = Sharding.replicated(len(shape), mesh.size)
    assert rep.is_replicated
    assert rep.merge(s) == s
    assert s.merge(rep) == s
    assert s.refines(rep)
    assert rep.refines(s) == s.is_replicated
    # A replicated sharding built from any mesh is the same value.
    assert Sharding.from_mesh(mesh, [-1] * len(shape), shape) == rep


def test_figure3_merge():
    """Paper Fig. 3: [A, B, C] with B split on y, merged with C split on x -> AyCx."""
    mesh = Mesh(np.arange(4).reshape(2, 2), ("x", "y"))
    shape = (4, 6, 8)
    by = Sharding.from_mesh(mesh, [-1, "y", -1], shape)
    cx = Sharding.from_mesh(mesh, [-1, -1, "x"], shape)
    both = Sharding.from_mesh(mesh, [-1, "y", "x"], shape)
    assert by.merge(cx) == both
    assert cx.merge(by) == both
    assert both.num_replicas == 1
    assert both.refines(by) and both.refines(cx)
    assert not by.refines(both)


def test_a_finer_split_that_nests_refines_the_coarser():
    """XLA's sub-tiling: on a value of 8 rows, each of x's halves is two of (x, y)'s
    eighths, held by the devices of that half, so the 8-way split refines the 2-way one
    (either order). Without a shape, or where uneven shards do not nest, it does not."""
    mesh = Mesh(np.arange(8).reshape(2, 4), ("x", "y"))
    x0 = Sharding.from_mesh(mesh, ["x", -1], (8, 8))
    xy0 = Sharding.from_mesh(mesh, [("x", "y"), -1], (8, 8))
    assert x0.merge(xy0, (8, 8)) == xy0 and xy0.merge(x0, (8, 8)) == xy0
    assert xy0.refines(x0, (8, 8)) and not x0.refines(xy0, (8, 8))
    assert x0.merge(xy0) is None and not xy0.refines(x0)
    # 7 rows: halves of 4 rows, eighths of 1 (the last empty): four eighths make a half.
    # 10 rows: halves of 5, eighths of 2: the third eighth, rows 4-5, crosses the halves.
    assert x0.merge(xy0, (7, 8)) == xy0 and x0.merge(xy0, (10, 8)) is None
    # With a split of the other dim over the replicas: y moves to dim 0.
    x0y1 = Sharding.from_mesh(mesh, ["x", "y"], (8, 8))
    assert x0y1.merge(xy0, (8, 8)) is None


def test_incompatible_merges_return_none():
    mesh = Mesh(np.arange(8).reshape(2, 4), ("x", "y"))
    shape = (8, 8)
    x0 = Sharding.from_mesh(mesh, ["x", -1], shape)
    x1 = Sharding.from_mesh(mesh, [-1, "x"], shape)
    y0 = Sharding.from_mesh(mesh, ["y", -1], shape)
    xy0 = Sharding.from_mesh(mesh, [("x", "y"), -1], shape)
    yx0 = Sharding.from_mesh(mesh, [("y", "x"), -1], shape)
    # Same mesh axis on two different dims.
    assert x0.merge(x1) is None and x1.merge(x0) is None
    # Different tile counts on the same dim.
    assert x0.merge(y0) is None and y0.merge(x0) is None
    # A finer split whose tiles do not nest in the coarser one's (x is its minor part).
    assert x0.merge(yx0, shape) is None and yx0.merge(x0, shape) is None
    # Same tile count, different devices per tile.
    assert xy0.merge(yx0) is None
    # Different rank or device count.
    assert x0.merge(Sharding.from_mesh(mesh, ["x"], (8,))) is None
    assert x0.merge(Sharding.replicated(2, 4)) is None


@st.composite
def remap_cases(draw):
    mesh, mapping, slots, shape = draw(cases())
    rank = len(shape)
    new_rank = draw(st.integers(rank, rank + 2))
    targets = draw(st.permutations(range(new_rank)))[:rank]
    dropped = draw(st.lists(st.booleans(), min_size=rank, max_size=rank))
    dim_map = [None if drop else t for t, drop in zip(targets, dropped)]
    return mesh, mapping, slots, shape, dim_map, new_rank


@settings(max_examples=200, deadline=None)
@given(remap_cases())
def test_remap_matches_moved_mapping(case):
    mesh, mapping, slots, shape, dim_map, new_rank = case
    s = Sharding.from_mesh(mesh, mapping, shape)
    moved = [()] * new_rank
    for src, dst in enumerate(dim_map):
        if dst is not None:
            moved[dst] = slots[src]
    expected = Sharding.from_mesh(mesh, moved, (1,) * new_rank)
    got = s.remap(dim_map, new_rank)
    assert got == expected
    assert got.rank == new_rank


@settings(max_examples=150, deadline=None)
@given(cases(), st.data())
def test_keep_dims_and_insert_dim(case, data):
    mesh, mapping, slots, shape = case
    s = Sharding.from_mesh(mesh, mapping, shape)
    rank = len(shape)
    keep = data.draw(st.sets(st.integers(0, max(rank - 1, 0))) if rank else st.just(set()))
    kept = s.keep_dims(keep)
    assert kept == Sharding.from_mesh(mesh, [slots[i] if i in keep else -1 for i in range(rank)], shape)
    assert s.refines(kept)
    assert s.keep_dims(range(rank)) == s
    assert s.keep_dims([]).is_replicated
    at = data.draw(st.integers(0, rank))
    expected = list(slots)
    expected.insert(at, -1)
    assert s.insert_dim(at) == Sharding.from_mesh(mesh, expected, (1,) * (rank + 1))


def test_remap_transpose_and_drop_explicit():
    mesh = Mesh(np.arange(8).reshape(2, 4), ("x", "y"))
    s = Sharding.from_mesh(mesh, ["x", "y"], (4, 8))
    assert s.remap([1, 0], 2) == Sharding.from_mesh(mesh, ["y", "x"], (8, 4))
    assert s.remap([0, None], 2) == Sharding.from_mesh(mesh, ["x", -1], (4, 8))
    assert s.remap([None, 0], 1) == Sharding.from_mesh(mesh, ["y"], (8,))
    assert s.remap([2, 0], 3) == Sharding.from_mesh(mesh, ["y", -1, "x"], (8, 1, 4))
    assert s.keep_dims([1]) == Sharding.from_mesh(mesh, [-1, "y"], (4, 8))


@settings(max_examples=150, deadline=None)
@given(cases(), st.integers(0, 2**32 - 1))
def test_equality_ignores_order_within_replication_groups(case, seed):
    mesh, mapping, slots, shape = case
    s = Sharding.from_mesh(mesh, mapping, shape)
    shuffled = np.random.default_rng(seed).permuted(np.array(s.tile_assignment), axis=-1)
    t = Sharding(shuffled)
    assert t == s
    assert hash(t) == hash(s)
    assert len({s, t}) == 1


def test_equality_explicit():
    a = np.arange(8).reshape(2, 4)
    # Replication groups {0..3}, {4..7} in different member orders.
    assert Sharding(a.reshape(2, 1, 4)) == Sharding(a[:, ::-1].reshape(2, 1, 4))
    assert hash(Sharding(a.reshape(2, 1, 4))) == hash(Sharding(a[:, ::-1].reshape(2, 1, 4)))
    m1 = Mesh(np.array([[0, 1], [2, 3]]), ("x", "y"))
    m2 = Mesh(np.array([[1, 0], [3, 2]]), ("x", "y"))
    assert Sharding.from_mesh(m1, ["x", -1], (4, 4)) == Sharding.from_mesh(m2, ["x", -1], (4, 4))
    # Different device orders: different layouts.
    assert Sharding.from_mesh(m1, ["x", "y"], (4, 4)) != Sharding.from_mesh(m2, ["x", "y"], (4, 4))
    assert Sharding.from_mesh(m1, [-1, "y"], (4, 4)) != Sharding.from_mesh(m2, [-1, "y"], (4, 4))
    assert Sharding.tiled(np.arange(4).reshape(2, 2)) != Sharding.tiled(np.arange(4).reshape(2, 2).T)
    assert Sharding.tiled(np.arange(4)) != Sharding.tiled(np.arange(4)[::-1])
    # Same devices, different tiling.
    assert Sharding.tiled(np.arange(4).reshape(2, 2)) != Sharding.tiled(np.arange(4).reshape(4, 1))
    assert Sharding.tiled(np.arange(4).reshape(2, 2)) != "{devices=[2,2]<=[4]}"


# ---------------------------------------------------------------------------------------
# 3. printed form
# ---------------------------------------------------------------------------------------
def test_printed_form():
    mesh = Mesh(np.arange(8).reshape(2, 4), ("x", "y"))
    assert repr(Sharding.from_mesh(mesh, ["x", -1], (4, 4))) == "{devices=[2,1,4]<=[8] last_tile_dim_replicate}"
    assert str(Sharding.from_mesh(mesh, ["x", -1], (4, 4))) == "{devices=[2,1,4]<=[8] last_tile_dim_replicate}"
    assert repr(Sharding.from_mesh(mesh, [-1, -1], (4, 4))) == "{replicated}"
    assert repr(Sharding.from_mesh(mesh, [None, None], (4, 4))) == "{replicated}"
    assert repr(Sharding.replicated(0, 8)) == "{replicated}"
    assert repr(Sharding.from_mesh(mesh, ["x", "y"], (4, 4))) == "{devices=[2,4]<=[8]}"
    assert repr(Sharding.from_mesh(mesh, [("x", "y"), -1], (8, 4))) == "{devices=[8,1]<=[8]}"
    # Splitting over the minor mesh axis alone transposes the device list (0,4,1,5,...).
    assert repr(Sharding.from_mesh(mesh, [-1, "y"], (4, 4))) == \
        "{devices=[1,4,2]<=[2,4]T(1,0) last_tile_dim_replicate}"
    assert repr(Sharding.from_mesh(mesh, ["y", "x"], (4, 4))) == "{devices=[4,2]<=[2,4]T(1,0)}"


def test_printed_form_permuted_device_order():
    order = [3, 1, 4, 0, 6, 5, 7, 2]
    mesh = Mesh(np.array(order).reshape(2, 4), ("x", "y"))
    assert repr(Sharding.from_mesh(mesh, ["x", "y"], (4, 4))) == "{devices=[2,4]3,1,4,0,6,5,7,2}"
    assert repr(Sharding.from_mesh(mesh, ["x", -1], (4, 4))) == \
        "{devices=[2,1,4]0,1,3,4,2,5,6,7 last_tile_dim_replicate}"
    assert repr(Sharding.from_mesh(mesh, [-1, -1], (4, 4))) == "{replicated}"


def test_printed_form_uses_transposed_iota_where_it_can():
    mesh = Mesh(np.array([0, 2, 4, 6, 1, 3, 5, 7]).reshape(2, 4), ("x", "y"))
    assert repr(Sharding.from_mesh(mesh, ["x", "y"], (4, 4))) == "{devices=[2,4]<=[4,2]T(1,0)}"
    mesh = Mesh(np.arange(8).reshape(2, 4), ("x", "y"))
    assert repr(Sharding.from_mesh(mesh, ["y", -1], (4, 4))) == \
        "{devices=[4,1,2]<=[2,4]T(1,0) last_tile_dim_replicate}"
    # a mesh laid out on a 3D torus (256 chips as 4x8x8: four factors) prints as compactly
    torus = Mesh(np.arange(256).reshape(4, 4, 2, 8).transpose(1, 3, 0, 2).reshape(32, 8), ("fsdp", "tensor"))
    assert repr(Sharding.from_mesh(torus, ["fsdp", "tensor"], (64, 64))) == "{devices=[32,8]<=[4,4,2,8]T(1,3,0,2)}"
    assert repr(Sharding.from_mesh(torus, [-1, "tensor"], (64, 64))) == \
        "{devices=[1,8,32]<=[4,4,2,8]T(0,2,1,3) last_tile_dim_replicate}"


def _parse_devices(body: str, n: int) -> np.ndarray:
    """The device list of a printed sharding: explicit, or iota "<=[dims]" + "T(perm)"."""
    m = re.fullmatch(r"<=\[([\d,]+)\](?:T\(([\d,]+)\))?", body)
    if m is None:
        return np.array([int(v) for v in body.split(",")])
    base = np.arange(n).reshape([int(d) for d in m.group(1).split(",")])
    return (base.transpose([int(p) for p in m.group(2).split(",")]) if m.group(2) else base).ravel()


@pytest.mark.parametrize("shape", [(6,), (2, 3, 4), (2, 2, 2, 2), (4, 4, 2, 8)])
def test_iota_form_reads_every_transposed_iota(shape):
    n = math.prod(shape)
    for perm in itertools.permutations(range(len(shape))):
        flat = np.arange(n).reshape(shape).transpose(perm).ravel()
        assert np.array_equal(_parse_devices(iota_form(flat), n), flat), (shape, perm)
    assert iota_form(np.array([1, 0, 2, 3])) is None and iota_form(np.array([0, 2, 1, 3, 5, 4])) is None


@settings(max_examples=100, deadline=None)
@given(cases())
def test_printed_form_is_consistent_with_equality(case):
    mesh, mapping, slots, shape = case
    s = Sharding.from_mesh(mesh, mapping, shape)
    text = repr(s)
    assert text.startswith("{") and text.endswith("}")
    if s.is_replicated:
        assert text == "{replicated}"
    else:
        dims = list(s.tiles) + ([s.num_replicas] if s.num_replicas > 1 else [])
        assert text.startswith("{devices=[" + ",".join(map(str, dims)) + "]")
        assert ("last_tile_dim_replicate" in text) == (s.num_replicas > 1)
        # Rebuild from the printed device list and compare.
        body = text[len("{devices=[" + ",".join(map(str, dims)) + "]"):-1]
        body = body.replace(" last_tile_dim_replicate", "")
        flat = _parse_devices(body, s.num_devices)
        assert Sharding(flat.reshape(s.tile_assignment.shape)) == s


def test_from_coords_built_once_per_coords():
    """Reshard searches build the same layouts from coordinates again and again: equal
    coordinates (any int dtype, any array) give the one layout; uneven tilings give None."""
    s = Sharding(np.arange(8).reshape(2, 4, 1))
    again = Sharding.from_coords(s.coords().astype(np.int64).copy(), s.tiles)
    assert again == s and again is Sharding.from_coords(list(map(list, s.coords())), [2, 4])
    assert Sharding.from_coords(s.coords().astype(np.int32), s.tiles) == s
    assert Sharding.from_coords(np.zeros((8, 2), np.int64), (2, 4)) is None     # one tile, held by all
    assert Sharding.from_coords(np.zeros((8, 0), np.int64), ()) == Sharding.replicated(0, 8)
