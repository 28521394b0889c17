"""The jax backend: runs an SPMD program on jax devices as ONE jax.jit around a
`jax.shard_map` of the per-device program (and, after it, the program's element-wise
tail on global arrays: runtime/epilogue.py).

The shard_map is over the user's mesh (as a jax Mesh); collectives span all of its axes,
flattened, so a device's mesh position is its axis index and our device groups become
`axis_index_groups` over positions (device ids map to positions through the mesh's
device order: ops.convert.LowerContext). The body is the per-device program, translated
instruction by instruction through each op record's `lower` (gspmd/ops). Arguments and
results are global jax.Arrays whose NamedShardings over the user's mesh are our
shardings (or, where shards are uneven or the mesh cannot express a layout, the finest
coarser one: the body slices or assembles the rest). Multi-process runs need nothing
else: jax.jit feeds each process's devices.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence

import jax
import numpy as np
from jax import lax
from jax import numpy as jnp
from jax._src.core import remove_explicit_mesh_axis_names   # jax's own, as vmap's shard_map rule uses it
from jax.sharding import NamedSharding, PartitionSpec as P

from gspmd import ops
from gspmd.errors import ShardingError
from gspmd.ir import Instr, Program, Value
from gspmd.mesh import Mesh, has_explicit_axes
from gspmd.ops.convert import LowerContext
from gspmd.runtime.epilogue import Epilogue
from gspmd.sharding import Sharding, spec_of


def lower_instr(instr: Instr, args: list, lc: LowerContext) -> list:
    """The instruction as jax.lax calls, from its op record's lowering."""
    lower = ops.lookup(instr.opcode).semantics.lower
    if lower is None:
        raise ShardingError(
            f"The jax backend has no lowering for opcode {instr.opcode!r} (instruction {instr.outputs} "
            f"from {instr.origin or 'the frontend'}); give its record in gspmd/ops a `lower`, or run with "
            "backend='sim'.")
    return lower(instr, args, lc)


def _identity(x):
    return x


# -- the executable --------------------------------------------------------------------------
def _run_body(spmd: Program, local_args: Sequence, lc: LowerContext) -> list:
    """The per-device program as jax calls (inside the shard_map body), in the order and
    groups of ops.lowering_steps."""
    env: dict[Value, object] = dict(zip(spmd.params, local_args))
    for step in ops.lowering_steps(spmd):
        if not step.together:
            (instr,) = step.instrs
            env.update(zip(instr.outputs, lower_instr(instr, [env[o] for o in instr.operands], lc)))
            continue
        lower_all = ops.lookup(step.instrs[0].opcode).semantics.lower_together[1]
        for instr, outs in zip(step.instrs, lower_all(step.instrs, [[env[o] for o in i.operands] for i in step.instrs],
                                                       lc)):
            env.update(zip(instr.outputs, outs))
    return [env[o] for o in spmd.outputs]


def _assemble(local, sharding: Sharding, shape: Sequence[int], lc: LowerContext):
    """Inside the body: the global array from the (padded) shards, gathered within each
    group of devices that holds one whole copy (one replica's tiles, in tile order)."""
    replicas = sharding.tile_assignment.reshape(-1, sharding.num_replicas).T      # [R, tiles]
    gathered = lax.all_gather(local, lc.axis, axis_index_groups=lc.positions(replicas).tolist())
    tiles = gathered.reshape(*sharding.tiles, *local.shape)
    r = len(shape)
    interleaved = tiles.transpose([i for d in range(r) for i in (d, r + d)])
    full = interleaved.reshape([t * n for t, n in zip(sharding.tiles, local.shape)])
    return full[tuple(slice(0, n) for n in shape)]


def _tile_of_block(block, value: Value, coarse: Sharding, lc: LowerContext):
    """Inside the body: this device's (padded) shard of `value` from its block of the
    coarser layout the array arrived in. Dims split only by value's sharding arrive
    whole: pad them to tiles x shard size and slice at this device's offset."""
    fine, shard = value.sharding, value.sharding.shard_shape(value.shape)
    sliced = [d for d in range(value.rank) if fine.tiles[d] != coarse.tiles[d]]
    widths = [(0, fine.tiles[d] * shard[d] - block.shape[d] if d in sliced else 0) for d in range(value.rank)]
    block = jnp.pad(block, widths)
    starts = [jnp.asarray(fine.coords()[:, d] * shard[d], np.int32)[lc.device_id()] if d in sliced else 0
              for d in range(value.rank)]
    return lax.dynamic_slice(block, starts, shard)


class OtherSignature(Exception):
    """An Executable was called with arguments of another signature than its own."""


