"""Structural checks: SSA, defined before use, unique names, outputs defined."""
from __future__ import annotations

from gspmd.errors import ShardingError
from gspmd.ir.program import Program


def verify(program: Program) -> None:
    defined = set(program.params)
    names = {p.name for p in program.params}
    for instr in program.instrs:
        for op in instr.operands:
            if op not in defined:
                raise ShardingError(f"{program.name}: {instr.opcode} uses %{op.name} before it is defined.")
        for out in instr.outputs:
            if out.name in names:
                raise ShardingError(f"{program.name}: value name %{out.name} is defined twice.")
            if out.producer is not instr:
                raise ShardingError(f"{program.name}: %{out.name} does not point back to its producer.")
            names.add(out.name)
            defined.add(out)
    for out in program.outputs:
        if out not in defined:
            raise ShardingError(f"{program.name}: output %{out.name} is never defined.")
