"""`gspmd.manual`: a subgraph written per device, as with jax.shard_map (paper 3.4).

Inside `fn` every value is one manual partition's piece: a dim mapped to manual mesh
axes by its spec is divided by their sizes, and JAX's collectives over those axis names
(psum, pmax, pmin, all_gather, psum_scatter, all_to_all, ppermute, axis_index) talk to
the other partitions. Mesh axes that are not manual stay automatic: specs may not name
them and the subgraph is replicated over them (each such subgroup runs it alike).

Run by plain JAX, the subgraph is vmapped over the manual axes with those axis names; in
gspmd its per-device code is placed into the SPMD program as it is (ops/manual.py).
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive, jaxpr_as_fun
from jax.interpreters import ad, mlir

from gspmd.errors import ShardingError
from gspmd.mesh import Mesh, as_mesh

manual_p = Primitive("manual")
manual_p.multiple_results = True


def manual(fn: Callable, mesh: Mesh, in_specs: Sequence, out_specs: Sequence,
           manual_axes: Optional[Sequence[str]] = None) -> Callable:
    """Wrap `fn` (positional array arguments, a tuple or single array result) so that
    it runs per manual partition. in_specs/out_specs: one dims_mapping per argument /
    result (mesh axis names or -1/None per dim). `mesh`: a gspmd.Mesh or jax Mesh."""
    mesh = as_mesh(mesh, "for gspmd.manual")
    axes = tuple(manual_axes) if manual_axes is not None else mesh.axis_names
    for a in axes:
        mesh.axis_index(a)   # validates the name
    single = not isinstance(out_specs, (list, tuple)) or (len(out_specs) > 0 and not isinstance(
        out_specs[0], (list, tuple)))
    out_specs = [out_specs] if single else list(out_specs)

    def wrapped(*args):
        if len(args) != len(in_specs):
            raise ShardingError(f"gspmd.manual got {len(args)} arguments but {len(in_specs)} in_specs.")
        in_norm = tuple(_spec(mesh, axes, s, np.shape(x), f"argument {i}") for i, (x, s) in
                        enumerate(zip(args, in_specs)))
        local = [jax.ShapeDtypeStruct(_local_shape(mesh, s, np.shape(x)), jnp.result_type(x))
                 for x, s in zip(args, in_norm)]
        closed = jax.make_jaxpr(lambda *a: _as_tuple(fn(*a)),
                                axis_env=[(a, _size(mesh, a)) for a in axes])(*local)
        if len(closed.out_avals) != len(out_specs):
            raise ShardingError(f"gspmd.manual: fn returns {len(closed.out_avals)} values but "
                                f"{len(out_specs)} out_specs were given.")
        out_norm = tuple(_spec(mesh, axes, s, None, f"result {i}") for i, s in enumerate(out_specs))
        out_shapes = tuple(_global_shape(mesh, s, a.shape) for s, a in zip(out_norm, closed.out_avals))
        outs = manual_p.bind(*args, body=closed, mesh=mesh, axes=axes, in_specs=in_norm, out_specs=out_norm,
                             out_shapes=out_shapes)
        return outs[0] if single else tuple(outs)
    return wrapped


def _as_tuple(x):
    return tuple(x) if isinstance(x, (list, tuple)) else (x,)


def _spec(mesh: Mesh, axes, spec, shape, what: str) -> tuple:
    """dims_mapping -> per dim, the tuple of manual axis names splitting it."""
    if shape is not None and len(spec) != len(shape):
        raise ShardingError(f"gspmd.manual: the spec {list(spec)} of {what} (shape {tuple(shape)}) needs one "
                            f"entry per dim on {mesh}.")
    out = []
    for entry in spec:
        names = () if entry is None or entry == -1 else tuple(entry) if isinstance(entry, (list, tuple)) \
            else (entry,)
        names = tuple(mesh.axis_names[mesh.axis_index(n)] for n in names)
        if any(n not in axes for n in names):
            raise ShardingError(f"gspmd.manual: the spec {list(spec)} of {what} names a mesh axis that is not "
                                f"manual ({axes}) on {mesh}; add it to manual_axes or leave that dim unsplit.")
        out.append(names)
    return tuple(out)


def _size(mesh: Mesh, name: str) -> int:
    return mesh.shape[mesh.axis_index(name)]


def _parts(mesh: Mesh, names) -> int:
    return math.prod(_size(mesh, n) for n in names)


def _local_shape(mesh: Mesh, spec, shape) -> tuple:
    for d, (names, n) in enumerate(zip(spec, shape)):
        if n % _parts(mesh, names):
            raise ShardingError(f"gspmd.manual: dim {d} of size {n} (shape {tuple(shape)}) does not divide into "
                                f"{_parts(mesh, names)} parts over axes {names} of {mesh}; pad it.")
    return tuple(n // _parts(mesh, names) for names, n in zip(spec, shape))


def _global_shape(mesh: Mesh, spec, shape) -> tuple:
    return tuple(n * _parts(mesh, names) for names, n in zip(spec, shape))


# -- plain JAX: vmap over the manual axes -------------------------------------------------
def _split(x, mesh: Mesh, axes, spec):
    """[*global] -> [*axis sizes, *local]: the manual axes lead, in `axes` order."""
    shape, lead, local = [], {}, []
    for names, n in zip(spec, x.shape):
        for name in names:
            lead[name] = len(shape)
            shape.append(_size(mesh, name))
        local.append(len(shape))
        shape.append(n // _parts(mesh, names))
    x = jnp.reshape(x, shape)
    x = jnp.transpose(x, [lead[a] for a in axes if a in lead] + local)
    for i, name in enumerate(axes):   # not split on this axis: every partition sees it whole
        if name not in lead:
            x = jnp.broadcast_to(jnp.expand_dims(x, i), x.shape[:i] + (_size(mesh, name),) + x.shape[i:])
    return x


def _merge(y, mesh: Mesh, axes, spec):
    """Inverse of _split; over axes the result is not split on, partition 0's copy."""
    used = {n for names in spec for n in names}
    y = y[tuple(slice(None) if a in used else 0 for a in axes)]
    kept = [a for a in axes if a in used]
    order, shape = [], []
    for d, names in enumerate(spec):
        order += [kept.index(n) for n in names] + [len(kept) + d]
        shape.append(y.shape[len(kept) + d] * _parts(mesh, names))
    return jnp.reshape(jnp.transpose(y, order), shape)


def _reference(*args, body, mesh, axes, in_specs, out_specs, out_shapes):
    fn = jaxpr_as_fun(body)
    for name in reversed(axes):
        fn = jax.vmap(fn, axis_name=name)
    outs = fn(*[_split(x, mesh, axes, s) for x, s in zip(args, in_specs)])
    return [_merge(y, mesh, axes, s) for y, s in zip(outs, out_specs)]


def _abstract(*args, body, out_shapes, **_):
    return [jax.core.ShapedArray(shape, a.dtype) for shape, a in zip(out_shapes, body.out_avals)]


def _no_differentiation(*args, **kwargs):
    raise ShardingError("Gradients through gspmd.manual are not supported yet: differentiate inside the "
                        "manual function, or write the region with mesh_split annotations.")


manual_p.def_impl(_reference)
manual_p.def_abstract_eval(_abstract)
mlir.register_lowering(manual_p, mlir.lower_fun(_reference, multiple_results=True))
ad.primitive_jvps[manual_p] = _no_differentiation
