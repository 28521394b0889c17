"""A manual region's view of a mesh (paper 3.4, manual subgroups).

The devices fall into subgroups that share their coordinates along the manual axes.
Inside the region every subgroup runs the same program on its piece of each value, and
that program is partitioned over the remaining (automatic) axes like any other: for
this it sees K "virtual" devices 0..K-1, K = devices per subgroup, laid out as the
automatic axes of the mesh. Virtual device v of subgroup g is the real device
`subgroups[g, v]`; a collective the partitioner builds among virtual devices runs among
the matching real devices of every subgroup.

A value crossing the region's boundary is split by its spec over the manual axes
(major) and, within each manual piece, by its layout inside the region over the
automatic axes (minor): `compose` gives that layout over the whole mesh.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from gspmd.errors import ShardingError
from gspmd.mesh import Mesh
from gspmd.sharding import Sharding

# Per dim, the manual axes splitting it (major to minor).
Spec = Sequence[tuple[str, ...]]


class ManualRegion:
    def __init__(self, mesh: Mesh, manual_axes: Sequence[str]):
        self.mesh = mesh
        self.axes = tuple(manual_axes)
        manual = [mesh.axis_index(a) for a in self.axes]
        auto = [d for d in range(mesh.ndim) if d not in manual]
        k = math.prod(mesh.shape[d] for d in auto)
        self.subgroups = mesh.devices.transpose(manual + auto).reshape(-1, k)
        self.num_devices = k
        self.sub_mesh = Mesh(np.arange(k).reshape([mesh.shape[d] for d in auto]), [mesh.axis_names[d] for d in auto])
        self.virtual = np.empty(mesh.size, np.int64)     # real device -> its virtual device
        self.virtual[self.subgroups] = np.arange(k)
        self._mesh_coords = np.empty((mesh.size, mesh.ndim), np.int64)
        self._mesh_coords[mesh.devices.ravel()] = np.indices(mesh.shape).reshape(mesh.ndim, -1).T
        # propagation asks for a region's boundary layouts once per operand it refines
        self._nested: dict[tuple, Sharding] = {}
        self._composed: dict[tuple, Sharding] = {}

    def __repr__(self):
        return f"ManualRegion({self.mesh}, manual={self.axes})"

    def local_layout(self, sharding: Sharding, what: str) -> Sharding:
        """A layout written inside the region over the whole mesh (an annotation there),
        as a layout over the region's virtual devices. It may not split over a manual axis."""
        per_subgroup = sharding.coords()[self.subgroups]
        if sharding.num_devices != self.mesh.size or not np.all(per_subgroup == per_subgroup[:1]):
            raise ShardingError(
                f"The annotation {sharding} of {what} inside a manual region over axes {self.axes} of {self.mesh} "
                "splits over a manual axis (or uses other devices): inside the region each manual partition "
                "holds its own piece already; annotate only over the automatic axes "
                f"{self.sub_mesh.axis_names}.")
        return Sharding.from_coords(per_subgroup[0], sharding.tiles)

    def manual_index(self, names: Sequence[str]) -> np.ndarray:
        """Per real device, its index along the manual axes `names` (major to minor)."""
        dims = [self.mesh.axis_index(n) for n in names]
        sizes = [self.mesh.shape[d] for d in dims]
        if not dims:
            return np.zeros(self.mesh.size, np.int64)
        return np.ravel_multi_index(tuple(self._mesh_coords[:, d] for d in dims), sizes)

    def parts(self, names: Sequence[str]) -> int:
        return math.prod(self.mesh.shape[self.mesh.axis_index(n)] for n in names)

    def nesting(self, spec: Spec, inside: Sharding, shape: Sequence[int]) -> Sharding:
        """`inside` with the dims unsplit whose split of a manual piece is not a split of
        the whole dim (uneven within a piece): what can cross the boundary as is."""
        key = _memo_key(spec, inside, shape)
        if key not in self._nested:
            self._nested[key] = self._nesting(spec, inside, shape)
        return self._nested[key]

    def _nesting(self, spec: Spec, inside: Sharding, shape: Sequence[int]) -> Sharding:
        keep = [d for d, (names, n) in enumerate(zip(spec, shape))
                if self.parts(names) == 1 or (n // self.parts(names)) % inside.tiles[d] == 0]
        return inside.keep_dims(keep)

    def compose(self, spec: Spec, inside: Sharding, shape: Sequence[int]) -> Sharding:
        """The whole-mesh layout of a value of global `shape` split by `spec` over the
        manual axes and within each piece by `inside` (over the virtual devices)."""
        key = _memo_key(spec, inside, shape)
        if key not in self._composed:
            self._composed[key] = self._compose(spec, self.nesting(spec, inside, shape), shape)
        return self._composed[key]

    def _compose(self, spec: Spec, inside: Sharding, shape: Sequence[int]) -> Sharding:
        local = inside.coords()[self.virtual]
        coords = np.stack([self.manual_index(names) * inside.tiles[d] + local[:, d] for d, names in enumerate(spec)],
                          axis=1) if spec else np.zeros((self.mesh.size, 0), np.int64)
        return Sharding.from_coords(coords, [self.parts(names) * t for names, t in zip(spec, inside.tiles)])


def _memo_key(spec: Spec, inside: Sharding, shape: Sequence[int]) -> tuple:
    return tuple(map(tuple, spec)), inside, tuple(shape)
