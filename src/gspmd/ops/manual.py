"""`manual` regions (gspmd.manual, jax.shard_map; paper 3.4, manual subgroups).

The body is per-manual-partition code: its values are each manual partition's piece,
and its named-axis collectives run between manual partitions. Over the mesh's other
(automatic) axes it is an ordinary program: completed by the same propagation (its own
annotations, over the region's virtual devices, gspmd.region) and partitioned by the
same partitioner, for the virtual devices of all subgroups at once.

At the boundary a value is split by its spec over the manual axes and, inside each
piece, by the layout the body gave it: `ManualRegion.compose`. Those layouts seed the
enclosing program's propagation like annotations, and its partition rule reshards
operands to them, partitions the body and places the result in the program."""
from __future__ import annotations

from gspmd.errors import ShardingError
from gspmd.ir import Instr, Program, Value
from gspmd.mesh import Mesh
from gspmd.ops.convert import physical_aval
from gspmd.ops.registry import CONTRACTION, Facets, Frontend, Rule, register
from gspmd.region import ManualRegion
from gspmd.sharding import Sharding, dims_mapping_from_spec
from gspmd.spmd import reshard as rs
from gspmd.spmd.context import Why
from gspmd.spmd.partitioned import PartitionedValue


def _crossing(instr: Instr, i: int) -> tuple:
    """Operand i (i >= operands: result i - operands): its spec over the manual axes,
    its layout inside the body (as the body's completion left it) and its global shape."""
    a, body, n = instr.attrs, instr.attrs["body"], len(instr.operands)
    inside, outside = (body.params[i], instr.operands[i]) if i < n else (body.outputs[i - n], instr.outputs[i - n])
    spec = a["in_specs"][i] if i < n else a["out_specs"][i - n]
    return spec, inside.sharding or Sharding.replicated(inside.rank, a["region"].num_devices), outside.shape


def _inside_layout(instr: Instr, i: int) -> Sharding:
    """Of operand i (or result i - operands), its layout inside the body, split only
    where the piece's split is a split of the whole (uneven splits stay inside)."""
    return instr.attrs["region"].nesting(*_crossing(instr, i))


def _boundary_layout(instr: Instr, i: int) -> Sharding:
    """Of operand i (or result i - operands), its layout over the whole mesh."""
    return instr.attrs["region"].compose(*_crossing(instr, i))


def _inside_layouts(instr: Instr) -> list[Sharding]:
    return [_inside_layout(instr, i) for i in range(len(instr.operands) + len(instr.outputs))]


def _boundary_layouts(instr: Instr) -> list[Sharding]:
    return [_boundary_layout(instr, i) for i in range(len(instr.operands) + len(instr.outputs))]


def _propagate_manual(instr: Instr, shardings, target: int) -> list:
    # only the asked one: propagation asks again for every operand whenever one changes
    return [_boundary_layout(instr, target)]


def _seed_manual(instr: Instr) -> list:
    return list(enumerate(_boundary_layouts(instr)))


def _partition_manual(ctx, instr: Instr, operands, targets) -> list[PartitionedValue]:
    body, region = instr.attrs["body"], instr.attrs["region"]
    n = len(operands)
    inside, boundary = _inside_layouts(instr), _boundary_layouts(instr)
    args = [rs.reshard(ctx, o, layout).local for o, layout in zip(operands, boundary[:n])]
    local = ctx.partition_subprogram(body, inside[:n], inside[n:], region.subgroups)
    outs = _place(ctx, local, args)
    return [rs.reshard(ctx, PartitionedValue(v, layout, o.shape), t)
            for v, layout, o, t in zip(outs, boundary[n:], instr.outputs, targets)]


