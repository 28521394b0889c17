"""partition-id and the five collectives. Their semantics run over all devices at once
(evaluate_all); groups are rows of device ids, ordered.

The partitioner emits them through spmd.context.DeviceContext; JAX's collectives over
named mesh axes (psum, all_gather, ppermute, axis_index, ...) become them inside manual
regions (gspmd.manual), where the enclosing region's mesh turns axis names into groups.
On the jax backend they lower to jax's grouped collectives over the shard_map axis.
"""
from __future__ import annotations

import functools
import math
from typing import Callable

import numpy as np
from jax import lax
from jax import numpy as jnp

from gspmd.errors import ShardingError
from gspmd.ir import Instr, Value
from gspmd.ir.reducer import ADD, AND, MAX, MIN, OR, Reducer
from gspmd.mesh import Mesh
from gspmd.ops.loop_motion import groups_within
from gspmd.ops.registry import (Facets, Frontend, Kernel, KernelOrders, Memory, Rewrites, Rule, Semantics, Timing,
                                elementwise_factors, major_first, register)
from gspmd.spmd.context import DeviceContext
from gspmd.spmd.cost import ComputeKind, Pattern
from gspmd.spmd.factors import PASS, REPLICATE, Factor


# -- reference semantics ----------------------------------------------------------------
def _evaluate_partition_id(instr, args, device):
    return [np.asarray(device, instr.outputs[0].dtype)]


def _per_group(instr, per_device, combine):
    """Apply combine(member arrays) -> member results for each device group."""
    out = [None] * len(per_device)
    for group in instr.attrs["groups"]:
        results = combine([per_device[d][0] for d in group])
        for d, r in zip(group, results):
            out[d] = [np.asarray(r, instr.outputs[0].dtype)]
    return out


def _evaluate_all_reduce(instr, per_device):
    reducer = instr.attrs["reducer"]
    return _per_group(instr, per_device, lambda xs: [reducer.reduce(np.stack(xs), (0,))] * len(xs))


def _evaluate_all_gather(instr, per_device):
    dim = instr.attrs["dim"]
    return _per_group(instr, per_device, lambda xs: [np.concatenate(xs, axis=dim)] * len(xs))


def _evaluate_reduce_scatter(instr, per_device):
    reducer, dim = instr.attrs["reducer"], instr.attrs["dim"]
    return _per_group(instr, per_device, lambda xs: np.split(reducer.reduce(np.stack(xs), (0,)), len(xs), axis=dim))


def _evaluate_all_to_all(instr, per_device):
    split, concat = instr.attrs["split_dim"], instr.attrs["concat_dim"]

    def exchange(xs):
        chunks = [np.split(x, len(xs), axis=split) for x in xs]
        return [np.concatenate([chunks[src][dst] for src in range(len(xs))], axis=concat)
                for dst in range(len(xs))]
    return _per_group(instr, per_device, exchange)


