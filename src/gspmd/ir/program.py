"""Program = SSA graph of instructions whose opcodes follow XLA HLO names."""
from __future__ import annotations

import itertools
from typing import Any, Optional, Sequence

import numpy as np

from gspmd.sharding import Sharding


class Value:
    """One SSA value: a static shape, a dtype, the instruction that made it (None for
    parameters) and, once completed, its sharding."""
    __slots__ = ("name", "shape", "dtype", "producer", "sharding")

    def __init__(self, name: str, shape: Sequence[int], dtype, producer: Optional["Instr"] = None):
        self.name = name
        self.shape = tuple(map(int, shape))
        self.dtype = np.dtype(dtype)
        self.producer = producer
        self.sharding: Optional[Sharding] = None

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def type_str(self) -> str:
        return f"{self.dtype.name}[{','.join(map(str, self.shape))}]"

    def __repr__(self):
        return f"%{self.name}:{self.type_str()}"


# The attribute that marks an instruction with effects beyond its results (a host
# callback that prints): it runs even when nothing reads its results, and two such
# instructions never merge.
SIDE_EFFECT = "side_effect"


class Instr:
    """One instruction. `origin` says where it came from (the JAX primitive or the
    partition rule that emitted it) and `source` the user's Python line ("train.py:12
    (loss)") or, at parameters and results, the pytree path; for reports and explain.
    `recomputed` marks the rematerialized forward computation a backward pass repeats
    (jax.checkpoint)."""
    __slots__ = ("opcode", "operands", "attrs", "outputs", "origin", "why", "source", "recomputed")

    def __init__(self, opcode: str, operands: Sequence[Value], attrs: dict, origin: str = "", source: str = ""):
        self.opcode = opcode
        self.operands = list(operands)
        self.attrs = dict(attrs)
        self.outputs: list[Value] = []
        self.origin = origin
        self.why = None   # collectives: the spmd.context.Why of the rule that made it
        self.source = source
        self.recomputed = False

    def remade(self, operands: Sequence[Value], output: Value, opcode: Optional[str] = None,
               attrs: Optional[dict] = None) -> "Instr":
        """This instruction again (or `opcode` with `attrs`, made in its place) on
        `operands`, producing `output`: its origin, line and flags kept (passes that
        rewrite an instruction)."""
        instr = Instr(opcode or self.opcode, operands, self.attrs if attrs is None else attrs, self.origin,
                      self.source)
        instr.why, instr.recomputed = self.why, self.recomputed
        instr.outputs, output.producer = [output], instr
        return instr

    @property
    def has_side_effect(self) -> bool:
        return bool(self.attrs.get(SIDE_EFFECT))

    @property
    def output(self) -> Value:
        assert len(self.outputs) == 1, f"{self.opcode} has {len(self.outputs)} outputs"
        return self.outputs[0]

    def __repr__(self):
        return f"Instr({self.opcode}, {[o.name for o in self.outputs]})"


class Program:
    def __init__(self, name: str = "main", parent: Optional["Program"] = None):
        """A sub-program (a loop body) shares its parent's value names, so that names
        stay unique across the whole nest."""
        self.name = name
        self.params: list[Value] = []
        self.instrs: list[Instr] = []
        self.outputs: list[Value] = []
        self.labels: dict[Value, str] = {}   # parameters and results: the user's pytree path
        self._names = parent._names if parent is not None else itertools.count()
        self.schedules: list = []   # pipelines traced into it (ir.schedule.PipelineSchedule), for reports
        # The body of a manual region (gspmd.region.ManualRegion): its values are per
        # manual partition and their layouts are over the region's virtual devices.
        self.region = None

    def fresh_name(self, hint: str = "v") -> str:
        return f"{hint}.{next(self._names)}"

    def values(self):
        yield from self.params
        for instr in self.instrs:
            yield from instr.outputs

    def subprograms(self, into_regions: bool = True):
        """Programs nested in this one's instructions (loop bodies, a conditional's
        tuple of branches, manual regions' bodies unless not `into_regions`), depth first."""
        for instr in self.instrs:
            for attr in instr.attrs.values():
                for sub in (attr if isinstance(attr, tuple) else (attr,)):
                    if isinstance(sub, Program) and (into_regions or sub.region is None):
                        yield sub
                        yield from sub.subprograms(into_regions)

    def regions(self):
        """Bodies of the manual regions in this program (not nested in another region)."""
        for p in (self, *self.subprograms(into_regions=False)):
            for instr in p.instrs:
                yield from (a for a in instr.attrs.values() if isinstance(a, Program) and a.region is not None)

    def all_instrs(self, into_regions: bool = True):
        """Every instruction of this program and of the programs nested in it."""
        yield from self.instrs
        for sub in self.subprograms(into_regions):
            yield from sub.instrs

    def all_values(self, into_regions: bool = True):
        yield from self.values()
        for sub in self.subprograms(into_regions):
            yield from sub.values()

    def find(self, name: str) -> Value:
        """A value by name, in this program or one nested in it."""
        for v in self.all_values():
            if v.name == name:
                return v
        raise KeyError(name)

    def users(self) -> dict[Value, list[Instr]]:
        users: dict[Value, list[Instr]] = {v: [] for v in self.values()}
        for instr in self.instrs:
            for op in instr.operands:
                users[op].append(instr)
        return users


class Builder:
    """Appends instructions to a program, each with the result shapes the caller gives;
    ir.emit's typed emitters work them out on top of this."""

    def __init__(self, program: Program, origin: str = "", source: str = ""):
        self.program = program
        self.origin = origin
        self.source = source
        self.recomputed = False   # instructions added now repeat a forward computation (remat)

    def param(self, shape, dtype, hint: str = "p") -> Value:
        v = Value(self.program.fresh_name(hint), shape, dtype)
        self.program.params.append(v)
        return v

    def add(self, opcode: str, operands: Sequence[Value], out_types: Sequence[tuple[Sequence[int], Any]],
            **attrs) -> list[Value]:
        instr = Instr(opcode, operands, attrs, self.origin, self.source)
        instr.recomputed = self.recomputed
        for shape, dtype in out_types:
            instr.outputs.append(Value(self.program.fresh_name(_hint(opcode)), shape, dtype, instr))
        self.program.instrs.append(instr)
        return instr.outputs

    def add1(self, opcode: str, operands: Sequence[Value], shape, dtype, **attrs) -> Value:
        return self.add(opcode, operands, [(shape, dtype)], **attrs)[0]


def _hint(opcode: str) -> str:
    return opcode.replace("-", "_")
