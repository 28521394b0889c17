"""gspmd.jit: trace -> complete shardings -> partition -> execute; and Lowered (its
lowering; running it is execution.py's, inspecting it inspection.py's)."""
from __future__ import annotations

import difflib
import re
from typing import Callable, Optional, Sequence, Union

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from gspmd import ops, propagation
from gspmd.analysis import Hardware, memory
from gspmd.arguments import (Signature, Template, abstract_argument, is_array, is_static_key, key_layout, leaf_key,
                             logical_axes, paths, result_logical_axes, result_paths)
from gspmd.checks import count, describe
from gspmd.compose import Transforms
from gspmd.errors import ShardingError
from gspmd.execution import Execution, check_compiler_options, gc_paused
from gspmd.frontend import mesh_split, trace
from gspmd.frontend.trace import jaxpr_of
from gspmd.frontend.annotation import is_tracing, tracing
from gspmd.inspection import Inspection
from gspmd.ir import Program, Value, verify
from gspmd.ir.dce import eliminate_dead_code
from gspmd.mesh import Mesh, as_mesh, jax_context_mesh
from gspmd.frontend.keys import KeyData
from gspmd.partitioner import partition
from gspmd.passes.fit_memory import fit_memory
from gspmd.runtime import jax_backend
from gspmd.spmd.cost import profile

BACKENDS = ("sim", "jax")
_JIT_OPTIONS = ("mesh", "backend", "static_argnums", "static_argnames", "donate_argnums", "donate_argnames",
                "in_shardings", "out_shardings", "memory_limit", "hardware", "compiler_options", "keep_unused", "inline")


