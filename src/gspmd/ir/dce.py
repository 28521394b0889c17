"""Dead-code elimination: an instruction none of whose results is used (directly or
through others) is dropped, unless it has side effects (a host callback that prints).
JAX traces keep such values (a zeros buffer of a gradient nobody reads); left in, they
would be materialized, whole and unsplit since no user gives them a sharding, on every
device. Instructions that share a `together` attribute live as one: the values of one
optimization barrier, all of which XLA computes if one is used."""
from __future__ import annotations

from typing import Callable, Optional

from gspmd.ir.program import Instr, Program

# prune(instr, which results are used): shrink an instruction to its used results
Prune = Callable[[Instr, list[bool]], None]


def eliminate_dead_code(program: Program, prune: Optional[Prune] = None) -> Program:
    """Rewrite `program` and the sub-programs of what it keeps in place (all of a
    sub-program's results stay: its op uses them), unless `prune` shrinks an
    instruction to the results in use (a loop's unused carries)."""
    live = set(program.outputs)
    together = _together(program)
    kept = []
    for instr in reversed(program.instrs):
        group = together.get(instr.attrs.get("together"), instr.outputs)
        if instr.has_side_effect or any(o in live for o in group):
            if prune is not None:
                prune(instr, [o in live for o in instr.outputs])
            kept.append(instr)
            live.update(instr.operands)
    program.instrs = kept[::-1]
    for instr in program.instrs:
        for attr in instr.attrs.values():
            for sub in (attr if isinstance(attr, tuple) else (attr,)):
                if isinstance(sub, Program):
                    eliminate_dead_code(sub, prune)
    return program


def _together(program: Program) -> dict:
    """`together` attribute -> the results of every instruction that has it. (All of a
    group's users follow all of its members, so the reverse walk has seen them.)"""
    groups: dict = {}
    for instr in program.instrs:
        if instr.attrs.get("together") is not None:
            groups.setdefault(instr.attrs["together"], []).extend(instr.outputs)
    return groups
