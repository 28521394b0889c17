"""What a partitioned program costs per device: its collectives (kind, bytes, groups and
the instruction/rule that made each), peak live memory and FLOPs. Needs no execution."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import numpy as np

from gspmd import ops
from gspmd.analysis import memory
from gspmd.analysis.hardware import PROFILES, GiB, Hardware, collective_seconds, profile
from gspmd.errors import ShardingError
from gspmd.ir import Program
from gspmd.spmd.context import Why

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


@dataclass(frozen=True)
class Collective:
    kind: str
    bytes: int            # per-device payload of the result
    groups: tuple         # device groups (pairs for collective-permute)
    origin: str           # the instruction and rule that created it
    executions: int = 1   # how often it runs (inside loops: the trip count)
    why: Optional[Why] = None   # the kind of rule that created it
    source: str = ""      # the user's line that made it ("train.py:12 (loss)"), or a pytree path

    def __iter__(self):   # unpacks as (kind, bytes, groups)
        return iter((self.kind, self.bytes, self.groups))


@dataclass
class Report:
    collectives: list[Collective] = field(default_factory=list)
    peak_memory_bytes: int = 0
    flops: int = 0
    hardware: Optional[Hardware] = None   # set by report(hardware=...): enables the estimates
    memory: Optional[memory.MemoryProfile] = None   # where the peak is: the buffers held then
    memory_budget: Optional[memory.BudgetChoice] = None   # how jit(memory_limit=) was met

    @property
    def compute_seconds(self) -> float:
        return self.flops / self._hw().flops_per_s

    @property
    def communication_seconds(self) -> float:
        hw = self._hw()
        return sum(c.executions * collective_seconds(c.kind, c.bytes, len(c.groups[0]) if c.groups else 1, hw)
                   for c in self.collectives)

    @property
    def step_seconds(self) -> float:
        """Estimated step time: compute plus communication, not overlapped."""
        return self.compute_seconds + self.communication_seconds

    @property
    def fits_in_memory(self) -> bool:
        return self.peak_memory_bytes <= self._hw().memory_bytes

    def _hw(self) -> Hardware:
        if self.hardware is None:
            raise ShardingError("Estimates need a hardware profile: call report(hardware='tpu-v3') "
                                f"(or one of {sorted(PROFILES)}).")
        return self.hardware

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
            lines.append(f"  {c.kind:<18} {c.bytes:>12,} B{times}  groups={_groups_str(c.groups)}  <- {c.origin}{at}")
        if self.fallbacks:
            lines.append(f"warning: {len(self.fallbacks)} reshard fallback(s) gather data only to split it again")
        lines.append(f"peak memory per device: {self.peak_memory_bytes:,} bytes")
        if self.memory is not None:
            lines += [f"  {t}" for t in self.memory.top(5)]
        if self.memory_budget is not None:
            lines.append(str(self.memory_budget))
        lines.append(f"flops per device: {self.flops:,}")
        if self.hardware is not None:
            lines.append(f"on {self.hardware.name}: compute {self.compute_seconds * 1e3:.3f} ms + communication "
                         f"{self.communication_seconds * 1e3:.3f} ms = step {self.step_seconds * 1e3:.3f} ms; "
                         f"memory {'fits' if self.fits_in_memory else 'DOES NOT FIT'} "
                         f"({self.peak_memory_bytes / GiB:.2f} of {self.hardware.memory_bytes / GiB:.0f} GiB)")
        return "\n".join(lines)


def _groups_str(groups) -> str:
    text = str([list(g) for g in groups]).replace(" ", "")
    return text if len(text) <= 60 else f"{text[:57]}..."


def analyse(spmd: Program, hardware: Union[None, str, Hardware] = None, donated: Sequence[int] = ()) -> Report:
    """`donated`: indices of parameters whose buffers the results may reuse."""
    held = memory.profile(spmd, memory.donation_aliases(spmd, donated))
    report = Report(peak_memory_bytes=held.peak_bytes, memory=held,
                    hardware=None if hardware is None else profile(hardware))
    _walk(spmd, 1, report)
    return report


def _walk(program: Program, executions: int, report: Report) -> None:
    """Count each instruction as often as it runs: a loop body's trip count times (once
    when the trip count is not known statically, as for while_loop); every branch of a
    conditional once (what it may cost, not which branch a run takes)."""
    for instr in program.instrs:
        if instr.opcode in COLLECTIVES:
            groups = instr.attrs["pairs"] if instr.opcode == "collective-permute" else instr.attrs["groups"]
            report.collectives.append(Collective(instr.opcode, instr.output.nbytes,
                                                 tuple(tuple(int(d) for d in g) for g in np.asarray(groups)),
                                                 instr.origin, executions, instr.why, instr.source))
        elif ops.lookup(instr.opcode).flops is not None:
            report.flops += ops.lookup(instr.opcode).flops(instr) * executions
        for sub, times in ops.runs(instr):
            _walk(sub, executions * times, report)