def jit(fn: Optional[Callable] = None, mesh=None, backend: str = "sim", *,
        static_argnums: Union[int, Sequence[int]] = (), static_argnames: Union[str, Sequence[str]] = (),
        donate_argnums: Union[int, Sequence[int]] = (), donate_argnames: Union[str, Sequence[str]] = (),
        in_shardings=None, out_shardings=None, memory_limit: Optional[int] = None,
        hardware: Union[None, str, Hardware] = None, compiler_options: Optional[dict] = None,
        keep_unused: bool = False, inline: bool = False, **unknown) -> "Partitioned":
    """Partition `fn` into one SPMD program for the devices of `mesh`; calling the result
    returns what `fn` returns on one device.

    Use it like jax.jit. `fn` is JAX code with gspmd.mesh_split annotations (or
    `in_shardings=`/`out_shardings=`: a PartitionSpec or NamedSharding per positional
    argument (the static ones left out, as jax.jit) / result, a prefix of their pytrees,
    one for all, None for "propagation decides"; with in_shardings, pass the arguments
    by position, as jax.jit wants).
    `mesh`: a gspmd.Mesh or jax.sharding.Mesh (default: the annotations' mesh).

    Backends: "sim" (default) runs all devices in this process with NumPy and returns
    NumPy arrays (padding is filled with NaN, so a missing mask shows; in explicit
    sharding mode, jax.Arrays typed with their layouts, as jax.jit's); "jax" runs on
    real jax devices as one jitted shard_map and returns jax.Arrays whose NamedShardings
    are the completed layouts over the mesh.

    Arguments: array leaves (NumPy, jax.Array, NumPy scalars) are the program's inputs;
    every other leaf (Python numbers, strings, functions, e.g. an Equinox module's
    activation) is static, as in eqx.filter_jit. `static_argnums`/`static_argnames`
    make whole arguments static; `donate_argnums`/`donate_argnames` let the outputs
    reuse those arguments' buffers (jax backend). Keyword arguments work as for jax.jit.

    Caching: one trace + completion + partition (+ compile) per signature (the
    arguments' pytree structure, shapes, dtypes and static values); later calls run
    the cached program directly (jax backend: a compiled executable called with the
    caller's arrays; NumPy inputs are placed by one transfer each).

    Composes with JAX: jax.grad/value_and_grad (the backward pass is itself partitioned
    with the same annotations), jax.jit around it (jax backend: the SPMD program is
    embedded; sim: a host callback), jax.vmap over it.

    Inspect without running: `f.lower(*args)` gives a Lowered (shapes may be
    jax.ShapeDtypeStruct) with `.as_text()`, `.report(hardware=...)` (collectives with
    their source lines, memory, FLOPs, step time), `.summary()`, `.explain(value)` (by
    pytree path like "params['w1']", result index or %name), `.sharding_of(value)`;
    `gspmd.visualize(lowered, value)` draws the layout.

    memory_limit: bytes per device the program should fit in (default: what a program
    may use of the memory of `hardware`, a profile such as "tpu-v3", when given: the
    device's memory less what its runtime reserves). Where one reshard of a value
    serves users far apart and holding it would exceed the limit, it is done again near
    the later users (more collective bytes, less memory); report() says what was chosen.
    hardware: a profile name or a gspmd.Hardware: what the partitioner prices its choices
    on (the default profile, tpu-v3, when None) and the default profile of report().

    As jax.jit's: without `fn`, a decorator taking it; `compiler_options` go to XLA
    (jax backend); `keep_unused` and `inline` are taken and change no result (a
    gspmd.jit inside another is always inlined)."""
    if fn is None:
        options = dict(static_argnums=static_argnums, static_argnames=static_argnames, donate_argnums=donate_argnums,
                       donate_argnames=donate_argnames, in_shardings=in_shardings, out_shardings=out_shardings,
                       memory_limit=memory_limit, hardware=hardware, compiler_options=compiler_options,
                       keep_unused=keep_unused, inline=inline, **unknown)
        return lambda f: jit(f, mesh, backend, **options)
    if "device" in unknown:
        raise ShardingError("gspmd.jit runs over the devices of its mesh, not one `device`: give mesh=... (for one "
                            "device, a mesh of one), or use jax.jit(device=...).")
    if unknown:
        name = next(iter(unknown))
        close = difflib.get_close_matches(name, _JIT_OPTIONS, n=1)
        raise ShardingError(f"gspmd.jit got an unknown keyword argument {name!r}; "
                            + (f"did you mean {close[0]!r}?" if close else f"it takes {', '.join(_JIT_OPTIONS)}."))
    if backend not in BACKENDS:
        raise ShardingError(f"Unknown backend {backend!r}; choose one of {BACKENDS} (gspmd.jit's backend says how "
                            "the program runs; jax.jit's named a platform: the jax backend runs on the mesh's devices).")
    check_compiler_options(compiler_options, backend, "jit")
    for name, flag in (("keep_unused", keep_unused), ("inline", inline)):
        if not isinstance(flag, bool):
            raise ShardingError(f"jit({name}=...) takes True or False (as jax.jit's), got "
                                f"{type(flag).__name__} {flag!r:.60}.")
    if not callable(fn):
        raise ShardingError(f"gspmd.jit needs a function, got {type(fn).__name__} {fn!r:.60}.")
    mesh = None if mesh is None else as_mesh(mesh, "for gspmd.jit(mesh=...)")
    memory_limit = None if memory_limit is None else count(memory_limit, "jit(memory_limit=...)",
                                                            example="memory_limit=8 * 2**30 (bytes per device)")
    hardware = None if hardware is None else profile(hardware)
    _check_layouts(in_shardings, "in_shardings", mesh)
    _check_layouts(out_shardings, "out_shardings", mesh)
    limit = memory_limit if memory_limit is not None else (hardware.usable_bytes if hardware else None)
    return Partitioned(fn, mesh, backend, Signature(fn, static_argnums, static_argnames, donate_argnums,
                                                           donate_argnames),
                       in_shardings, out_shardings, limit, hardware, compiler_options)