def even_spec(mesh: Mesh, sharding: Sharding, shape: Sequence[int]) -> P:
    """The finest PartitionSpec over `mesh` that `sharding` refines and that splits
    `shape` evenly: exactly `sharding` where it can be."""
    if 0 in shape:   # XLA lays out values with no elements whole, whatever it is told
        return P()
    mapping = sharding.dims_mapping(mesh) or [None] * sharding.rank
    return spec_of([axes if axes and n % t == 0 else None for axes, n, t in zip(mapping, shape, sharding.tiles)])


def result_layouts(mesh: Mesh, outputs: Sequence[Value], auto: bool = False) -> list[NamedSharding]:
    """The layouts a program's results come back in, over the user's jax mesh (whose
    axes may be Explicit), so that jax code can combine them with its own arrays; with
    `auto`, over its twin of Auto axes (for untyped results)."""
    return [NamedSharding(mesh.to_jax(auto=auto), even_spec(mesh, v.sharding, v.shape)) for v in outputs]


def explicit_mode(mesh: Mesh) -> bool:
    """Whether jax traces in explicit sharding mode over the mesh (jax.set_mesh of it)."""
    context = jax.sharding.get_abstract_mesh()
    return has_explicit_axes(context) and context == mesh.to_jax().abstract_mesh


def typed_results(run: Callable, mesh: Mesh, layouts: Sequence[NamedSharding]) -> Callable:
    """`run`, whose results, traced in explicit mode over the mesh or from arguments
    typed with Explicit axes (arrays placed over a jax.make_mesh mesh, no jax.set_mesh
    needed), are typed with `layouts` as jax's are (it runs in automatic mode inside;
    jitted, for jax runs no auto_axes of a host callback eagerly)."""
    def call(*args):
        if not typed(mesh, args):
            return run(*args)
        return jax.jit(jax.sharding.auto_axes(run, out_sharding=tuple(layouts)))(*args)
    return call


def typed(mesh: Mesh, args: Sequence) -> bool:
    """Whether jax's types hold the layouts of a call's arguments and results: in
    explicit mode over the mesh, or where an argument is typed by Explicit axes."""
    return explicit_mode(mesh) or any(_explicitly_typed(x) for x in args)


def _explicitly_typed(x) -> bool:
    sharding = getattr(jax.typeof(x), "sharding", None)
    return sharding is not None and has_explicit_axes(sharding.mesh)