def _evaluate_ragged_all_to_all(instr, per_device):
    """Each device's output with the rows sent to it written in: slice i of a sender
    (input_offsets[i], send_sizes[i] rows of its operand) goes to the group's member
    i // slices-per-member, at the sender's output_offsets[i] there."""
    out = [[np.array(args[1], copy=True)] for args in per_device]
    for group in instr.attrs["groups"]:
        for sender in group:
            operand, _, input_offsets, send_sizes, output_offsets, _ = per_device[sender]
            per_member = len(send_sizes) // len(group)
            for i, (start, size, at) in enumerate(zip(input_offsets, send_sizes, output_offsets)):
                out[group[i // per_member]][0][at:at + size] = operand[start:start + size]
    return out


def _evaluate_collective_permute(instr, per_device):
    # Devices that nobody sends to receive zeros (HLO semantics).
    out = [[np.zeros_like(x[0])] for x in per_device]
    for src, dst in instr.attrs["pairs"]:
        out[dst] = [per_device[src][0].copy()]
    return out


# -- JAX's named-axis collectives inside manual regions -----------------------------------
def _manual_mesh(b, eqn) -> Mesh:
    if not b.manual_regions:
        raise ShardingError(f"`{eqn.primitive.name}` over a named axis is only meaningful inside gspmd.manual "
                            "or jax.shard_map; move it into a manual function.")
    return b.manual_regions[-1].mesh


def _named_groups(b, eqn, names) -> np.ndarray:
    """[G, k]: devices differing only along the named axes, ordered by their index there."""
    mesh = _manual_mesh(b, eqn)
    names = (names,) if isinstance(names, str) else tuple(names)
    dims = [mesh.axis_index(n) for n in names]
    rest = [d for d in range(mesh.ndim) if d not in dims]
    return mesh.devices.transpose(rest + dims).reshape(-1, math.prod(mesh.shape[d] for d in dims))


def _convert_psum(reducer: Reducer):
    def convert(b, eqn, args):
        groups = _named_groups(b, eqn, eqn.params["axes"])
        return [b.add1("all-reduce", [x], x.shape, x.dtype, groups=groups, reducer=reducer) for x in args]
    return convert


def _convert_all_gather(b, eqn, args):
    p, (x,) = eqn.params, args
    dim, groups = p["all_gather_dimension"], _named_groups(b, eqn, p["axis_name"])
    if not p["tiled"]:   # a new dim of size k: gather along an inserted unit dim
        x = b.add1("reshape", [x], x.shape[:dim] + (1,) + x.shape[dim:], x.dtype)
    shape = list(x.shape)
    shape[dim] *= groups.shape[1]
    return [b.add1("all-gather", [x], shape, x.dtype, dim=dim, groups=groups)]


def _convert_reduce_scatter(b, eqn, args):
    p, (x,) = eqn.params, args
    dim, groups = p["scatter_dimension"], _named_groups(b, eqn, p["axis_name"])
    shape = list(x.shape)
    shape[dim] //= groups.shape[1]
    y = b.add1("reduce-scatter", [x], shape, x.dtype, dim=dim, groups=groups, reducer=ADD)
    if not p["tiled"]:
        y = b.add1("reshape", [y], tuple(n for d, n in enumerate(shape) if d != dim), x.dtype)
    return [y]


def _convert_all_to_all(b, eqn, args):
    p, (x,) = eqn.params, args
    groups = _named_groups(b, eqn, p["axis_name"])
    k, split, concat = groups.shape[1], p["split_axis"], p["concat_axis"]
    shape = list(x.shape)
    shape[split] //= k
    shape[concat] *= k
    return [b.add1("all-to-all", [x], shape, x.dtype, split_dim=split, concat_dim=concat, groups=groups)]


def _convert_ragged_all_to_all(b, eqn, args):
    if eqn.params.get("axis_index_groups") is not None:
        raise ShardingError("ragged_all_to_all with axis_index_groups is not supported; name mesh axes instead "
                            "(a shard_map over the axes the exchange runs along).")
    output = args[1]
    return [b.add1("ragged-all-to-all", list(args), output.shape, output.dtype,
                   groups=_named_groups(b, eqn, eqn.params["axis_name"]))]


def _convert_ppermute(b, eqn, args):
    p, (x,) = eqn.params, args
    groups = _named_groups(b, eqn, p["axis_name"])
    pairs = [(line[src], line[dst]) for line in groups for src, dst in p["perm"]]
    return [b.add1("collective-permute", [x], x.shape, x.dtype, pairs=np.asarray(pairs, np.int64))]


def _convert_pbroadcast(b, eqn, args):
    """The source member's value to every member of its group (a permute from one to
    all: exact, where jax's own lowering exists only for GPUs)."""
    p, (x,) = eqn.params, args
    groups = _named_groups(b, eqn, p["axis_name"])
    pairs = [(line[p["source"]], d) for line in groups for d in line]
    return [b.add1("collective-permute", [x], x.shape, x.dtype, pairs=np.asarray(pairs, np.int64))]


def _convert_axis_index(b, eqn, args):
    mesh = _manual_mesh(b, eqn)
    coords = np.empty(mesh.size, np.int32)
    coords[mesh.devices] = np.indices(mesh.shape)[mesh.axis_index(eqn.params["axis_name"])]
    return [DeviceContext(b, mesh.size).table_lookup(coords)]


# -- inside a manual region's body, partitioned over its automatic axes --------------------
# A collective over manual axes runs between manual partitions, on each device's tile of
# the automatic layout: dims it gathers, scatters or exchanges along must be whole there.
def _whole_along(*dims_attrs: str):
    def factors(instr: Instr) -> list[Factor]:
        whole = {instr.attrs[a] for a in dims_attrs}
        out = instr.outputs[0]
        return [Factor(size, (d, d), REPLICATE if d in whole else PASS) for d, size in enumerate(out.shape)]
    return factors


def _ragged_factors(instr: Instr) -> list[Factor]:
    """Tensors: operand, output, the four offset and size vectors, result. The ragged
    rows and the vectors stay whole; the dims after the rows split freely."""
    operand, output = instr.operands[:2]
    alone = lambda t, size: Factor(size, tuple(0 if k == t else None for k in range(7)), REPLICATE)
    return ([alone(0, operand.shape[0]), Factor(output.shape[0], (None, 0, None, None, None, None, 0), REPLICATE)]
            + [alone(t, instr.operands[t].shape[0]) for t in range(2, 6)]
            + [Factor(size, (d, d, None, None, None, None, d), PASS) for d, size in enumerate(output.shape) if d])


# -- jax lowering: grouped collectives over the shard_map axis ----------------------------
def _lower_partition_id(instr, args, lc):
    return [lax.convert_element_type(lc.device_id(), instr.outputs[0].dtype)]


def _axis_groups(instr: Instr, lc):
    """The instruction's groups as axis_index_groups (None: one group of all devices in
    order). JAX wants groups of equal size that cover every device."""
    groups = np.asarray(instr.attrs["groups"])
    n = lc.axis_size()
    if sorted(groups.ravel().tolist()) != list(range(n)):
        raise ShardingError(f"{instr.opcode} groups {groups.tolist()} do not cover the {n} devices once each; "
                            "the jax backend cannot express that collective.")
    positions = lc.positions(groups)
    if positions.shape[0] == 1 and np.array_equal(positions[0], np.arange(n)):
        return None
    return positions.tolist()


def _rank_in_group(instr: Instr, lc):
    """This device's position within its group (a scalar)."""
    groups = np.asarray(instr.attrs["groups"])
    rank = np.empty(groups.size, np.int32)
    rank[groups.ravel()] = np.tile(np.arange(groups.shape[1], dtype=np.int32), groups.shape[0])
    return jnp.asarray(rank)[lc.device_id()]


def _all_reduce_value(instr: Instr, x, lc):
    reducer, groups = instr.attrs["reducer"], _axis_groups(instr, lc)
    if reducer is ADD:
        return lax.psum(x, lc.axis, axis_index_groups=groups)
    if reducer in (MAX, MIN) or (reducer in (AND, OR) and x.dtype == jnp.bool_):
        op = lax.pmax if reducer in (MAX, OR) else lax.pmin
        wide = x.astype(jnp.int32) if x.dtype == jnp.bool_ else x   # no boolean max/min collective
        out = op(wide, lc.axis, axis_index_groups=groups).astype(x.dtype)
        if jnp.issubdtype(x.dtype, jnp.floating):
            # HLO max/min propagate NaN; XLA's CPU all-reduce drops it.
            nan = lax.pmax(jnp.isnan(x).astype(jnp.int32), lc.axis, axis_index_groups=groups)
            out = jnp.where(nan > 0, jnp.asarray(jnp.nan, x.dtype), out)
        return out
    # No native collective (product, bitwise): gather the group's values, reduce locally.
    members = lax.all_gather(x, lc.axis, axis_index_groups=groups)
    return reducer.lax_reduce(members, (0,)).astype(x.dtype)


def _reduced_as(instr: Instr, x: Value) -> list[tuple[Pattern, int]]:
    """The collectives _all_reduce_value runs to reduce x over instr's groups."""
    reducer, dtype, count = instr.attrs["reducer"], x.dtype, math.prod(x.shape)
    if reducer is ADD:
        return [(Pattern.ALL_REDUCE, x.nbytes)]
    if reducer in (MAX, MIN) or (reducer in (AND, OR) and dtype == np.bool_):
        wide = count * 4 if dtype == np.bool_ else x.nbytes
        nan_flags = [(Pattern.ALL_REDUCE, count * 4)] if np.issubdtype(dtype, np.floating) else []
        return [(Pattern.ALL_REDUCE, wide)] + nan_flags
    return [(Pattern.ALL_GATHER, _group_size(instr) * x.nbytes)]


def _group_size(instr: Instr) -> int:
    return np.asarray(instr.attrs["groups"]).shape[1]


def _lowered_as(collectives: Callable[[Instr], list[tuple[Pattern, int]]]):
    """A lowered_collectives facet: none over empty operands or one-device groups, which
    the lowerings skip (or XLA drops), else `collectives(instr)`."""
    def lowered(instr: Instr, num_devices: int) -> list[tuple[Pattern, int]]:
        if 0 in instr.operands[0].shape or _group_size(instr) == 1:
            return []
        return collectives(instr)
    return lowered


def _as_itself(instr: Instr) -> list[tuple[Pattern, int]]:
    return [(Pattern(instr.opcode), instr.outputs[0].nbytes)]   # a Pattern's value is its opcode


def _lower_all_reduce(instr, args, lc):
    if np.asarray(instr.attrs["groups"]).shape[1] == 1:
        return [args[0]]
    return [_all_reduce_value(instr, args[0], lc)]


def _collective_along(collective: Callable, x, dim: int, lc):
    """collective(x, dim); in a program with a row-major-only kernel (an FFT), along dim 0
    with `dim` moved there and back: the copies XLA makes anyway, but explicit, so that
    its CPU layout assignment does not hand the `dim`-major layout it gives a gather or
    scatter along `dim` on to an FFT that made the operand, through element-wise ops and
    reductions (XLA:CPU's FFT kernel then fails a layout check, IsMonotonicWithDim0Major;
    tests/test_complex.py's plain-jax reproducer says when this can go)."""
    if not lc.row_major:
        return collective(x, dim)
    return _moved(collective(_moved(x, dim, 0), 0), 0, dim)


def _moved(x, source: int, destination: int):
    """jnp.moveaxis as one lax.transpose (jnp's is a jit of its own, traced per shape:
    ~0.4 ms a collective in a first call)."""
    if source == destination:
        return x
    order = [d for d in range(x.ndim) if d != source]
    order.insert(destination, source)
    return lax.transpose(x, order)


def _lower_all_gather(instr, args, lc):
    groups = _axis_groups(instr, lc)
    gather = lambda x, d: lax.all_gather(x, lc.axis, axis=d, axis_index_groups=groups, tiled=True)
    return [_collective_along(gather, args[0], instr.attrs["dim"], lc)]


def _lower_reduce_scatter(instr, args, lc):
    dim = instr.attrs["dim"]
    if instr.attrs["reducer"] is ADD:
        groups = _axis_groups(instr, lc)
        scatter = lambda x, d: lax.psum_scatter(x, lc.axis, scatter_dimension=d, axis_index_groups=groups, tiled=True)
        return [_collective_along(scatter, args[0], dim, lc)]
    # Other reducers: all-reduce, then keep this device's piece.
    size = instr.outputs[0].shape[dim]
    full = _all_reduce_value(instr, args[0], lc)
    return [lax.dynamic_slice_in_dim(full, _rank_in_group(instr, lc) * size, size, axis=dim)]


def _scattered_as(instr: Instr) -> list[tuple[Pattern, int]]:
    """A sum is one reduce-scatter; other reducers reduce the whole operand (see below)."""
    if instr.attrs["reducer"] is ADD:
        return [(Pattern.REDUCE_SCATTER, instr.outputs[0].nbytes)]
    return _reduced_as(instr, instr.operands[0])


def _scatter_key(instr):
    """Reduce-scatters summing over the same groups in one dtype may run as one (XLA:CPU
    has no reduce-scatter combiner: each would be a rendezvous of every device)."""
    if instr.attrs["reducer"] is not ADD or 0 in instr.operands[0].shape:
        return None
    return instr.operands[0].dtype, tuple(map(tuple, np.asarray(instr.attrs["groups"]).tolist()))


def _lower_reduce_scatters(instrs, args, lc):
    """One reduce-scatter of the operands side by side: each operand's scattered dim
    moved first and split into the group's pieces, [pieces, rest] concatenated along
    rest, scattered along the pieces; each result cut back out."""
    if len(instrs) == 1:
        return [_lower_reduce_scatter(instrs[0], args[0], lc)]
    n = np.asarray(instrs[0].attrs["groups"]).shape[1]
    rows = [_moved(x[0], i.attrs["dim"], 0).reshape(n, -1) for i, x in zip(instrs, args)]
    mine = lax.psum_scatter(jnp.concatenate(rows, 1), lc.axis, scatter_dimension=0,
                            axis_index_groups=_axis_groups(instrs[0], lc), tiled=True)[0]
    out, start = [], 0
    for i, row in zip(instrs, rows):
        dim, shape = i.attrs["dim"], i.outputs[0].shape
        piece = mine[start:start + row.shape[1]].reshape((shape[dim],) + shape[:dim] + shape[dim + 1:])
        out.append([_moved(piece, 0, dim)])
        start += row.shape[1]
    return out


def _lower_all_to_all(instr, args, lc):
    # The barrier keeps XLA:CPU (jaxlib 0.10) from simplifying the operand's pieces apart:
    # a padded transpose's pieces became a transpose laid out otherwise and broadcasts,
    # which its verifier rejects (tests/test_fuzz.py has jax's own reproducer).
    a = instr.attrs
    return [lax.all_to_all(lax.optimization_barrier(args[0]), lc.axis, a["split_dim"], a["concat_dim"],
                           axis_index_groups=_axis_groups(instr, lc), tiled=True)]


def _lower_ragged_all_to_all(instr, args, lc):
    """jax's ragged_all_to_all over the whole shard_map axis, each device's slices
    addressed to its group's members (the others get none). XLA:CPU has no such
    collective: there every slice travels padded to the operand's rows in one
    all_to_all and is written where its sizes say."""
    operand, output, *ragged = args
    if 0 in operand.shape:
        return [output]
    over_axis = [_to_every_position(instr, v, lc) for v in ragged]
    return [lax.platform_dependent(operand, output, *over_axis, cpu=functools.partial(_ragged_by_all_to_all, lc.axis),
                                   default=functools.partial(lax.ragged_all_to_all, axis_name=lc.axis))]


def _to_every_position(instr: Instr, vector, lc):
    """A vector of slices per group member as one per position of the axis."""
    groups = lc.positions(instr.attrs["groups"])
    n, (count, k) = lc.axis_size(), groups.shape
    if count == 1 and np.array_equal(groups[0], np.arange(n)):
        return vector
    per_member = vector.shape[0] // k
    row = np.empty((n, k), np.int64)
    row[groups.ravel()] = np.repeat(groups, k, axis=0)
    members = jnp.asarray(row)[lc.axis_index()]
    at = (members[:, None] * per_member + jnp.arange(per_member)).ravel()
    return jnp.zeros(n * per_member, vector.dtype).at[at].set(vector)


def _ragged_by_all_to_all(axis, operand, output, input_offsets, send_sizes, output_offsets, recv_sizes):
    rows = operand.shape[0]
    within = jnp.arange(rows)
    picked = jnp.take(operand, input_offsets[:, None] + within, axis=0, mode="clip")
    sent = jnp.where((within < send_sizes[:, None]).reshape(picked.shape[:2] + (1,) * (operand.ndim - 1)),
                     picked, jnp.zeros((), operand.dtype))
    received = lax.all_to_all(sent, axis, 0, 0, tiled=True)
    at = lax.all_to_all(output_offsets, axis, 0, 0, tiled=True)[:, None] + within
    at = jnp.where(within < recv_sizes[:, None], at, output.shape[0])     # past the end: dropped
    return output.at[at.ravel()].set(received.reshape((-1,) + operand.shape[1:]), mode="drop")


def _permute_rounds(pairs) -> list[list[tuple[int, int]]]:
    """Pairs in rounds with one pair per source each (ppermute needs unique sources)."""
    rounds: list[list] = []
    sources: list[set] = []     # each round's, to look up (reports ask this of 2048-device programs)
    for src, dst in pairs:
        free = next((k for k, senders in enumerate(sources) if src not in senders), None)
        if free is None:
            free = len(rounds)
            rounds.append([])
            sources.append(set())
        rounds[free].append((src, dst))
        sources[free].add(src)
    return rounds


def _lowered_collective_permute(instr: Instr, num_devices: int) -> list[tuple[Pattern, int]]:
    """One collective-permute per round."""
    if 0 in instr.operands[0].shape:
        return []
    pairs = [tuple(p) for p in np.asarray(instr.attrs["pairs"]).reshape(-1, 2).tolist()]
    return [(Pattern.PERMUTE, instr.outputs[0].nbytes)] * len(_permute_rounds(pairs))


def _lower_collective_permute(instr, args, lc):
    """ppermute needs unique sources: a source sending to several devices goes in rounds.
    Devices nobody sends to get zeros (HLO semantics, as ppermute does)."""
    pairs = [tuple(int(d) for d in p) for p in lc.positions(np.asarray(instr.attrs["pairs"]).reshape(-1, 2))]
    rounds = _permute_rounds(pairs)
    out = lax.ppermute(args[0], lc.axis, rounds[0]) if rounds else jnp.zeros_like(args[0])
    for r in rounds[1:]:
        received = np.zeros(lc.axis_size(), bool)
        received[[d for _, d in r]] = True
        out = jnp.where(jnp.asarray(received)[lc.axis_index()], lax.ppermute(args[0], lc.axis, r), out)
    return [out]


def _empty_safe(lower):
    """An empty operand gives an empty result (XLA rejects collectives over empty dims,
    which shards of tiny intermediates, as in associative scans, can have)."""
    def safe(instr, args, lc):
        if 0 in args[0].shape:
            return [jnp.zeros(o.shape, o.dtype) for o in instr.outputs]
        return lower(instr, args, lc)
    return safe


def _along_dim(instr) -> KernelOrders:
    """XLA gathers and scatters along the outermost dim: it lays the collective's dim
    out first in the operand and the result."""
    order = major_first(instr.outputs[0].rank, instr.attrs["dim"])
    return KernelOrders(((order,),), order)


def _gather_apart(ctx, instr) -> Value:
    """The all-gather again as a gather over a new leading dim, moved into place: a
    different collective, so that no common-subexpression elimination (XLA's looks through
    optimization barriers) merges the two, and no costlier (XLA lays a gathered inner dim
    out first and copies it into place either way)."""
    x, dim, groups = instr.operands[0], instr.attrs["dim"], instr.attrs["groups"]
    lead = ctx.b.add1("reshape", [x], (1, *x.shape), x.dtype)
    gathered = ctx.all_gather(lead, 0, groups, instr.why, "again, for a later user")
    moved = ctx.b.add1("transpose", [gathered], (*x.shape[:dim], gathered.shape[0], *x.shape[dim:]), x.dtype,
                       permutation=(*range(1, dim + 1), 0, *range(dim + 1, x.rank + 1)))
    return ctx.b.add1("reshape", [moved], instr.output.shape, x.dtype)


def _ragged_payload(instr) -> int:
    """The rows a device sends or receives, at most: what it holds to send, or the buffer
    it receives into, the smaller (MaxText sizes its receive buffer for the worst routing,
    up to the group's size times its tokens; the rows sent back are the tokens it holds)."""
    operand, output = instr.operands[:2]
    return min(operand.nbytes, output.nbytes)


def _all_to_all_pieces(instr) -> int:
    """XLA sends an all-to-all's input as one sliced copy per destination."""
    return instr.operands[0].nbytes


def _uniform_within_groups(instr, groups, uniform) -> bool:
    """All-reduce and all-gather results are the same on every device of their groups."""
    return groups_within(groups, np.asarray(instr.attrs["groups"]))


def _varying(instr, groups, uniform) -> bool:
    """Each device receives its own part."""
    return False


register("partition-id",
         frontend=Frontend(converts={"axis_index": _convert_axis_index}),
         semantics=Semantics(evaluate=_evaluate_partition_id, lower=_lower_partition_id),
         timing=Timing(compute=ComputeKind.FREE),
         facets=Facets(uniform=lambda instr, groups, uniform: groups.shape[1] == 1))
register("all-reduce",
         frontend=Frontend(converts={"psum": _convert_psum(ADD), "psum_invariant": _convert_psum(ADD),
                                 "pmax": _convert_psum(MAX), "pmin": _convert_psum(MIN)}),
         semantics=Semantics(evaluate_all=_evaluate_all_reduce, lower=_empty_safe(_lower_all_reduce),
                             lowered_collectives=_lowered_as(lambda instr: _reduced_as(instr, instr.operands[0]))),
         rule=Rule(factors=elementwise_factors),
         timing=Timing(collective=Pattern.ALL_REDUCE),
         memory=Memory(combined_as=lambda instr: (repr(instr.attrs.get("groups")), instr.attrs.get("reducer"))),
         facets=Facets(uniform=_uniform_within_groups))
register("all-gather",
         frontend=Frontend(converts={"all_gather": _convert_all_gather, "all_gather_invariant": _convert_all_gather}),
         semantics=Semantics(evaluate_all=_evaluate_all_gather, lower=_empty_safe(_lower_all_gather),
                             lowered_collectives=_lowered_as(_as_itself)),
         rule=Rule(factors=_whole_along("dim")),
         timing=Timing(collective=Pattern.ALL_GATHER),
         kernel=Kernel(orders=_along_dim),
         rewrites=Rewrites(repeat=_gather_apart),
         facets=Facets(uniform=_uniform_within_groups))
register("reduce-scatter",
         frontend=Frontend(converts={"reduce_scatter": _convert_reduce_scatter}),
         semantics=Semantics(evaluate_all=_evaluate_reduce_scatter, lower=_empty_safe(_lower_reduce_scatter),
                             lower_together=(_scatter_key, _lower_reduce_scatters),
                             lowered_collectives=_lowered_as(_scattered_as)),
         rule=Rule(factors=_whole_along("dim")),
         timing=Timing(collective=Pattern.REDUCE_SCATTER),
         kernel=Kernel(orders=_along_dim),
         facets=Facets(uniform=_varying))
register("all-to-all",
         frontend=Frontend(converts={"all_to_all": _convert_all_to_all}),
         semantics=Semantics(evaluate_all=_evaluate_all_to_all, lower=_empty_safe(_lower_all_to_all),
                             lowered_collectives=_lowered_as(_as_itself)),
         rule=Rule(factors=_whole_along("split_dim", "concat_dim")),
         timing=Timing(collective=Pattern.ALL_TO_ALL),
         memory=Memory(scratch=_all_to_all_pieces),
         facets=Facets(uniform=_varying))
register("ragged-all-to-all",
         frontend=Frontend(converts={"ragged_all_to_all": _convert_ragged_all_to_all}),
         semantics=Semantics(evaluate_all=_evaluate_ragged_all_to_all, lower=_lower_ragged_all_to_all),
         rule=Rule(factors=_ragged_factors),
         timing=Timing(collective=Pattern.ALL_TO_ALL, payload=_ragged_payload),
         memory=Memory(scratch=_all_to_all_pieces),
         facets=Facets(uniform=_varying))
register("collective-permute",
         frontend=Frontend(converts={"ppermute": _convert_ppermute, "pbroadcast": _convert_pbroadcast}),
         semantics=Semantics(evaluate_all=_evaluate_collective_permute, lower=_empty_safe(_lower_collective_permute),
                             lowered_collectives=_lowered_collective_permute),
         rule=Rule(factors=elementwise_factors),
         timing=Timing(collective=Pattern.PERMUTE),
         facets=Facets(uniform=_varying))
