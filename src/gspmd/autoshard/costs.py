"""What the search prices layouts with: a thin layer over the shared cost model.

The search compares hundreds of thousands of layouts, so it speaks of mesh axes
instead of Shardings: a layout is, per tensor dim, the mesh axes that split it (major
to minor). Collectives are priced by the shared model (analysis/hardware.py) for the
device groups that one set of axes forms; resharding follows the partitioner's own
order of strategies (spmd/reshard.py): slices are free, a split that moves to another
dim is an all-to-all, a split that goes away is an all-gather. The final plan is
always priced by the real partitioner and report; this layer only ranks candidates.

Replaceable: once spmd/cost.py prices a collective over explicit device groups
(topology-aware), `Pricing.rate` asks it for the groups of `axes` and nothing else
here changes.
"""
from __future__ import annotations

import math
from typing import Sequence

from gspmd.analysis.hardware import Hardware, collective_seconds

Layout = tuple   # per tensor dim: a tuple of mesh axis indices (major to minor)
Collective = tuple   # (kind, axes, result bytes per device)
_PROBE = 1 << 30


class Pricing:
    """Costs on one mesh (its axis sizes) and one hardware profile, memoized."""

    def __init__(self, mesh_shape: Sequence[int], hardware: Hardware):
        self.sizes = tuple(int(s) for s in mesh_shape)
        self.hardware = hardware
        self._rates: dict = {}
        self._reshards: dict = {}
        self._bytes: dict = {}
        self._reshard_seconds: dict = {}

    def group_size(self, axes) -> int:
        return math.prod(self.sizes[a] for a in axes)

    def rate(self, kind: str, axes: tuple) -> tuple[float, float]:
        """(latency, seconds per result byte) of one collective over the groups `axes` form."""
        key = (kind, axes)
        if key not in self._rates:
            k = self.group_size(axes)
            latency = collective_seconds(kind, 0, k, self.hardware)
            self._rates[key] = (latency, (collective_seconds(kind, _PROBE, k, self.hardware) - latency) / _PROBE)
        return self._rates[key]

    def seconds(self, collectives) -> float:
        total = 0.0
        for kind, axes, nbytes in collectives:
            latency, per_byte = self.rate(kind, axes)
            total += latency + nbytes * per_byte
        return total

    def compute_seconds(self, flops: float) -> float:
        return flops / self.hardware.flops_per_s

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
                steps.append(("all-to-all", (a,), self.local_bytes(_freeze(current), shape, itemsize)))
                current[dim].remove(a)
                current[to].append(a)
        for dim in range(len(src)):
            gone = tuple(a for a in src[dim][keep[dim]:] if a in current[dim])   # gathered (then sliced anew)
            if gone:
                current[dim] = [a for a in current[dim] if a not in gone]
                steps.append(("all-gather", tuple(sorted(gone)), self.local_bytes(_freeze(current), shape, itemsize)))
        return steps


def _common_prefix(a: tuple, b: tuple) -> int:
    k = 0
    while k < len(a) and k < len(b) and a[k] == b[k]:
        k += 1
    return k


def _freeze(layout) -> Layout:
    return tuple(tuple(axes) for axes in layout)

