"""How a partitioned program composes with JAX's transformations, as a jax.jit does:
each derivative and batched form of the function is a program of its own, traced from
the function and partitioned (with its annotations) on first use.

- jvp: a custom JVP rule runs the program and binds `gspmd_tangent`, the function's
  tangent map (linear in the tangents). Reverse mode transposes that map: its transpose
  is the pullback program (which recomputes the forward). Its own JVP is the tangent
  program's, so jvp, jacfwd, hessian and grad-of-grad compose to any order. Only the
  inputs jax perturbs have tangents (symbolic zeros tell the others, as under jax.jit:
  grad(argnums=i) differentiates argument i alone, and an op on the others need not
  be differentiable); each set of them has its own tangent and pullback programs, and
  results that depend on none of them have symbolically zero tangents.
- vmap: a custom vmap rule partitions the vmapped function; outputs that depend on no
  batched input stay unbatched (out_axes=None works as under jax.jit).
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import jax
import numpy as np
from jax import numpy as jnp
from jax.extend import core as jcore
from jax._src.core import unmapped_aval     # a type with a batch dim (its layout too), as vmap makes it
from jax.custom_derivatives import SymbolicZero
from jax.interpreters import ad, batching, mlir

from gspmd.frontend.trace import jaxpr_of
from gspmd.mesh import Mesh

Partition = Callable[[Callable], Callable]   # a function -> its partitioned form (a gspmd.jit of it)


def _inexact(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.inexact)


class Transforms:
    """The derived programs of one flat function (arrays in, a pytree of arrays out) of
    the given input and output avals, each partitioned by `partition` when first used."""

    def __init__(self, flat_fn: Callable, in_avals: Sequence, out_avals: Sequence, name: str, partition: Partition,
                 mesh: Optional[Mesh] = None, out_batched: Sequence[bool] = ()):
        """`mesh`: the jit's, under which the function is traced."""
        self.flat_fn, self.name, self.partition, self.mesh = flat_fn, name, partition, mesh
        self.in_avals, self.out_avals = list(in_avals), list(out_avals)
        self.floats = [i for i, a in enumerate(self.in_avals) if _inexact(a.dtype)]   # inputs with tangents
        self.float_outs = [i for i, a in enumerate(self.out_avals) if _inexact(a.dtype)]
        self.out_batched = list(out_batched)     # of a batched form: which outputs carry the batch dim
        self._program = None
        self._live_outs: dict = {}     # perturbed inputs -> the float outputs that depend on them
        self._tangent_maps: dict = {}  # (perturbed inputs, their outputs) -> tangent program
        self._pullbacks: dict = {}     # (perturbed inputs, their outputs) -> pullback program
        self._vmapped: dict = {}     # (in_batched, size) -> the vmapped function's Transforms

    def wrap(self, program: Callable) -> Callable:
        """program(*arrays) -> outputs, made to compose with jvp, grad and vmap."""
        run = jax.custom_batching.custom_vmap(lambda *xs: tuple(program(*xs)))
        run.def_vmap(lambda axis_size, in_batched, *xs: self._vmap_rule(program, axis_size, in_batched, *xs))
        composed = jax.custom_jvp(lambda *xs: run(*xs))

        def jvp(primals, tangents):
            live = tuple(i for i in self.floats if type(tangents[i]) is not SymbolicZero)
            outs = composed(*primals)    # itself, for the primals may carry an outer jvp's tangents
            live_outs = self.live_outputs(live)
            types = [jax.typeof(o).to_tangent_aval() for o in outs]   # with their layouts in explicit mode
            tangents_out = dict(zip(live_outs, tangent_p.bind(
                *primals, *[tangents[i] for i in live], transforms=self, live=live, live_outs=live_outs,
                out_types=tuple(types[i] for i in live_outs)) if live_outs else ()))
            return outs, tuple(tangents_out[i] if i in tangents_out else SymbolicZero(t) for i, t in enumerate(types))
        composed.defjvp(jvp, symbolic_zeros=True)
        return composed

    def live_outputs(self, live: tuple[int, ...]) -> tuple[int, ...]:
        """The float outputs that depend on the inputs `live` (the others' tangents are zero)."""
        if live not in self._live_outs:
            sources = [i in live for i in range(len(self.in_avals))]
            depends = _dependent_outputs(self.flat_fn, self.in_avals, sources, self.mesh)
            self._live_outs[live] = tuple(i for i in self.float_outs if depends[i])
        return self._live_outs[live]

    # -- the derived programs -------------------------------------------------------------
    def _of(self, live: tuple[int, ...], live_outs: tuple[int, ...], primals: Sequence) -> Callable:
        """The function of its inputs `live`, the others fixed at `primals`; the outputs `live_outs`."""
        def fn(*xs):
            outs = jax.tree_util.tree_leaves(self.flat_fn(*_put(primals, live, xs)))
            return [outs[i] for i in live_outs]
        return fn

    def tangent_map(self, live: tuple[int, ...], live_outs: tuple[int, ...]) -> Callable:
        """(*primals, *tangents of the inputs `live`) -> the tangents of the outputs `live_outs`."""
        key = (live, live_outs)
        if key not in self._tangent_maps:
            n = len(self.in_avals)

            def tangents(*args):
                primals = args[:n]
                return jax.jvp(self._of(live, live_outs, primals), [primals[i] for i in live], list(args[n:]))[1]
            tangents.__name__ = f"jvp_{self.name}"
            self._tangent_maps[key] = self.partition(tangents)
        return self._tangent_maps[key]

    def pullback(self, live: tuple[int, ...], live_outs: tuple[int, ...]) -> Callable:
        """(primals, cotangents of the outputs `live_outs`) -> the cotangents of the inputs `live`."""
        key = (live, live_outs)
        if key not in self._pullbacks:
            def backward(primals, cotangents):
                _, vjp = jax.vjp(self._of(live, live_outs, primals), *[primals[i] for i in live])
                return vjp(list(cotangents))
            backward.__name__ = f"grad_{self.name}"
            self._pullbacks[key] = self.partition(backward)
        return self._pullbacks[key]

    def batched(self, in_batched: tuple[bool, ...], size: int) -> "Transforms":
        """The transforms of the function vmapped over dim 0 of the batched inputs; its
        outputs that depend on no batched input stay unbatched (`out_batched`)."""
        key = (in_batched, size)
        if key not in self._vmapped:
            in_axes = [0 if b else None for b in in_batched]
            out_batched = _dependent_outputs(self.flat_fn, self.in_avals, in_batched, self.mesh)
            out_axes = [0 if b else None for b in out_batched]
            flat_fn = self.flat_fn

            def batched(*xs):
                return jax.vmap(lambda *ys: jax.tree_util.tree_leaves(flat_fn(*ys)), in_axes=in_axes,
                                out_axes=out_axes, axis_size=size)(*xs)
            batched.__name__ = f"vmap_{self.name}"
            in_avals = [jax.ShapeDtypeStruct((size, *a.shape) if b else a.shape, a.dtype)
                        for a, b in zip(self.in_avals, in_batched)]
            out_avals = [jax.ShapeDtypeStruct((size, *a.shape) if b else a.shape, a.dtype)
                         for a, b in zip(self.out_avals, out_batched)]
            self._vmapped[key] = Transforms(batched, in_avals, out_avals, batched.__name__, self.partition, self.mesh,
                                            out_batched)
        return self._vmapped[key]

    def program(self) -> Callable:
        """The function itself, partitioned (for a batched form: what vmap runs)."""
        if self._program is None:
            self._program = self.partition(self.flat_fn)
        return self._program

    def _vmap_rule(self, program: Callable, axis_size: int, in_batched: Sequence[bool], *arrays):
        if not any(in_batched):
            return tuple(program(*arrays)), (False,) * len(self.out_avals)
        batched = self.batched(tuple(in_batched), axis_size)
        return tuple(batched.program()(*arrays)), tuple(batched.out_batched)