class Partitioned:
    """A function partitioned by gspmd.jit: call it like the function; `lower(...)` to
    inspect. See help(gspmd.jit)."""

    def __init__(self, fn: Callable, mesh: Optional[Mesh], backend: str, signature: Optional[Signature] = None,
                 in_shardings=None, out_shardings=None, memory_limit: Optional[int] = None,
                 hardware: Optional[Hardware] = None, compiler_options: Optional[dict] = None):
        self.fn, self.mesh, self.backend = fn, mesh, backend
        self.memory_limit, self.hardware = memory_limit, hardware
        self.compiler_options = compiler_options or {}
        self.signature = signature or Signature(fn, (), (), ())
        self.__wrapped__ = fn
        self.__name__ = self.signature.name
        self._traced_fn = _with_layouts(fn, in_shardings, out_shardings, mesh, self.signature)
        self._cache: dict = {}
        self._fast: dict = {}    # (pytree structure, context mesh) -> (output structure, compiled program)

    def __call__(self, *args, **kwargs):
        if is_tracing():     # inside another gspmd.jit: part of its program
            return self._traced_fn(*args, **kwargs)
        if not kwargs:
            # Steady state on the jax backend: the compiled program of the last signature
            # with this pytree structure, called with the caller's arrays; jax itself
            # checks shapes and layouts (a mismatch falls through to the general path).
            leaves, treedef = _flatten(args)
            fast = self._fast.get((treedef, jax.sharding.get_abstract_mesh()))
            if fast is not None:
                try:
                    return _unflatten(fast[0], fast[1](*leaves))
                except (jax_backend.OtherSignature, TypeError, ValueError):
                    pass
        args, kwargs, static = self.signature.split_static(args, kwargs)
        leaves, treedef = _flatten((args, kwargs))
        try:
            lowered = self._cache.get((treedef, static, tuple(map(leaf_key, leaves)), _context_mesh()))
        except TypeError:        # an unhashable static value: _lower explains
            lowered = None
        if lowered is None:
            with gc_paused():   # the first call lowers, compiles and runs: one pause for all three
                lowered = self._lower(args, kwargs, static, leaves, treedef)
                out = lowered._run(leaves)
        else:
            out = lowered._run(leaves)
        if lowered.fast_call is not None and not kwargs and self.signature.simple:
            self._fast[jax.tree_util.tree_structure(args), jax.sharding.get_abstract_mesh()] = lowered.fast_call
        return out

    def lower(self, *args, **kwargs) -> "Lowered":
        """Trace, complete and partition for these arguments; executes nothing. Array
        arguments may be jax.ShapeDtypeStruct. Cached per signature."""
        args, kwargs, static = self.signature.split_static(args, kwargs)
        leaves, treedef = _flatten((args, kwargs))
        return self._lower(args, kwargs, static, leaves, treedef)

    def _lower(self, args: tuple, kwargs: dict, static: tuple, leaves: list, treedef) -> "Lowered":
        self.signature.check_call(*self.signature.rebuild(static, args, kwargs))
        names = paths(self.signature, args, kwargs, static)
        keys = tuple(leaf_key(x) for x in leaves)
        _check_static(static, leaves, keys, names, self.signature)
        key = (treedef, static, keys, _context_mesh())
        if key not in self._cache:
            with gc_paused():
                self._cache[key] = Lowered(self, Template.of(treedef, keys, static), leaves, names,
                                           self.signature.donated_leaves(args, kwargs, static),
                                           logical_axes((args, kwargs)))
        return self._cache[key]

    def trace(self, *args, **kwargs) -> "Traced":
        """As jax.jit's trace: the function traced for these arguments, with `.jaxpr`,
        `.out_info` and `.lower()` (gspmd completes and partitions as it traces: this is
        lower()'s work, cached with it)."""
        return Traced(self.lower(*args, **kwargs))

    def eval_shape(self, *args, **kwargs):
        """The results' shapes and dtypes for these arguments (jax.ShapeDtypeStruct, or
        arrays), as jax.jit's eval_shape; executes nothing."""
        return self.lower(*args, **kwargs).out_info

    def clear_cache(self) -> None:
        """Forget every lowered signature (as jax.jit's clear_cache): the next call lowers anew."""
        self._cache.clear()
        self._fast.clear()

    def __repr__(self):
        return f"gspmd.jit({self.signature.name}, mesh={self.mesh}, backend={self.backend!r})"


_flatten, _unflatten = jax.tree_util.tree_flatten, jax.tree_util.tree_unflatten


class Traced:
    """What `gspmd.jit(f).trace(*args)` gives, as jax.jit's: `jaxpr` (the function on its
    flat array arguments as gspmd traces it: typed PRNG keys enter as key data),
    `out_info`, `fun_name`, and `lower()`."""

    def __init__(self, lowered: "Lowered"):
        self._lowered = lowered
        self.fun_name = lowered._signature.name

    @property
    def jaxpr(self):
        lowered = self._lowered
        return jaxpr_of(lowered.flat_fn, lowered.keys.avals, lowered.meshes[0] if lowered.meshes else None)

    @property
    def out_info(self):
        return self._lowered.out_info

    def lower(self) -> "Lowered":
        return self._lowered


