"""jaxpr -> Program: the generic driver. Each equation's primitive is looked up among the
op records' converters (ops.registry.PRIMITIVES); calls (jit, custom_jvp/vjp) are inlined;
literals and closed-over arrays become constants."""
from __future__ import annotations

import jax
import numpy as np
from jax.extend import core as jcore

from gspmd.errors import ShardingError
from gspmd.ir import Program, Value
from gspmd.ops import PRIMITIVES
from gspmd.ops.convert import Conversion

# Primitives that only wrap a sub-jaxpr: their body is converted in place.
CALLS = ("jit", "pjit", "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr", "remat", "checkpoint",
         "closed_call", "core_call")
_BODY_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def trace(fn, flat_avals, name: str = "main") -> tuple[Program, object]:
    """Trace fn(*flat_args) into a Program; returns it and the output pytree def."""
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*flat_avals)
    program = Program(name)
    b = Conversion(program, _inline)
    params = [b.param(v.aval.shape, v.aval.dtype, hint="arg") for v in closed.jaxpr.invars]
    program.outputs = _inline(b, closed, params)
    return program, jax.tree_util.tree_structure(out_shape)


def _inline(b: Conversion, closed, args: list[Value]) -> list[Value]:
    """Convert the equations of `closed` (a closed or open jaxpr) with `args` as inputs."""
    jaxpr = closed.jaxpr if hasattr(closed, "jaxpr") else closed
    consts = closed.consts if hasattr(closed, "consts") else []
    env: dict = {var: b.constant(np.asarray(c)) for var, c in zip(jaxpr.constvars, consts)}
    env.update(zip(jaxpr.invars, args))

    def read(atom) -> Value:
        if isinstance(atom, jcore.Literal):
            return b.constant(np.asarray(atom.val, atom.aval.dtype))
        return env[atom]

    for eqn in jaxpr.eqns:
        b.origin = eqn.primitive.name
        outs = _convert(b, eqn, [read(a) for a in eqn.invars])
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def _convert(b: Conversion, eqn, args: list[Value]) -> list[Value]:
    name = eqn.primitive.name
    if name in CALLS:
        return _call(b, eqn, args)
    convert = PRIMITIVES.get(name)
    if convert is None:
        raise ShardingError(
            f"JAX primitive {name!r} (in `{eqn}`) is not supported by gspmd's frontend yet; rewrite that part "
            "with supported ops or file an issue.")
    return convert(b, eqn, args)


def _call(b: Conversion, eqn, args: list[Value]) -> list[Value]:
    for key in _BODY_PARAMS:
        if key in eqn.params:
            origin, body = b.origin, eqn.params[key]
            invars = (body.jaxpr if hasattr(body, "jaxpr") else body).invars
            outs = _inline(b, body, args[len(args) - len(invars):])
            b.origin = origin
            return outs
    raise ShardingError(f"Cannot find the body of call primitive {eqn.primitive.name!r}.")
