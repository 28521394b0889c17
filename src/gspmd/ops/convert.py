"""What the drivers hand to an op record's converter and to its jax lowering.

A converter turns one jaxpr equation into IR instructions: `convert(b, eqn, args)` with
`b` a Conversion (a Builder onto the program being built, plus constants, implicit
broadcasts, the equation's result types and the driver's inlining of sub-jaxprs). A
lowering turns one instruction of the per-device program into jax.lax calls inside the
jax backend's shard_map: `lower(instr, args, lc)` with `lc` a LowerContext.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import jax
import numpy as np
from jax import lax
from jax.extend import core as jcore

from gspmd.ir import Builder, Instr, Program, Value
from gspmd.mesh import Mesh, concrete_mesh

# convert(conversion, jaxpr equation, operand values) -> result values
Converter = Callable[["Conversion", object, list[Value]], list[Value]]
# inline(conversion, closed or open jaxpr, argument values) -> result values
Inline = Callable[["Conversion", object, list[Value]], list[Value]]


def convert_by_impl(b: "Conversion", eqn, args: list[Value]) -> list[Value]:
    """A library's primitive whose implementation is JAX code (equinox's maybe_set,
    noinline): that code, traced on the equation's operand types, converted in the
    equation's place. Literal operands stay concrete (noinline's index of its function)."""
    literal = [isinstance(v, jcore.Literal) for v in eqn.invars]

    def impl(*traced):
        rest = iter(traced)
        operands = [np.asarray(v.val, v.aval.dtype) if known else next(rest) for v, known in zip(eqn.invars, literal)]
        return eqn.primitive.impl(*operands, **eqn.params)
    closed = jax.make_jaxpr(impl)(*(v.aval for v, known in zip(eqn.invars, literal) if not known))
    return b.inline(closed, [a for a, known in zip(args, literal) if not known])


class Conversion(Builder):
    """A Builder for one (sub-)program being converted from a jaxpr."""

    def __init__(self, program: Program, inline: Inline, origin: str = "",
                 manual_regions: Optional[list] = None, mesh: Optional[Mesh] = None,
                 meshes: Optional[list] = None):
        super().__init__(program, origin)
        self._inline = inline
        self.mesh = mesh   # gspmd.jit(mesh=...)
        # The manual regions being converted (gspmd.region.ManualRegion), innermost last:
        # collectives over named axes inside them resolve their device groups on its mesh,
        # and annotations there are over its virtual devices.
        self.manual_regions = [] if manual_regions is None else manual_regions
        self.meshes = [] if meshes is None else meshes   # every mesh mesh_of resolved

    def inline(self, jaxpr, args: Sequence[Value]) -> list[Value]:
        """Convert a sub-jaxpr (closed or open) in place, with `args` as its inputs."""
        return self._inline(self, jaxpr, list(args))

    def on(self, program: Program) -> "Conversion":
        """A Conversion onto another program (a loop body) sharing this one's state."""
        on = Conversion(program, self._inline, self.origin, self.manual_regions, self.mesh, self.meshes)
        on.recomputed = self.recomputed
        return on

    def mesh_of(self, jax_mesh) -> Mesh:
        """The gspmd Mesh of a jax mesh named in the program (a NamedSharding's, a
        shard_map's). An abstract one (from a bare PartitionSpec) is the concrete mesh
        that jax.set_mesh put around the call, else gspmd.jit(mesh=...), with its axes."""
        mesh = self._resolve(jax_mesh)
        self.meshes.append(mesh)
        return mesh

    def _resolve(self, jax_mesh) -> Mesh:
        if isinstance(jax_mesh, jax.sharding.Mesh):
            return Mesh.from_jax(jax_mesh)
        return concrete_mesh(jax_mesh, self.mesh)

    def local_layout(self, sharding, what: str):
        """A layout written over a whole mesh, as the program being converted sees it:
        inside a manual region, over the region's virtual devices."""
        return self.manual_regions[-1].local_layout(sharding, what) if self.manual_regions else sharding

    def subprogram(self, name: str, params: Sequence[Value], build: Callable, hint: str = "carry") -> Program:
        """A nested program (loop body, branch) with parameters typed like `params`,
        whose results are build(its conversion, its parameters)."""
        sub = Program(f"{self.program.name}.{name}", parent=self.program)
        sb = self.on(sub)
        sub.outputs = build(sb, [sb.param(v.shape, v.dtype, hint=hint) for v in params])
        return sub

    def invariants(self, outer: Sequence[Value], params: Sequence[Value]) -> list[Value]:
        """What a sub-program (a loop's body or condition, a branch) reads for operands
        that stay the same over it (`params`, its parameters for `outer`): an index
        expression of iotas and scalar constants (jnp.arange, its broadcasts, reshapes and
        wraps of negative indices) made again inside, as XLA's while-loop constant sinking
        does, so that the rules reading iotas there (parallel gathers) see one; any other
        operand, its parameter."""
        return [self._made_again(v) or p for v, p in zip(outer, params)]

    def _made_again(self, outer: Value) -> Optional[Value]:
        cone = _index_expression(outer)
        if cone is None:
            return None
        copies: dict[Value, Value] = {}
        for instr in cone:
            made = self.add(instr.opcode, [copies[v] for v in instr.operands],
                            [(v.shape, v.dtype) for v in instr.outputs], **instr.attrs)
            copies.update(zip(instr.outputs, made))
        return copies[outer]

    def constant(self, value, dtype=None) -> Value:
        value = np.asarray(value, dtype)
        return self.add1("constant", [], value.shape, value.dtype, value=value)

    def broadcast_to(self, x: Value, shape: Sequence[int]) -> Value:
        """Scalars (jaxpr literals) broadcast implicitly in JAX; make it explicit."""
        if x.shape == tuple(shape):
            return x
        return self.add1("broadcast", [x], tuple(shape), x.dtype,
                         dims=tuple(range(len(shape) - x.rank, len(shape))))

    @staticmethod
    def out_aval(eqn, i: int = 0) -> tuple[tuple[int, ...], np.dtype]:
        """Shape and dtype of the equation's i-th result (of its key data for keys)."""
        return physical_aval(eqn.outvars[i].aval)


