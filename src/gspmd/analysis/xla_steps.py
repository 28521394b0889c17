"""The per-device program as XLA runs it, for the memory model (analysis/memory.py): each
instruction with the layout copies its kernel wants and the operands XLA:CPU expands
before it, XLA:CPU's combined all-reduces, and which values loop fusion computes inside
their users instead of storing."""
from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass
from typing import Optional

from gspmd import ops
from gspmd.ir import Instr, Program, Value
from gspmd.ops.registry import Order, Storage, same_order

FUSIBLE = (Storage.ELEMENTWISE, Storage.INDEXED, Storage.REPEATED, Storage.IN_PLACE, Storage.BITCAST)


def made_by(instr: Instr) -> str:
    """Where a value came from: the instruction and rule that made it. The one place to
    add the Python source line once instructions carry it."""
    return instr.origin or instr.opcode


@dataclass(eq=False)
class Step:
    """One instruction as XLA runs it: the original, or a layout copy (instr None)."""
    instr: Optional[Instr]
    operands: list[Value]
    outputs: list[Value]
    storage: Storage
    expensive: bool
    origin: str
    scratch: int = 0
    source: str = ""   # the user's line (a layout copy: its reader's)
    combined: tuple = ()   # the further instructions it runs (all-reduces XLA:CPU combines)

    @property
    def name(self) -> str:
        return self.outputs[0].name if self.outputs else ""


def program_steps(program: Program, kernel_scratch: bool) -> tuple[list[Step], dict[Value, Order]]:
    """The program with the layout copies that kernels want, each made before the first
    instruction that reads it, and the operands XLA:CPU expands, each right before its
    reader; and the values not laid out row-major, with their order."""
    steps: list[Step] = []
    copies: dict[tuple[Value, Order], Value] = {}
    stored: dict[Value, Order] = {}   # values not laid out row-major
    for instr in program.instrs:
        op = ops.lookup(instr.opcode).memory
        orders = ops.lookup(instr.opcode).kernel.orders
        kernel = orders(instr) if orders else None
        operands = list(instr.operands)
        expanded = op.expanded(instr) if op.expanded and kernel_scratch else {}
        for index, n in expanded.items():   # written in the layout the kernel wants: no copy
            v = operands[index]
            operands[index] = Value(f"{v.name}.expanded", (n, *v.shape), v.dtype)
            operands[index].sharding = v.sharding
            steps.append(Step(None, [v], [operands[index]], Storage.REPEATED if n > 1 else Storage.ELEMENTWISE,
                               False, f"{n} masked copies of %{v.name} for {made_by(instr)}", source=instr.source))
        wants = () if kernel is None else kernel.cpu_operands if kernel_scratch and kernel.cpu_operands else kernel.operands
        for index, wanted in enumerate(wants):
            v = operands[index]
            if index in expanded or wanted is None or any(same_order(v.shape, stored.get(v), w) for w in wanted):
                continue
            order = next((w for w in wanted if (v, w) in copies), wanted[0])
            if (v, order) not in copies:
                copy = copies[v, order] = Value(f"{v.name}.layout", v.shape, v.dtype)
                copy.sharding, stored[copy] = v.sharding, order
                steps.append(Step(None, [v], [copy], Storage.INDEXED, False,
                                   f"layout copy of %{v.name} for {made_by(instr)}", source=instr.source))
            operands[index] = copies[v, order]
        expensive = op.expensive(instr) if callable(op.expensive) else op.expensive
        steps.append(Step(instr, operands, list(instr.outputs), ops.storage(instr), expensive, made_by(instr),
                           op.scratch(instr) if op.scratch and kernel_scratch else 0, instr.source))
        if kernel is not None and kernel.result is not None:
            stored.update((out, kernel.result) for out in instr.outputs)
    return steps, stored