def _place(ctx, local: Program, args: list[Value]) -> list[Value]:
    """The partitioned body's instructions, in the enclosing program, on `args`."""
    env = dict(zip(local.params, args))
    for inner in local.instrs:
        outs = ctx.b.add(inner.opcode, [env[v] for v in inner.operands],
                         [(v.shape, v.dtype) for v in inner.outputs], **inner.attrs)
        placed = ctx.b.program.instrs[-1]     # (effects may have no results)
        placed.origin = f"{ctx.b.origin} [manual: {inner.origin or inner.opcode}]"
        placed.why = inner.why or Why.MANUAL
        placed.recomputed = inner.recomputed
        env.update(zip(inner.outputs, outs))
    return [env[v] for v in local.outputs]


def _emit_manual(b, mesh: Mesh, axes, body_jaxpr, args: list[Value], in_specs, out_specs, out_types) -> list[Value]:
    """A manual region over `axes` of `mesh`: the body is per-manual-partition code,
    converted into a sub-program whose named-axis collectives resolve over the mesh.
    Specs give, per dim, the tuple of mesh axis names splitting it; out_types the
    global results."""
    if b.manual_regions:
        raise ShardingError(f"A manual region over {tuple(axes)} of {mesh} inside another manual region "
                            f"({b.manual_regions[-1]}) is not supported; make the outer region manual over all "
                            "these axes instead.")
    region = ManualRegion(mesh, axes)
    body = Program(f"{b.program.name}.manual", parent=b.program)
    body.region = region
    sb = b.on(body)
    sb.origin = "manual"
    jaxpr = body_jaxpr.jaxpr if hasattr(body_jaxpr, "jaxpr") else body_jaxpr
    params = [sb.param(*physical_aval(v.aval), hint="local") for v in jaxpr.invars]   # keys as their key data
    sb.manual_regions.append(region)
    try:
        body.outputs = sb.inline(body_jaxpr, params)
    finally:
        sb.manual_regions.pop()
    in_specs, out_specs = tuple(map(tuple, in_specs)), tuple(map(tuple, out_specs))
    # The layouts the specs name (automatic axes unsplit): what the region's device count is read from.
    def named(spec, shape):
        return region.compose(spec, Sharding.replicated(len(shape), region.num_devices), shape)
    in_shardings = tuple(named(s, a.shape) for s, a in zip(in_specs, args))
    out_shardings = tuple(named(s, shape) for s, (shape, _) in zip(out_specs, out_types))
    return b.add("manual", args, out_types, body=body, region=region, in_specs=in_specs, out_specs=out_specs,
                 in_shardings=in_shardings, out_shardings=out_shardings)


def _convert_manual(b, eqn, args: list[Value]) -> list[Value]:
    """gspmd.manual's primitive (its specs are normalized already)."""
    p = eqn.params
    out_types = [(shape, a.dtype) for shape, a in zip(p["out_shapes"], p["body"].out_avals)]
    return _emit_manual(b, p["mesh"], p["axes"], p["body"], args, p["in_specs"], p["out_specs"], out_types)


def _convert_shard_map(b, eqn, args: list[Value]) -> list[Value]:
    """jax.shard_map: a manual region over its mesh's axes that it makes manual; the
    others stay automatic."""
    def names(spec, shape):
        return tuple(() if e is None else (e,) if isinstance(e, str) else e
                     for e in dims_mapping_from_spec(spec, shape))
    p = eqn.params
    mesh = b.mesh_of(p["mesh"])
    axes = tuple(a for a in mesh.axis_names if a in p.get("newly_manual_axes", mesh.axis_names))
    out_types = [b.out_aval(eqn, i) for i in range(len(eqn.outvars))]
    return _emit_manual(b, mesh, axes, p["jaxpr"], args, [names(s, a.shape) for s, a in zip(p["in_specs"], args)],
                        [names(s, shape) for s, (shape, _) in zip(p["out_specs"], out_types)], out_types)


# "manual" is gspmd.frontend.manual.manual_p's name.
register("manual",
         frontend=Frontend(converts={"manual": _convert_manual, "shard_map": _convert_shard_map}),
         rule=Rule(propagate=_propagate_manual, seed=_seed_manual, partition=_partition_manual, priority=CONTRACTION),
         facets=Facets(layouts_named=lambda instr: [*instr.attrs["in_shardings"], *instr.attrs["out_shardings"]]))
