"""gspmd.jit: trace -> complete shardings -> partition -> execute; and Lowered."""
from __future__ import annotations

from typing import Callable, Optional, Union

import jax
import numpy as np

from gspmd import propagation
from gspmd.analysis import Hardware, Report, analyse
from gspmd.analysis.hardware import profile
from gspmd.errors import ShardingError
from gspmd.frontend import trace
from gspmd.frontend.keys import KeyData
from gspmd.ir import Program, Value, format_program, verify
from gspmd.ir.dce import eliminate_dead_code
from gspmd.mesh import Mesh
from gspmd.ops.convert import is_key
from gspmd.partitioner import fit_memory, partition
from gspmd.runtime import jax_backend, sim
from gspmd.sharding import Sharding

BACKENDS = ("sim", "jax")


def jit(fn: Callable, mesh: Optional[Mesh] = None, backend: str = "sim", memory_limit: Optional[int] = None,
        hardware: Union[None, str, Hardware] = None) -> "Partitioned":
    """Partition `fn` for the devices of `mesh` (or of its annotations' meshes).
    Calling the result runs one SPMD program on all devices and returns what `fn`
    returns on one device.

    memory_limit: bytes per device the program should fit in (default: the memory of
    `hardware`, a profile such as "tpu-v3", when given). Where one reshard of a value
    serves users far apart and holding it would exceed the limit, it is done again near
    the later users (more collective bytes, less memory); report() says what was chosen.
    hardware: also the default profile of report()."""
    if backend not in BACKENDS:
        raise ShardingError(f"Unknown backend {backend!r}; choose one of {BACKENDS}.")
    if mesh is not None and not isinstance(mesh, Mesh):
        raise ShardingError(f"jit(mesh=...) needs a gspmd.Mesh, got {type(mesh).__name__}.")
    if memory_limit is not None and (not isinstance(memory_limit, (int, np.integer)) or memory_limit <= 0):
        raise ShardingError(f"jit(memory_limit=...) needs a positive number of bytes per device, "
                            f"got {memory_limit!r}.")
    hardware = None if hardware is None else profile(hardware)
    limit = memory_limit if memory_limit is not None else (hardware.memory_bytes if hardware else None)
    return Partitioned(fn, mesh, backend, limit, hardware)


def _abstract(x) -> jax.ShapeDtypeStruct:
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    x = x if hasattr(x, "dtype") and hasattr(x, "shape") else np.asarray(x)
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype if is_key(x.dtype) else jax.dtypes.canonicalize_dtype(x.dtype))


class Partitioned:
    def __init__(self, fn: Callable, mesh: Optional[Mesh], backend: str, memory_limit: Optional[int] = None,
                 hardware: Optional[Hardware] = None):
        self.fn, self.mesh, self.backend = fn, mesh, backend
        self.memory_limit, self.hardware = memory_limit, hardware
        self._cache: dict = {}

    def lower(self, *args) -> "Lowered":
        """Trace, complete and partition for these argument shapes; executes nothing.
        Arguments may be arrays or jax.ShapeDtypeStruct."""
        flat, in_tree = jax.tree_util.tree_flatten(args)
        avals = [_abstract(a) for a in flat]
        # jax's context mesh (jax.set_mesh) says what bare PartitionSpecs in fn mean.
        key = (in_tree, tuple((a.shape, a.dtype) for a in avals), jax.sharding.get_abstract_mesh(),
               jax.sharding.get_mesh())
        if key not in self._cache:
            self._cache[key] = Lowered(self.fn, in_tree, avals, self.mesh, self.backend, self.memory_limit,
                                       self.hardware)
        return self._cache[key]

    def __call__(self, *args):
        return self.lower(*args)(*args)


