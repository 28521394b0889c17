"""Sharding completion: give every value a Sharding, starting from the annotations.

Priority passes (paper 3.5): ops of priority <= level propagate forward and backward
sweeps until nothing changes, for level = elementwise, layout, contraction. A value's
sharding only ever becomes more refined (merge), annotations stay fixed except their
UNSPECIFIED dims, and nothing that no annotation reaches gets split.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from gspmd import ops
from gspmd.ir import Instr, Program, Value
from gspmd.ops.registry import CONTRACTION, ELEMENTWISE, LAYOUT
from gspmd.sharding import Sharding


@dataclass
class Completion:
    """Where each value's sharding came from: the instruction whose rule refined it
    last, and the value it was carried from (None for annotations)."""
    provenance: dict[Value, list[tuple[Instr, Optional[Value]]]] = field(default_factory=dict)


def _open_dims(v: Value) -> Optional[tuple[int, ...]]:
    """Dims propagation may still refine: all for plain values, only the UNSPECIFIED
    ones for annotation outputs."""
    p = v.producer
    if p is not None and p.opcode == "sharding":
        return tuple(p.attrs["unspecified"])
    return None


def complete(program: Program, num_devices: int) -> Completion:
    completion = Completion()
    for instr in program.instrs:
        if instr.opcode == "sharding":
            instr.output.sharding = instr.attrs["sharding"]
            completion.provenance[instr.output] = [(instr, None)]
    for level in (ELEMENTWISE, LAYOUT, CONTRACTION):
        active = [i for i in program.instrs if ops.lookup(i.opcode).priority <= level]
        changed = True
        while changed:
            changed = False
            for instr in active + active[::-1]:
                changed |= _refine(instr, completion)
    for v in program.values():
        if v.sharding is None:
            v.sharding = Sharding.replicated(v.rank, num_devices)
    return completion


def _refine(instr: Instr, completion: Completion) -> bool:
    tensors = instr.operands + instr.outputs
    changed = False
    for t, v in enumerate(tensors):
        open_dims = _open_dims(v)
        if open_dims == ():
            continue
        shardings = [u.sharding for u in tensors]
        for proposal, source in zip(ops.propagate(instr, shardings, t), _sources(tensors, t)):
            if open_dims is not None:
                proposal = proposal.keep_dims(open_dims)
            merged = proposal if v.sharding is None else v.sharding.merge(proposal)
            if merged is not None and merged != v.sharding:
                v.sharding = merged
                completion.provenance.setdefault(v, []).append((instr, source))
                changed = True
    return changed


def _sources(tensors: list[Value], target: int) -> list[Value]:
    """The tensors whose proposals ops.propagate returns, in order (those that have a
    sharding, other than the target)."""
    return [u for t, u in enumerate(tensors) if t != target and u.sharding is not None]