def _context_mesh():
    """jax's context mesh (jax.set_mesh): it says what bare PartitionSpecs in fn mean."""
    abstract = jax.sharding.get_abstract_mesh()
    return abstract if abstract.empty else (abstract, jax_context_mesh())


def _check_static(static: tuple, leaves: list, keys: tuple, names: list[str], signature: Signature) -> None:
    """Static values must be hashable (they key the cache) and not traced."""
    for where, value in static:
        what = f"static argument {where!r} of {signature.name}"
        if isinstance(value, jax.core.Tracer):
            raise ShardingError(f"The {what} is a traced value ({value.aval.str_short()}); static arguments must be "
                                "concrete Python values: pass it as an ordinary (array) argument instead.")
        _check_hashable(value, what)
    for x, key, name in zip(leaves, keys, names):
        if is_static_key(key):
            _check_hashable(x, f"argument {name} (a static value: gspmd.jit traces only arrays)")


def _check_hashable(value, what: str) -> None:
    try:
        hash(value)
    except TypeError:
        raise ShardingError(f"The {what} is a {type(value).__name__}, which is not hashable, so it cannot key "
                            "gspmd.jit's cache; make it hashable, or pass its arrays as arguments.") from None


def _with_layouts(fn: Callable, in_shardings, out_shardings, mesh: Optional[Mesh], signature: Signature) -> Callable:
    """fn with in_shardings / out_shardings applied as mesh_split annotations, as jax.jit
    reads them: in_shardings covers the positional arguments with the static ones
    removed (a list counts as a tuple), and a call with keyword arguments takes none."""
    if in_shardings is None and out_shardings is None:
        return fn
    if isinstance(in_shardings, list):
        in_shardings = tuple(in_shardings)

    def annotated(*args, **kwargs):
        if in_shardings is not None:
            if kwargs:
                raise ShardingError(
                    f"{signature.name} got keyword arguments {sorted(kwargs)} and gspmd.jit was given in_shardings, "
                    "which cover the positional arguments only (jax.jit refuses this too): pass them by "
                    "position, or annotate them with gspmd.mesh_split inside the function.")
            static = signature.static_positions(len(args))
            dynamic = tuple(a for i, a in enumerate(args) if i not in static)
            dynamic = iter(_annotate(in_shardings, dynamic, mesh, "in_shardings",
                                     "the positional arguments (static ones removed)"))
            args = tuple(a if i in static else next(dynamic) for i, a in enumerate(args))
        out = fn(*args, **kwargs)
        return out if out_shardings is None else _annotate(out_shardings, out, mesh, "out_shardings", "the result")
    return annotated


def _is_layout(s) -> bool:
    return s is None or isinstance(s, (PartitionSpec, NamedSharding))


def _check_layouts(layouts, what: str, mesh: Optional[Mesh]) -> None:
    """in_shardings/out_shardings: a pytree (a prefix of the arguments' or results')
    whose leaves are PartitionSpecs (given a mesh, or under jax.set_mesh), NamedShardings
    or None."""
    for layout in jax.tree_util.tree_leaves(layouts, is_leaf=_is_layout):
        if not _is_layout(layout):
            raise ShardingError(f"{what} holds {describe(layout)}; give one PartitionSpec, NamedSharding or None per "
                                f"entry (a prefix of its pytree), e.g. {what}=(P('data', None), None).")
        if isinstance(layout, PartitionSpec) and mesh is None and jax_context_mesh() is None:
            _no_mesh(layout, what)


def _no_mesh(layout: PartitionSpec, what: str):
    raise ShardingError(f"{what} gives {layout} without a mesh; pass gspmd.jit(..., mesh=...), call it under "
                        "jax.set_mesh(mesh), or use NamedShardings.")


def _annotate(layouts, tree, mesh: Optional[Mesh], what: str, of: str):
    def split(layout, x):
        if layout is None or not is_array(x):
            return x
        if isinstance(layout, NamedSharding):
            return mesh_split(x, layout)
        around = mesh if mesh is not None else jax_context_mesh()   # a bare spec means jax.set_mesh's mesh
        return mesh_split(x, around, layout) if around is not None else _no_mesh(layout, what)
    try:
        return jax.tree_util.tree_map(lambda layout, sub: jax.tree_util.tree_map(lambda x: split(layout, x), sub),
                                      layouts, tree, is_leaf=_is_layout)
    except ShardingError as e:
        raise ShardingError(f"{what} {layouts}: {e}") from None
    except ValueError as e:
        raise ShardingError(f"{what} {layouts} does not match the structure of {of}: give one PartitionSpec, "
                            f"NamedSharding or None per entry (a prefix of its pytree). ({e})") from None


