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

import functools
import heapq
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence, Union

from gspmd import ops
from gspmd.ir import Instr, Program, Value
from gspmd.ops.registry import is_annotation, priority
from gspmd.sharding import Sharding, merge_on
from gspmd.spmd import cost as cm
from gspmd.spmd import reshard as rs

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


def complete(program: Program, num_devices: int, hardware: Union[None, str, cm.Hardware] = None) -> Completion:
    """Give every value of `program` a sharding, in place; returns the provenance. The
    bodies of manual regions are completed first, each over its own virtual devices:
    their layouts then say how values cross the regions' boundaries. Conflicts between
    operands are settled by what resharding costs on `hardware` (the default profile
    when None), as the partitioner prices it."""
    hw = cm.profile(hardware)
    completion = Completion()
    for body in program.regions():
        completion.provenance.update(complete(body, body.region.num_devices, hw).provenance)
    programs = [program, *program.subprograms(into_regions=False)]
    work = _Worklist(programs)
    for instr in work.position:
        if is_annotation(instr):
            instr.output.sharding = instr.attrs["sharding"]
            completion.provenance[instr.output] = [Step(instr, None, instr.output.sharding)]
            work.touch(instr.output)
        tensors = ops.tensors(instr)
        for t, layout in ops.seeds(instr):   # layouts an op fixes by itself (a manual region's specs)
            if _merge_into(tensors[t], layout, _open_dims(tensors[t])):
                completion.provenance.setdefault(tensors[t], []).append(Step(instr, None, tensors[t].sharding))
                work.touch(tensors[t])
    for instr, direction, changed in work:
        for v in _refine(instr, direction, completion, work.tensors[instr], changed, hw):
            work.touch(v)
    for p in programs:
        for v in p.values():
            if v.sharding is None:
                v.sharding = Sharding.replicated(v.rank, num_devices)
    return completion


class _Worklist:
    """Pending (instruction, direction) items, most urgent first, each queued once, with
    the tensors whose layouts changed since it last ran (only they can teach it more)."""

    def __init__(self, programs: list[Program]):
        """`programs`: a program and those nested in it (not in manual regions)."""
        self.position = {instr: i for i, instr in enumerate(instr for p in programs for instr in p.instrs)}
        self.tensors = {instr: _Tensors(instr) for instr in self.position}
        # Who learns from a value: the instruction making it, those reading it, and loops
        # tying it to their carry.
        self.learners: dict[Value, list[Instr]] = {}
        for p in programs:
            for v, readers in p.users().items():
                self._learners(v).extend(readers)
        for instr in self.position:
            for v in ops.tensors(instr)[len(instr.operands) + len(instr.outputs):]:
                self._learners(v).append(instr)
        self.heap: list[tuple[int, int, int, int]] = []
        self.changed: dict[tuple[int, int], set[Value]] = {}   # queued items and what changed for them

    def push(self, instr: Instr, direction: int, v: Value) -> None:
        pos = self.position[instr]
        changed = self.changed.get((pos, direction))
        if changed is not None:
            changed.add(v)
            return
        self.changed[(pos, direction)] = {v}
        order = pos if direction == FORWARD else -pos
        heapq.heappush(self.heap, (priority(instr.opcode, direction == FORWARD), direction, order, pos))

    def _learners(self, v: Value) -> list[Instr]:
        return self.learners.setdefault(v, [] if v.producer is None else [v.producer])

    def touch(self, v: Value) -> None:
        """v's sharding changed: everything that reads or writes v may learn from it."""
        for instr in self.learners[v]:
            sides = self.tensors[instr].sides
            for direction in (FORWARD, BACKWARD):
                if any(u is not v for u in sides[direction]):   # else nothing there to refine
                    self.push(instr, direction, v)

    def __iter__(self) -> Iterator[tuple[Instr, int, set[Value]]]:
        instrs = list(self.position)
        while self.heap:
            _, direction, _, pos = heapq.heappop(self.heap)
            yield instrs[pos], direction, self.changed.pop((pos, direction))


class _Tensors:
    """tensors(instr), those each direction refines, where each value appears among
    them, and the instruction's propagation rule (ops.proposer, made when first asked)."""

    def __init__(self, instr: Instr):
        self.instr = instr
        self.values = ops.tensors(instr)
        n_in = len(instr.operands)
        self.sides = (self.values[n_in:], self.values[:n_in])   # FORWARD, BACKWARD
        self.places: dict[Value, list[int]] = {}
        for i, v in enumerate(self.values):
            self.places.setdefault(v, []).append(i)

    @functools.cached_property
    def propose(self) -> Callable[[list[Optional[Sharding]], int], Sequence[Sharding]]:
        return ops.proposer(self.instr)


def _open_dims(v: Value) -> Optional[tuple[int, ...]]:
    """Dims propagation may still refine: all for plain values (None), only the
    UNSPECIFIED ones for annotation outputs."""
    p = v.producer
    if p is not None and is_annotation(p):
        return tuple(p.attrs["unspecified"])
    return None


Offer = tuple[Value, Sharding]   # a layout proposed for a target, and the tensor it came from


