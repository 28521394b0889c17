"""What the search prices layouts with: a thin layer over the shared cost model.

The search compares hundreds of thousands of layouts, so it speaks of mesh axes
instead of Shardings: a layout is, per tensor dim, the mesh axes that split it (major
to minor). Collectives are priced by the shared cost model (spmd/cost.py, topology
aware) for the device groups that a set of mesh axes forms on the mesh's devices;
compute by its roofline; resharding follows the partitioner's own order of
strategies (spmd/reshard.py): slices are free, a split that moves to another dim is an
all-to-all, a split that goes away is an all-gather. The final plan is always priced by
the real partitioner and report; this layer only ranks candidates.
"""
from __future__ import annotations

import math

from gspmd.mesh import Mesh
from gspmd.spmd import cost

Layout = tuple   # per tensor dim: a tuple of mesh axis indices (major to minor)
Collective = tuple   # (cost.Pattern, axes, result bytes per device)


class Pricing:
    """Costs on one mesh (its devices) and one hardware profile, memoized."""

    def __init__(self, mesh: Mesh, hardware: cost.Hardware):
        self.devices = mesh.devices
        self.sizes = tuple(int(s) for s in mesh.shape)
        self.hardware = hardware
        # The share of communication a step cannot hide behind independent compute.
        self.exposed = 1.0 - hardware.overlap
        self._rates: dict = {}
        self._reshards: dict = {}
        self._bytes: dict = {}
        self._reshard_seconds: dict = {}

    def group_size(self, axes) -> int:
        return math.prod(self.sizes[a] for a in axes)

    def rate(self, pattern: cost.Pattern, axes: tuple) -> tuple[float, float]:
        """(latency, seconds per result byte) of one collective over the groups `axes` form."""
        key = (pattern, axes)
        if key not in self._rates:
            rate = cost.rate(pattern, cost.axis_groups(self.devices, axes), self.devices.size, self.hardware)
            self._rates[key] = (rate.latency, rate.per_byte)
        return self._rates[key]

    def seconds(self, collectives) -> float:
        total = 0.0
        for pattern, axes, nbytes in collectives:
            latency, per_byte = self.rate(pattern, axes)
            total += latency + nbytes * per_byte
        return total

    def matmul_seconds(self, flops: float, nbytes: float) -> float:
        return cost.compute_seconds(cost.ComputeKind.MATMUL, flops, nbytes, self.hardware)

    def memory_seconds(self, nbytes: float) -> float:
        return cost.compute_seconds(cost.ComputeKind.MEMORY, 0.0, nbytes, self.hardware)

    def tiles(self, layout: Layout) -> list[int]:
        return [self.group_size(axes) for axes in layout]

    def local_bytes(self, layout: Layout, shape, itemsize: int) -> int:
        key = (layout, shape, itemsize)
        found = self._bytes.get(key)
        if found is None:
            found = self._bytes[key] = itemsize * math.prod(-(-n // t) for n, t in zip(shape, self.tiles(layout)))
        return found

    def reshard(self, src: Layout, dst: Layout, shape, itemsize: int) -> tuple:
        """The collectives that turn a value laid out as `src` into `dst`."""
        key = (src, dst, shape, itemsize)
        if key not in self._reshards:
            self._reshards[key] = tuple(self._plan(src, dst, shape, itemsize)) if src != dst else ()
        return self._reshards[key]

    def reshard_seconds(self, src: Layout, dst: Layout, shape, itemsize: int) -> float:
        if src == dst:
            return 0.0
        key = (src, dst, shape, itemsize)
        found = self._reshard_seconds.get(key)
        if found is None:
            found = self._reshard_seconds[key] = self.seconds(self.reshard(src, dst, shape, itemsize))
        return found

    def _plan(self, src: Layout, dst: Layout, shape, itemsize: int) -> list[Collective]:
        # Per dim, the axes both layouts start with stay; the source's others leave the
        # dim: to the dim the target puts them on (all-to-all) or nowhere (all-gather).
        keep = [_common_prefix(s, d) for s, d in zip(src, dst)]
        leaving = {a: dim for dim, (s, k) in enumerate(zip(src, keep)) for a in s[k:]}
        arriving = {a: dim for dim, (d, k) in enumerate(zip(dst, keep)) for a in d[k:]}
        current = [list(axes) for axes in src]
        steps = []
        for a, dim in leaving.items():
            to = arriving.get(a)
            if to is not None and to != dim:
                steps.append((cost.Pattern.ALL_TO_ALL, (a,), self.local_bytes(_freeze(current), shape, itemsize)))
                current[dim].remove(a)
                current[to].append(a)
        for dim in range(len(src)):
            gone = tuple(a for a in src[dim][keep[dim]:] if a in current[dim])   # gathered (then sliced anew)
            if gone:
                current[dim] = [a for a in current[dim] if a not in gone]
                steps.append((cost.Pattern.ALL_GATHER, tuple(sorted(gone)), self.local_bytes(_freeze(current), shape, itemsize)))
        return steps


def _common_prefix(a: tuple, b: tuple) -> int:
    k = 0
    while k < len(a) and k < len(b) and a[k] == b[k]:
        k += 1
    return k


def _freeze(layout) -> Layout:
    return tuple(tuple(axes) for axes in layout)
