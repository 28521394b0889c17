"""Mesh: an n-d array of device ids with one name per dimension (and its jax twin)."""
from __future__ import annotations

import functools
import math
from typing import Optional, Sequence

import jax
import numpy as np

from gspmd.errors import ShardingError


class Mesh:
    """A logical device mesh: `devices` is an n-d array of device ids 0..N-1 (in any
    order: the order is how a user maps the logical mesh onto the physical network),
    `axis_names` names each mesh dimension.

    Device id d is jax device `jax_devices()[d]`: by default the first N of
    `jax.devices()`; a mesh built from jax devices (`Mesh.from_jax(jax_mesh)`, or
    `Mesh(jax_mesh.devices, names)`) keeps the devices it was given. `to_jax()` gives
    the `jax.sharding.Mesh` over those devices. A mesh over devices this process has
    not (another topology's, or gspmd.planning's stand-ins; ids in the order of theirs)
    is for planning: programs over it lower and report, the jax backend will not run.
    """

    def __init__(self, devices, axis_names: Sequence[str]):
        axis_names = _axis_names(axis_names)
        devices, self._jax_devices = _device_ids(devices)
        if devices.size == 0 or devices.dtype.kind not in "iu":
            raise ShardingError(f"Mesh devices must be integer device ids (or jax devices), got "
                                f"{devices.tolist()!r:.60} of dtype {devices.dtype}; use e.g. "
                                "np.arange(8).reshape(2, 4).")
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
        # The jax mesh this one came from (its axis types: jax.make_mesh makes Explicit
        # axes), which functions are traced under and results laid out over; None: Auto axes.
        # An abstract one (Mesh.of_abstract) names no devices: a staged trace's arguments do.
        self._jax_mesh: Optional[jax.sharding.Mesh | jax.sharding.AbstractMesh] = None

    # -- jax interop ----------------------------------------------------------------
    @classmethod
    def from_jax(cls, mesh) -> "Mesh":
        """The gspmd.Mesh of a `jax.sharding.Mesh` (any axis types, e.g. from
        jax.make_mesh): same devices, same layout, same axis names."""
        if isinstance(mesh, Mesh):
            raise ShardingError(f"Mesh.from_jax needs a jax.sharding.Mesh, got the gspmd {mesh!r}: use it as it is "
                                "(or mesh.to_jax() for its jax twin).")
        if not isinstance(mesh, jax.sharding.Mesh):
            raise ShardingError(f"Mesh.from_jax needs a jax.sharding.Mesh with devices, got {mesh!r}; "
                                "an abstract mesh has no device order: set a concrete one with jax.set_mesh.")
        return _from_jax(mesh)

    @classmethod
    def of_abstract(cls, mesh: jax.sharding.AbstractMesh) -> "Mesh":
        """The mesh an abstract one stands for in a staged trace (another jax.jit's) whose
        arguments are typed over it: its positions as device ids. Programs over it run
        in that trace only, where jax takes the devices from the outer call's arguments."""
        return _from_abstract(mesh)

    @property
    def is_abstract(self) -> bool:
        """Whether the mesh stands for an abstract one (Mesh.of_abstract): no devices of its own."""
        return isinstance(self._jax_mesh, jax.sharding.AbstractMesh)

    def to_jax(self, auto: bool = False) -> jax.sharding.Mesh | jax.sharding.AbstractMesh:
        """This mesh as a `jax.sharding.Mesh` over its jax devices: the one it came from
        (Mesh.from_jax, with that mesh's axis types), else (or with `auto`) one of Auto
        axes; for an abstract mesh (Mesh.of_abstract), that mesh or its twin of Auto axes."""
        if self._jax_mesh is not None and not auto:
            return self._jax_mesh
        if self.is_abstract:
            return self._jax_mesh.update_axis_types(dict.fromkeys(self.axis_names, jax.sharding.AxisType.Auto))
        return self._jax_mesh_over(self.jax_devices())

    def _jax_mesh_over(self, devices: Sequence) -> jax.sharding.Mesh:
        return jax.sharding.Mesh(np.array(devices, dtype=object)[self.devices], self.axis_names,
                                 axis_types=self._auto_axes())

    def _auto_axes(self) -> tuple:
        """Every axis Auto, stated: jax's defaults moved (jax 0.12's AbstractMesh is Explicit)."""
        return (jax.sharding.AxisType.Auto,) * len(self.axis_names)

    def abstract(self) -> jax.sharding.AbstractMesh:
        """jax's abstract twin (what jax traces under): the jax mesh's it came from, else
        that of one of Auto axes over its jax devices (device kind included: what
        jax.shard_map derives from a jax.sharding.Mesh over them and compares with the
        context mesh), or without devices where jax has too few (planning only). Over devices
        this process has not (stand-ins), over those: jax asks only for their platform and kind."""
        if self._jax_mesh is not None:
            return self._jax_mesh.abstract_mesh
        if self._jax_devices is not None:
            return self._jax_mesh_over(self._jax_devices).abstract_mesh
        if self.size <= jax.device_count():
            return self.to_jax(auto=True).abstract_mesh
        return jax.sharding.AbstractMesh(self.shape, self.axis_names, axis_types=self._auto_axes())

    def has_jax_devices(self) -> bool:
        """Whether jax_devices() has the mesh's devices (else the mesh is for planning)."""
        if self._jax_devices is not None:
            return set(self._jax_devices) <= set(jax.devices())
        return self.size <= jax.device_count()

    def jax_devices(self) -> list:
        """The jax device of each device id (raises when jax has too few devices)."""
        devices = jax.devices()
        if self._jax_devices is not None:
            local = set(devices)
            others = [d for d in self._jax_devices if d not in local]
            if others:
                raise ShardingError(
                    f"{self} is over devices this process does not have ({others[0].platform} devices of kind "
                    f"{others[0].device_kind!r}): such a mesh is for planning (lower() and report()), not for "
                    "running; run on a mesh over jax.devices().")
            return list(self._jax_devices)
        if self.size > len(devices):
            raise ShardingError(
                f"{self} needs {self.size} devices but jax has {len(devices)} ({devices[0].platform}); on CPU "
                f"set XLA_FLAGS=--xla_force_host_platform_device_count={self.size} (or jax_num_cpu_devices) "
                "before importing jax.")
        return devices[:self.size]

    def same_devices(self, other: "Mesh") -> bool:
        """True when both meshes cover the same jax devices with the same ids."""
        return self.size == other.size and self._jax_devices == other._jax_devices

    # -- shape ------------------------------------------------------------------------
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

    def factor_axis(self, axis, names: Sequence[str], sizes: Sequence[int]) -> "Mesh":
        """This mesh with `axis` factored into axes `names` of `sizes` (major first), over
        the same devices in the same order: annotations over it split a dim over a part
        of the axis."""
        k = self.axis_index(axis)
        if math.prod(sizes) != self.shape[k] or len(names) != len(sizes):
            raise ShardingError(f"Axis {self.axis_names[k]!r} of {self} has {self.shape[k]} devices, which "
                                f"{dict(zip(names, sizes))} do not factor.")
        shape = self.shape[:k] + tuple(sizes) + self.shape[k + 1:]
        factored = Mesh(self.devices.reshape(shape), self.axis_names[:k] + tuple(names) + self.axis_names[k + 1:])
        factored._jax_devices = self._jax_devices
        return factored

    def _key(self):
        return (self.devices.shape, self.devices.tobytes(), self.axis_names, self._jax_devices)

    def __eq__(self, other):
        return isinstance(other, Mesh) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def __repr__(self):
        axes = ", ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.shape))
        order = "" if np.array_equal(self.devices.ravel(), np.arange(self.size)) else \
            f", devices={_listed(self.devices.ravel())}"
        where = ", abstract" if self.is_abstract else "" if self._jax_devices is None else \
            f", jax devices {_listed(np.array([d.id for d in self._jax_devices]))}"
        return f"Mesh({axes}{order}{where})"


