"""The SPMD partitioner driver: walks the completed program and asks each op's
partition rule for per-device code; the result is one program for all devices."""
from __future__ import annotations

from typing import Mapping, Optional, Sequence, Union

import numpy as np

from gspmd import ops
from gspmd.analysis import memory
from gspmd.errors import ShardingError
from gspmd.ir import Builder, Instr, Program
from gspmd.ir.cse import eliminate_common_subexpressions
from gspmd.ir.dce import eliminate_dead_code
from gspmd.ops.reassociate import reassociate_all_reduces
from gspmd.sharding import Sharding
from gspmd.spmd import cost as cm
from gspmd.spmd import reshard as rs
from gspmd.spmd.context import DeviceContext
from gspmd.spmd.partitioned import PartitionedValue


def partition(program: Program, num_devices: int, hardware: Union[None, str, cm.Hardware] = None) -> Program:
    """The per-device program; choices between plans are priced on `hardware` (the
    default profile when None)."""
    with cm.pricing(hardware):
        spmd = _partition(program, num_devices, [p.sharding for p in program.params],
                          [o.sharding for o in program.outputs])
    spmd.schedules = list(program.schedules)
    return spmd


def _partition(program: Program, num_devices: int, in_layouts: Sequence[Sharding],
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
            return _partition(sub, num_devices, ins, outs, subgroups)
        return _partition(sub, region_subgroups.shape[1], ins, outs, region_subgroups)

    ctx = DeviceContext(b, num_devices, partition_subprogram=partition_subprogram, partitioned=env.__getitem__,
                        subgroups=subgroups)
    for p, layout in zip(program.params, in_layouts):
        local = b.param(layout.shard_shape(p.shape), p.dtype, hint=p.name)
        local.sharding = layout
        b.origin, b.source = f"parameter %{p.name}", program.labels.get(p, "")
        env[p] = rs.reshard(ctx, PartitionedValue(local, layout, p.shape), p.sharding)
    for instr in program.instrs:
        b.origin, b.source = _describe(instr), instr.source
        b.recomputed = instr.recomputed
        results = _partition_instr(ctx, instr, [env[o] for o in instr.operands])
        for out, pv in zip(instr.outputs, results):
            assert pv.sharding == out.sharding, (instr, pv.sharding, out.sharding)
            env[out] = pv
    b.origin, b.recomputed = f"{program.name} results", False
    spmd.outputs = []
    for o, layout in zip(program.outputs, out_layouts):
        b.source = program.labels.get(o, "")
        spmd.outputs.append(rs.reshard(ctx, env[o], layout).local)
    eliminate_common_subexpressions(spmd)   # one reshard of a value serves all its users
    reassociate_all_reduces(spmd)            # ar(a) + ar(b) -> ar(a + b)
    eliminate_dead_code(spmd, ops.prune)
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


def fit_memory(spmd: Program, num_devices: int, limit: int, aliases: Mapping[int, int] = {},
               kernel_scratch: bool = True) -> memory.BudgetChoice:
    """Fit the per-device program in `limit` bytes where it can, trading collective bytes
    for memory: a gather (a collective whose result is larger than its operand, and whose
    op record says how to repeat it) whose result is held idle across the peak, read
    before and after it, is done again right before its later readers, so that only its
    sharded operand stays live in between.
    The largest first, as many as the excess needs; repeated while the peak exceeds the
    limit and re-gathering lowers it. `aliases` and `kernel_scratch` as for
    memory.profile (the donated parameters, the target's kernels)."""
    def profile() -> memory.MemoryProfile:
        return memory.profile(spmd, aliases, kernel_scratch=kernel_scratch)
    held = profile()
    shared, regathered, extra = held.peak_bytes, [], 0
    while held.peak_bytes > limit:
        undo, moved, excess = [], [], held.peak_bytes - limit
        for gather, later in sorted(_idle_across_peak(spmd, held), key=lambda c: -c[0].output.nbytes):
            if excess <= 0:
                break
            undo.append(_gather_again(spmd, num_devices, gather, later))
            moved.append(gather.output)
            excess -= gather.output.nbytes
        after = profile() if moved else held
        if after.peak_bytes >= held.peak_bytes:
            for restore in reversed(undo):
                restore()
            break
        held = after
        regathered += [v.name for v in moved]
        extra += sum(v.nbytes for v in moved)
    return memory.BudgetChoice(limit, shared, held.peak_bytes, extra, tuple(regathered))


def _idle_across_peak(spmd: Program, held: memory.MemoryProfile) -> list[tuple[Instr, list[Instr]]]:
    """Gathers whose result is read before the peak and after it but not at it: each
    with its readers after the peak."""
    peak, readers, results = held.peak_step, spmd.users(), set(spmd.outputs)
    found = []
    for instr in spmd.instrs:
        if ops.lookup(instr.opcode).repeat is None or len(instr.outputs) != 1 or instr.output in results:
            continue
        v = instr.output
        if v.nbytes <= sum(o.nbytes for o in instr.operands) or held.step_of(instr) >= peak:
            continue
        steps = [held.step_of(r) for r in readers[v]]
        if min(steps) < peak < max(steps) and peak not in steps:
            found.append((instr, [r for r in readers[v] if held.step_of(r) > peak]))
    return found


def _gather_again(spmd: Program, num_devices: int, gather: Instr, later: list[Instr]):
    """Repeat `gather` (as its op record says: by instructions no common-subexpression
    elimination merges with it) right before the first of `later`, and let them read the
    repeat; returns a function that undoes it."""
    staging = Program("regather", parent=spmd)
    v = gather.output
    copy = ops.lookup(gather.opcode).repeat(DeviceContext(Builder(staging, gather.origin), num_devices), gather)
    copy.sharding = v.sharding
    added = staging.instrs
    at = min(spmd.instrs.index(r) for r in later)
    spmd.instrs[at:at] = added
    before = [(r, list(r.operands)) for r in later]
    for r in later:
        r.operands = [copy if o is v else o for o in r.operands]

    def undo():
        spmd.instrs[:] = [i for i in spmd.instrs if i not in added]
        for r, operands in before:
            r.operands = operands
    return undo


def _describe(instr) -> str:
    """`%name = opcode`, or the opcode alone for an instruction without results."""
    return f"%{instr.outputs[0].name} = {instr.opcode}" if instr.outputs else instr.opcode
