"""`manual` regions (gspmd.manual, jax.shard_map): per-device code placed into the SPMD program as it is.

Operands are laid out as the region's in_specs ask, the body's instructions are copied
with the local operands in place of its parameters, and its results are laid out as the
out_specs say. The body is not partitioned further (auto axes replicate it)."""
from __future__ import annotations

from gspmd.ir import Instr, Program, Value
from gspmd.mesh import Mesh
from gspmd.ops.registry import CONTRACTION, register
from gspmd.sharding import Sharding, dims_mapping_from_spec
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


def _emit_manual(b, mesh: Mesh, body_jaxpr, args: list[Value], in_specs, out_specs, out_types) -> list[Value]:
    """A manual region: the body is per-device code already, converted into a
    sub-program whose named-axis collectives resolve over the region's mesh. Specs give,
    per dim, the tuple of mesh axis names splitting it; out_types the global results."""
    body = Program(f"{b.program.name}.manual", parent=b.program)
    sb = b.on(body)
    sb.origin = "manual"
    jaxpr = body_jaxpr.jaxpr if hasattr(body_jaxpr, "jaxpr") else body_jaxpr
    params = [sb.param(v.aval.shape, v.aval.dtype, hint="local") for v in jaxpr.invars]
    sb.manual_meshes.append(mesh)
    try:
        body.outputs = sb.inline(body_jaxpr, params)
    finally:
        sb.manual_meshes.pop()
    in_shardings = tuple(_spec_sharding(mesh, s, a.shape) for s, a in zip(in_specs, args))
    out_shardings = tuple(_spec_sharding(mesh, s, shape) for s, (shape, _) in zip(out_specs, out_types))
    return b.add("manual", args, out_types, body=body, in_shardings=in_shardings, out_shardings=out_shardings)


def _convert_manual(b, eqn, args: list[Value]) -> list[Value]:
    """gspmd.manual's primitive (its specs are normalized already)."""
    p = eqn.params
    out_types = [(shape, a.dtype) for shape, a in zip(p["out_shapes"], p["body"].out_avals)]
    return _emit_manual(b, p["mesh"], p["body"], args, p["in_specs"], p["out_specs"], out_types)


def _convert_shard_map(b, eqn, args: list[Value]) -> list[Value]:
    """jax.shard_map: a manual region over its mesh. Axes left out of its axis_names stay
    automatic; as in gspmd.manual the body is replicated over them."""
    def names(spec, shape):
        return tuple(() if e is None else (e,) if isinstance(e, str) else e
                     for e in dims_mapping_from_spec(spec, shape))
    p = eqn.params
    out_types = [b.out_aval(eqn, i) for i in range(len(eqn.outvars))]
    return _emit_manual(b, b.mesh_of(p["mesh"]), p["jaxpr"], args,
                        [names(s, a.shape) for s, a in zip(p["in_specs"], args)],
                        [names(s, shape) for s, (shape, _) in zip(p["out_specs"], out_types)], out_types)


# "manual" is gspmd.frontend.manual.manual_p's name.
register("manual", converts={"manual": _convert_manual, "shard_map": _convert_shard_map}, propagate=_propagate_manual,
         partition=_partition_manual, priority=CONTRACTION)
