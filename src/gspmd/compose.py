"""How a partitioned program composes with JAX's transformations, as a jax.jit does:
each derivative and batched form of the function is a program of its own, traced from
the function and partitioned (with its annotations) on first use.

- jvp: a custom JVP rule runs the program and binds `gspmd_tangent`, the function's
  tangent map (linear in the tangents). Reverse mode transposes that map: its transpose
  is the pullback program (which recomputes the forward). Its own JVP is the tangent
  program's, so jvp, jacfwd, hessian and grad-of-grad compose to any order.
- vmap: a custom vmap rule partitions the vmapped function; outputs that depend on no
  batched input stay unbatched (out_axes=None works as under jax.jit).
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import jax
import numpy as np
from jax import numpy as jnp
from jax.extend import core as jcore
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
        self._tangent_map = self._pullback = self._program = None
        self._vmapped: dict = {}     # (in_batched, size) -> the vmapped function's Transforms

    def wrap(self, program: Callable) -> Callable:
        """program(*arrays) -> outputs, made to compose with jvp, grad and vmap."""
        run = jax.custom_batching.custom_vmap(lambda *xs: tuple(program(*xs)))
        run.def_vmap(lambda axis_size, in_batched, *xs: self._vmap_rule(program, axis_size, in_batched, *xs))
        composed = jax.custom_jvp(lambda *xs: run(*xs))

        def jvp(primals, tangents):
            float_tangents = [tangents[i] for i in self.floats]
            outs = composed(*primals)    # itself, for the primals may carry an outer jvp's tangents
            tangents_out = iter(tangent_p.bind(*primals, *float_tangents, transforms=self))
            return outs, tuple(next(tangents_out) if i in self.float_outs else np.zeros(a.shape, jax.dtypes.float0)
                               for i, a in enumerate(self.out_avals))
        composed.defjvp(jvp)
        return composed

    # -- the derived programs -------------------------------------------------------------
    def _of_floats(self, primals: Sequence) -> Callable:
        """The function of its float inputs, the others fixed at `primals`; float results."""
        def fn(*floats):
            full = list(primals)
            for i, x in zip(self.floats, floats):
                full[i] = x
            outs = jax.tree_util.tree_leaves(self.flat_fn(*full))
            return [outs[i] for i in self.float_outs]
        return fn

    def tangent_map(self) -> Callable:
        """(*primals, *float tangents) -> the float results' tangents."""
        if self._tangent_map is None:
            n = len(self.in_avals)

            def tangents(*args):
                primals = args[:n]
                return jax.jvp(self._of_floats(primals), [primals[i] for i in self.floats], list(args[n:]))[1]
            tangents.__name__ = f"jvp_{self.name}"
            self._tangent_map = self.partition(tangents)
        return self._tangent_map

    def pullback(self) -> Callable:
        """(primals, float results' cotangents) -> the float inputs' cotangents."""
        if self._pullback is None:
            def backward(primals, cotangents):
                _, vjp = jax.vjp(self._of_floats(primals), *[primals[i] for i in self.floats])
                return vjp(list(cotangents))
            backward.__name__ = f"grad_{self.name}"
            self._pullback = self.partition(backward)
        return self._pullback

    def batched(self, in_batched: tuple[bool, ...], size: int) -> "Transforms":
        """The transforms of the function vmapped over dim 0 of the batched inputs; its
        outputs that depend on no batched input stay unbatched (`out_batched`)."""
        key = (in_batched, size)
        if key not in self._vmapped:
            in_axes = [0 if b else None for b in in_batched]
            out_batched = _batched_outputs(self.flat_fn, self.in_avals, in_batched, self.mesh)
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


def _batched_outputs(flat_fn: Callable, in_avals: Sequence, in_batched: Sequence[bool], mesh) -> list[bool]:
    """Which outputs of flat_fn depend on a batched input: those vmap batches (an
    equation with a batched operand batches all of its results)."""
    jaxpr = jaxpr_of(lambda *xs: jax.tree_util.tree_leaves(flat_fn(*xs)), in_avals, mesh).jaxpr
    batched = {v for v, b in zip(jaxpr.invars, in_batched) if b}
    for eqn in jaxpr.eqns:
        if any(isinstance(v, jcore.Var) and v in batched for v in eqn.invars):
            batched.update(eqn.outvars)
    return [isinstance(v, jcore.Var) and v in batched for v in jaxpr.outvars]


# -- the tangent map as a primitive: linear in its tangents, transposed by the pullback ----
tangent_p = jcore.Primitive("gspmd_tangent")
tangent_p.multiple_results = True


def _split(args: Sequence, transforms: Transforms) -> tuple[list, list]:
    n = len(transforms.in_avals)
    return list(args[:n]), list(args[n:])


def _impl(*args, transforms: Transforms):
    return transforms.tangent_map()(*args)


def _abstract_eval(*args, transforms: Transforms):
    return [jax.core.ShapedArray(transforms.out_avals[i].shape, transforms.out_avals[i].dtype)
            for i in transforms.float_outs]


def _jvp(args, dargs, *, transforms: Transforms):
    """The tangent map is linear in its tangents but not in its primals: its own
    tangent is the tangent program's tangent map."""
    dargs = [ad.instantiate_zeros(d) for d in dargs]
    outs, touts = jax.jvp(lambda *xs: transforms.tangent_map()(*xs), list(args), dargs)
    return list(outs), list(touts)


def _transpose(cts, *args, transforms: Transforms):
    primals, tangents = _split(args, transforms)
    if any(ad.is_undefined_primal(p) for p in primals):
        raise NotImplementedError("gspmd_tangent is linear in its tangents only")
    cts = [ad.instantiate_zeros(ct) for ct in cts]
    grads = transforms.pullback()(primals, cts)
    return [None] * len(primals) + [g if ad.is_undefined_primal(t) else None for g, t in zip(grads, tangents)]


def _batch(args, dims, *, transforms: Transforms):
    """Batched, the tangent map is the batched function's, bound again (so that it
    stays transposable: grad of a vmap). Each input whose primal or tangent is batched
    is batched in both, along dim 0."""
    primals, tangents = _split(dims, transforms)
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    batched = [primals[i] is not None
               or (i in transforms.floats and tangents[transforms.floats.index(i)] is not None)
               for i in range(len(primals))]
    along = batched + [batched[i] for i in transforms.floats]
    args = [_along_0(x, d, size) if b else x for x, d, b in zip(args, dims, along)]
    on_batched = transforms.batched(tuple(batched), size)
    outs = tangent_p.bind(*args, transforms=on_batched)
    return list(outs), [0 if on_batched.out_batched[i] else None for i in on_batched.float_outs]


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