class Lowered:
    def __init__(self, fn: Callable, in_tree, avals, mesh: Optional[Mesh], backend: str = "sim",
                 memory_limit: Optional[int] = None, hardware: Optional[Hardware] = None):
        def flat_fn(*flat_args):
            return fn(*jax.tree_util.tree_unflatten(in_tree, flat_args))
        self.keys = KeyData(flat_fn, avals)   # typed PRNG keys cross as their key data
        self.program, self.out_tree = trace(self.keys.fn, self.keys.avals, getattr(fn, "__name__", "main"), mesh)
        eliminate_dead_code(self.program)
        verify(self.program)
        self.num_devices = _device_count(self.program, mesh)
        self.completion = propagation.complete(self.program, self.num_devices)
        self.spmd = partition(self.program, self.num_devices)
        # how the program was fitted to the memory limit (None: no limit given)
        self.memory_budget = None if memory_limit is None else fit_memory(self.spmd, self.num_devices, memory_limit)
        verify(self.spmd)
        self.hardware = hardware
        self.backend, self.mesh = backend, mesh
        # indices of parameters whose buffers the results may reuse (donated arguments)
        self.donated: tuple[int, ...] = ()
        self._jax: Optional[jax_backend.Executable] = None

    # -- execution ----------------------------------------------------------------
    def __call__(self, *args):
        flat = self.keys.args(jax.tree_util.tree_flatten(args)[0])
        if len(flat) != len(self.program.params):
            raise ShardingError(f"Expected {len(self.program.params)} array arguments, got {len(flat)}.")
        for i, (x, p) in enumerate(zip(flat, self.program.params)):
            if tuple(np.shape(x)) != p.shape:
                raise ShardingError(f"Argument {i} has shape {tuple(np.shape(x))} but the program was lowered "
                                    f"for {p.shape}; call the jitted function (it lowers again) or lower anew.")
        outs = self.jax_executable()(flat) if self.backend == "jax" else self._run_sim(flat)
        outs = self.keys.results(outs)
        return jax.tree_util.tree_unflatten(self.out_tree, outs)

    def jax_executable(self) -> jax_backend.Executable:
        """The SPMD program as one shard_map on jax devices (compiled on first use)."""
        if self._jax is None:
            self._jax = jax_backend.Executable(self.spmd, self.program.params, self.program.outputs,
                                               self.num_devices, self.mesh)
        return self._jax

    def _run_sim(self, flat) -> list[np.ndarray]:
        per_param = [sim.shard(np.asarray(x, p.dtype), p.sharding) for x, p in zip(flat, self.program.params)]
        per_device = [[shards[d] for shards in per_param] for d in range(self.num_devices)]
        results = sim.run(self.spmd, per_device, self.num_devices)
        return [sim.unshard([results[d][i] for d in range(self.num_devices)], v.sharding, v.shape)
                for i, v in enumerate(self.program.outputs)]

    # -- inspection ---------------------------------------------------------------
    def as_text(self) -> str:
        return (f"// completed program: every value's sharding\n{format_program(self.program)}\n\n"
                f"// SPMD program run by each of {self.num_devices} devices\n"
                f"{format_program(self.spmd, with_sharding=False)}")

    def report(self, hardware: Union[None, str, "Hardware"] = None) -> Report:
        """Collectives, peak memory and FLOPs per device; with a hardware profile
        ("tpu-v3", "tpu-v4", "a100", "h100", "h200", "cpu") also the estimated step time.
        `.memory` shows where the peak is: the buffers held then, largest first, and the
        bytes held over the run (`.memory.plot("out.png")`); `.memory_budget` how the
        program was fitted to jit(memory_limit=...)."""
        report = analyse(self.spmd, hardware if hardware is not None else self.hardware, self.donated)
        report.memory_budget = self.memory_budget
        return report

    def value(self, ref: Union[int, str, Value]) -> Value:
        """A value of the completed program: by output index, by name, or itself."""
        if isinstance(ref, Value):
            return ref
        if isinstance(ref, int):
            if not -len(self.program.outputs) <= ref < len(self.program.outputs):
                raise ShardingError(f"Output index {ref} is out of range: the program has "
                                    f"{len(self.program.outputs)} outputs; name a value instead.")
            return self.program.outputs[ref]
        try:
            return self.program.find(ref.lstrip("%"))
        except KeyError:
            raise ShardingError(f"No value named {ref!r}; names are the %names in as_text().") from None

    def sharding_of(self, ref: Union[int, str, Value]) -> Sharding:
        return self.value(ref).sharding

    def explain(self, ref: Union[int, str, Value]) -> str:
        """Which annotations a value's sharding came from, and through which ops: one
        shortest chain per annotation, each step with the layout it left behind."""
        v = self.value(ref)
        lines = [f"%{v.name}: {v.type_str()} sharding={v.sharding}"]
        chains = self.completion.origins(v)
        if not chains:
            lines.append("  no annotation reaches it: replicated")
        for (annotated, first), *rest in chains:
            lines.append(f"  from annotation %{annotated.name} = sharding(%{first.instr.operands[0].name}) "
                         f"{first.sharding}")
            for u, step in rest:
                way = "forward" if u in step.instr.outputs else "backward"
                lines.append(f"    -> {step.instr.opcode} ({way} from %{step.source.name}): "
                             f"%{u.name} {step.sharding}")
        return "\n".join(lines)


def _layouts_named(instr) -> list[Sharding]:
    """Layouts the user wrote: annotations and the specs of manual regions."""
    if instr.opcode == "sharding":
        return [instr.attrs["sharding"]]
    if instr.opcode == "manual":
        return list(instr.attrs["in_shardings"]) + list(instr.attrs["out_shardings"])
    return []


def _device_count(program: Program, mesh: Optional[Mesh]) -> int:
    counts = {s.num_devices for i in program.all_instrs() for s in _layouts_named(i)}
    if mesh is not None:
        counts.add(mesh.size)
    if len(counts) > 1:
        raise ShardingError(f"Annotations and jit(mesh=...) use meshes of different sizes {sorted(counts)}; "
                            "all meshes of one program must cover the same devices.")
    return counts.pop() if counts else 1