def combine_all_reduces(steps: list[Step]) -> list[Step]:
    """XLA:CPU's all-reduce combiner: all-reduces over the same groups with the same
    reducer and dtype, none of which reads another's result, run as one (no size limit,
    at most 256), which holds all their operands until the last is ready and all their
    results from then on. As XLA, greedily in program order: each group starts at the
    first all-reduce left and takes the next ones of its kind until one reads (through
    any path) an all-reduce in it, or one in it reads that one."""
    def kind(step: Step):
        i = step.instr
        combined_as = None if i is None else ops.lookup(i.opcode).memory.combined_as
        if combined_as is None or len(step.operands) != 1 or len(step.outputs) != 1:
            return None
        return combined_as(i), step.outputs[0].dtype

    kinds = {id(s): k for s in steps if (k := kind(s)) is not None}
    left = [s for s in steps if id(s) in kinds]
    behind = _all_reduces_behind(steps, set(kinds))
    while len(left) > 1:
        group, members = [left[0]], {id(left[0])}
        for step in left[1:]:
            if len(group) >= 256:
                break
            if kinds[id(step)] != kinds[id(group[0])]:
                continue
            # Either way round: an earlier group's merge may have put a member behind
            # a later all-reduce (it now reads what another part of the merge reads).
            if behind[id(step)] & members or any(id(step) in behind[id(g)] for g in group):
                break
            group.append(step)
            members.add(id(step))
        left = [s for s in left if id(s) not in members]
        if len(group) > 1:
            first = group[0]
            merged = dataclasses.replace(first, operands=[v for g in group for v in g.operands],
                                         outputs=[v for g in group for v in g.outputs],
                                         scratch=sum(g.scratch for g in group),
                                         combined=tuple(g.instr for g in group[1:]))
            merged.origin = f"{first.origin} (combined with {len(group) - 1} more all-reduces)"
            kinds[id(merged)] = kinds[id(first)]
            steps = _topological([merged if s is first else s for s in steps
                                  if id(s) not in members or s is first])
            behind = _all_reduces_behind(steps, {id(s) for s in left})   # the merged step reads more
    return steps


def _all_reduces_behind(steps: list[Step], wanted: set[int]) -> dict[int, set[int]]:
    """For each step (`steps` in a topological order), the steps in `wanted` that it
    reads through some path."""
    producer = {o: s for s in steps for o in s.outputs}
    behind: dict[int, set[int]] = {}
    for step in steps:
        acc: set[int] = set()
        for v in step.operands:
            p = producer.get(v)
            if p is not None and id(p) in behind:
                acc |= behind[id(p)]
                if id(p) in wanted:
                    acc.add(id(p))
        behind[id(step)] = acc
    return behind


def _topological(steps: list[Step]) -> list[Step]:
    """`steps` in an order where each comes after the steps it reads, otherwise as given."""
    producer = {o: s for s in steps for o in s.outputs}
    index = {id(s): i for i, s in enumerate(steps)}
    waits = {id(s): len({id(producer[v]) for v in s.operands if v in producer and producer[v] is not s})
             for s in steps}
    readers: dict[int, list[Step]] = {}
    for s in steps:
        for p in {id(producer[v]) for v in s.operands if v in producer and producer[v] is not s}:
            readers.setdefault(p, []).append(s)
    ready = [index[id(s)] for s in steps if not waits[id(s)]]
    heapq.heapify(ready)
    order = []
    while ready:
        step = steps[heapq.heappop(ready)]
        order.append(step)
        for r in readers.get(id(step), ()):
            waits[id(r)] -= 1
            if not waits[id(r)]:
                heapq.heappush(ready, index[id(r)])
    return order + [s for s in steps if all(s is not o for o in order)]


def fused_values(steps: list[Step], results: set[Value], cpu: bool = False) -> set[Value]:
    """Values XLA's loop fusion computes inside their users instead of storing (`cpu`:
    as XLA:CPU's, which fuses no concatenate of more than 8 operands).

    Not followed: XLA:CPU also fuses a concatenate into one fusion only (read by two, it
    stores it; measured, benchmarks/RESULTS.md issue 45): with that, the U-Net's BFS
    report comes within 3% of XLA's but its memory-minimizing one 15% over."""
    readers: dict[Value, list[Step]] = {}
    for step in steps:
        for v in step.operands:
            readers.setdefault(v, []).append(step)
    def fusible(step: Step) -> bool:
        unfused = None if step.instr is None else ops.lookup(step.instr.opcode).memory.cpu_unfused
        return step.storage in FUSIBLE and not (cpu and unfused is not None and unfused(step.instr))

    fused: set[Value] = set()
    for step in steps:
        if not fusible(step):
            continue
        for v in step.outputs:   # several: threefry's two words, each fused where it is read
            users = readers.get(v, [])
            if v in results or not users or not all(fusible(u) for u in users):
                continue
            if step.expensive and (len(users) > 1 or users[0].operands.count(v) > 1
                                   or users[0].storage is Storage.REPEATED):
                continue   # XLA would compute it in several places: it stores it once instead
            fused.add(v)
    return fused
