"""Text form of a Program, in the spirit of HLO text."""
from __future__ import annotations

import numpy as np

from gspmd.ir.program import Instr, Program, Value


def _attr(v) -> str:
    if isinstance(v, np.ndarray) and v.ndim == 2 and v.dtype.kind in "iu":   # device groups
        text = ",".join("{" + ",".join(map(str, row)) + "}" for row in v.tolist())
        return "{" + (text if len(text) <= 120 else f"{text[:117]}...") + "}"
    if isinstance(v, np.ndarray):
        return f"{v.dtype.name}{list(v.shape)}" if v.size > 8 else np.array2string(v, separator=",")
    if isinstance(v, Program):
        return f"<{v.name}>"
    if isinstance(v, tuple) and any(isinstance(x, Program) for x in v):   # a conditional's branches
        return "{" + ",".join(map(_attr, v)) + "}"
    return repr(v) if isinstance(v, str) else str(v)


def _value(v: Value, with_sharding: bool) -> str:
    s = f"%{v.name}: {v.type_str()}"
    if with_sharding and v.sharding is not None:
        s += f" sharding={v.sharding}"
    return s


def format_instr(instr: Instr, with_sharding: bool = True) -> str:
    outs = ", ".join(_value(o, with_sharding) for o in instr.outputs)
    parts = [f"%{o.name}" for o in instr.operands]
    parts += [f"{k}={_attr(v)}" for k, v in instr.attrs.items() if v is not None]
    return f"  {outs + ' = ' if outs else ''}{instr.opcode}({', '.join(parts)})"


def format_program(program: Program, with_sharding: bool = True) -> str:
    """The program, preceded by the programs nested in it (loop bodies/conditions)."""
    nested = [_format_one(sub, with_sharding) for sub in reversed(list(program.subprograms()))]
    return "\n\n".join(nested + [_format_one(program, with_sharding)])


def _format_one(program: Program, with_sharding: bool) -> str:
    params = ", ".join(_value(p, with_sharding) for p in program.params)
    lines = [f"{program.name}({params}) {{"]
    lines += [format_instr(i, with_sharding) for i in program.instrs]
    lines.append(f"  return {', '.join('%' + o.name for o in program.outputs)}")
    lines.append("}")
    return "\n".join(lines)