def _put(values: Sequence, positions: Sequence[int], xs: Sequence) -> list:
    """`values` with xs in place at `positions`."""
    out = list(values)
    for i, x in zip(positions, xs):
        out[i] = x
    return out


def _dependent_outputs(flat_fn: Callable, in_avals: Sequence, sources: Sequence[bool], mesh) -> list[bool]:
    """Which outputs of flat_fn depend on an input marked in `sources` (an equation
    with such an operand has all of its results depend on it): those vmap batches when
    the sources are the batched inputs, those with tangents when they are the perturbed ones."""
    jaxpr = jaxpr_of(lambda *xs: jax.tree_util.tree_leaves(flat_fn(*xs)), in_avals, mesh).jaxpr
    reached = {v for v, b in zip(jaxpr.invars, sources) if b}
    for eqn in jaxpr.eqns:
        if any(isinstance(v, jcore.Var) and v in reached for v in eqn.invars):
            reached.update(eqn.outvars)
    return [isinstance(v, jcore.Var) and v in reached for v in jaxpr.outvars]


# -- the tangent map as a primitive: linear in its tangents, transposed by the pullback ----
tangent_p = jcore.Primitive("gspmd_tangent")
tangent_p.multiple_results = True


def _split(args: Sequence, transforms: Transforms) -> tuple[list, list]:
    n = len(transforms.in_avals)
    return list(args[:n]), list(args[n:])


