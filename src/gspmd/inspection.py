"""What a lowered program says about itself (Lowered's inspecting half), in the user's
terms: values named by pytree path, output index or %name; layouts as PartitionSpecs
over the user's meshes; the programs as text; the report; where each layout came from.
"""
from __future__ import annotations

from typing import Callable, Optional, Union

import numpy as np

from gspmd import propagation
from gspmd.analysis import Hardware, Report, analyse
from gspmd.analysis.memory import BudgetChoice
from gspmd.analysis.summary import collective_table
from gspmd.checks import describe
from gspmd.errors import ShardingError
from gspmd.ir import Program, Value, format_program
from gspmd.mesh import Mesh
from gspmd.propagation import Completion
from gspmd.sharding import Sharding


class Inspection:
    """Inspecting a Lowered (a mixin). It reads what lowering made: the completed
    `program` (with its values' labels) and its `completion` (where each layout came
    from), the per-device `spmd` program, the meshes, device count, hardware profile,
    donated parameters and how the program was fitted to a memory limit."""
    program: Program
    spmd: Program
    completion: Completion
    meshes: list[Mesh]
    num_devices: int
    hardware: Optional[Hardware]
    donated: tuple[int, ...]
    memory_budget: Optional[BudgetChoice]
    logical_axes: dict[Value, tuple]   # parameters' and results' logical axis names, as flax declares them
    backend_assembly: Callable[[], list]   # Execution's: the collectives the backend runs around the program
    runs_breadth_first: Callable[[], bool]   # Execution's: whether XLA:CPU's concurrency scheduler runs it

    def describe(self, sharding: Sharding) -> str:
        """A sharding as a PartitionSpec over the user's mesh, next to XLA's form."""
        if not isinstance(sharding, Sharding):
            raise ShardingError(f"Lowered.describe needs a gspmd.Sharding, got {describe(sharding)}; for a value "
                                "use explain(value) or describe(sharding_of(value)).")
        return sharding.describe(*self.meshes)

    def _layout(self, v: Value, sharding: Optional[Sharding] = None) -> str:
        """describe(), after the logical axis names the value's flax variable declares."""
        text = self.describe(v.sharding if sharding is None else sharding)
        names = self.logical_axes.get(v)
        return text if names is None else f"logical axes {names}: {text}"

    def label(self, ref: Union[int, str, Value]) -> str:
        """The user's name of a value (see `value`): its pytree path for parameters and results."""
        v = self.value(ref)
        return self.program.labels.get(v, f"%{v.name}")

    def as_text(self) -> str:
        """The completed program (every value's sharding) and the per-device program,
        after the parameters' and results' layouts in the user's terms."""
        layouts = "\n".join(f"//   {self.label(v):<28} %{v.name}: {v.type_str()}  {self._layout(v)}"
                            for v in self.program.params + self.program.outputs)
        return (f"// parameters and results:\n{layouts}\n\n"
                f"// completed program: every value's sharding\n{format_program(self.program)}\n\n"
                f"// SPMD program run by each of {self.num_devices} devices\n"
                f"{format_program(self.spmd, with_sharding=False)}")

    def report(self, hardware: Union[None, str, Hardware] = None) -> Report:
        """Collectives (kind, bytes, groups, the op and rule that made each and the
        source line or pytree path it came from), peak memory and FLOPs per device;
        with a hardware profile ("tpu-v3", "tpu-v4", "a100", "h100", "h200", "cpu")
        also the estimated step time and FLOPs utilization. `.memory` shows where the peak is: the buffers
        held then, largest first, and the bytes held over the run
        (`.memory.plot("out.png")`); `.memory_budget` how the program was fitted to
        jit(memory_limit=...). Collectives count as often as they run (x trip count in
        loops) and every branch of a conditional once, each saying the loop body or
        branch it is `within`; `.backend_collectives` are what the jax backend's compiled
        program holds (each once, as its HLO text lists them: analysis.xla.hlo_collectives).
        Memory follows the schedule the program runs in: on the jax backend on CPU
        devices, given no hardware, XLA:CPU's default (breadth first, for concurrency);
        else the memory-minimizing one accelerators use."""
        hardware = hardware if hardware is not None else self.hardware
        report = analyse(self.spmd, self.num_devices, hardware, self.donated, self.backend_assembly(),
                         breadth_first=hardware is None and self.runs_breadth_first())
        report.memory_budget = self.memory_budget
        return report

    def summary(self) -> str:
        """One table of per-device collective bytes, by source line and collective kind."""
        return collective_table(self.report())

    def value(self, ref: Union[int, str, Value]) -> Value:
        """A value of the completed program: by output index, by pytree path
        ("params['w1']", "result[0]", or a unique last key like "w1"), by %name, or itself."""
        if isinstance(ref, Value):
            return ref
        if isinstance(ref, (bool, np.bool_)) or not isinstance(ref, (int, np.integer, str)):
            raise ShardingError(f"A value is named by output index (an int), pytree path or %name (a str), got "
                                f"{describe(ref)}; e.g. {next(iter(self.program.labels.values()), 'result')!r} or 0.")
        if isinstance(ref, (int, np.integer)):
            if not -len(self.program.outputs) <= ref < len(self.program.outputs):
                raise ShardingError(f"Output index {ref} is out of range: the program has "
                                    f"{len(self.program.outputs)} outputs; name a value instead.")
            return self.program.outputs[ref]
        by_path = {label: v for v, label in self.program.labels.items()}
        if ref in by_path:
            return by_path[ref]
        try:
            return self.program.find(ref.lstrip("%"))
        except KeyError:
            pass
        ends = [label for label in by_path if label.endswith((f"[{ref!r}]", f".{ref}"))]
        if len(ends) == 1:
            return by_path[ends[0]]
        if ends:
            raise ShardingError(f"{ref!r} names several values ({', '.join(ends)}); give the whole path.")
        raise ShardingError(f"No value named {ref!r}; name a parameter or result by its path ("
                            f"{', '.join(list(by_path)[:6])}{', ...' if len(by_path) > 6 else ''}) or a value by its "
                            "%name in as_text().")

    def sharding_of(self, ref: Union[int, str, Value]) -> Sharding:
        """The completed sharding of a value (see `value` for how to name one)."""
        return self.value(ref).sharding

    def explain(self, ref: Union[int, str, Value]) -> str:
        """Which annotations a value's sharding came from, and through which ops: one
        shortest chain per annotation, each step with its source line and the layout
        it left behind."""
        v = self.value(ref)
        lines = [f"{self.label(v)} (%{v.name}: {v.type_str()}): {self._layout(v)}"]
        chains = self.completion.origins(v)
        if not chains:
            lines.append("  no annotation reaches it: replicated")
        for (annotated, first), *rest in chains:
            source = (f"annotation %{annotated.name} = mesh_split({self.label(first.instr.operands[0])})"
                      if propagation.is_annotation(first.instr) else f"the specs of {first.instr.opcode} %{annotated.name}")
            lines.append(f"  from {source}{_at(first.instr)}: {self.describe(first.sharding)}")
            for u, step in rest:
                way = "forward" if u in step.instr.outputs else "backward"
                lines.append(f"    -> {step.instr.opcode} ({way} from %{step.source.name}){_at(step.instr)}: "
                             f"{self.label(u)} {self._layout(u, step.sharding)}")
        return "\n".join(lines)


def _at(instr) -> str:
    return f" at {instr.source}" if instr.source else ""
