"""The SPMD partitioner driver: walks the completed program and asks each op's
partition rule for per-device code; the result is one program for all devices, which
the passes after partitioning (passes.AFTER_PARTITION) then rewrite."""
from __future__ import annotations

from typing import Optional, Sequence, Union

import numpy as np

from gspmd import ops, passes
from gspmd.errors import ShardingError
from gspmd.ir import Builder, Program
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

    ctx = DeviceContext(b, num_devices, partition_subprogram=partition_subprogram, partitioned=env.__getitem__,
                        subgroups=subgroups, hardware=hw)
    for p, layout in zip(program.params, in_layouts):
        local = b.param(layout.shard_shape(p.shape), p.dtype, hint=p.name)
        local.sharding = layout
        b.origin, b.source = f"parameter %{p.name}", program.labels.get(p, "")
        if b.source:
            spmd.labels[local] = b.source   # its pytree path, for the memory report
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
