"""The SPMD partitioner driver: walks the completed program and asks each op's
partition rule for per-device code; the result is one program for all devices, which
the passes after partitioning (passes.AFTER_PARTITION) then rewrite."""
from __future__ import annotations

from collections import Counter
from functools import partial
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

import numpy as np

from gspmd import ops, passes
from gspmd.errors import ShardingError
from gspmd.ir import Builder, Instr, Program, Value
from gspmd.passes.cse import attrs_key
from gspmd.sharding import Sharding
from gspmd.spmd import cost as cm
from gspmd.spmd import reshard as rs
from gspmd.spmd.context import DeviceContext
from gspmd.spmd.partitioned import PartitionedValue


def partition(program: Program, num_devices: int, hardware: Union[None, str, cm.Hardware] = None) -> Program:
    """The per-device program; choices between plans are priced on `hardware` (the
    default profile when None)."""
    spmd = _partition(program, num_devices, cm.profile(hardware), [p.sharding for p in program.params],
                      [o.sharding for o in program.outputs])
    spmd.schedules = list(program.schedules)
    return spmd


def _partition(program: Program, num_devices: int, hw: cm.Hardware, in_layouts: Sequence[Sharding],
               out_layouts: Sequence[Sharding], subgroups: Optional[np.ndarray] = None) -> Program:
    """Per-device code for `program` whose parameters arrive laid out as `in_layouts`
    and whose results must leave as `out_layouts` (a loop body's carry, say); inside a
    manual region, for the virtual devices of every subgroup (`subgroups` [G, K])."""
    spmd = Program(f"{program.name}.spmd")
    b = Builder(spmd)
    env: dict = {}

    def partition_subprogram(sub, ins, outs, region_subgroups=None):
        """A loop body in the same devices, or a manual region's body in its subgroups."""
        if region_subgroups is None:
            return _partition(sub, num_devices, hw, ins, outs, subgroups)
        return _partition(sub, region_subgroups.shape[1], hw, ins, outs, region_subgroups)

    sharers = _sharers(program)
    ctx = DeviceContext(b, num_devices, partition_subprogram=partition_subprogram, partitioned=env.__getitem__,
                        subgroups=subgroups, hardware=hw, tidy=partial(passes.run, pipeline=passes.AFTER_PARTITION),
                        sharers=sharers)
    for p, layout in zip(program.params, in_layouts):
        local = b.param(layout.shard_shape(p.shape), p.dtype, hint=p.name)
        local.sharding = layout
        b.origin, b.source = f"parameter %{p.name}", program.labels.get(p, "")
        if b.source:
            spmd.labels[local] = b.source   # its pytree path, for the memory report
        env[p] = rs.reshard(ctx, PartitionedValue(local, layout, p.shape), p.sharding)
    replays = _Replays(spmd)
    for instr in program.instrs:
        b.origin, b.source = _describe(instr), instr.source
        b.recomputed = instr.recomputed
        operands = [env[o] for o in instr.operands]
        key = _replay_key(instr, operands, sharers)
        results = replays.replay(key, b, operands)
        if results is None:
            start = len(spmd.instrs)
            results = _partition_instr(ctx, instr, operands)
            replays.record(key, b, operands, spmd.instrs[start:], results)
        for out, pv in zip(instr.outputs, results):
            assert pv.sharding == out.sharding, (instr, pv.sharding, out.sharding)
            env[out] = pv
    b.origin, b.recomputed = f"{program.name} results", False
    spmd.outputs = []
    for o, layout in zip(program.outputs, out_layouts):
        b.source = program.labels.get(o, "")
        spmd.outputs.append(rs.reshard(ctx, env[o], layout).local)
    passes.run(spmd, passes.AFTER_PARTITION)
    for local, layout in zip(spmd.outputs, out_layouts):
        local.sharding = layout
    return spmd


def _partition_instr(ctx: DeviceContext, instr, operands: list[PartitionedValue]) -> list[PartitionedValue]:
    """The op's partition rule; a failure inside it names the instruction and layouts."""
    try:
        return ops.partition(ctx, instr, operands, [o.sharding for o in instr.outputs])
    except ShardingError:
        raise
    except Exception as e:
        layouts = ", ".join(f"%{o.name}: {o.type_str()} {o.sharding}" for o in instr.operands)
        raise ShardingError(
            f"Internal error partitioning {_describe(instr)} (from {instr.origin or '?'}) "
            f"with operands {layouts} -> {[o.sharding for o in instr.outputs]}: {type(e).__name__}: {e}. Please report "
            "this program; annotating the operands differently may avoid it.") from e


def _describe(instr) -> str:
    """`%name = opcode`, or the opcode alone for an instruction without results."""
    return f"%{instr.outputs[0].name} = {instr.opcode}" if instr.outputs else instr.opcode