def _listed(ids: np.ndarray) -> str:
    """Device ids as a list, or (past 32, as on a slice of a TPU pod) in iota form where they are one."""
    return (ids.size > 32 and iota_form(ids)) or str(ids.tolist())


def iota_form(flat: np.ndarray) -> Optional[str]:
    """XLA's compact form of a device order that is arange(N) reshaped and transposed
    ("<=[8]", "<=[2,4]T(1,0)"), with as few dims as it takes (a mesh laid out on a 3D
    torus takes four or more); None otherwise. Read off the order itself, minor dim first:
    each dim is the longest run of equal steps between blocks of the dims before it."""
    n = flat.size
    if np.array_equal(flat, np.arange(n)):
        return f"<=[{n}]"
    dims: list[tuple[int, int]] = []      # (size, stride in arange(N)), minor first
    block = 1
    while block < n:
        stride, run = int(flat[block]) - int(flat[0]), 2
        while block * run < n and int(flat[block * run]) - int(flat[0]) == run * stride:
            run += 1
        size = max((z for z in range(2, run + 1) if (n // block) % z == 0), default=None)
        if size is None:
            return None
        dims.append((size, stride))
        block *= size
    strides = sorted(dims, key=lambda d: d[1])      # the iota's dims, minor first
    if flat[0] != 0 or [t for _, t in strides] != list(np.cumprod([1] + [z for z, _ in strides[:-1]])):
        return None
    shape = [z for z, _ in reversed(strides)]       # the iota's dims, major first
    perm = [len(dims) - 1 - strides.index(d) for d in reversed(dims)]
    if not np.array_equal(np.arange(n).reshape(shape).transpose(perm).ravel(), flat):
        return None
    return f"<=[{','.join(map(str, shape))}]T({','.join(map(str, perm))})"


def _axis_names(names) -> tuple[str, ...]:
    """Mesh axis names: a sequence of distinct non-empty strings, in mesh dim order."""
    if isinstance(names, str):
        raise ShardingError(f"Mesh axis_names {names!r} is one string; give one name per mesh "
                            f"dimension, e.g. ({names!r},).")
    if not isinstance(names, (tuple, list)) or not all(isinstance(n, str) and n for n in names):
        raise ShardingError(f"Mesh axis_names must be a tuple of non-empty strings, one per mesh dimension "
                            f"(in order), got {names!r:.60}; e.g. ('data', 'model').")
    return tuple(names)


def _device_ids(devices) -> tuple[np.ndarray, Optional[tuple]]:
    """Device ids, and the jax devices they stand for when jax devices were given (None
    when those are the first N of jax.devices(), the default)."""
    try:
        arr = np.asarray(devices)
    except ValueError:
        raise ShardingError(f"Mesh devices {devices!r:.60} are not a rectangular array (rows of different "
                            "lengths); give an n-d array of device ids, e.g. np.arange(8).reshape(2, 4).") from None
    if arr.dtype != object or arr.size == 0 or not all(hasattr(d, "platform") for d in arr.ravel()):
        return arr, None
    position = {d: i for i, d in enumerate(jax.devices())}
    unknown = [d for d in arr.ravel() if d not in position]
    if 0 < len(unknown) < arr.size:
        raise ShardingError(f"Mesh devices {unknown} are not among jax.devices(); build meshes over this "
                            "process's jax devices (or, to plan for hardware this process has not, all over "
                            "another topology's devices).")
    if unknown:    # another topology's devices (to plan for): ordered by their ids
        position = {d: d.id for d in arr.ravel()}
    ordered = sorted(set(arr.ravel()), key=position.__getitem__)
    if len(ordered) != arr.size:
        raise ShardingError(f"Mesh devices {[d.id for d in arr.ravel()]} list a device more than once.")
    ids = np.vectorize({d: i for i, d in enumerate(ordered)}.__getitem__, otypes=[np.int64])(arr)
    default = not unknown and ordered == jax.devices()[:len(ordered)]
    return ids, None if default else tuple(ordered)


def has_explicit_axes(mesh) -> bool:
    """Whether a jax mesh (concrete or abstract) has an axis in explicit sharding mode,
    so that values over it carry their layouts in their types."""
    return jax.sharding.AxisType.Explicit in mesh.axis_types


def explicit_sharding(x) -> Optional[jax.sharding.NamedSharding]:
    """The layout x's type carries: a jax array's (or jax.ShapeDtypeStruct's) sharding
    over a mesh with Explicit axes (jax.make_mesh's); None for any other value."""
    if isinstance(x, jax.core.Tracer):
        return None
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding) and has_explicit_axes(sharding.mesh):
        return sharding
    return None


def as_mesh(mesh, what: str = "", within: Optional[Mesh] = None) -> Mesh:
    """A gspmd.Mesh from a gspmd.Mesh or a jax.sharding.Mesh, or from a
    jax.sharding.AbstractMesh the mesh it stands for (see concrete_mesh; `within`: the
    gspmd.jit's mesh); a ShardingError otherwise."""
    if isinstance(mesh, Mesh):
        return mesh
    if isinstance(mesh, jax.sharding.Mesh):
        return _from_jax(mesh)
    if isinstance(mesh, jax.sharding.AbstractMesh):
        return concrete_mesh(mesh, within)
    where = f" {what}" if what else ""
    raise ShardingError(
        f"Expected a mesh{where}, got {type(mesh).__module__}.{type(mesh).__name__} {mesh!r:.60}; give a "
        "gspmd.Mesh(np.arange(n).reshape(...), axis_names) or a jax.sharding.Mesh (e.g. jax.make_mesh).")


def concrete_mesh(abstract: jax.sharding.AbstractMesh, within: Optional[Mesh] = None) -> Mesh:
    """The mesh an abstract one (a bare PartitionSpec's, or a NamedSharding's built
    without devices, as MaxText's abstract train state for ahead-of-time compilation)
    stands for: the concrete mesh jax.set_mesh put around the call, else `within`
    (gspmd.jit(mesh=...)), whichever has the same axes and sizes."""
    axes = tuple(zip(abstract.axis_names, abstract.axis_sizes))
    context = jax_context_mesh()
    for mesh in (None if context is None else _from_jax(context), within):
        if mesh is not None and tuple(zip(mesh.axis_names, mesh.shape)) == axes:
            return mesh
    raise ShardingError(
        f"A PartitionSpec or an abstract mesh names the mesh axes {dict(axes)}, but no mesh with these axes is "
        "known: call the function under `with jax.set_mesh(mesh):`, or pass gspmd.jit(mesh=...) with these axes "
        "(a gspmd.Mesh needs no jax devices: planning only), or use NamedSharding over a concrete mesh.")


@functools.lru_cache(maxsize=256)
def _from_jax(mesh: jax.sharding.Mesh) -> Mesh:
    ours = Mesh(mesh.devices, mesh.axis_names)
    ours._jax_mesh = mesh
    return ours


@functools.lru_cache(maxsize=256)
def _from_abstract(mesh: jax.sharding.AbstractMesh) -> Mesh:
    ours = Mesh(np.arange(mesh.size).reshape(mesh.axis_sizes), mesh.axis_names)
    ours._jax_mesh = mesh
    return ours


def jax_context_mesh() -> Optional[jax.sharding.Mesh]:
    """The concrete mesh jax.set_mesh put around the call, also inside a jax trace
    (where jax.sharding.get_mesh refuses); None without one."""
    from jax._src.mesh import get_concrete_mesh    # jax's own reader, which works in traces
    mesh = get_concrete_mesh()
    return None if mesh is None or mesh.empty else mesh