class Lowered(Execution, Inspection):
    """One traced, completed and partitioned program for one call signature.

    `program` is the completed program (every value's sharding), `spmd` the per-device
    program. Call it like the function (execution.py); inspect with as_text, report,
    summary, explain, sharding_of (inspection.py); values are named by pytree path
    ("params['w1']", "result[0]"), output index or %name. Lowering is here: trace,
    complete, partition, fit to the memory limit."""

    def __init__(self, partitioned: Partitioned, template: Template, leaves: list, names: list[str],
                 donate: tuple[int, ...] = (), logical: Optional[list] = None):
        self.backend, self._template = partitioned.backend, template
        self.donated = donate   # parameters whose buffers the results may reuse (donated arguments)
        self._signature = partitioned.signature
        param_names = template.dynamic_leaves(names)
        committed = [key_layout(k) for k in template.dynamic_leaves(list(template.keys))]
        avals = [abstract_argument(x, name, layout)
                 for x, name, layout in zip(template.dynamic_leaves(leaves), param_names, committed)]
        signature, fn = partitioned.signature, partitioned._traced_fn
        mesh = _jit_mesh(partitioned.mesh, committed)
        layouts = [_input_layout(layout, len(a.shape), i in donate) for i, (layout, a) in enumerate(zip(committed, avals))]

        def flat_fn(*dynamic):
            dynamic = [x if layout is None else mesh_split(x, *layout) for x, layout in zip(dynamic, layouts)]
            args, kwargs = jax.tree_util.tree_unflatten(template.treedef, template.leaves(dynamic))
            args, kwargs = signature.rebuild(template.static, args, kwargs)
            return fn(*args, **kwargs)
        self.keys = KeyData(flat_fn, avals)   # typed PRNG keys cross as their key data
        self.flat_fn = self.keys.fn           # what the program computes: on key data
        with tracing(mesh) as seen:
            self.program, self.out_tree = _trace(self.keys.fn, self.keys.avals, signature.name, mesh,
                                                 leaves, names)
        self._leaf_names = names
        self.program.labels = dict(zip(self.program.params, param_names))
        self.program.labels.update(zip(self.program.outputs, result_paths(self.out_tree)))
        # the logical axis names flax variables declare (MaxText's embed, mlp, ...), per dim
        declared = template.dynamic_leaves(logical or [None] * len(leaves)) + result_logical_axes(self.out_tree)
        self.logical_axes = {v: names for v, names in zip(self.program.params + self.program.outputs, declared)
                             if names is not None and len(names) == len(v.shape)}
        eliminate_dead_code(self.program)
        verify(self.program)
        self.num_devices = _device_count(self.program, [mesh] + seen.meshes)
        self.meshes = _unique([mesh] + seen.meshes)
        self.mesh = self.meshes[0] if self.meshes else Mesh(np.arange(self.num_devices), ("d",))
        self.completion = propagation.complete(self.program, self.num_devices, partitioned.hardware)
        self.spmd = partition(self.program, self.num_devices, partitioned.hardware)
        # how the program was fitted to the memory limit (None: no limit given)
        limit = partitioned.memory_limit
        self.memory_budget = None if limit is None else fit_memory(
            self.spmd, self.num_devices, limit, memory.donation_aliases(self.spmd, self.donated),
            kernel_scratch=partitioned.hardware is None or partitioned.hardware.kernel_scratch,
            hardware=partitioned.hardware)
        verify(self.spmd)
        self.hardware = partitioned.hardware
        self.compiler_options = partitioned.compiler_options
        self._ready_to_run()
        # its derivatives and batched forms, partitioned when jax asks for them
        def partitioned_alike(fn: Callable) -> Partitioned:
            # over this program's mesh: the derived programs may see traced arguments only, whose
            # types name an abstract mesh (Explicit axes, no jax.set_mesh), not its devices
            return Partitioned(fn, partitioned.mesh or mesh, self.backend, compiler_options=self.compiler_options)
        # the arguments' avals as traced: over a mesh of Explicit axes their types hold their layouts,
        # which the derived programs' traces must keep (jax's type rules refuse typed and untyped operands)
        self.transforms = Transforms(self.flat_fn, self.keys.avals, _avals(self.program.outputs),
                                     signature.name, partitioned_alike, mesh)


