"""What a partitioned program costs per device: its collectives (kind, bytes, groups and
the instruction/rule that made each), peak live memory and FLOPs; with a hardware
profile, the step time the shared cost model (spmd/cost.py) predicts and the
utilization it implies. Needs no execution."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import numpy as np

from gspmd import ops
from gspmd.analysis import memory
from gspmd.analysis.timing import Timing, time_program
from gspmd.errors import ShardingError
from gspmd.ir import Program
from gspmd.ir.schedule import PipelineSchedule
from gspmd.spmd.context import Why
from gspmd.spmd.cost import PROFILES, ComputeKind, GiB, Hardware, Pattern, profile

COLLECTIVES = tuple(p.value for p in Pattern)   # the kinds, in the order reports list them


@dataclass(frozen=True)
class Collective:
    kind: str
    bytes: int            # per-device payload of the result
    groups: tuple         # device groups (pairs for collective-permute)
    origin: str           # the instruction and rule that created it
    executions: int = 1   # how often it runs (inside loops: the trip count)
    why: Optional[Why] = None   # the kind of rule that created it
    source: str = ""      # the user's line that made it ("train.py:12 (loss)"), or a pytree path
    within: str = ""      # the loop body or conditional branch it runs in ("" at the top level)

    def __iter__(self):   # unpacks as (kind, bytes, groups)
        return iter((self.kind, self.bytes, self.groups))


@dataclass
class Report:
    collectives: list[Collective] = field(default_factory=list)
    peak_memory_bytes: int = 0
    flops: int = 0                 # every op's arithmetic per device, memory-bound ops included
    memory_bound_flops: int = 0    # the part done by element-wise ops and reductions
    hardware: Optional[Hardware] = None   # set by report(hardware=...): enables the estimates
    memory: Optional[memory.MemoryProfile] = None   # where the peak is: the buffers held then
    memory_budget: Optional[memory.BudgetChoice] = None   # how jit(memory_limit=) was met
    timing: Optional[Timing] = None
    # Filled where the program's structure says so (pipelines, rematerialization): the
    # share of the step's compute spent on pipeline bubbles (padded microbatches) and
    # on recomputing the forward pass. The raw utilization counts both as useful.
    bubble_fraction: Optional[float] = None
    recompute_fraction: Optional[float] = None
    recompute_flops: int = 0   # of `flops`: forward computation repeated by a backward pass (remat)
    pipelines: list[PipelineSchedule] = field(default_factory=list)   # pipeline schedules in the program
    # The collectives the jax backend's compiled program holds, before XLA's own rewrites
    # (combining, simplifying): each of `collectives` as its lowering runs it (a float
    # max all-reduce also reduces NaN flags; a product gathers the group's values; those
    # the backend lowers together, as reduce-scatters XLA:CPU does not combine, as one) and,
    # on a jax-backend Lowered, the gathers that assemble results whose layout no
    # NamedSharding holds (uneven shards). Compare these with the compiled HLO text
    # (analysis.xla.hlo_collectives): that lists each once, whatever its executions.
    backend_collectives: list[Collective] = field(default_factory=list)

    @property
    def compute_seconds(self) -> float:
        """Every op's time on the hardware, one after another (no communication)."""
        return self._timing().compute_seconds

    @property
    def communication_seconds(self) -> float:
        """Every collective's time, one after another."""
        return self._timing().communication_seconds

    @property
    def step_seconds(self) -> float:
        """Estimated step time: compute plus the communication it cannot hide."""
        return self._timing().step_seconds

    @property
    def exposed_communication_seconds(self) -> float:
        return max(self.step_seconds - self.compute_seconds, 0.0)

    @property
    def flops_utilization(self) -> float:
        """FLOPs per device / (peak x step): the "raw" utilization, which counts bubbles
        and recomputation as work, as the paper's profiler does."""
        return self.flops / (self._hw().flops_per_s * self.step_seconds) if self.step_seconds else 0.0

    @property
    def effective_utilization(self) -> float:
        """Utilization without the bubble and recompute shares (where they are known)."""
        return self.flops_utilization * (1 - (self.bubble_fraction or 0.0)) * (1 - (self.recompute_fraction or 0.0))

    @property
    def fits_in_memory(self) -> bool:
        return self.peak_memory_bytes <= self._hw().usable_bytes

    def _hw(self) -> Hardware:
        if self.hardware is None:
            raise ShardingError("Estimates need a hardware profile: call report(hardware='tpu-v3') "
                                f"(or one of {sorted(PROFILES)}).")
        return self.hardware

    def _timing(self) -> Timing:
        self._hw()
        return self.timing

    @property
    def collective_bytes(self) -> int:
        return sum(c.bytes * c.executions for c in self.collectives)

    @property
    def fallbacks(self) -> list[Collective]:
        """Collectives of the replicate-then-slice fallback: data gathered only to be
        split again. Each names the op and both layouts; annotate to avoid them."""
        return [c for c in self.collectives if c.why is Why.FALLBACK]

    def counts(self) -> Counter:
        return Counter(c.kind for c in self.collectives)

    def __str__(self):
        lines = [f"collectives: {len(self.collectives)} ({self.collective_bytes:,} bytes per device)"]
        for c in self.collectives:
            times = f" x{c.executions}" if c.executions > 1 else ""
            at = f", at {c.source}" if c.source else ""
            within = f", in {c.within}" if c.within else ""
            lines.append(f"  {c.kind:<18} {c.bytes:>12,} B{times}  groups={_groups_str(c.groups)}  <- {c.origin}{at}"
                         f"{within}")
        extra = _tally(self.backend_collectives) - _tally(self.collectives)
        if extra:
            lines.append(f"the jax backend runs besides (lowerings, result assembly): {dict(sorted(extra.items()))} "
                         "bytes; see .backend_collectives")
        if self.fallbacks:
            lines.append(f"warning: {len(self.fallbacks)} reshard fallback(s) gather data only to split it again")
        lines.append(f"peak memory per device: {self.peak_memory_bytes:,} bytes")
        if self.memory is not None:
            lines += [f"  {t}" for t in self.memory.top(5)]
        if self.memory_budget is not None:
            lines.append(str(self.memory_budget))
        lines.append(f"flops per device: {self.flops:,} ({self.memory_bound_flops:,} memory-bound)")
        for p in self.pipelines:
            lines.append(f"pipeline {p.name}: {p.stages} stages x {p.microbatches} microbatches x {p.repeats} "
                         f"repeats in {p.steps} steps, bubble {p.bubble_fraction:.1%}")
        if self.hardware is not None:
            lines.append(f"on {self.hardware.name}: compute {self.compute_seconds * 1e3:.3f} ms + exposed communication "
                         f"{self.exposed_communication_seconds * 1e3:.3f} ms (of {self.communication_seconds * 1e3:.3f})"
                         f" = step {self.step_seconds * 1e3:.3f} ms; flops utilization "
                         f"{self.flops_utilization:.1%}; memory {'fits' if self.fits_in_memory else 'DOES NOT FIT'} "
                         f"({self.peak_memory_bytes / GiB:.2f} of {self.hardware.usable_bytes / GiB:.2f} GiB usable)")
            for name, value in (("bubbles", self.bubble_fraction), ("recompute", self.recompute_fraction)):
                if value is not None:
                    lines.append(f"  {name}: {value:.1%} of compute")
        return "\n".join(lines)


