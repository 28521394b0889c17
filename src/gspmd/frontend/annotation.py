"""`mesh_split`: a JAX primitive that is the identity at run time and carries a Sharding.

Its JVP and transpose put the same annotation on tangents and cotangents, so gradients
get the layout of the value they belong to; under vmap the new dim is left UNSPECIFIED.
gspmd.jit traces inside `tracing(mesh)`: there mesh_split checks its mesh against the
jit's and records it; anywhere else it warns (once per call site) that it does nothing.
"""
from __future__ import annotations

import contextlib
import sys
import warnings
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from gspmd.checks import array_shape
from gspmd.errors import ShardingError, UnpartitionedWarning
from gspmd.mesh import Mesh, as_mesh
from gspmd.sharding import UNSPECIFIED, Sharding, example_mapping, normalize_dims_mapping

mesh_split_p = Primitive("mesh_split")
_substitutes: list[Callable] = []


@dataclass
class Tracing:
    """What a gspmd.jit trace knows about meshes: its own (jit(mesh=)) and those its
    annotations used, in order of first use."""
    mesh: Optional[Mesh]
    meshes: list[Mesh] = field(default_factory=list)

    def use(self, mesh: Mesh, what: str) -> None:
        for other, whose in ((self.mesh, "gspmd.jit(mesh=...)"), (self.meshes[0] if self.meshes else None,
                                                                  "an earlier annotation")):
            if other is not None and not mesh.same_devices(other):
                differ = f"of different sizes ({mesh.size} and {other.size} devices)" if mesh.size != other.size \
                    else "over different jax devices"
                raise ShardingError(
                    f"mesh_split of the {what} uses {mesh} but {whose} uses {other}: meshes {differ}. All meshes "
                    "of one program must cover the same devices: annotate over the jit's mesh (or "
                    "jit_mesh.to_jax()), or give jit the annotations' mesh.")
        if mesh not in self.meshes:
            self.meshes.append(mesh)


_tracing: list[Tracing] = []
_warned_sites: set[tuple[str, int]] = set()


@contextlib.contextmanager
def tracing(mesh: Optional[Mesh]) -> Iterator[Tracing]:
    """gspmd.jit traces the user's function inside this block."""
    _tracing.append(Tracing(mesh))
    try:
        yield _tracing[-1]
    finally:
        _tracing.pop()


def is_tracing() -> bool:
    """Whether a gspmd.jit is tracing a function now (a gspmd.jit called inside it is
    inlined, as jax.jit inlines a nested jax.jit)."""
    return bool(_tracing)


def record_mesh(mesh: Mesh, what: str) -> None:
    """Within a gspmd.jit trace: check an annotation's mesh against the others, and
    remember it (outputs are laid out over the meshes the user named)."""
    if _tracing:
        _tracing[-1].use(mesh, what)


@contextlib.contextmanager
def mesh_split_as(fn: Callable) -> Iterator[None]:
    """Within the block, mesh_split(x, mesh, dims_mapping) returns fn(x, mesh, dims_mapping)
    instead (mesh a gspmd.Mesh, dims_mapping a list of one entry per dim): e.g. a
    with_sharding_constraint, to hand the same annotated model to XLA's own partitioner."""
    _substitutes.append(fn)
    try:
        yield
    finally:
        _substitutes.pop()


def unpartitioned() -> contextlib.AbstractContextManager:
    """Within the block mesh_split returns its input, without a warning: for running an
    annotated function on one device on purpose (a reference result)."""
    return mesh_split_as(lambda x, mesh, dims_mapping: x)


def mesh_split(x, mesh, dims_mapping=None):
    """Annotate `x` as split over `mesh` (a gspmd.Mesh or jax.sharding.Mesh).

    dims_mapping[i] says what splits tensor dim i: a mesh axis (name or index), a
    tuple of axes (major to minor), -1/None for unsplit, or UNSPECIFIED to let
    propagation decide. A PartitionSpec works too (short forms are padded with None,
    P.UNCONSTRAINED is UNSPECIFIED), and so does `mesh_split(x, named_sharding)`.

    Semantically the identity; it takes effect inside gspmd.jit (elsewhere it warns
    once per call site and does nothing)."""
    if _is_named_sharding(mesh):
        if dims_mapping is not None:
            raise ShardingError(f"mesh_split(x, {mesh}, {dims_mapping!r}): a NamedSharding already holds the "
                                "spec; drop the dims_mapping, or pass the mesh instead of the NamedSharding.")
        mesh, dims_mapping = mesh.mesh, mesh.spec
    shape = array_shape(x, "The value mesh_split annotates")
    what = f"value of shape {shape}"
    mesh = as_mesh(mesh, f"for mesh_split of the {what}", _tracing[-1].mesh if _tracing else None)
    if dims_mapping is None:
        raise ShardingError(f"mesh_split of the {what} on {mesh} needs a dims_mapping (one entry per dim, e.g. "
                            f"{example_mapping(mesh, len(shape))}) or a NamedSharding.")
    dims_mapping = normalize_dims_mapping(dims_mapping, shape, mesh, f"{what} on {mesh}")
    if _substitutes:
        return _substitutes[-1](x, mesh, dims_mapping)
    if _tracing:
        record_mesh(mesh, what)
    else:   # still bound: a jaxpr jax caches now may be inlined into a gspmd.jit later
        _warn_unpartitioned(what)
    sharding = Sharding.from_mesh(mesh, dims_mapping, shape)
    unspecified = tuple(i for i, e in enumerate(dims_mapping) if e is UNSPECIFIED)
    return mesh_split_p.bind(x, sharding=sharding, unspecified=unspecified)


def _is_named_sharding(x) -> bool:
    import jax
    return isinstance(x, jax.sharding.NamedSharding)


def _warn_unpartitioned(what: str) -> None:
    """Once per call site: the first frame outside gspmd's own frontend."""
    frame = sys._getframe(2)
    site = (frame.f_code.co_filename, frame.f_lineno)
    if site in _warned_sites:
        return
    _warned_sites.add(site)
    warnings.warn_explicit(
        f"gspmd.mesh_split of a {what} ran outside gspmd.jit (eagerly or under jax.jit), where it does "
        "nothing: the value is not partitioned. Call the function through gspmd.jit(fn, mesh=...) to "
        "partition it; under plain jax.jit use jax.lax.with_sharding_constraint; to run it on one device on "
        "purpose, wrap the call in gspmd.frontend.annotation.unpartitioned().",
        UnpartitionedWarning, site[0], site[1])


def _transpose(ct, x, *, sharding, unspecified):
    return [mesh_split_p.bind(ct, sharding=sharding, unspecified=unspecified)]


def _batch(args, dims, *, sharding, unspecified):
    (x,), (bd,) = args, dims
    if bd is None:   # operand not batched
        return mesh_split_p.bind(x, sharding=sharding, unspecified=unspecified), bd
    shifted = tuple(d + (d >= bd) for d in unspecified)
    return mesh_split_p.bind(x, sharding=sharding.insert_dim(bd),
                             unspecified=tuple(sorted(shifted + (bd,)))), bd


mesh_split_p.def_impl(lambda x, **_: x)
mesh_split_p.def_abstract_eval(lambda x, **_: x)
ad.deflinear2(mesh_split_p, _transpose)
batching.primitive_batchers[mesh_split_p] = _batch
mlir.register_lowering(mesh_split_p, mlir.lower_fun(lambda x, **_: x, multiple_results=False))
