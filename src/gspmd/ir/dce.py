"""Dead-code elimination: every op in the IR is pure, so an instruction none of whose
results is used (directly or through others) is dropped. JAX traces keep such values
(a zeros buffer of a gradient nobody reads); left in, they would be materialized, whole
and unsplit since no user gives them a sharding, on every device."""
from __future__ import annotations

from gspmd.ir.program import Program


def eliminate_dead_code(program: Program) -> Program:
    """Rewrite `program` (not its sub-programs, whose results the loop uses) in place."""
    live = set(program.outputs)
    kept = []
    for instr in reversed(program.instrs):
        if any(o in live for o in instr.outputs):
            kept.append(instr)
            live.update(instr.operands)
    program.instrs = kept[::-1]
    return program