def _tally(collectives: Sequence[Collective]) -> Counter:
    """Bytes by kind, each collective once (as compiled program text lists it)."""
    tally = Counter()
    for c in collectives:
        tally[c.kind] += c.bytes
    return tally


def _groups_str(groups) -> str:
    text = str([list(g) for g in groups]).replace(" ", "")
    return text if len(text) <= 60 else f"{text[:57]}..."


def analyse(spmd: Program, num_devices: int, hardware: Union[None, str, Hardware] = None,
            donated: Sequence[int] = (), assembly: Sequence[Collective] = (), breadth_first: bool = False) -> Report:
    """`donated`: indices of parameters whose buffers the results may reuse; `assembly`:
    the collectives a backend runs around the program (Report.backend_collectives);
    `breadth_first`: memory in the order of XLA:CPU's default scheduler."""
    hw = None if hardware is None else profile(hardware)
    held = memory.profile(spmd, memory.donation_aliases(spmd, donated), kernel_scratch=hw is None or hw.kernel_scratch,
                          breadth_first=breadth_first)
    report = Report(peak_memory_bytes=held.peak_bytes, memory=held, pipelines=list(spmd.schedules))
    if hw is not None:
        report.hardware = hw
        report.timing = time_program(spmd, hw, num_devices)
    _walk(spmd, 1, report, num_devices=num_devices)
    report.backend_collectives += assembly
    report.bubble_fraction = _bubble_fraction(report.pipelines)
    report.recompute_fraction = report.recompute_flops / report.flops if report.recompute_flops else None
    return report


