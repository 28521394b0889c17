"""The SPMD partitioner driver: walks the completed program and asks each op's
partition rule for per-device code; the result is one program for all devices."""
from __future__ import annotations

from typing import Sequence

from gspmd import ops
from gspmd.errors import ShardingError
from gspmd.ir import Builder, Program
from gspmd.ir.cse import eliminate_common_subexpressions
from gspmd.ir.dce import eliminate_dead_code
from gspmd.sharding import Sharding
from gspmd.spmd import reshard as rs
from gspmd.spmd.context import DeviceContext
from gspmd.spmd.partitioned import PartitionedValue


def partition(program: Program, num_devices: int) -> Program:
    return _partition(program, num_devices, [p.sharding for p in program.params],
                      [o.sharding for o in program.outputs])


def _partition(program: Program, num_devices: int, in_layouts: Sequence[Sharding],
               out_layouts: Sequence[Sharding]) -> Program:
    """Per-device code for `program` whose parameters arrive laid out as `in_layouts`
    and whose results must leave as `out_layouts` (a loop body's carry, say)."""
    spmd = Program(f"{program.name}.spmd")
    b = Builder(spmd)
    env: dict = {}
    ctx = DeviceContext(b, num_devices, partition_subprogram=lambda sub, ins, outs: _partition(sub, num_devices, ins, outs),
                        partitioned=env.__getitem__)
    for p, layout in zip(program.params, in_layouts):
        local = b.param(layout.shard_shape(p.shape), p.dtype, hint=p.name)
        local.sharding = layout
        b.origin = f"parameter %{p.name}"
        env[p] = rs.reshard(ctx, PartitionedValue(local, layout, p.shape), p.sharding)
    for instr in program.instrs:
        b.origin = f"%{instr.outputs[0].name} = {instr.opcode}"
        results = _partition_instr(ctx, instr, [env[o] for o in instr.operands])
        for out, pv in zip(instr.outputs, results):
            assert pv.sharding == out.sharding, (instr, pv.sharding, out.sharding)
            env[out] = pv
    b.origin = f"{program.name} results"
    spmd.outputs = [rs.reshard(ctx, env[o], layout).local for o, layout in zip(program.outputs, out_layouts)]
    eliminate_common_subexpressions(spmd)   # one reshard of a value serves all its users
    eliminate_dead_code(spmd)
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
            f"Internal error partitioning %{instr.outputs[0].name} = {instr.opcode} (from {instr.origin or '?'}) "
            f"with operands {layouts} -> {instr.outputs[0].sharding}: {type(e).__name__}: {e}. Please report "
            "this program; annotating the operands differently may avoid it.") from e
