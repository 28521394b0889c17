"""Mesh: an n-d array of device ids with one name per dimension."""
from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from gspmd.errors import ShardingError


class Mesh:
    """A logical device mesh.

    `devices` may list the ids 0..N-1 in any order: the order is how a user maps the
    logical mesh onto the physical network.
    """

    def __init__(self, devices, axis_names: Sequence[str]):
        devices = np.asarray(devices)
        axis_names = tuple(axis_names)
        if devices.dtype.kind not in "iu":
            raise ShardingError(f"Mesh devices must be integer device ids, got dtype {devices.dtype}.")
        if len(axis_names) != devices.ndim:
            raise ShardingError(
                f"Mesh of shape {devices.shape} needs {devices.ndim} axis names, got {axis_names}: "
                "give one name per mesh dimension.")
        if len(set(axis_names)) != len(axis_names):
            raise ShardingError(f"Mesh axis names {axis_names} repeat a name: make them unique.")
        flat = devices.ravel()
        n = flat.size
        if sorted(flat.tolist()) != list(range(n)):
            dupes = sorted({int(d) for d in flat if (flat == d).sum() > 1})
            missing = sorted(set(range(n)) - set(flat.tolist()))
            raise ShardingError(
                f"Mesh devices {flat.tolist()} must be the ids 0..{n - 1}, each once "
                f"(duplicates: {dupes}, missing: {missing}). Use e.g. np.arange({n}).reshape(...).")
        self.devices = devices.astype(np.int64)
        self.devices.setflags(write=False)
        self.axis_names = axis_names

    @classmethod
    def from_jax(cls, jax_mesh: jax.sharding.Mesh) -> "Mesh":
        """The same mesh with gspmd's device ids: device id d is jax.devices()[d]."""
        if not isinstance(jax_mesh, jax.sharding.Mesh):
            raise ShardingError(f"Mesh.from_jax needs a jax.sharding.Mesh with devices, got {jax_mesh!r}; "
                                "an abstract mesh has no device order: set a concrete one with jax.set_mesh.")
        ids = {device: i for i, device in enumerate(jax.devices())}
        devices = jax_mesh.devices
        if not all(d in ids and ids[d] < devices.size for d in devices.flat):
            raise ShardingError(
                f"{jax_mesh} uses devices {[str(d) for d in devices.flat]}, but gspmd numbers devices by their "
                f"position in jax.devices() and a mesh of {devices.size} must use the first {devices.size} of "
                "them; build the jax mesh from jax.devices()[:n].")
        return cls(np.vectorize(ids.__getitem__, otypes=[np.int64])(devices), jax_mesh.axis_names)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.devices.shape

    @property
    def size(self) -> int:
        return self.devices.size

    @property
    def ndim(self) -> int:
        return self.devices.ndim

    def axis_index(self, axis) -> int:
        """Mesh dim of an axis given by name or by a non-negative int."""
        if isinstance(axis, str):
            if axis not in self.axis_names:
                raise ShardingError(f"Unknown mesh axis {axis!r}; {self} has axes {self.axis_names}.")
            return self.axis_names.index(axis)
        if isinstance(axis, (int, np.integer)) and not isinstance(axis, bool):
            if not 0 <= axis < self.ndim:
                raise ShardingError(
                    f"Mesh dim {axis} is out of range for {self} with {self.ndim} dims; "
                    f"use 0..{self.ndim - 1} or an axis name from {self.axis_names}.")
            return int(axis)
        raise ShardingError(f"Mesh axis must be a name or an int, got {axis!r} for {self}.")

    def _key(self):
        return (self.devices.shape, self.devices.tobytes(), self.axis_names)

    def __eq__(self, other):
        return isinstance(other, Mesh) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def __repr__(self):
        axes = ", ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.shape))
        order = "" if np.array_equal(self.devices.ravel(), np.arange(self.size)) else \
            f", devices={self.devices.ravel().tolist()}"
        return f"Mesh({axes}{order})"