class Executable:
    """An SPMD program compiled for the jax devices of `mesh`, as ONE jax.jit: global
    arrays in and out, laid out as NamedShardings over the mesh; inside, a shard_map of
    the per-device program. Layouts a NamedSharding cannot hold (uneven shards, or not
    expressible over this mesh) travel in the finest coarser one: the body slices its
    shard out of such an input and assembles such an output.

    Call it with the flat global arguments (NumPy arrays or jax.Arrays): a jax.Array
    already laid out as `input_sharding(i)` is used in place, any other is moved there
    by one device_put; arguments in `donate` give their buffers to the outputs."""

    def __init__(self, spmd: Program, params: Sequence[Value], outputs: Sequence[Value], mesh: Mesh,
                 donate: Sequence[int] = (), wrap: Callable[[Callable], Callable] = _identity,
                 compiler_options: Optional[dict] = None):
        """`wrap` turns the traced program into what is jitted (the caller's custom
        differentiation and batching rules around it); `compiler_options` are XLA's."""
        self.spmd, self.params, self.outputs, self.mesh = spmd, list(params), list(outputs), mesh
        # The program runs over Auto axes; its results are laid out over the user's jax mesh
        # (whose axes may be Explicit), so that jax code can combine them with its own arrays.
        self.jax_mesh = mesh.to_jax(auto=True)      # raises a clear error when jax has too few devices
        ids = mesh.devices.ravel()
        self._ids = None if np.array_equal(ids, np.arange(mesh.size)) else ids
        self.in_shardings = [self.named_sharding(p.sharding, p.shape) for p in self.params]
        self.out_shardings = result_layouts(mesh, self.outputs)
        self._coarse_in = [self._coarse(ns, v) for ns, v in zip(self.in_shardings, self.params)]
        # The element-wise tail runs after the shard_map, on global arrays (runtime/epilogue.py);
        # the shard_map's results are the core's outputs, each as (global value, coarser layout
        # it leaves in or None).
        self.epilogue = Epilogue(spmd, self.params, self.outputs, mesh.size,
                                 lambda v: v.sharding is not None and self._coarse(self._named(v), v) is None)
        core_globals = [g for local, g in zip(spmd.outputs, self.outputs) if local not in self.epilogue.made]
        core_globals += list(self.epilogue.read.values())
        self._core_out = [(g, self._coarse(self._named(g), g)) for g in core_globals]
        self._wrap = wrap
        # The program is jitted by itself inside the wrapper: jax lowers the custom vmap
        # rule's call by evaluating its jaxpr again, which is then one call, not the
        # whole shard_map body traced a second time.
        self._program = jax.jit(self._run_global)
        self.compiler_options = compiler_options or {}
        jit = functools.partial(jax.jit, wrap(self._program), in_shardings=tuple(self.in_shardings),
                                out_shardings=tuple(self.out_shardings), donate_argnums=tuple(donate))
        self.jitted = jit(compiler_options=self.compiler_options or None)
        self._compiled = None
        self.multiprocess = jax.process_count() > 1

    # -- layouts ------------------------------------------------------------------------
    def _named(self, v: Value) -> NamedSharding:
        return self.named_sharding(v.sharding, v.shape)

    def named_sharding(self, sharding: Sharding, shape: Sequence[int]) -> NamedSharding:
        """The finest NamedSharding over the mesh that `sharding` refines and that splits
        `shape` evenly: exactly `sharding` where it can be."""
        return NamedSharding(self.jax_mesh, even_spec(self.mesh, sharding, shape))

    def _coarse(self, named: NamedSharding, value: Value) -> Sharding | None:
        """The layout `named` gives value, when coarser than value's own (None: the same)."""
        # read over our mesh, not named's jax mesh: an abstract one names no devices
        coarse = Sharding.from_mesh(self.mesh, named.spec, value.shape) if value.rank else value.sharding
        return None if coarse == value.sharding else coarse

    def assembly_gathers(self) -> list[tuple[Value, int, np.ndarray]]:
        """The gathers _body runs to assemble results whose layout no NamedSharding holds:
        (the result, bytes per device, device groups) each (see _assemble)."""
        gathers = []
        for g, coarse in self._core_out:
            replicas = g.sharding.tile_assignment.reshape(-1, g.sharding.num_replicas).T
            if coarse is not None and replicas.shape[1] > 1:
                local = int(np.prod(g.sharding.shard_shape(g.shape))) * np.dtype(g.dtype).itemsize
                gathers.append((g, replicas.shape[1] * local, replicas))
        return gathers

    def input_sharding(self, i: int) -> NamedSharding:
        """The layout in which argument i is used without copies."""
        return self.in_shardings[i]

    # -- compile ------------------------------------------------------------------------
    @property
    def compiled(self) -> jax.stages.Compiled:
        """The compiled program (for its HLO text and memory analysis)."""
        if self._compiled is None:
            self._compiled = self._compile(self.compiler_options)
        return self._compiled

    def compile(self, compiler_options: Optional[dict] = None) -> jax.stages.Compiled:
        """The compiled program; with more of XLA's options, compiled anew with them."""
        if not compiler_options:
            return self.compiled
        return self._compile({**self.compiler_options, **compiler_options})

    def _compile(self, options: dict) -> jax.stages.Compiled:
        in_types = [jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=s) for p, s in zip(self.params, self.in_shardings)]
        return self.jitted.lower(*in_types).compile(options or None)

    def run_compiled(self, compiled: jax.stages.Compiled, flat_args: Sequence) -> list[jax.Array]:
        """Run `compiled` (this program, compiled ahead of time) on the flat arguments,
        moved to its input layouts where they are elsewhere."""
        return list(compiled(*(self.place(flat_args) or flat_args)))

    def _run_global(self, *args):
        if any(tuple(x.shape) != p.shape or np.dtype(x.dtype) != p.dtype for x, p in zip(args, self.params)):
            raise OtherSignature()      # jax retraces for another signature: not this program's
        epilogue = self.epilogue
        in_specs = tuple(self.in_shardings[k].spec for k in self._fed)
        out_specs = tuple(P() if coarse is not None else self._named(g).spec for g, coarse in self._core_out)

        def run(*args):
            # whatever jax.set_mesh says outside; and all axes the shard_map's, also where a vmap
            # outside batches a dim split over an Explicit axis (jax leaves such axes out of a
            # shard_map traced inside that vmap; this trace of one example's program only feeds
            # our custom vmap rule, Transforms._vmap_rule, which runs the batched program instead)
            with (jax.sharding.use_abstract_mesh(self.jax_mesh.abstract_mesh),
                  remove_explicit_mesh_axis_names(self.jax_mesh.axis_names)):
                results = jax.shard_map(self._body, mesh=self.jax_mesh, in_specs=in_specs, out_specs=out_specs,
                                        check_vma=False)(*[args[k] for k in self._fed])
                # element-wise lowerings read nothing of a device: no LowerContext
                return tuple(epilogue.run(args, results, lambda instr, xs: lower_instr(instr, xs, None)))
        return typed_results(run, self.mesh, self.out_shardings)(*args)

    @functools.cached_property
    def fast(self) -> Callable:
        """What a steady-state call runs: the jitted program (over a mesh of Explicit axes,
        for traced arguments in explicit mode, the typed one)."""
        if not has_explicit_axes(self.mesh.to_jax()):
            return self.jitted

        def call(*args):
            traced = any(isinstance(x, jax.core.Tracer) for x in args)
            return (self._for_traced(args) if traced else self.jitted)(*args)
        return call

    def _for_traced(self, args: Sequence) -> Callable:
        """The program inside a caller's trace (grad, jit, vmap): typed where the arguments'
        types hold their layouts, in explicit mode or over a mesh of Explicit axes without
        jax.set_mesh (_nested's sharding constraints are refused there: vmap adds an
        UNCONSTRAINED batch dim, which a mesh of no Auto axes cannot hold)."""
        return self._typed if typed(self.mesh, args) else self._nested

    @functools.cached_property
    def _typed(self) -> Callable:
        """The program for traced arguments in explicit mode, where their types hold their
        layouts (and those of their cotangents under grad, and of batch dims under vmap)."""
        return jax.jit(self._wrap(self._program))

    @functools.cached_property
    def _fed(self) -> list[int]:
        """The arguments the shard_map takes: the core's, but for zero-size ones (XLA folds
        such an operand into a constant, and then rejects the shard_map that reads it)."""
        return [k for k in self.epilogue.arguments if self.params[k].nbytes]

    def _body(self, *fed):
        lc = LowerContext(self.jax_mesh.axis_names, lambda program, args: _run_body(program, args, lc), self._ids,
                          ops.wants_row_major(self.epilogue.core))
        blocks = dict(zip(self._fed, fed))
        local = [jnp.zeros(p.shape, p.dtype) if k not in blocks     # zero-size: nothing to feed
                 else blocks[k] if self._coarse_in[k] is None
                 else _tile_of_block(blocks[k], self.params[k], self._coarse_in[k], lc)
                 for k, p in zip(self.epilogue.arguments, self.epilogue.core.params)]
        outs = _run_body(self.epilogue.core, local, lc)
        return tuple(o if coarse is None else _assemble(o, g.sharding, g.shape, lc)
                     for o, (g, coarse) in zip(outs, self._core_out))

    # -- run ------------------------------------------------------------------------------
    def __call__(self, flat_args: Sequence) -> list[jax.Array]:
        if self.multiprocess:    # jax.jit takes no NumPy inputs for shardings spanning processes
            flat_args = self.place(flat_args) or flat_args
        if any(isinstance(x, jax.core.Tracer) for x in flat_args):
            return list(self._for_traced(flat_args)(*flat_args))
        try:
            return list(self.jitted(*flat_args))
        except ValueError:
            placed = self.place(flat_args)
            if placed is None:     # not a layout mismatch
                raise
            return list(self.jitted(*placed))

    @functools.cached_property
    def _nested(self) -> Callable:
        """The program inside a caller's trace (grad, jit, vmap): jitted without input or
        output layouts, its results constrained inside instead. jax transposes a jit's
        out_shardings into its pullback's in_shardings, which then refuse the committed
        cotangents of an eager grad in any other layout; and jax's batching carries
        committed arrays over in their own layouts (XLA moves them into the shard_map's).
        XLA's options are the outermost jit's to give."""
        program = self._wrap(self._program)

        def constrained(*args):
            return jax.lax.with_sharding_constraint(program(*args), tuple(self.out_shardings))
        return jax.jit(constrained)

    def place(self, flat_args: Sequence) -> list | None:
        """The arguments with every jax.Array in another layout moved to its input
        sharding (one device_put each), and in multi-process runs every NumPy array
        made a global jax.Array from this process's shards; None if nothing moved or the
    arguments are traced (see `_nested`)."""
        if any(isinstance(x, jax.core.Tracer) for x in flat_args):
            return None
        moved = [not x.sharding.is_equivalent_to(s, x.ndim) if isinstance(x, jax.Array) else self.multiprocess
                 for x, s in zip(flat_args, self.in_shardings)]
        if not any(moved):
            return None
        return [_move(x, s) if m else x for x, s, m in zip(flat_args, self.in_shardings, moved)]


def _move(x, sharding: NamedSharding) -> jax.Array:
    """x laid out as `sharding`. A host array (the same in every process) gives each
    process its own shards; an array spread over several processes moves inside a
    (cached) jitted identity, which every process runs."""
    if not isinstance(x, jax.Array):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
    if x.is_fully_addressable:
        return jax.device_put(x, sharding)
    return jax.jit(_identity, out_shardings=sharding)(x)
