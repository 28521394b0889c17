"""Updates of zeros added into their accumulator, as updates of the accumulator:
a + scatter(0, i, u, +) = scatter(a, i, u, +) and a + dynamic-update-slice(0, u, i) =
dynamic-update-slice(a, dynamic-slice(a, i) + u, i).

The converter writes every scatter-add as a scatter into the reducer's identity and an
element-wise combine with the operand (so that shares of the updates scattered on
different devices combine), and JAX adds the gradient of a gather or a dynamic slice to
what it has accumulated so far. Both make a pass over the whole array where the update
itself touches only its rows: a loop that reads one layer of a stack per step (a circular
pipeline's stage, a scan over an embedding's rows) added the whole stack of gradients
every step. Folded, the update is made to the accumulator in place, as XLA's algebraic
simplifier does; adding a zero (x + 0 = x) is looked through on the way.
"""
from __future__ import annotations

from collections import Counter
from typing import Optional

from gspmd.ir import Instr, Program, Value
from gspmd.ir.reducer import ADD
from gspmd.ops.registry import is_zero, lookup


def _is_sum(instr: Instr) -> bool:
    return lookup(instr.opcode).facets.combines is ADD


def fold_updates_into_accumulators(program: Program) -> Program:
    """Rewrite `program` in place; the updates of zeros left unread are for dead-code
    elimination to drop."""
    uses = Counter(o for instr in program.instrs for o in instr.operands) + Counter(program.outputs)
    rewritten: list[Instr] = []
    for instr in program.instrs:
        rewritten += (_folded(program, instr, uses) if _is_sum(instr) else None) or [instr]
    program.instrs = rewritten
    return program


def _folded(program: Program, add: Instr, uses: Counter) -> Optional[list[Instr]]:
    """`add` as an update of its other operand, when one operand is (a zero plus) an
    update of zeros that only this add reads."""
    out = add.output
    for k in (0, 1):
        update, acc = _update_of_zeros(add.operands[k], uses), add.operands[1 - k]
        if update is None or (acc.shape, acc.dtype) != (out.shape, out.dtype):
            continue
        folded = lookup(update.opcode).facets.added_to(update, acc, add, program)
        if folded is not None:
            return folded
    return None


def _update_of_zeros(v: Value, uses: Counter) -> Optional[Instr]:
    """The scatter-add into zeros or dynamic-update-slice of zeros that `v` is (through
    adds of zeros), read only on the way to `v`."""
    while uses[v] == 1 and v.producer is not None:
        p = v.producer
        if lookup(p.opcode).facets.added_to is not None and is_zero(p.operands[0]) \
                and (p.output.shape, p.output.dtype) == (v.shape, v.dtype):
            return p
        zeros = [is_zero(o) for o in p.operands]
        if not _is_sum(p) or sorted(zeros) != [False, True]:
            return None
        v = p.operands[zeros.index(False)]
    return None

