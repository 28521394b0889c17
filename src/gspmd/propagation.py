"""Sharding completion: give every value a Sharding, starting from the annotations.

A worklist of (instruction, direction) items, always taking the most urgent first
(paper 3.5): elementwise ops in both directions, then layout ops (backward through
broadcast and forward through reduce before the other way round), then dot and
convolution. Within one priority, forward items run in program order and backward
items in reverse order, like alternating sweeps; an instruction is looked at again only
when one of its tensors changed, so completion costs about linear time in the program.

A value's sharding only ever becomes more refined (merge), annotations stay fixed
except their UNSPECIFIED dims, and nothing that no annotation reaches gets split.
Every refinement is recorded (which instruction, carried from which tensor), so that
`explain` can name the annotations a sharding came from and the ops in between.
"""
from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator, Optional

from gspmd import ops
from gspmd.ir import Instr, Program, Value
from gspmd.ops.registry import priority
from gspmd.sharding import Sharding

FORWARD, BACKWARD = 0, 1   # towards an instruction's outputs / towards its operands


@dataclass(frozen=True)
class Step:
    """One refinement of a value: `instr`'s rule carried `source`'s sharding to it
    (source None: the value is the output of annotation `instr`), giving `sharding`."""
    instr: Instr
    source: Optional[Value]
    sharding: Sharding


@dataclass
class Completion:
    provenance: dict[Value, list[Step]] = field(default_factory=dict)

    def origins(self, v: Value) -> list[list[tuple[Value, Step]]]:
        """For each annotation v's sharding derives from (nearest first), the shortest
        chain of refinements from it to v: [(annotation output, its step), ...,
        (v, the step that carried the layout to v)]."""
        parent: dict[Value, Optional[tuple[Value, Step]]] = {v: None}
        chains, todo = [], deque([v])
        while todo:
            u = todo.popleft()
            for step in self.provenance.get(u, []):
                if step.source is None:
                    chains.append(_chain(u, step, parent))
                elif step.source not in parent:
                    parent[step.source] = (u, step)
                    todo.append(step.source)
        return chains


def _chain(u: Value, first: Step, parent) -> list[tuple[Value, Step]]:
    chain = [(u, first)]
    while parent[u] is not None:
        u, step = parent[u]
        chain.append((u, step))
    return chain


def is_annotation(instr: Instr) -> bool:
    return instr.opcode == "sharding"


def complete(program: Program, num_devices: int) -> Completion:
    """Give every value of `program` a sharding, in place; returns the provenance."""
    completion = Completion()
    work = _Worklist(program)
    for instr in program.all_instrs():
        if is_annotation(instr):
            instr.output.sharding = instr.attrs["sharding"]
            completion.provenance[instr.output] = [Step(instr, None, instr.output.sharding)]
            work.touch(instr.output)
    for instr, direction in work:
        for v in _refine(instr, direction, completion):
            work.touch(v)
    for v in program.all_values():
        if v.sharding is None:
            v.sharding = Sharding.replicated(v.rank, num_devices)
    return completion


class _Worklist:
    """Pending (instruction, direction) items, most urgent first, each queued once."""

    def __init__(self, program: Program):
        self.position = {instr: i for i, instr in enumerate(program.all_instrs())}
        # Who learns from a value: instructions reading it, and loops tying it to their carry.
        self.users: dict[Value, list[Instr]] = {}
        for p in (program, *program.subprograms()):
            for v, readers in p.users().items():
                self.users.setdefault(v, []).extend(readers)
        for instr in self.position:
            for v in ops.tensors(instr)[len(instr.operands) + len(instr.outputs):]:
                self.users.setdefault(v, []).append(instr)
        self.heap: list[tuple[int, int, int, int]] = []
        self.queued: set[tuple[int, int]] = set()

    def push(self, instr: Instr, direction: int) -> None:
        pos = self.position[instr]
        if (pos, direction) in self.queued:
            return
        self.queued.add((pos, direction))
        order = pos if direction == FORWARD else -pos
        heapq.heappush(self.heap, (priority(instr.opcode, direction == FORWARD), direction, order, pos))

    def touch(self, v: Value) -> None:
        """v's sharding changed: everything that reads or writes v may learn from it."""
        for instr in ([v.producer] if v.producer is not None else []) + self.users[v]:
            self.push(instr, FORWARD)
            self.push(instr, BACKWARD)

    def __iter__(self) -> Iterator[tuple[Instr, int]]:
        instrs = list(self.position)
        while self.heap:
            _, direction, _, pos = heapq.heappop(self.heap)
            self.queued.discard((pos, direction))
            yield instrs[pos], direction


def _open_dims(v: Value) -> Optional[tuple[int, ...]]:
    """Dims propagation may still refine: all for plain values (None), only the
    UNSPECIFIED ones for annotation outputs."""
    p = v.producer
    if p is not None and is_annotation(p):
        return tuple(p.attrs["unspecified"])
    return None


def _refine(instr: Instr, direction: int, completion: Completion) -> list[Value]:
    """Merge into each target tensor what every other tensor of `instr` implies for it,
    one source at a time (so each refinement names its source); returns the changed."""
    tensors = ops.tensors(instr)
    first = len(instr.operands) if direction == FORWARD else 0
    last = len(tensors) if direction == FORWARD else len(instr.operands)
    changed = []
    for t in range(first, last):
        v, open_dims = tensors[t], _open_dims(tensors[t])
        if open_dims == ():
            continue
        for s in ops.informants(instr, t, len(tensors)):
            source = tensors[s]
            if source is v or source.sharding is None or source.sharding.is_replicated:
                continue
            visible: list[Optional[Sharding]] = [None] * len(tensors)
            visible[s] = source.sharding
            for proposal in ops.propagate(instr, visible, t):
                if _merge_into(v, proposal, open_dims):
                    completion.provenance.setdefault(v, []).append(Step(instr, source, v.sharding))
                    if v not in changed:
                        changed.append(v)
    return changed


def _merge_into(v: Value, proposal: Sharding, open_dims: Optional[tuple[int, ...]]) -> bool:
    """Refine v's sharding with `proposal` if they are compatible and it adds a split."""
    if open_dims is not None:
        proposal = proposal.keep_dims(open_dims)
    if proposal.is_replicated:
        return False
    merged = proposal if v.sharding is None else v.sharding.merge(proposal)
    if merged is None or merged == v.sharding:
        return False
    v.sharding = merged
    return True
