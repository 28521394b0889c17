"""How a lowered program runs (Lowered's running half): a call checked leaf by leaf
against the signature it was lowered for, then the sim backend (NumPy, all devices in
this process; under jax transformations a host callback) or the jax backend (one
compiled shard_map, see runtime/jax_backend.py). Its derivatives and batched forms
(compose.py) wrap whichever runs.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
from typing import Callable, Iterator, Optional

import jax
import numpy as np

from gspmd.analysis import schedule
from gspmd.analysis.report import Collective
from gspmd.arguments import Signature, Template, is_array, is_static_key, leaf_key
from gspmd.checks import describe
from gspmd.compose import Transforms
from gspmd.errors import ShardingError
from gspmd.frontend.keys import KeyData
from gspmd.ir import Program
from gspmd.mesh import Mesh
from gspmd.runtime import jax_backend, sim
from gspmd.spmd.context import Why
from gspmd.spmd.cost import Pattern

_LOWER_AGAIN = "call the jitted function (it lowers again) or lower anew."
_flatten = jax.tree_util.tree_flatten


class Execution:
    """Running a Lowered (a mixin). It reads what lowering made: the signature, the
    call's template and leaf names, the programs (`program`: completed, `spmd`: per device),
    the mesh, the donated parameters, `keys` (typed PRNG keys as key data) and
    `transforms`; `_ready_to_run` sets up its own state."""
    backend: str
    program: Program
    spmd: Program
    mesh: Mesh
    num_devices: int
    donated: tuple[int, ...]
    keys: KeyData
    out_tree: object
    compiler_options: dict
    transforms: Transforms
    meshes: list[Mesh]       # every mesh the function names (none: nothing to partition)
    flat_fn: Callable        # the function on the flat arguments (typed PRNG keys as key data)
    _signature: Signature
    _template: Template
    _leaf_names: list[str]

    def _ready_to_run(self) -> None:
        """Nothing compiled yet: the first call picks the backend's way to run."""
        self._jax: Optional[jax_backend.Executable] = None
        self._execute: Callable[[list], list] = self._first_execute
        self._host_program: Optional[Callable] = None

    def __call__(self, *args, **kwargs):
        """Run on arguments of the signature this was lowered for."""
        return self._run(self._checked(args, kwargs))

    def compile(self, compiler_options: Optional[dict] = None) -> "Compiled":
        """As jax.jit's `.lower(...).compile(...)`: the program compiled now (the jax
        backend; `compiler_options` are XLA's), to call and to analyse."""
        return Compiled(self, compiler_options)

    @property
    def out_info(self):
        """The results' shapes and dtypes (jax.ShapeDtypeStruct), as jax.jit's eval_shape gives them."""
        flat = [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in self.program.outputs]
        return jax.tree_util.tree_unflatten(self.out_tree, jax.eval_shape(lambda *xs: self.keys.results(xs), *flat))

    def backend_assembly(self) -> list[Collective]:
        """The collectives the backend runs around the program: on the jax backend, the
        gathers that assemble results whose layout no NamedSharding holds (none known
        where this process has not the mesh's devices: such a program is for planning)."""
        if self.backend != "jax" or not self.mesh.has_jax_devices():
            return []
        return [Collective(Pattern.ALL_GATHER.value, nbytes, tuple(map(tuple, groups.tolist())),
                           f"{self.label(v)}: assembled by the jax backend (uneven shards)", why=Why.RESHARD,
                           source=self.label(v))
                for v, nbytes, groups in self.jax_executable().assembly_gathers()]

    def runs_breadth_first(self) -> bool:
        """Whether the compiled program runs in the order of XLA:CPU's default scheduler
        (analysis/schedule.py): the jax backend's, on CPU devices, unless XLA_FLAGS turns
        that scheduler off (XLA:CPU reads it from there alone, not from compiler_options)."""
        if not (self.backend == "jax" and self.mesh.has_jax_devices() and schedule.xla_cpu_breadth_first()):
            return False
        device = self.mesh.abstract().abstract_device   # also an abstract mesh's (Mesh.of_abstract)
        return device is not None and device.platform == "cpu"

    def _checked(self, args: tuple, kwargs: dict) -> list:
        """The call's leaves, checked against the signature this was lowered for."""
        dynamic, dynamic_kwargs, static = self._signature.split_static(args, kwargs)
        leaves, treedef = _flatten((dynamic, dynamic_kwargs))
        if treedef != self._template.treedef or static != self._template.static:
            self._other_structure(leaves, args, kwargs)
        self._check_leaves(leaves)
        return leaves

    def _other_structure(self, leaves: list, args: tuple, kwargs: dict) -> None:
        """Why a call of another pytree structure (or other static arguments) than the
        lowered one cannot run: too many or few arrays, a call the function cannot take."""
        expected = [f"{n}: {_type_text(k[0], k[1])}" for n, k in zip(self._leaf_names, self._template.keys)
                    if not is_static_key(k)]
        arrays = sum(map(is_array, leaves))
        if arrays != len(expected):
            raise ShardingError(f"Expected {len(expected)} array arguments ({', '.join(expected)}), got {arrays}; "
                                f"{_LOWER_AGAIN}")
        self._signature.check_call(args, kwargs)
        static = f"; static: {dict(self._template.static)}" if self._template.static else ""
        raise ShardingError(f"{self._signature.name} was lowered for arguments of another pytree structure "
                            f"or other static arguments ({', '.join(expected)}{static}); {_LOWER_AGAIN}")

    def _check_leaves(self, leaves: list) -> None:
        """Each leaf as lowered, as a compiled jax function checks: the same static
        value, or an array of the same shape and dtype."""
        for x, key, name in zip(leaves, self._template.keys, self._leaf_names):
            if is_static_key(key):
                if leaf_key(x) != key:
                    raise ShardingError(f"Argument {name} is {describe(x)} but the program was lowered for the "
                                        f"static value {key[2]!r}; {_LOWER_AGAIN}")
            elif not is_array(x) or (tuple(x.shape), _dtype(x.dtype)) != (key[0], _dtype(key[1])):
                given = f"has shape {tuple(x.shape)} and dtype {_dtype(x.dtype)}" if is_array(x) else \
                    f"is {describe(x)}"
                raise ShardingError(f"Argument {name} {given} but the program was lowered for shape {key[0]} and "
                                    f"dtype {_dtype(key[1])}; {_LOWER_AGAIN}")

    def _run(self, leaves: list, execute: Optional[Callable[[list], list]] = None):
        arrays = self.keys.args(self._template.dynamic_leaves(leaves))
        if execute is None and self._inlined(arrays):
            execute = self._inline
        return jax.tree_util.tree_unflatten(self.out_tree, self.keys.results((execute or self._execute)(arrays)))

    def _inlined(self, arrays: list) -> bool:
        """Called inside a caller's trace (another jax.jit's, grad, vmap) with no mesh
        named anywhere (no mesh=, jax.set_mesh, placed argument or annotation): there is
        nothing to partition, and the devices are the enclosing computation's, which
        only jax knows, so the function runs inline in that trace, as a jax.jit nested
        in another does (a program for one device would pin it to device 0)."""
        return not self.meshes and any(isinstance(x, jax.core.Tracer) for x in arrays)

    def _inline(self, arrays: list) -> list:
        return jax.tree_util.tree_leaves(self.flat_fn(*arrays))

    def _first_execute(self, arrays: list) -> list:
        with gc_paused():   # the jax backend builds its executable, traces and compiles here
            self._execute = self.jax_executable() if self.backend == "jax" else self._run_on_host
            return self._execute(arrays)

    @property
    def fast_call(self) -> Optional[tuple]:
        """(output structure, compiled program taking the flat arrays) when a call can
        go straight to the compiled program: jax backend, a mesh named (see _inlined) over
        devices of its own (one over an abstract mesh runs in staged traces only), every
        leaf an array (no typed PRNG keys), one process."""
        if (self._jax is None or not self.meshes or self.mesh.is_abstract or self._template.dynamic is not None
                or self._jax.multiprocess or any(self.keys.key_args) or any(self.keys.key_results)):
            return None
        return self.out_tree, self._jax.fast

    def jax_executable(self) -> jax_backend.Executable:
        """The SPMD program as one jitted shard_map on the mesh's jax devices (it
        composes with jax.grad, jax.jit and jax.vmap like the function)."""
        if self._jax is None:
            self._jax = jax_backend.Executable(self.spmd, self.program.params, self.program.outputs, self.mesh,
                                               self.donated, wrap=self.transforms.wrap,
                                               compiler_options=self.compiler_options)
        return self._jax

    def _run_on_host(self, arrays: list) -> list:
        """The sim backend; called with tracers (under grad, jit, vmap) it runs as a host
        callback inside the caller's computation."""
        if not any(isinstance(x, jax.core.Tracer) for x in arrays):
            results = self._run_sim(arrays)
            if jax_backend.typed(self.mesh, arrays):   # typed with their layouts, as jax.jit's results
                layouts = jax_backend.result_layouts(self.mesh, self.program.outputs)
                return [jax.device_put(r, s) for r, s in zip(results, layouts)]
            return results
        if self._host_program is None:
            shapes = [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in self.program.outputs]

            def call(*ys):
                return tuple(jax.pure_callback(lambda *hs: self._run_sim(hs), shapes, *ys))
            if not self.mesh.has_jax_devices():   # more devices simulated than jax has: nowhere to lay them
                self._host_program = self.transforms.wrap(call)
                return self._host_program(*arrays)
            layouts = jax_backend.result_layouts(self.mesh, self.program.outputs)
            # Laid out as the jax backend's results (over the mesh's Auto axes where untyped), in one
            # jit with the callback: jax lays a callback's results out on device 0 alone (a maximal
            # GSPMDSharding) where its operands are on several devices, which no later eager jax op
            # takes (jax.jit(callback)(x) + 1 fails alike), nor an eager constraint.
            laid_out = jax.jit(call, out_shardings=tuple(jax_backend.result_layouts(self.mesh, self.program.outputs,
                                                                                    auto=True)))

            def on_host(*xs):   # results typed with their layouts in explicit mode, as the jax backend's
                if jax_backend.typed(self.mesh, xs):
                    return jax_backend.typed_results(call, self.mesh, layouts)(*xs)
                return laid_out(*xs)
            self._host_program = self.transforms.wrap(on_host)
        return self._host_program(*arrays)

    def _run_sim(self, flat) -> list[np.ndarray]:
        per_param = [sim.shard(np.asarray(x, p.dtype), p.sharding) for x, p in zip(flat, self.program.params)]
        per_device = [[shards[d] for shards in per_param] for d in range(self.num_devices)]
        results = sim.run(self.spmd, per_device, self.num_devices)
        return [sim.unshard([results[d][i] for d in range(self.num_devices)], v.sharding, v.shape)
                for i, v in enumerate(self.program.outputs)]