def _bubble_fraction(pipelines: Sequence[PipelineSchedule]) -> Optional[float]:
    """The share of the pipelines' stage-steps that compute on padding (None without one)."""
    slots = sum(p.slots for p in pipelines)
    return 1 - sum(p.busy_slots for p in pipelines) / slots if slots else None


def flops(program: Program) -> int:
    """Arithmetic of one run of `program`, loops counted per trip (any program: the
    whole traced step, or one device's)."""
    report = Report()
    _walk(program, 1, report)
    return report.flops


def _walk(program: Program, executions: int, report: Report, seen_groups: Optional[dict] = None,
          within: str = "", num_devices: int = 1) -> None:
    """Count each instruction as often as it runs: a loop body's trip count times (once
    when the trip count is not known statically, as for while_loop); every branch of a
    conditional once (what it may cost, not which branch a run takes; each collective
    says which branch or body it is `within`)."""
    seen_groups = {} if seen_groups is None else seen_groups

    def collective(kind: str, nbytes: int, instr, origin: str) -> Collective:
        groups = np.asarray(instr.attrs.get("pairs", instr.attrs.get("groups", [])))
        # Many collectives share their groups: convert each distinct array once.
        key = (groups.shape, groups.tobytes())
        if key not in seen_groups:
            seen_groups[key] = tuple(map(tuple, groups.tolist()))
        return Collective(kind, nbytes, seen_groups[key], origin, executions, instr.why, instr.source, within)
    for instr in program.instrs:
        op = ops.lookup(instr.opcode).timing
        if op.collective is not None:
            report.collectives.append(collective(instr.opcode, ops.collective_bytes(instr), instr, instr.origin))
        if op.flops is not None:
            flops = op.flops(instr) * executions
            report.flops += flops
            report.recompute_flops += flops if instr.recomputed else 0
            if op.compute is ComputeKind.MEMORY:
                report.memory_bound_flops += flops
        for sub, times in ops.runs(instr):
            _walk(sub, executions * times, report, seen_groups, sub.name, num_devices)
    for step in ops.lowering_steps(program):
        # a group lowered together runs each kind of collective its members run as one
        lowered: dict[Pattern, list[int]] = {}
        for instr in step.instrs:
            for pattern, nbytes in ops.lowered_collectives(instr, num_devices):
                lowered.setdefault(pattern, []).append(nbytes)
        first = step.instrs[0]
        for pattern, sizes in lowered.items():
            origin = first.origin if len(step.instrs) == 1 else \
                f"{first.origin} and {len(step.instrs) - 1} more, run as one by the jax backend"
            if step.together:
                report.backend_collectives.append(collective(pattern.value, sum(sizes), first, origin))
            else:
                report.backend_collectives += [collective(pattern.value, n, first, origin) for n in sizes]