class _Code(NamedTuple):
    """One instruction a rule emitted, as it was then (later rules may rewrite it)."""
    opcode: str
    operands: tuple[Value, ...]
    attrs: dict
    outputs: tuple[Value, ...]
    origin: str
    why: Any


class _Replays:
    """Per-device code of the instructions seen before in one program: a program repeats
    itself (layers, their gradients), and an op that the common factor rule partitions
    gives the same code for the same attributes, layouts and shapes, so that code is
    made once and copied onto the new operands. Ops with rules of their own may look
    beyond their operands' layouts (at producers, constants): they are always partitioned.
    A value the context keeps for reuse (the partition id, a table lookup) that the first
    instance made is made again by a replay; common-subexpression elimination merges them."""

    def __init__(self, program: Program):
        self.program = program
        self.seen: dict[tuple, tuple[list[Value], list[_Code], str, list[PartitionedValue]]] = {}

    def record(self, key: Optional[tuple], b: Builder, operands: list[PartitionedValue], emitted: list[Instr],
               results: list[PartitionedValue]) -> None:
        if key is not None:
            code = [_Code(i.opcode, tuple(i.operands), dict(i.attrs), tuple(i.outputs), i.origin, i.why) for i in emitted]
            self.seen[key] = ([pv.local for pv in operands], code, b.origin, results)

    def replay(self, key: Optional[tuple], b: Builder, operands: list[PartitionedValue]) -> Optional[list[PartitionedValue]]:
        """The recorded code under `key`, copied onto `operands`; None if none."""
        if key is None or key not in self.seen:
            return None
        locals_, code, origin, results = self.seen[key]
        copies: dict[Value, Value] = {old: pv.local for old, pv in zip(locals_, operands)}
        for old in code:
            outs = b.add(old.opcode, [copies.get(v, v) for v in old.operands], [(o.shape, o.dtype) for o in old.outputs],
                         **old.attrs)
            new = self.program.instrs[-1]
            # a collective's origin names the rule that made it after the instruction's
            new.origin = b.origin + old.origin[len(origin):] if old.origin.startswith(origin) else old.origin
            new.why = old.why
            for o, v in zip(old.outputs, outs):
                v.sharding = o.sharding
                copies[o] = v
        return [PartitionedValue(copies.get(pv.local, pv.local), pv.sharding, pv.shape) for pv in results]


def _sharers(program: Program) -> Callable[[Instr], tuple[int, ...]]:
    """sharers(instr): per operand of `instr`, how many ops alike read that value there
    (instr among them): the same opcode and attributes on operands and results laid out
    alike. Such ops (the Q, K and V projections of one activation) take the same layouts
    for the same reasons, and resharding the operand is paid once for all of them:
    common-subexpression elimination keeps one copy of the reshard. Counted for the ops
    the common factor rule partitions, the only ones that ask."""
    readers = Counter(id(o) for instr in program.instrs for o in instr.operands)
    counts: Counter = Counter()
    keys: dict[int, dict[int, tuple]] = {}     # id(instr) -> {operand read by others too: its key}
    for instr in program.instrs:
        shared = [t for t, o in enumerate(instr.operands) if readers[id(o)] > 1]
        if shared and _common_rule(instr):
            alike = (instr.opcode, attrs_key(instr), tuple(o.sharding for o in instr.operands),
                     tuple(o.sharding for o in instr.outputs))
            keys[id(instr)] = {t: (id(instr.operands[t]), t, alike) for t in shared}
            counts.update(keys[id(instr)].values())

    def sharers(instr: Instr) -> tuple[int, ...]:
        mine = keys.get(id(instr), {})
        return tuple(counts[mine[t]] if t in mine else 1 for t in range(len(instr.operands)))
    return sharers


def _common_rule(instr: Instr) -> bool:
    """Does the common factor rule partition `instr` (no rule of its own)?"""
    rule = ops.lookup(instr.opcode).rule
    return rule.partition is None and rule.factors is not None


def _replay_key(instr: Instr, operands: list[PartitionedValue],
                sharers: Callable[[Instr], tuple[int, ...]]) -> Optional[tuple]:
    """What the common factor rule reads of `instr` and its operands (which operands are
    one value, too, and how many ops share their reshards); None where the op has a rule
    of its own."""
    if not _common_rule(instr):
        return None
    locals_ = [pv.local for pv in operands]
    return (instr.opcode, attrs_key(instr),
            tuple((pv.sharding, pv.shape, pv.local.shape, pv.dtype, locals_.index(pv.local)) for pv in operands),
            tuple((o.shape, o.dtype, o.sharding) for o in instr.outputs), sharers(instr))