class Compiled:
    """What `Lowered.compile()` gives, as jax.stages.Compiled: call it with arguments of
    the lowered signature; `memory_analysis()`, `cost_analysis()` and `as_text()` are
    XLA's of the compiled program on the jax backend. The sim backend compiles nothing:
    there they are gspmd's own estimates for one device (a MemoryStats with the fields
    of XLA's, FLOPs) and the per-device program's text."""

    def __init__(self, lowered: Execution, compiler_options: Optional[dict] = None):
        self.lowered = lowered
        self._xla, self._execute = None, None
        check_compiler_options(compiler_options, lowered.backend, "compile")
        if lowered.backend == "jax":
            executable = lowered.jax_executable()
            self._xla = executable.compile(compiler_options)
            self._execute = functools.partial(executable.run_compiled, self._xla)

    def __call__(self, *args, **kwargs):
        return self.lowered._run(self.lowered._checked(args, kwargs), self._execute)

    def memory_analysis(self):
        if self._xla is not None:
            return self._xla.memory_analysis()
        profile = self.lowered.report().memory
        outputs = sum(v.nbytes for v in self.lowered.spmd.outputs)    # aliased ones included, as XLA's
        held = profile.arguments_bytes + outputs - profile.aliased_bytes
        return MemoryStats(argument_size_in_bytes=profile.arguments_bytes, output_size_in_bytes=outputs,
                           alias_size_in_bytes=profile.aliased_bytes,
                           temp_size_in_bytes=max(profile.peak_bytes - held, 0))

    def cost_analysis(self):
        if self._xla is not None:
            return self._xla.cost_analysis()
        return {"flops": float(self.lowered.report().flops)}

    def as_text(self) -> str:
        return self._xla.as_text() if self._xla is not None else self.lowered.as_text()


