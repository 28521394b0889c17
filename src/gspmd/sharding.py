"""Sharding: how a tensor's elements are laid out over devices.

A sharding is a tile assignment: an int array of device ids of shape
(*tiles_per_dim, replication). Device d holds tile `coords(d)`; shard size along a dim
is ceil(D / tiles) and the last shards may hold padding. The trailing replication dim
is always present (1 when fully tiled), so replicated, tiled and partially tiled
shardings share one representation and one set of algorithms.

Most algorithms work on the *coordinate view*: an (N, rank) array giving each device's
tile index per dim. Merging, transfers between tensors and collective groups are all
small numpy operations on it, so planning for 2048 devices costs little.
"""
from __future__ import annotations

import functools
import math
from typing import Optional, Sequence

import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from gspmd.checks import count, describe
from gspmd.errors import ShardingError

from gspmd.mesh import Mesh, as_mesh, iota_form


class _Unspecified:
    """Marker for a dims_mapping entry left to propagation."""

    def __repr__(self):
        return "UNSPECIFIED"

    def __reduce__(self):
        return "UNSPECIFIED"


UNSPECIFIED = _Unspecified()


class Sharding:
    """How a tensor's elements are laid out over devices: a tile assignment of device
    ids, shape (*tiles per dim, replicas). Build one with Sharding.from_mesh(mesh,
    dims_mapping, shape) or Sharding.from_named(named_sharding, shape); read it in a
    mesh's terms with .spec(mesh) / .describe(mesh). Printed in XLA's notation."""
    __slots__ = ("tile_assignment", "tiles", "_coords", "_key", "_hash", "is_replicated")

    def __init__(self, tile_assignment):
        self._set(_tile_assignment(tile_assignment))

    @classmethod
    def _of(cls, arr: np.ndarray) -> "Sharding":
        """The sharding of a tile assignment gspmd built itself (a permutation of the
        device ids already), without checking it again."""
        sharding = cls.__new__(cls)
        sharding._set(arr.astype(np.int64, copy=False))
        return sharding

    def __reduce__(self):
        # Pickled as its tile assignment: what _set derives is derived again.
        return Sharding._of, (self.tile_assignment,)

    def _set(self, arr: np.ndarray) -> None:
        # Devices inside one replication group are interchangeable: keep them sorted so
        # equal layouts compare equal.
        arr = np.sort(arr, axis=-1)
        arr.setflags(write=False)
        self.tile_assignment = arr
        self.tiles: tuple[int, ...] = arr.shape[:-1]     # read by every layout computation
        self._coords = None
        # Layouts are compared and hashed far more often than made (plan caches, merges).
        self._key = (arr.shape, arr.tobytes())
        self._hash = hash(self._key)
        self.is_replicated = all(t == 1 for t in arr.shape[:-1])

    # -- constructors -------------------------------------------------------------
    @classmethod
    def replicated(cls, rank: int, num_devices: int) -> "Sharding":
        rank = count(rank, "Sharding.replicated(rank)", minimum=0)
        num_devices = count(num_devices, "Sharding.replicated(num_devices)")
        return _replicated(rank, num_devices)

    @classmethod
    def tiled(cls, devices) -> "Sharding":
        """Fully tiled: `devices` has one dim per tensor dim."""
        devices = _tile_assignment(devices)
        return cls._of(devices.reshape(devices.shape + (1,)))

    @classmethod
    def from_coords(cls, coords: np.ndarray, tiles: Sequence[int]) -> Optional["Sharding"]:
        """Sharding in which device d holds tile coords[d]; None when tiles are not all
        held by the same number of devices (no valid layout)."""
        coords = np.ascontiguousarray(coords)
        return _from_coords(coords.tobytes(), coords.shape, coords.dtype.str, tuple(int(t) for t in tiles))

    @classmethod
    def from_mesh(cls, mesh, dims_mapping, shape: Sequence[int]) -> "Sharding":
        """The sharding `mesh_split(x, mesh, dims_mapping)` asks for (UNSPECIFIED dims
        are left unsplit here; the annotation records them as open). `mesh` may be a
        jax.sharding.Mesh and `dims_mapping` a PartitionSpec (padded with None like JAX)."""
        shape = _shape(shape)
        mesh = as_mesh(mesh, f"for the value of shape {shape}")
        what = f"value of shape {shape} on {mesh}"
        dims_mapping = normalize_dims_mapping(dims_mapping, shape, mesh, what)
        per_dim = [_mesh_dims(mesh, entry, what) for entry in dims_mapping]
        used = [m for dims in per_dim for m in dims]
        if len(set(used)) != len(used):
            twice = sorted({mesh.axis_names[m] for m in used if used.count(m) > 1})
            raise ShardingError(
                f"dims_mapping {list(dims_mapping)} for the {what} uses mesh axis {twice} more than "
                "once; each mesh dim may split at most one tensor dim.")
        unused = [m for m in range(mesh.ndim) if m not in used]
        arr = mesh.devices.transpose(used + unused)
        tiles = [math.prod(mesh.shape[m] for m in dims) for dims in per_dim]
        return cls._of(arr.reshape(tiles + [math.prod(mesh.shape[m] for m in unused)]))

    @classmethod
    def from_named(cls, named, shape: Sequence[int]) -> "Sharding":
        """The sharding of a jax NamedSharding for a value of this shape."""
        if not isinstance(named, NamedSharding):
            raise ShardingError(f"Sharding.from_named needs a jax.sharding.NamedSharding, got {describe(named)}; for "
                                "a PartitionSpec use Sharding.from_mesh(mesh, spec, shape).")
        return _from_named(named, _shape(shape))

    # -- basic properties ---------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.tile_assignment.ndim - 1

    @property
    def num_replicas(self) -> int:
        return self.tile_assignment.shape[-1]

    @property
    def num_devices(self) -> int:
        return self.tile_assignment.size

    def coords(self) -> np.ndarray:
        """(N, rank) array: tile index of device d along each dim."""
        if self._coords is None:
            idx = np.indices(self.tile_assignment.shape).reshape(self.rank + 1, -1)
            coords = np.empty((self.num_devices, self.rank), np.int64)
            coords[self.tile_assignment.ravel()] = idx[:-1].T
            coords.setflags(write=False)
            self._coords = coords
        return self._coords

    def shard_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        return tuple(-(-d // t) for d, t in zip(shape, self.tiles))

    def offset(self, device: int, dim: int, shape: Sequence[int]) -> int:
        """Paper's Offset(S, d, i): where device d's shard starts along dim i."""
        return int(self.coords()[device, dim]) * -(-shape[dim] // self.tiles[dim])

    # -- algebra ------------------------------------------------------------------
    def merge(self, other: "Sharding", shape: Optional[Sequence[int]] = None) -> Optional["Sharding"]:
        """The sharding that agrees with both on every dim either one splits
        (paper Fig. 3, AyB + BCx -> AyCx), or None if they are incompatible. Given the
        value's `shape`, a dim both split takes the finer split where each device's
        fine shard lies inside its coarse one (XLA's sub-tiling)."""
        if not isinstance(other, Sharding):
            raise ShardingError(f"Sharding.merge needs another Sharding, got {describe(other)}.")
        if shape is not None and len(shape := _shape(shape)) != self.rank:
            raise ShardingError(f"Sharding.merge got shape {shape} of rank {len(shape)} for layouts of rank "
                                f"{self.rank}: pass the shape of the value both lay out (or None).")
        return _merge(self, other, shape)

    def _merge(self, other: "Sharding", shape: Optional[tuple[int, ...]]) -> Optional["Sharding"]:
        if other.rank != self.rank or other.num_devices != self.num_devices:
            return None
        mine, theirs = self.coords(), other.coords()
        tiles, cols = [], []
        for i, (a, b) in enumerate(zip(self.tiles, other.tiles)):
            (coarse, c), (fine, f) = sorted([(a, mine[:, i]), (b, theirs[:, i])], key=lambda t: t[0])
            if not _nests(c, coarse, f, fine, None if shape is None else shape[i]):
                return None
            tiles.append(fine)
            cols.append(f)
        coords = np.stack(cols, axis=1) if cols else np.zeros((self.num_devices, 0), np.int64)
        merged = Sharding.from_coords(coords, tiles)
        # The same object when nothing changed: propagation's "did it refine?" is then `is`.
        return self if merged == self else other if merged == other else merged

    def refines(self, other: "Sharding", shape: Optional[Sequence[int]] = None) -> bool:
        """True if self agrees with `other` and splits at least as much (on a value of
        `shape`: finer splits nested in other's too)."""
        return self.merge(other, shape) == self

    def remap(self, dim_map: Sequence[Optional[int]], new_rank: int) -> "Sharding":
        """Carry this sharding to a tensor of rank new_rank whose dim dim_map[i] holds
        this tensor's dim i (None: the dim has no counterpart and its split turns into
        replication). Unmapped target dims are unsplit."""
        return _remap(self, tuple(dim_map), new_rank)

    def _remap(self, dim_map: tuple, new_rank: int) -> "Sharding":
        coords = np.zeros((self.num_devices, new_rank), np.int64)
        tiles = [1] * new_rank
        for src, dst in enumerate(dim_map):
            if dst is not None and self.tiles[src] > 1:
                coords[:, dst] = self.coords()[:, src]
                tiles[dst] = self.tiles[src]
        return Sharding.from_coords(coords, tiles)

    def keep_dims(self, dims) -> "Sharding":
        """Same layout with every dim outside `dims` unsplit (turned into replication)."""
        dims = set(dims)
        return self.remap([i if i in dims else None for i in range(self.rank)], self.rank)

    def insert_dim(self, dim: int) -> "Sharding":
        """Add an unsplit dim at position `dim`."""
        return Sharding._of(np.expand_dims(self.tile_assignment, dim))

    # -- identity & printing ------------------------------------------------------
    def __eq__(self, other):
        # Unequal layouts mostly differ in their hash, equal ones compare their bytes.
        return self is other or (isinstance(other, Sharding) and self._hash == other._hash and self._key == other._key)

    def order_key(self) -> tuple:
        """A deterministic sort key (ties between equally cheap layouts)."""
        return self._key

    def __hash__(self):
        return self._hash

    def __repr__(self):
        if self.is_replicated:
            return "{replicated}"
        dims = list(self.tiles) + ([self.num_replicas] if self.num_replicas > 1 else [])
        flat = self.tile_assignment.ravel()
        devices = iota_form(flat) or ",".join(map(str, flat.tolist()))
        suffix = " last_tile_dim_replicate" if self.num_replicas > 1 else ""
        return f"{{devices=[{','.join(map(str, dims))}]{devices}{suffix}}}"

    # -- in a mesh's terms --------------------------------------------------------
    def mesh_axes(self, mesh: Mesh) -> Optional[tuple[tuple[int, ...], ...]]:
        """Per tensor dim, the mesh dims (major to minor) over which mesh_split over
        `mesh` splits it to give exactly this sharding (size-1 mesh dims in none), or
        None when no dims_mapping does."""
        return _mesh_axes(self, mesh)

    def dims_mapping(self, mesh: Mesh) -> Optional[list]:
        """A dims_mapping with which mesh_split over `mesh` gives exactly this sharding
        (entries: None or a tuple of axis names), or None when there is none."""
        mesh = as_mesh(mesh, "for Sharding.dims_mapping")
        axes = self.mesh_axes(mesh)
        return None if axes is None else [tuple(mesh.axis_names[a] for a in dims) or None for dims in axes]

    def spec(self, mesh: Mesh) -> Optional[PartitionSpec]:
        """This sharding as a PartitionSpec over `mesh`, or None when it is not one."""
        mapping = self.dims_mapping(mesh)
        return None if mapping is None else spec_of(mapping)

    def describe(self, *meshes: Mesh) -> str:
        """"P('data', None) over Mesh(data=2, model=4) {devices=[2,1,4]<=[8] ...}": the
        spec over the first of `meshes` that expresses it, next to XLA's form."""
        for mesh in meshes:
            mesh = None if mesh is None else as_mesh(mesh, "for Sharding.describe")
            spec = self.spec(mesh) if mesh is not None and mesh.size == self.num_devices else None
            if spec is not None:
                return f"{format_spec(spec)} over {mesh} {self}"
        return repr(self)


def spec_of(mapping: Sequence[Optional[tuple]]) -> PartitionSpec:
    """A PartitionSpec from a dims_mapping of axis-name tuples (or None) per dim."""
    return PartitionSpec(*(None if not axes else axes[0] if len(axes) == 1 else tuple(axes) for axes in mapping))


def format_spec(spec: PartitionSpec) -> str:
    """P('data', None), P(('x', 'y'),): as one writes a PartitionSpec."""
    return f"P({', '.join(map(repr, spec))}{',' if len(spec) == 1 else ''})"


def normalize_dims_mapping(dims_mapping, shape: Optional[Sequence[int]], mesh: Mesh, what: str) -> list:
    """A dims_mapping as a list of one entry per dim of `shape` (shape None: rank not
    known yet, not checked): a PartitionSpec as dims_mapping_from_spec reads it; a string,
    a set or any other container is a mistake."""
    rank = 2 if shape is None else len(shape)
    if isinstance(dims_mapping, str):
        raise ShardingError(
            f"dims_mapping {dims_mapping!r} for the {what} is a string, not one entry per tensor dim; write "
            f"[{dims_mapping!r}{', None' * max(rank - 1, 0)}] (or P({dims_mapping!r})).")
    if isinstance(dims_mapping, PartitionSpec):
        return dims_mapping_from_spec(dims_mapping, shape)
    if not isinstance(dims_mapping, (list, tuple)):
        raise ShardingError(f"dims_mapping {dims_mapping!r:.60} for the {what} is of type "
                            f"{type(dims_mapping).__name__}, not a sequence (list or tuple) of one entry per tensor "
                            f"dim in order; write e.g. {example_mapping(mesh, rank)}, or a PartitionSpec.")
    dims_mapping = list(dims_mapping)
    if shape is not None and len(dims_mapping) != rank:
        raise ShardingError(
            f"dims_mapping {dims_mapping} has {len(dims_mapping)} entries but the {what} "
            f"has rank {rank}: give one entry per tensor dim (-1 or None for unsplit).")
    return dims_mapping


def example_mapping(mesh: Mesh, rank: int) -> list:
    """A dims_mapping to show in a message: dim 0 split over the mesh's first axis."""
    return [mesh.axis_names[0]] + [None] * (rank - 1) if rank else []


def _tile_assignment(devices) -> np.ndarray:
    """A tile assignment as given: a rectangular integer array holding each device id
    0..N-1 once, with at least the replication dim."""
    try:
        arr = np.asarray(devices)
    except ValueError:
        arr = None
    if arr is None or arr.ndim < 1 or arr.dtype.kind not in "iu" or not np.array_equal(
            np.sort(arr.ravel()), np.arange(arr.size)):
        raise ShardingError(f"A tile assignment must be an integer array (one dim per tensor dim, then the "
                            f"replication dim) holding each device id 0..N-1 once, got {describe(devices)}; build "
                            "layouts with Sharding.from_mesh(mesh, dims_mapping, shape) or Sharding.replicated.")
    return arr.astype(np.int64)


def _shape(shape) -> tuple[int, ...]:
    """A value's shape: a sequence of non-negative ints."""
    if isinstance(shape, (tuple, list)) and all(isinstance(d, (int, np.integer)) and not isinstance(d, bool)
                                                and d >= 0 for d in shape):
        return tuple(int(d) for d in shape)
    raise ShardingError(f"A value's shape must be a tuple of non-negative ints, got {describe(shape)}; e.g. (8, 16).")


def _nests(coarse_coords: np.ndarray, coarse: int, fine_coords: np.ndarray, fine: int, size: Optional[int]) -> bool:
    """Whether, along one dim of `size` split `coarse` and `fine` ways, every device's
    fine shard lies inside its coarse shard, so that the fine split refines the coarse
    one: the same split, or (size known) a multiple whose shards nest (a 4-way split
    replicated twice, and an 8-way split with each quarter's halves on that quarter's
    devices; an uneven size only where k fine shards make one coarse shard exactly)."""
    if coarse == 1:
        return True
    if fine == coarse:
        return np.array_equal(fine_coords, coarse_coords)
    k = fine // coarse
    return (size is not None and fine % coarse == 0 and -(-size // coarse) == k * -(-size // fine)
            and np.array_equal(fine_coords // k, coarse_coords))


# Propagation and partitioning ask the same questions many times over; layouts are
# immutable and hashable, so the answers are memoized (this keeps 2048 devices cheap).
_merge = functools.lru_cache(maxsize=65536)(Sharding._merge)


def merge_on(a: Sharding, b: Sharding, shape: tuple[int, ...]) -> Optional[Sharding]:
    """a.merge(b, shape) for gspmd's own callers, whose shape is a value's (a tuple of
    ints of the layouts' rank already): propagation merges far too often to check it."""
    return _merge(a, b, shape)
_remap = functools.lru_cache(maxsize=65536)(Sharding._remap)


@functools.lru_cache(maxsize=65536)
def _from_coords(data: bytes, shape: tuple, dtype: str, tiles: tuple[int, ...]) -> Optional[Sharding]:
    # Reshard-plan searches build the same few layouts from coordinates over and over
    # (each move of each layout they expand, in every search): built once each.
    coords = np.frombuffer(data, dtype).reshape(shape)
    n = coords.shape[0]
    ntiles = math.prod(tiles)
    if n % ntiles:
        return None
    linear = np.ravel_multi_index(tuple(coords.T), tiles) if tiles else np.zeros(n, np.int64)
    if not np.all(np.bincount(linear, minlength=ntiles) == n // ntiles):
        return None
    order = np.argsort(linear, kind="stable")   # by tile, then by device id
    return Sharding._of(order.reshape(tiles + (n // ntiles,)))


@functools.lru_cache(maxsize=256)     # asked for every unsplit value and constant
def _replicated(rank: int, num_devices: int) -> Sharding:
    return Sharding._of(np.arange(num_devices).reshape((1,) * rank + (num_devices,)))


@functools.lru_cache(maxsize=4096)    # asked for every argument and result of a program
def _from_named(named: NamedSharding, shape: tuple[int, ...]) -> Sharding:
    return Sharding.from_mesh(named.mesh, named.spec, shape)


@functools.lru_cache(maxsize=4096)
def _mesh_axes(sharding: Sharding, mesh: Mesh) -> Optional[tuple[tuple[int, ...], ...]]:
    """Read off the layout: a tensor dim is split over the mesh dims along which its tile
    index steps, major (largest step) first. One check against from_mesh rejects layouts
    that no dims_mapping gives."""
    if mesh.size != sharding.num_devices:
        return None
    tile_index = sharding.coords()[mesh.devices]            # (*mesh shape, rank)
    axes = [a for a in range(mesh.ndim) if mesh.shape[a] > 1]
    steps = {a: tile_index[tuple(int(b == a) for b in range(mesh.ndim))] - tile_index[(0,) * mesh.ndim]
             for a in axes}
    per_dim = tuple(tuple(sorted((a for a in axes if steps[a][i]), key=lambda a: -steps[a][i]))
                    for i in range(sharding.rank))
    if sum(map(len, per_dim)) != len(set().union(*per_dim)):   # a mesh dim steps two tensor dims
        return None
    return per_dim if Sharding.from_mesh(mesh, per_dim, (1,) * sharding.rank) == sharding else None


def _mesh_dims(mesh: Mesh, entry, what: str) -> tuple[int, ...]:
    """Mesh dims one dims_mapping entry splits a tensor dim over (major to minor)."""
    if entry is None or entry is UNSPECIFIED:
        return ()
    if isinstance(entry, (int, np.integer)) and not isinstance(entry, bool) and entry == -1:
        return ()
    entries = entry if isinstance(entry, (tuple, list)) else (entry,)
    try:
        return tuple(mesh.axis_index(e) for e in entries)
    except ShardingError as e:
        raise ShardingError(f"Bad dims_mapping entry {entry!r} for the {what}: {e}") from None


def dims_mapping_from_spec(spec: PartitionSpec, shape: Optional[Sequence[int]]) -> list:
    """A jax PartitionSpec as a dims_mapping for a value of `shape`: a short spec leaves
    the trailing dims unsplit (as in JAX) and P.UNCONSTRAINED leaves a dim to propagation.
    Without a shape, one entry per entry of the spec. Axes a spec names `unreduced` (the
    value held as partial sums over them) or `reduced` split no dim: the value is their
    sum either way, and where its partial sums are added is the partitioner's choice."""
    entries = spec.partitions if isinstance(spec, PartitionSpec) else spec
    if shape is not None and len(entries) > len(shape):
        raise ShardingError(f"{spec} has {len(entries)} entries but the value of shape {tuple(shape)} has rank "
                            f"{len(shape)}: give at most one entry per dim.")

    def entry(e):
        if e is PartitionSpec.UNCONSTRAINED:
            return UNSPECIFIED
        return (tuple(e) or None) if isinstance(e, (tuple, list)) else e
    return [entry(e) for e in entries] + [None] * (0 if shape is None else len(shape) - len(entries))