def _trace(flat_fn: Callable, avals: list, name: str, mesh: Optional[Mesh], leaves: list, names: list[str]):
    """trace(), with a clear error when the function fails on an argument gspmd.jit
    passed through as static that was meant as an array."""
    try:
        return trace(flat_fn, avals, name, mesh)
    except (TypeError, AttributeError, ShardingError) as e:
        suspect = _meant_as_array(e, leaves, names)
        if suspect is None:
            raise
        where, text = suspect
        raise ShardingError(
            f"Tracing {name} failed ({type(e).__name__}: {e}) and argument {where} is {text}: gspmd.jit "
            "passes non-array arguments through unchanged (static, as eqx.filter_jit does). Pass a numeric array "
            "there (np.asarray of a rectangular list), or make the function handle it in Python.") from e


def _meant_as_array(e: Exception, leaves: list, names: list[str]) -> Optional[tuple[str, str]]:
    """(argument, what it is) of a static leaf the failed trace probably meant as an
    array: a string, or (where the error speaks of a list) a list of Python numbers."""
    for x, n in zip(leaves, names):
        if isinstance(x, (str, bytes)) and (not isinstance(e, ShardingError) or repr(x) in str(e)):
            return n, f"the string {x!r}"
    if isinstance(e, ShardingError) or not re.search(r"\b(list|tuple)\b", str(e)):
        return None
    for x, n in zip(leaves, names):
        if isinstance(x, (int, float, complex)) and re.search(r"\[\d+\]$", n):
            return re.sub(r"(\[\d+\])+$", "", n), "a list of Python numbers"
    return None


def _jit_mesh(mesh: Optional[Mesh], committed: list) -> Optional[Mesh]:
    """The jit's mesh: jit(mesh=...), else jax.set_mesh's, else the first committed
    argument's (jax.jit runs where its arguments are; a staged one's type names an
    abstract mesh only, whose devices are the outer call's)."""
    if mesh is not None:
        return mesh
    context = jax_context_mesh()
    if context is not None:
        return Mesh.from_jax(context)
    layouts = [c for c in committed if c is not None]
    concrete = [c.mesh for c in layouts if isinstance(c.mesh, jax.sharding.Mesh)]
    if concrete:
        return Mesh.from_jax(concrete[0])
    return Mesh.of_abstract(layouts[0].mesh) if layouts else None


def _input_layout(committed: Optional[NamedSharding], rank: int, donated: bool) -> Optional[tuple]:
    """The annotation a committed argument's layout puts on its parameter, as jax.jit
    keeps such a layout: its split dims; the dims it leaves whole are left to
    propagation (the results of a gspmd.jit on the jax backend come back whole along
    dims they split unevenly, and must go in again as they were made), except for a
    donated argument, whose layout is kept whole so that its own buffer is used. Even
    with no dim split it names the devices the program runs on, as under jax.jit.
    Returns mesh_split's (mesh, spec), or None for no annotation."""
    if committed is None:
        return None
    spec = tuple(committed.spec) + (None,) * (rank - len(committed.spec))
    if donated:
        return committed.mesh, PartitionSpec(*spec)
    return committed.mesh, PartitionSpec(*(PartitionSpec.UNCONSTRAINED if e is None else e for e in spec))


def _avals(values: Sequence[Value]) -> list[jax.ShapeDtypeStruct]:
    return [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in values]


def _unique(meshes: list) -> list[Mesh]:
    out: list[Mesh] = []
    for m in meshes:
        if m is not None and m not in out:
            out.append(m)
    return out


def _device_count(program: Program, meshes: list) -> int:
    """The devices of the program: those of its layouts and of the meshes its trace used
    (also where the values they annotated are dead)."""
    counts = {s.num_devices for i in program.all_instrs(into_regions=False) for s in ops.layouts_named(i)}
    counts.update(m.size for m in meshes if m is not None)
    if len(counts) > 1:
        raise ShardingError(f"Annotations and jit(mesh=...) use meshes of different sizes {sorted(counts)}; "
                            "all meshes of one program must cover the same devices.")
    return counts.pop() if counts else 1
