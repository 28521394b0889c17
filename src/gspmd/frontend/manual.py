"""`gspmd.manual`: a subgraph written per device, as with jax.shard_map (paper 3.4).

Inside `fn` every value is one manual partition's piece: a dim mapped to manual mesh
axes by its spec is divided by their sizes, and JAX's collectives over those axis names
(psum, pmax, pmin, all_gather, psum_scatter, all_to_all, ppermute, axis_index) talk to
the other partitions. Mesh axes that are not manual stay automatic: specs may not name
them, and inside the subgraph values are partitioned over them as its own mesh_split
annotations (over those axes only) and propagation say (ops/manual.py).

Run by plain JAX, the subgraph is vmapped over the manual axes with those axis names.
Its gradient is a manual region too: the forward region also returns each partition's
residuals of the subgraph's vjp, and the backward region applies that vjp.
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive, jaxpr_as_fun
from jax.interpreters import mlir
from jax.sharding import PartitionSpec

from gspmd.checks import array_shape, describe, function
from gspmd.errors import ShardingError
from gspmd.mesh import Mesh, as_mesh
from gspmd.sharding import normalize_dims_mapping

manual_p = Primitive("manual")
manual_p.multiple_results = True


def manual(fn: Callable, mesh: Mesh, in_specs: Sequence, out_specs: Sequence,
           manual_axes: Optional[Sequence[str]] = None) -> Callable:
    """Wrap `fn` (positional array arguments, a tuple or single array result) so that
    it runs per manual partition. in_specs/out_specs: one dims_mapping per argument /
    result (mesh axis names or -1/None per dim; a PartitionSpec in_specs applies to every
    argument). `mesh`: a gspmd.Mesh or jax Mesh."""
    mesh = as_mesh(mesh, "for gspmd.manual")
    axes = _manual_axes(mesh, manual_axes)
    single = isinstance(out_specs, PartitionSpec) or not isinstance(out_specs, (list, tuple)) or (
        len(out_specs) > 0 and not isinstance(out_specs[0], (list, tuple)))
    out_specs = [out_specs] if single else list(out_specs)
    if not isinstance(in_specs, (list, tuple)):
        raise ShardingError(f"gspmd.manual(in_specs=...) needs one dims_mapping per argument of fn, got "
                            f"{describe(in_specs)}; e.g. in_specs=[['{mesh.axis_names[0]}', None]] for one argument.")
    if not isinstance(in_specs, PartitionSpec):
        function(fn, "gspmd.manual's fn (it gets one argument per entry of in_specs)", arity=len(in_specs))

    def wrapped(*args):
        specs = [in_specs] * len(args) if isinstance(in_specs, PartitionSpec) else in_specs
        if len(args) != len(specs):
            raise ShardingError(f"gspmd.manual got {len(args)} arguments but {len(specs)} in_specs.")
        in_norm = tuple(_spec(mesh, axes, s, array_shape(x, f"Argument {i} of gspmd.manual"), f"argument {i}")
                        for i, (x, s) in enumerate(zip(args, specs)))
        out_norm = tuple(_spec(mesh, axes, s, None, f"result {i}") for i, s in enumerate(out_specs))
        outs = _Region(fn, mesh, axes, in_norm, out_norm).differentiable()(*args)
        return outs[0] if single else tuple(outs)
    return wrapped


class _Region:
    """One gspmd.manual call: the region, and its gradient as a manual region too (the
    forward region also returns the per-partition residuals of the body's vjp, the
    backward region applies the vjp to them)."""

    def __init__(self, fn: Callable, mesh: Mesh, axes: tuple, in_specs: tuple, out_specs: tuple):
        self.fn, self.mesh, self.axes, self.in_specs, self.out_specs = fn, mesh, axes, in_specs, out_specs

    def bind(self, body: Callable, args, in_specs, out_specs: Callable[[list], Sequence]):
        """manual_p over `body` (per partition); out_specs(its local results) -> their specs."""
        local = [jax.ShapeDtypeStruct(_local_shape(self.mesh, s, np.shape(x)), jnp.result_type(x))
                 for x, s in zip(args, in_specs)]
        closed = jax.make_jaxpr(lambda *a: _as_tuple(body(*a)),
                                axis_env=[(a, _size(self.mesh, a)) for a in self.axes])(*local)
        specs = tuple(out_specs(closed.out_avals))
        out_shapes = tuple(_global_shape(self.mesh, s, a.shape) for s, a in zip(specs, closed.out_avals))
        return manual_p.bind(*args, body=closed, mesh=self.mesh, axes=self.axes, in_specs=tuple(in_specs),
                             out_specs=specs, out_shapes=out_shapes)

    def results(self, avals) -> tuple:
        if len(avals) != len(self.out_specs):
            raise ShardingError(f"gspmd.manual: fn returns {len(avals)} values but {len(self.out_specs)} out_specs "
                                "were given.")
        for i, (spec, aval) in enumerate(zip(self.out_specs, avals)):
            if len(spec) != len(aval.shape):
                raise ShardingError(f"gspmd.manual: out_specs[{i}] has {len(spec)} entries but result {i} of fn has "
                                    f"rank {len(aval.shape)} (per partition {aval.str_short()}): give one entry per "
                                    "dim (-1 or None for unsplit).")
        return self.out_specs

    def unsplit_axes(self, spec) -> tuple:
        """The manual axes a spec does not split over."""
        return tuple(a for a in self.axes if all(a not in names for names in spec))

    def replicas(self, spec) -> int:
        return math.prod(_size(self.mesh, a) for a in self.unsplit_axes(spec))

    def sum_replicas(self, g, spec):
        axes = self.unsplit_axes(spec)
        return jax.lax.psum(g, axes) if axes else g

    def residual_spec(self, aval) -> tuple:
        """A residual of one partition gets a leading unit dim per manual axis, split over it."""
        return tuple((a,) for a in self.axes) + ((),) * (len(aval.shape) - len(self.axes))

    def differentiable(self) -> Callable:
        vjp_structure = []

        def run(*args):
            return tuple(self.bind(self.fn, args, self.in_specs, self.results))

        def fwd(*args):
            def body(*a):
                outs, vjp = jax.vjp(lambda *b: _as_tuple(self.fn(*b)), *a)
                residuals, structure = jax.tree_util.tree_flatten(vjp)
                vjp_structure.append(structure)
                return (*outs, *[jnp.reshape(r, (1,) * len(self.axes) + jnp.shape(r)) for r in residuals])

            def specs(avals):
                n = len(self.out_specs)
                return self.results(avals[:n]) + tuple(self.residual_spec(a) for a in avals[n:])
            outs = self.bind(body, args, self.in_specs, specs)
            n = len(self.out_specs)
            return tuple(outs[:n]), (tuple(outs[n:]), tuple(jnp.issubdtype(jnp.result_type(x), jnp.inexact)
                                                             for x in args))

        def bwd(saved, cts):
            residuals, differentiable = saved
            structure = vjp_structure[-1]

            def body(*a):
                rs, cts = a[:len(residuals)], a[len(residuals):]
                vjp = jax.tree_util.tree_unflatten(structure, [jnp.reshape(r, jnp.shape(r)[len(self.axes):])
                                                               for r in rs])
                # A result not split over a manual axis is the same in every partition along
                # it: each takes an equal share of its cotangent. An argument not split over
                # one was the same in all of them: its cotangent is the sum of theirs.
                grads = vjp(tuple(ct / self.replicas(spec) for ct, spec in zip(cts, self.out_specs)))
                return tuple(self.sum_replicas(g, spec) for g, spec, d in zip(grads, self.in_specs, differentiable)
                             if d)

            in_specs = tuple(self.residual_spec(r) for r in residuals) + self.out_specs
            grad_specs = tuple(s for s, d in zip(self.in_specs, differentiable) if d)
            grads = iter(self.bind(body, (*residuals, *cts), in_specs, lambda avals: grad_specs))
            return tuple(next(grads) if d else None for d in differentiable)

        region = jax.custom_vjp(run)
        region.defvjp(fwd, bwd)
        return region


def _as_tuple(x):
    return tuple(x) if isinstance(x, (list, tuple)) else (x,)


def _manual_axes(mesh: Mesh, manual_axes) -> tuple[str, ...]:
    """The manual axes by name (all of the mesh's by default), each once."""
    if manual_axes is None:
        return mesh.axis_names
    if isinstance(manual_axes, str) or not isinstance(manual_axes, (list, tuple, set, frozenset)):
        raise ShardingError(f"gspmd.manual(manual_axes=...) needs a tuple of mesh axis names, got "
                            f"{describe(manual_axes)}; e.g. manual_axes=({mesh.axis_names[0]!r},).")
    try:
        axes = tuple(mesh.axis_names[mesh.axis_index(a)] for a in manual_axes)
    except ShardingError as e:
        raise ShardingError(f"gspmd.manual(manual_axes={manual_axes!r}): {e}") from None
    if len(set(axes)) != len(axes):
        raise ShardingError(f"gspmd.manual(manual_axes={manual_axes!r}) names an axis more than once on {mesh}; "
                            "name each manual axis once.")
    return axes


def _spec(mesh: Mesh, axes, spec, shape, what: str) -> tuple:
    """dims_mapping -> per dim, the tuple of manual axis names splitting it (shape None:
    a result's, whose rank `_Region.results` checks)."""
    of = f"{what} of gspmd.manual" + ("" if shape is None else f" (shape {tuple(shape)})")
    spec = normalize_dims_mapping(spec, shape, mesh, of)
    out = []
    for entry in spec:
        names = () if entry is None or entry == -1 else tuple(entry) if isinstance(entry, (list, tuple)) \
            else (entry,)
        try:
            names = tuple(mesh.axis_names[mesh.axis_index(n)] for n in names)
        except ShardingError as e:
            raise ShardingError(f"gspmd.manual: bad entry {entry!r} in the spec {list(spec)} of {what}: {e}") from None
        if any(n not in axes for n in names):
            raise ShardingError(f"gspmd.manual: the spec {list(spec)} of {what} names a mesh axis that is not "
                                f"manual ({axes}) on {mesh}; add it to manual_axes or leave that dim unsplit.")
        out.append(names)
    used = [n for names in out for n in names]
    if len(set(used)) != len(used):
        raise ShardingError(f"gspmd.manual: the spec {list(spec)} of {what} uses a mesh axis more than once on "
                            f"{mesh}; each mesh axis may split at most one dim.")
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


manual_p.def_impl(_reference)
manual_p.def_abstract_eval(_abstract)
mlir.register_lowering(manual_p, mlir.lower_fun(_reference, multiple_results=True))