INDEX_EXPRESSION_UP_TO = 16    # instructions an index expression may take to be made again


def _index_expression(v: Value) -> Optional[list[Instr]]:
    """The instructions computing integer `v` from iotas and scalar constants alone, in
    order (None: it reads anything else, has a side effect or a sub-program, or takes
    more than INDEX_EXPRESSION_UP_TO)."""
    cone: list[Instr] = []

    def visit(v: Value) -> bool:
        p = v.producer
        if p is None or not (np.issubdtype(v.dtype, np.integer) or v.dtype == np.bool_):
            return False
        if p in cone:
            return True
        if p.has_side_effect or any(isinstance(x, Program) for a in p.attrs.values()
                                    for x in (a if isinstance(a, tuple) else (a,))):
            return False
        if not p.operands and not (p.opcode == "iota" or (p.opcode == "constant" and v.shape == ())):
            return False
        if not all(visit(o) for o in p.operands) or len(cone) >= INDEX_EXPRESSION_UP_TO:
            return False
        cone.append(p)
        return True
    return cone if visit(v) else None


@dataclass(frozen=True, eq=False)
class BoundPrimitive:
    """A JAX primitive with its parameters, which an op runs as it is on each device's
    arrays (host callbacks, decompositions): called, its results as a list. Equal only to
    itself (its parameters may hold functions)."""
    primitive: object
    params: dict

    def __call__(self, *args) -> list:
        results = self.primitive.bind(*args, **self.params)
        return list(results) if self.primitive.multiple_results else [results]

    def __repr__(self):
        return self.primitive.name


def call_eagerly(instr, args, call: Optional[BoundPrimitive] = None) -> list[np.ndarray]:
    """The results of instr's `call` (a BoundPrimitive; or `call`, one standing in for it)
    on NumPy arrays, in its output dtypes: the NumPy reference of ops that run a JAX
    primitive as it is."""
    call = instr.attrs["call"] if call is None else call
    return [np.asarray(r).astype(o.dtype, copy=False) for r, o in zip(call(*args), instr.outputs)]


def is_key(dtype) -> bool:
    """Whether `dtype` is a typed PRNG key's (jax.random.key)."""
    # NumPy's own dtypes first: most values, and asking jax is slow
    return dtype is not None and not isinstance(dtype, np.dtype) and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def physical_aval(aval) -> tuple[tuple[int, ...], np.dtype]:
    """Shape and dtype of a value in the IR: typed PRNG keys are their key data."""
    if is_key(aval.dtype):
        aval = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(aval.shape, aval.dtype))
    return tuple(aval.shape), np.dtype(aval.dtype)


class LowerContext:
    """The jax backend runs the per-device program inside a shard_map over a mesh whose
    axes `axis` names (collectives span them all, flattened: a device's mesh position is
    its axis index); `ids[p]` is the device id at position p (None: p itself). Lowerings
    of ops with sub-programs run them through `run`."""

    def __init__(self, axis, run: Callable[[Program, Sequence], list], ids: Optional[np.ndarray] = None,
                 row_major: bool = False):
        self.axis = axis
        self.run = run
        self.ids = ids
        self.row_major = row_major   # the program has a kernel that takes only row-major layouts
        self._axis_size: Optional[int] = None

    def axis_index(self):
        """This device's position in the mesh."""
        return lax.axis_index(self.axis)

    def axis_size(self) -> int:
        if self._axis_size is None:     # lax.axis_size binds a psum each time it is asked
            self._axis_size = lax.axis_size(self.axis)
        return self._axis_size

    def device_id(self):
        """This device's id (partition-id)."""
        return self.axis_index() if self.ids is None else jax.numpy.asarray(self.ids, np.int32)[self.axis_index()]

    def positions(self, device_ids) -> np.ndarray:
        """Mesh positions of device ids (collectives' groups and pairs name positions)."""
        device_ids = np.asarray(device_ids, np.int64)
        return device_ids if self.ids is None else np.argsort(self.ids)[device_ids]


# -- the context mesh a traced jaxpr runs under ------------------------------------------------
def closed_in(closed, mesh):
    """A closed jaxpr whose equations run under context mesh `mesh` (see in_context)."""
    return closed.replace(jaxpr=in_context(closed.jaxpr, mesh))


def in_context(jaxpr, mesh):
    """`jaxpr` with every equation's recorded context (sub-jaxprs' too) but its mesh `mesh`."""
    def moved(ctx):
        with ctx.manager, jax.sharding.use_abstract_mesh(mesh):
            return type(ctx)()

    def param(value):
        if isinstance(value, tuple):
            return tuple(map(param, value))
        if isinstance(value, jcore.ClosedJaxpr):
            return closed_in(value, mesh)
        return in_context(value, mesh) if isinstance(value, jcore.Jaxpr) else value

    return jaxpr.replace(eqns=[eqn.replace(ctx=moved(eqn.ctx), params={k: param(v) for k, v in eqn.params.items()})
                               for eqn in jaxpr.eqns])