# Its parameters: `transforms`, the function's; `live`, the inputs whose tangents it takes
# (after all primals); `live_outs`, the outputs whose tangents it gives, of `out_types`
# (the primal results' tangent types: in explicit sharding mode they hold layouts).
def _impl(*args, transforms: Transforms, live: tuple, live_outs: tuple, out_types: tuple):
    return transforms.tangent_map(live, live_outs)(*args)


def _abstract_eval(*args, out_types: tuple, **_):
    return list(out_types)


def _jvp(args, dargs, *, transforms: Transforms, live: tuple, live_outs: tuple, out_types: tuple):
    """The tangent map is linear in its tangents but not in its primals: its own
    tangent is the tangent program's tangent map, of the arguments perturbed here only."""
    perturbed = [i for i, d in enumerate(dargs) if type(d) is not ad.Zero]

    def tangent_map(*xs):
        return transforms.tangent_map(live, live_outs)(*_put(args, perturbed, xs))
    outs, touts = jax.jvp(tangent_map, [args[i] for i in perturbed], [dargs[i] for i in perturbed])
    return list(outs), list(touts)


def _transpose(cts, *args, transforms: Transforms, live: tuple, live_outs: tuple, out_types: tuple):
    primals, tangents = _split(args, transforms)
    if any(ad.is_undefined_primal(p) for p in primals):
        raise NotImplementedError("gspmd_tangent is linear in its tangents only")
    cts = [ad.instantiate_zeros(ct) for ct in cts]
    grads = transforms.pullback(live, live_outs)(primals, cts)
    return [None] * len(primals) + [g if ad.is_undefined_primal(t) else None for g, t in zip(grads, tangents)]


def _batch(args, dims, *, transforms: Transforms, live: tuple, live_outs: tuple, out_types: tuple):
    """Batched, the tangent map is the batched function's, bound again (so that it
    stays transposable: grad of a vmap). Each input whose primal or tangent is batched
    is batched in both, along dim 0."""
    primals, tangents = _split(dims, transforms)
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    batched = [primals[i] is not None or (i in live and tangents[live.index(i)] is not None)
               for i in range(len(primals))]
    along = batched + [batched[i] for i in live]
    args = [_along_0(x, d, size) if b else x for x, d, b in zip(args, dims, along)]
    on_batched = transforms.batched(tuple(batched), size)
    dims_out = [0 if on_batched.out_batched[i] else None for i in live_outs]
    outs = tangent_p.bind(*args, transforms=on_batched, live=live, live_outs=live_outs,
                          out_types=tuple(unmapped_aval(size, d, t) for d, t in zip(dims_out, out_types)))
    return list(outs), dims_out


def _along_0(x, dim, size: int):
    """x batched along dim 0 (broadcast there if not batched)."""
    if dim is None:
        return jnp.broadcast_to(x, (size, *np.shape(x)))
    return jnp.moveaxis(x, dim, 0)


tangent_p.def_impl(_impl)
tangent_p.def_abstract_eval(_abstract_eval)
ad.primitive_jvps[tangent_p] = _jvp
ad.primitive_transposes[tangent_p] = _transpose
batching.primitive_batchers[tangent_p] = _batch
mlir.register_lowering(tangent_p, mlir.lower_fun(_impl, multiple_results=True))
