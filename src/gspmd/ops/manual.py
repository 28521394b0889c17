"""`manual` regions (gspmd.manual): per-device code placed into the SPMD program as it is.

Operands are laid out as the region's in_specs ask, the body's instructions are copied
with the local operands in place of its parameters, and its results are laid out as the
out_specs say. The body is not partitioned further (auto axes replicate it)."""
from __future__ import annotations

from gspmd.ir import Instr, Program, Value
from gspmd.mesh import Mesh
from gspmd.ops.registry import CONTRACTION, register
from gspmd.sharding import Sharding
from gspmd.spmd import reshard as rs
from gspmd.spmd.partitioned import PartitionedValue


def _propagate_manual(instr: Instr, shardings, target: int) -> list:
    """The specs fix the layouts at the region's boundary."""
    n = len(instr.operands)
    return [instr.attrs["in_shardings"][target] if target < n else instr.attrs["out_shardings"][target - n]]


def _partition_manual(ctx, instr: Instr, operands, targets) -> list[PartitionedValue]:
    body, a = instr.attrs["body"], instr.attrs
    local = {p: rs.reshard(ctx, o, s).local for p, o, s in zip(body.params, operands, a["in_shardings"])}
    for inner in body.instrs:
        outs = ctx.b.add(inner.opcode, [local[v] for v in inner.operands],
                         [(v.shape, v.dtype) for v in inner.outputs], **inner.attrs)
        for out in outs:
            out.producer.origin = f"{ctx.b.origin} [manual: {inner.origin or inner.opcode}]"
        local.update(zip(inner.outputs, outs))
    results = [PartitionedValue(local[v], s, o.shape)
               for v, s, o in zip(body.outputs, a["out_shardings"], instr.outputs)]
    return [rs.reshard(ctx, pv, t) for pv, t in zip(results, targets)]


def _spec_sharding(mesh: Mesh, spec, shape) -> Sharding:
    """A manual spec (per dim, the tuple of axis names splitting it) as a layout."""
    return Sharding.from_mesh(mesh, [names if names else -1 for names in spec], shape)


def _convert_manual(b, eqn, args: list[Value]) -> list[Value]:
    """gspmd.manual's primitive: its body is per-device code already, converted into a
    sub-program whose named-axis collectives resolve over the region's mesh."""
    p = eqn.params
    mesh, body = p["mesh"], Program(f"{b.program.name}.manual", parent=b.program)
    sb = b.on(body)
    sb.origin = "manual"
    params = [sb.param(v.aval.shape, v.aval.dtype, hint="local") for v in p["body"].jaxpr.invars]
    sb.manual_meshes.append(mesh)
    try:
        body.outputs = sb.inline(p["body"], params)
    finally:
        sb.manual_meshes.pop()
    in_shardings = tuple(_spec_sharding(mesh, s, a.shape) for s, a in zip(p["in_specs"], args))
    out_shardings = tuple(_spec_sharding(mesh, s, shape) for s, shape in zip(p["out_specs"], p["out_shapes"]))
    return b.add("manual", args, [(shape, a.dtype) for shape, a in zip(p["out_shapes"], p["body"].out_avals)],
                 body=body, in_shardings=in_shardings, out_shardings=out_shardings)


# "manual" is gspmd.frontend.manual.manual_p's name.
register("manual", converts={"manual": _convert_manual}, propagate=_propagate_manual, partition=_partition_manual,
         priority=CONTRACTION)
