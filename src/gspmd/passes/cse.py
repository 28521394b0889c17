"""Common-subexpression elimination: an instruction with the same opcode, operands and
attributes as an earlier one computes the same value (every op in the IR is pure but
those marked with side effects, and in an SPMD program every device runs the same
instructions), so it is dropped and its uses read the earlier result.

Partition rules reshard an operand wherever an op needs it; after this pass one value
resharded the same way for several ops (an activation gathered before the Q, K and V
einsums and again for the weight gradients) is resharded once, as XLA's partitioner
does with its reshard cache.
"""
from __future__ import annotations

from typing import Hashable

import numpy as np

from gspmd.ir.program import Instr, Program, Value


def eliminate_common_subexpressions(program: Program) -> Program:
    """Rewrite `program` in place without repeated instructions; returns it."""
    first: dict[Hashable, Instr] = {}
    replaced: dict[Value, Value] = {}
    kept = []
    for instr in program.instrs:
        instr.operands = [replaced.get(o, o) for o in instr.operands]
        if instr.has_side_effect:
            kept.append(instr)
            continue
        key = _key(instr)
        earlier = first.setdefault(key, instr)
        if earlier is instr:
            kept.append(instr)
            continue
        replaced.update(zip(instr.outputs, earlier.outputs))
    program.instrs = kept
    program.outputs = [replaced.get(o, o) for o in program.outputs]
    return program


def _key(instr: Instr) -> Hashable:
    return (instr.opcode, tuple(id(o) for o in instr.operands),
            tuple((o.shape, o.dtype.str) for o in instr.outputs),
            attrs_key(instr))


def attrs_key(instr: Instr) -> Hashable:
    """The instruction's attributes as a hashable value: equal when the attributes are."""
    if not instr.attrs:     # half of all instructions
        return ()
    return tuple(sorted((k, _attr_key(v)) for k, v in instr.attrs.items()))


def _attr_key(v) -> Hashable:
    if type(v) is int or type(v) is str:    # most attributes (dims), their own keys; not bool
        return v
    if isinstance(v, np.ndarray):
        return ("array", v.dtype.str, v.shape, v.tobytes())
    if isinstance(v, (list, tuple)):
        return tuple(_attr_key(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted((k, _attr_key(x)) for k, x in v.items()))
    # True == 1 and -0.0 == 0.0 as Python values, not as attributes
    if isinstance(v, (bool, np.bool_)):
        return ("bool", bool(v))
    if isinstance(v, (float, np.floating)):
        return ("float", float(v).hex())
    try:
        hash(v)
    except TypeError:
        return ("object", id(v))
    return v