def check_compiler_options(options, backend: str, where: str) -> None:
    """XLA's options (jax.jit's and Compiled's `compiler_options`): a dict, for the jax backend."""
    if options is not None and not isinstance(options, dict):
        raise ShardingError(f"{where}(compiler_options=...) takes a dict of XLA option names to values (as "
                            f"jax.jit's), got {type(options).__name__} {options!r:.60}.")
    if options and backend != "jax":
        raise ShardingError(f"compiler_options {sorted(options)} are XLA's, and the sim backend compiles nothing; "
                            "give them with backend='jax'.")


@dataclasses.dataclass(frozen=True)
class MemoryStats:
    """A device's bytes, named as XLA's CompiledMemoryStats names them."""
    argument_size_in_bytes: int
    output_size_in_bytes: int
    alias_size_in_bytes: int
    temp_size_in_bytes: int
    generated_code_size_in_bytes: int = 0
    host_argument_size_in_bytes: int = 0
    host_output_size_in_bytes: int = 0
    host_alias_size_in_bytes: int = 0
    host_temp_size_in_bytes: int = 0


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Lowering allocates many objects and frees few; pausing the cyclic garbage
    collector meanwhile saves up to a third of its time."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _dtype(dtype):
    """A dtype as jax computes in it (float64 is float32 unless x64 is on)."""
    return jax.dtypes.canonicalize_dtype(dtype, allow_extended_dtype=True)


def _type_text(shape, dtype) -> str:
    return f"{_dtype(dtype)}[{','.join(map(str, shape))}]"
