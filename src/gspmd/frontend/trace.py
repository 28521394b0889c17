"""jaxpr -> Program: the generic driver. Each equation's primitive is looked up among the
op records' converters (ops.registry.PRIMITIVES); calls (custom_jvp/vjp, checkpoint) are
inlined; literals and closed-over arrays become constants."""
from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Callable, Optional

import jax
import numpy as np
from jax._src.core import ShardingTypeError   # jax's type rules' refusal (no public name)
from jax.extend import core as jcore
from jax.sharding import AxisType, NamedSharding

from gspmd.errors import ShardingError
from gspmd.frontend import keys
from gspmd.frontend.annotation import record_mesh, tracing
from gspmd.frontend.source import source_line
from gspmd.ir import Program, Value
from gspmd.mesh import Mesh, explicit_sharding, has_explicit_axes
from gspmd.ops import PRIMITIVES
from gspmd.ops.convert import Conversion
from gspmd.ops.elementwise import annotate

# Primitives that only wrap a sub-jaxpr: their body is converted in place. (A nested
# jax.jit may carry shardings: the `sharding` record converts it.)
# custom_partitioning's body is the function it partitions: gspmd partitions that body
# itself (its partition callback, written for XLA's shardings, is not called).
# jax >= 0.12: eval_jaxpr (a scan's body as jax.checkpoint's partial evaluation leaves
# it) calls its jaxpr; call_hi_primitive (jnp.searchsorted and other "hijax" ops)
# carries no jaxpr: its body is the primitive's own expansion, traced here.
CALLS = ("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr", "remat", "checkpoint", "closed_call",
         "core_call", "custom_partitioning", "call_hi_primitive", "eval_jaxpr")
_BODY_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr", "call")
# Forward computation a backward pass repeats: JAX's name for what a differentiated
# jax.checkpoint recomputes, and ours for a forward pass rerun whole (recipes.rerun_forward).
RERUN_SCOPE = "rerun_forward"
_RECOMPUTE_SCOPES = ("rematted_computation", RERUN_SCOPE)
# Pipeline schedules recorded while a function is traced for gspmd (see record_schedule).
_schedules: contextvars.ContextVar[Optional[list]] = contextvars.ContextVar("gspmd_schedules", default=None)


def record_schedule(schedule) -> None:
    """Library code run while tracing (gspmd.pipeline) notes its loop structure on the
    program being traced, for reports; outside gspmd.jit this does nothing."""
    recorded = _schedules.get()
    if recorded is not None:
        recorded.append(schedule)


# on_equation(index, equation, its operand values, its result values): what each
# top-level equation became
OnEquation = Callable[[int, object, list[Value], list[Value]], None]


def trace(fn, flat_avals, name: str = "main", mesh: Optional[Mesh] = None,
          on_equation: Optional[OnEquation] = None) -> tuple[Program, object]:
    """Trace fn(*flat_args) into a Program; returns it and the output pytree def. With
    `mesh` (gspmd.jit's) and no jax mesh set, bare PartitionSpecs in fn refer to it.
    `on_equation` hears where each equation of fn's own jaxpr went (tools that map
    values back to source lines: gspmd.auto)."""
    schedules = _schedules.set([])
    try:
        closed, out_shape = _jaxpr(fn, flat_avals, mesh)
        program = Program(name)
        program.schedules = _schedules.get()
    finally:
        _schedules.reset(schedules)
    b = Conversion(program, _inline, mesh=mesh)
    params = [b.param(v.aval.shape, v.aval.dtype, hint="arg") for v in closed.jaxpr.invars]
    program.outputs = _inline(b, closed, params, on_equation)
    for used in b.meshes:      # meshes of jax annotations (with_sharding_constraint, shard_map)
        record_mesh(used, "value annotated with a jax sharding")
    return program, jax.tree_util.tree_structure(out_shape)


def jaxpr_of(fn: Callable, flat_avals, mesh: Optional[Mesh] = None):
    """fn's closed jaxpr, traced as gspmd.jit traces it (for analyses of the function
    itself, such as which outputs vmap batches)."""
    with tracing(mesh):
        return _jaxpr(fn, flat_avals, mesh)[0]


# What jax says refusing fn under the context mesh: jax.shard_map given a mesh that is not
# the context's; jnp functions (repeat, ...) asked to split a dim split over an Explicit
# axis of the context, without an out_sharding to say how.
_REFUSALS_UNDER_CONTEXT = ("should match the mesh passed to shard_map", "via `out_sharding`")


