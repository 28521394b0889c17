"""The SPMD partitioner driver: walks the completed program and asks each op's
partition rule for per-device code; the result is one program for all devices."""
from __future__ import annotations

from gspmd import ops
from gspmd.ir import Builder, Program
from gspmd.ir.cse import eliminate_common_subexpressions
from gspmd.spmd.context import DeviceContext
from gspmd.spmd.partitioned import PartitionedValue


def partition(program: Program, num_devices: int) -> Program:
    spmd = Program(f"{program.name}.spmd")
    b = Builder(spmd)
    ctx = DeviceContext(b, num_devices)
    env: dict = {}
    for p in program.params:
        local = b.param(p.sharding.shard_shape(p.shape), p.dtype, hint=p.name)
        local.sharding = p.sharding
        env[p] = PartitionedValue(local, p.sharding, p.shape)
    for instr in program.instrs:
        b.origin = f"%{instr.outputs[0].name} = {instr.opcode}"
        results = ops.partition(ctx, instr, [env[o] for o in instr.operands],
                                [o.sharding for o in instr.outputs])
        for out, pv in zip(instr.outputs, results):
            assert pv.sharding == out.sharding, (instr, pv.sharding, out.sharding)
            env[out] = pv
    spmd.outputs = [env[o].local for o in program.outputs]
    eliminate_common_subexpressions(spmd)   # one reshard of a value serves all its users
    for o, local in zip(program.outputs, spmd.outputs):
        local.sharding = o.sharding
    return spmd