def _refine(instr: Instr, direction: int, completion: Completion, tensors: _Tensors,
            sources: set[Value], hw: cm.Hardware) -> list[Value]:
    """Merge into each target tensor (outputs and tied values forward, operands backward)
    what the tensors in `sources` (those that changed) imply for it, one source at a
    time so that each refinement names its source; where the sources' offers cannot all
    hold, in the order that costs least (`_by_cost`). Returns the changed values.
    Informants are symmetric: the targets a source informs are its own informants."""
    n, n_in = len(tensors.values), len(instr.operands)
    offers: dict[int, list[Offer]] = {}
    for source in sorted(sources, key=lambda v: tensors.places[v][0]):    # in operand order: deterministic
        if source.sharding is None or source.sharding.is_replicated:
            continue
        for s in tensors.places[source]:
            for t in ops.informants(instr, s, n):
                v = tensors.values[t]
                if (t < n_in) != (direction == BACKWARD) or v is source or _open_dims(v) == ():
                    continue
                offers.setdefault(t, []).extend([(source, p) for p in tensors.propose(_only(n, s, source.sharding), t)])
    changed = []
    for t, offered in offers.items():
        v = tensors.values[t]
        open_dims = _open_dims(v)
        for source, proposal in _by_cost(tensors, t, offered, open_dims, hw):
            if _merge_into(v, proposal, open_dims):
                completion.provenance.setdefault(v, []).append(Step(instr, source, v.sharding))
                if v not in changed:
                    changed.append(v)
    return changed


def _only(n: int, place: int, sharding: Sharding) -> list[Optional[Sharding]]:
    """What a rule sees when only tensor `place` has a layout."""
    visible: list[Optional[Sharding]] = [None] * n
    visible[place] = sharding
    return visible


def _merged(v: Value, start: Optional[Sharding], offers: Sequence[Offer], open_dims) -> tuple[Optional[Sharding], bool]:
    """The layout the offers give target v if it had `start`, merged in order, and
    whether every one of them held."""
    layout, all_held = start, True
    for _, proposal in offers:
        proposal = proposal if open_dims is None else proposal.keep_dims(open_dims)
        merged = proposal if layout is None else merge_on(layout, proposal, v.shape)
        all_held &= merged is not None
        layout = merged or layout
    return layout, all_held


def _by_cost(tensors: _Tensors, t: int, offers: list[Offer], open_dims: Optional[tuple[int, ...]],
             hw: cm.Hardware) -> list[Offer]:
    """The offers for target t in the order to merge them. Where they conflict (operands
    of a dot asking for splits that cannot both hold), the offer to merge first is the
    one whose layout takes the least resharding of the op's other tensors to agree with
    it (priced on `hw`, the partitioner's cost model); at equal cost, as XLA prefers,
    the layout that splits every operand alike (a batch dim), then the larger tensor's
    offer, then operand order."""
    if len(offers) == 1:
        return offers
    v = tensors.values[t]
    if _merged(v, v.sharding, offers, open_dims)[1]:
        return offers
    orders = [[offers[i]] + offers[:i] + offers[i + 1:] for i in range(len(offers))]

    def key(i: int) -> tuple:
        layout = _merged(v, v.sharding, orders[i], open_dims)[0]
        resharding, shared = _agreeing_with(tensors, t, layout, hw)
        return cm.rounded(resharding), -shared, -orders[i][0][0].nbytes, i
    return orders[min(range(len(orders)), key=key)]


def _agreeing_with(tensors: _Tensors, t: int, layout: Sharding, hw: cm.Hardware) -> tuple[cm.Cost, int]:
    """What resharding the other tensors of the op (those with layouts) to agree with
    target t laid out as `layout` costs, and the fewest tiles into which `layout` splits
    any of them (more than one: a split they all share, as of a batch dim). A tensor
    whose own layout leads to one that conflicts with `layout` gives up its splits for
    the layout `layout` implies for it."""
    n, v = len(tensors.values), tensors.values[t]
    total, shared = cm.FREE, None
    for j, u in enumerate(tensors.values):
        if u is v or u.sharding is None:
            continue
        implied, _ = _merged(u, None, [(v, p) for p in tensors.propose(_only(n, t, layout), j)], None)
        implied = implied or Sharding.replicated(u.rank, layout.num_devices)
        shared = min(shared or layout.num_devices, math.prod(implied.tiles))
        kept = merge_on(u.sharding, implied, u.shape)
        if kept is None or not _merged(v, layout, [(u, p) for p in tensors.propose(_only(n, j, kept), t)], None)[1]:
            total = cm.add_costs(total, rs.quick_cost(u.sharding, implied, u.shape, u.dtype.itemsize, hw))
    return total, shared or 1


def _merge_into(v: Value, proposal: Sharding, open_dims: Optional[tuple[int, ...]]) -> bool:
    """Refine v's sharding with `proposal` if they are compatible and it adds a split."""
    if open_dims is not None:
        proposal = proposal.keep_dims(open_dims)
    if proposal.is_replicated:
        return False
    merged = proposal if v.sharding is None else merge_on(v.sharding, proposal, v.shape)
    if merged is None or merged == v.sharding:
        return False
    v.sharding = merged
    return True