def _jaxpr(fn, flat_avals, mesh: Optional[Mesh]):
    """fn's closed jaxpr and output shapes, traced under _as_jax_context. Where jax
    refuses fn under the context mesh gspmd chose, fn is traced as jax.jit traces it:
    without a context mesh (one the user set with jax.set_mesh stays, and so does jax's
    error). jax refuses a jax.shard_map given a mesh whose axis types differ from that
    context's (a jax.make_mesh mesh inside gspmd.jit(mesh=<Auto axes>), or the other way
    round); and some of jax's own rules under a context mesh of Explicit axes, which
    arguments typed by a jax.make_mesh mesh make the context (sort's jvp types the iota it
    adds replicated, unlike the sorted operand: 'Arguments to sort must have equal
    shardings'; jnp.repeat along a split dim asks for an out_sharding), where jax.jit runs fn."""
    context, recorded = _as_jax_context(mesh, flat_avals), _schedules.get()
    start = 0 if recorded is None else len(recorded)
    try:
        with context:
            return jax.make_jaxpr(fn, return_shape=True)(*flat_avals)
    except (ValueError, ShardingTypeError) as e:
        refused = isinstance(e, ShardingTypeError) or any(r in str(e) for r in _REFUSALS_UNDER_CONTEXT)
        if isinstance(context, contextlib.nullcontext) or not refused:
            raise
    if recorded is not None:
        del recorded[start:]   # what the refused trace recorded
    return jax.make_jaxpr(fn, return_shape=True)(*flat_avals)


def _as_jax_context(mesh: Optional[Mesh], flat_avals):
    """jax's context mesh for tracing: the user's (jax.set_mesh) if any; else, as jax.jit
    takes it, the mesh arguments are laid out over by their types (Explicit axes); else
    `mesh`'s axes, of the types its jax mesh has (jax asks only for an abstract mesh;
    Conversion.mesh_of finds its devices)."""
    if not jax.sharding.get_abstract_mesh().empty:
        return contextlib.nullcontext()
    typed = [s.mesh.abstract_mesh for s in map(explicit_sharding, flat_avals) if s is not None]
    if typed:
        return jax.sharding.use_abstract_mesh(typed[0])
    if mesh is None:
        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(mesh.abstract())


def _inline(b: Conversion, closed, args: list[Value], on_equation: Optional[OnEquation] = None) -> list[Value]:
    """Convert the equations of `closed` (a closed or open jaxpr) with `args` as inputs.
    An equation with no line of the user's code in its traceback (inside a jitted library
    function such as jnp.take, traced once and cached) is charged to the calling line."""
    origin, recomputed, caller = b.origin, b.recomputed, b.source
    jaxpr = closed.jaxpr if hasattr(closed, "jaxpr") else closed
    consts = closed.consts if hasattr(closed, "consts") else []
    env: dict = {var: b.constant(keys.constant(c)) for var, c in zip(jaxpr.constvars, consts)}
    env.update(zip(jaxpr.invars, args))

    def read(atom) -> Value:
        if isinstance(atom, jcore.Literal):
            return b.constant(np.asarray(atom.val, atom.aval.dtype))
        return env[atom]

    for index, eqn in enumerate(jaxpr.eqns):
        b.origin, b.source = eqn.primitive.name, source_line(eqn) or caller
        b.recomputed = recomputed or _recomputes(str(eqn.source_info.name_stack))
        operands = [read(a) for a in eqn.invars]
        outs = [_typed(b, v, out) for v, out in zip(eqn.outvars, _convert(b, eqn, operands))]
        env.update(zip(eqn.outvars, outs))
        if on_equation is not None:
            on_equation(index, eqn, operands, outs)
    b.origin, b.recomputed, b.source = origin, recomputed, caller
    return [read(v) for v in jaxpr.outvars]


def _recomputes(name_stack: str) -> bool:
    return any(scope in name_stack for scope in _RECOMPUTE_SCOPES)


def _typed(b: Conversion, var, value: Value) -> Value:
    """In explicit sharding mode a value's type holds its layout (jax's type rules gave
    it): that layout is an annotation. Over a mesh with automatic axes too, dims the type
    leaves unsplit are left to propagation."""
    sharding = getattr(var.aval, "sharding", None)
    if b.manual_regions or not isinstance(sharding, NamedSharding):
        return value
    if not has_explicit_axes(sharding.mesh):
        return value
    return annotate(b, value, sharding, only_named=any(t != AxisType.Explicit for t in sharding.mesh.axis_types))


def _convert(b: Conversion, eqn, args: list[Value]) -> list[Value]:
    name = eqn.primitive.name
    if name in CALLS:
        return _call(b, eqn, args)
    convert = PRIMITIVES.get(name)
    if convert is None:
        raise ShardingError(
            f"JAX primitive {name!r} (in `{eqn}`) is not supported by gspmd's frontend yet; rewrite that part "
            "with supported ops or file an issue.")
    if keys.moves_keys(eqn):
        return keys.convert_per_word(b, eqn, args, convert)
    return convert(b, eqn, args)


def _call(b: Conversion, eqn, args: list[Value]) -> list[Value]:
    if eqn.primitive.name == "call_hi_primitive":
        return _inline(b, _expansion(eqn), args)
    for key in _BODY_PARAMS:
        if key in eqn.params:
            body = eqn.params[key]
            invars = (body.jaxpr if hasattr(body, "jaxpr") else body).invars
            return _inline(b, body, args[len(args) - len(invars):])
    raise ShardingError(f"Cannot find the body of call primitive {eqn.primitive.name!r}.")


def _expansion(eqn):
    """The jaxpr a hijax primitive stands for: its expansion (`to_lojax`) traced on the
    equation's operand types."""
    return jax.make_jaxpr(functools.partial(eqn.primitive.to_lojax, **eqn.params))(*(v.aval for v in eqn.invars))
