"""All-reduce reassociation: a sum (or difference) of values all-reduced over the same
device groups is the all-reduce of the sum of their partial sums, ar(a) + ar(b) =
ar(a + b). Where each all-reduce is read only by that sum, one collective replaces
several: the input gradient of an activation read by the Q, K and V projections (each
partial over the heads' axis) is all-reduced once, not three times. XLA's
AllReduceReassociate pass does the same after partitioning.

Memory stays as it was (each partial sum is as large as its all-reduced value). Not so
for reduce-scatters: their partial sums are larger than their results by the group
size, and holding several of them for one sum raised the peak of the paper-scale 2D
Transformer by 7%, so those are left alone.
"""
from __future__ import annotations

from collections import Counter
from typing import Optional

from gspmd.ir import Instr, Program, Value
from gspmd.passes.cse import attrs_key
from gspmd.ir.reducer import ADD
from gspmd.ops.registry import lookup
from gspmd.spmd.cost import Pattern


def reassociate_all_reduces(program: Program) -> Program:
    """Rewrite `program` in place; the all-reduces left unread are for dead-code
    elimination to drop."""
    uses = Counter(o for instr in program.instrs for o in instr.operands) + Counter(program.outputs)
    rewritten = []
    for instr in program.instrs:
        all_reduces = _summed_all_reduces(instr, uses)
        if all_reduces is None:
            rewritten.append(instr)
            continue
        before = all_reduces[0].operands[0]
        partial = instr.remade([r.operands[0] for r in all_reduces],
                               Value(program.fresh_name(instr.opcode), before.shape, before.dtype))
        rewritten += [partial, all_reduces[-1].remade([partial.output], instr.output)]
    program.instrs = rewritten
    return program


def _summed_all_reduces(instr: Instr, uses: Counter) -> Optional[list[Instr]]:
    """The add-all-reduces `instr` sums, when it is linear in all of its (several)
    operands, each is an add-all-reduce read only here, and all reduce alike."""
    linear = lookup(instr.opcode).rewrites.linear
    everything = tuple(range(len(instr.operands)))
    if len(everything) < 2 or linear is None or everything not in map(tuple, linear(instr)):
        return None
    producers = [o.producer for o in instr.operands]
    if not all(_is_add_all_reduce(p) and uses[p.output] == 1 for p in producers):
        return None
    first = producers[0]
    alike = all(p.output.dtype == instr.output.dtype
                and p.operands[0].shape == first.operands[0].shape and attrs_key(p) == attrs_key(first) for p in producers)
    return producers if alike else None


def _is_add_all_reduce(instr: Optional[Instr]) -> bool:
    return (instr is not None and lookup(instr.opcode).timing.collective is Pattern.ALL_REDUCE
            and instr.attrs["reducer"] is ADD)

