"""Control flow: `while` with cond and body sub-programs over one carried tuple
(JAX's while_loop, fori_loop and scan all become it; scan as XLA lowers it: a counter,
dynamic-slices of the scanned inputs, dynamic-update-slices of the stacked outputs; a
scan unrolled whole, `unroll=True`, as jax lowers it: its body once per step), and
`conditional` (JAX's cond and switch): an int32 index picks one of several branch
sub-programs, each taking the operands after the index and giving the same result types.

Every carried value of a loop is tied across five places: the loop operand, the loop
result, the body's parameter and result, and the cond's parameter. A conditional ties
each operand to every branch's parameter and each result to every branch's result.
Propagation drives all places of a value to one layout, and the partitioner partitions
each sub-program to exactly those layouts (the carry keeps its layout on every
iteration; every branch leaves its results as the conditional's), so choosing a branch
or running another iteration moves no data.

The index is a scalar and so always whole on every device; one computed from split data
(`x.sum() > 0`) was made whole by its reduction's all-reduce, so all devices agree.
"""
from __future__ import annotations

from functools import lru_cache, partial
from typing import Callable, Optional

import numpy as np
from jax import lax
from jax import numpy as jnp

from gspmd.errors import ShardingError
from gspmd.ir import Instr, Program, Value
from gspmd.ir.dce import eliminate_dead_code
from gspmd.ir.emit import concatenate, reshape, slice_dim
from gspmd.ir.reducer import OR
from gspmd.ops.convert import Conversion, physical_aval
from gspmd.ops.loop_motion import (as_partial, defer_branch_reductions, defer_reductions, finish_reductions,
                                  params_read)
from gspmd.ops.registry import (ELEMENTWISE, Frontend, Memory, Rewrites, Rule, Semantics, Storage, Timing,
                                lookup, prune, register)
from gspmd.spmd import factors as fx
from gspmd.spmd import reshard as rs
from gspmd.spmd.partitioned import PartitionedValue

# places(instr, target) -> indices into tensors(instr) that hold the same value as target
Places = Callable[[Instr, int], list[int]]


def _same_layout(places: Places) -> Callable:
    """Propagation for tied values: each place takes the layouts its other places have."""
    def propagate(instr: Instr, shardings, target: int) -> list:
        return [shardings[i] for i in places(instr, target) if shardings[i] is not None]
    return propagate


def tied_values(instr: Instr) -> list[Value]:
    """The loop's values beyond its operands and results: body params, body results, cond params."""
    body, cond = instr.attrs["body"], instr.attrs["cond"]
    return body.params + body.outputs + cond.params


def _tied_places(instr: Instr, target: int) -> list[int]:
    """Carried value i appears in five places (operand, result, body parameter, body
    result, cond parameter): the indices of target's four others."""
    n = len(instr.operands)
    return [place * n + target % n for place in range(5) if place * n + target % n != target]


def _evaluate_while(instr: Instr, per_device: list[list[np.ndarray]], run) -> list[list[np.ndarray]]:
    body, cond = instr.attrs["body"], instr.attrs["cond"]
    carry = per_device
    while True:
        decisions = {bool(out[0]) for out in run(cond, carry)}
        if len(decisions) > 1:
            raise ShardingError("Internal error: devices disagree on a while loop's condition; "
                                "please report this program.")
        if not decisions.pop():
            return carry
        carry = run(body, carry)


def _partition_while(ctx, instr: Instr, operands: list[PartitionedValue], targets) -> list[PartitionedValue]:
    """The carry keeps the loop results' layouts on every iteration; sums of all-reduced
    values that only the code after the loop reads are reduced once, after it."""
    body, cond = instr.attrs["body"], instr.attrs["cond"]
    carry = [rs.reshard(ctx, o, t) for o, t in zip(operands, targets)]
    local_body = ctx.partition_subprogram(body, targets, targets)
    local_cond = ctx.partition_subprogram(cond, targets, [cond.outputs[0].sharding])
    init, deferred = defer_reductions(ctx, local_body, local_cond, [c.local for c in carry])
    if deferred:    # an update of zeros whose all-reduce went can fold into its accumulator now
        ctx.tidy(local_body)
    outs = ctx.b.add("while", init, [(p.shape, p.dtype) for p in local_body.params],
                     body=local_body, cond=local_cond, trip_count=instr.attrs.get("trip_count"))
    outs = finish_reductions(ctx, outs, deferred)
    return [PartitionedValue(v, t, o.shape) for v, t, o in zip(outs, targets, instr.outputs)]


# -- conversion -------------------------------------------------------------------------
INDEX = np.int32
# build(conversion of the sub-program, its parameters) -> its results
Build = Callable[[Conversion, list[Value]], list[Value]]


def emit_while(b: Conversion, carry: list[Value], cond: Build, body: Build,
               trip_count: Optional[int] = None) -> list[Value]:
    """trip_count: how often the body runs, where known statically (for reports)."""
    return b.add("while", carry, [(v.shape, v.dtype) for v in carry], cond=b.subprogram("cond", carry, cond),
                 body=b.subprogram("body", carry, body), trip_count=trip_count)


def _convert_while(b: Conversion, eqn, args: list[Value]) -> list[Value]:
    """A while loop. Its condition may be batched (vmap of a while loop, as JAX's own
    lowerings make: a bool per leading element of every carry), which means, as JAX
    lowers it: loop while any holds, and step only the elements whose condition holds."""
    p = eqn.params
    nc, nb = p["cond_nconsts"], p["body_nconsts"]
    fixed = nc + nb
    batched = bool(p["cond_jaxpr"].out_avals[0].shape)

    def holds(sb, params) -> Value:
        return sb.inline(p["cond_jaxpr"], sb.invariants(args[:nc], params[:nc]) + params[fixed:])[0]

    def cond(sb, params):
        pred = holds(sb, params)
        if batched:
            pred = sb.add1("reduce", [pred], (), np.bool_, dims=tuple(range(pred.rank)), reducer=OR)
        return [pred]

    def body(sb, params):
        carry = params[fixed:]
        stepped = sb.inline(p["body_jaxpr"], sb.invariants(args[nc:fixed], params[nc:fixed]) + carry)
        if batched:
            pred = holds(sb, params)
            stepped = [sb.add1("select", [sb.add1("broadcast", [pred], x.shape, np.bool_, dims=tuple(range(pred.rank))),
                                          new, x], x.shape, x.dtype) for new, x in zip(stepped, carry)]
        return params[:fixed] + stepped

    return emit_while(b, args, cond, body)[fixed:]


def scan_counts(params: dict) -> tuple[int, int]:
    """How many of a scan's operands are constants and how many carries: jax <= 0.11
    states the counts; jax >= 0.12 packs the operands' trees (constants, carries, xs) in
    `ft_in` (its `ft_out` also lists ys forwarded from xs, which are not results of the
    equation: only the body's outputs are)."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carries, _ = params["ft_in"].unpack()
    return len(consts), len(carries)


def _convert_scan(b: Conversion, eqn, args: list[Value]) -> list[Value]:
    p = eqn.params
    (nconst, ncarry), length, jaxpr = scan_counts(p), p["length"], p["jaxpr"]
    nx = len(args) - nconst - ncarry
    # XLA's while-loop simplifier inlines a loop that runs once, jax's lowering unrolls a
    # scan with unroll=True (penzai's LayerStack): so do we.
    if 0 < length <= p.get("unroll", 1):     # (unroll >= 1: a scan of one step is always here)
        return _unrolled_scan(b, args, nconst, ncarry, length, p["reverse"], jaxpr)
    y_types = [physical_aval(v.aval) for v in jaxpr.jaxpr.outvars[ncarry:]]
    ys = [b.broadcast_to(b.constant(0, dtype), (length, *shape)) for shape, dtype in y_types]
    if length == 0:   # and one that never runs it removes (its body's slices could not fit)
        return args[nconst:nconst + ncarry] + ys
    carry = [b.constant(0, INDEX)] + args + ys

    def cond(sb, params):
        return [sb.add1("compare", [params[0], sb.constant(length, INDEX)], (), np.bool_, direction="LT")]

    def body(sb, params):
        i, consts = params[0], sb.invariants(args[:nconst], params[1:1 + nconst])
        c = params[1 + nconst:1 + nconst + ncarry]
        xs = params[1 + nconst + ncarry:1 + nconst + ncarry + nx]
        bufs = params[1 + nconst + ncarry + nx:]
        index = sb.add1("subtract", [sb.constant(length - 1, INDEX), i], (), INDEX) if p["reverse"] else i
        zero = sb.constant(0, INDEX)

        def starts(rank):   # the scanned dim at `index`, the others whole
            return [index] + [zero] * (rank - 1)

        x_t = [sb.add1("reshape", [sb.add1("dynamic-slice", [x, *starts(x.rank)], (1, *x.shape[1:]), x.dtype)],
                       x.shape[1:], x.dtype) for x in xs]
        outs = sb.inline(jaxpr, consts + c + x_t)
        new_bufs = [sb.add1("dynamic-update-slice",
                            [buf, sb.add1("reshape", [y], (1, *y.shape), y.dtype), *starts(buf.rank)],
                            buf.shape, buf.dtype) for buf, y in zip(bufs, outs[ncarry:])]
        step = sb.add1("add", [i, sb.constant(1, INDEX)], (), INDEX)
        return [step, *consts, *outs[:ncarry], *xs, *new_bufs]

    outs = emit_while(b, carry, cond, body, trip_count=length)
    return outs[1 + nconst:1 + nconst + ncarry] + outs[len(outs) - len(ys):]


def _unrolled_scan(b: Conversion, args: list[Value], nconst: int, ncarry: int, length: int, reverse: bool,
                   jaxpr) -> list[Value]:
    """The body inlined once per step on static slices of the scanned inputs, its
    per-step outputs stacked: the program jax.jit compiles for a scan it unrolls whole
    (penzai's LayerStack scans so), with no loop of dynamic slices for XLA to compile.
    Each step is completed and partitioned on its own, as jax.jit's partitioner does."""
    consts, carry, xs = args[:nconst], args[nconst:nconst + ncarry], args[nconst + ncarry:]
    ys_at: dict[int, list[Value]] = {}
    for t in (reversed(range(length)) if reverse else range(length)):
        x_t = [reshape(b, slice_dim(b, x, 0, t, t + 1), x.shape[1:]) for x in xs]
        outs = b.inline(jaxpr, consts + carry + x_t)
        carry, ys_at[t] = outs[:ncarry], [reshape(b, y, (1, *y.shape)) for y in outs[ncarry:]]
    return carry + [concatenate(b, [ys_at[t][k] for t in range(length)], 0) for k in range(len(jaxpr.out_avals) - ncarry)]


def _lower_while(instr, args, lc):
    body, cond = instr.attrs["body"], instr.attrs["cond"]
    return list(lax.while_loop(lambda carry: lc.run(cond, carry)[0], lambda carry: tuple(lc.run(body, carry)),
                               tuple(args)))


def _while_runs(instr: Instr) -> list[tuple[Program, int]]:
    trips = instr.attrs.get("trip_count") or 1
    return [(instr.attrs["cond"], trips), (instr.attrs["body"], trips)]


# Trips whose branch indices timing computes one by one (NumPy on scalars): beyond, every
# branch counts once, as for any conditional.
_MAX_COUNTED_TRIPS = 1 << 14


@lru_cache(maxsize=64)     # timing asks again for each estimate of the loop
def _branch_shares(instr: Instr) -> dict[Instr, list[float]]:
    """The body's conditionals whose branch only the loop's counters decide (a pipeline
    takes its loss in the steps that finish a microbatch): the share of the trips that
    runs each branch, from the index computed for every trip."""
    body, trips = instr.attrs["body"], instr.attrs.get("trip_count")
    counters = _counters(instr)
    shares = {}
    for c in body.instrs if trips and trips <= _MAX_COUNTED_TRIPS and counters else ():
        cone = _computed_from(c.operands[0], {p for p, _, _ in counters}) if c.opcode == "conditional" else None
        if cone is None:
            continue
        n, taken = len(c.attrs["branches"]), []
        for t in range(trips):
            known = {param: np.asarray(start + step * t, param.dtype) for param, start, step in counters}
            for i in cone:
                known[i.output] = lookup(i.opcode).semantics.evaluate(i, [known[o] for o in i.operands], 0)[0]
            index = int(known[c.operands[0]])
            taken.append(index if 0 <= index < n else n - 1)     # as HLO: out of range, the last
        shares[c] = [taken.count(k) / trips for k in range(n)]
    return shares


def _computed_from(v: Value, counters: set) -> Optional[list[Instr]]:
    """The instructions, in order, that compute scalar `v` from the counters and
    constants alone (None where anything else decides it, such as a device id)."""
    cone: dict[Instr, None] = {}

    def visit(v: Value) -> bool:
        p = v.producer
        if v in counters or p in cone:
            return True
        if (p is None or v.shape != () or len(p.outputs) != 1 or lookup(p.opcode).semantics.evaluate is None
                or not (p.operands or lookup(p.opcode).memory.storage is Storage.LITERAL)
                or not all(visit(o) for o in p.operands)):
            return False
        cone[p] = None
        return True
    return list(cone) if visit(v) else None


def _counters(instr: Instr) -> list[tuple[Value, int, int]]:
    """(body parameter, first value, step) of each integer carry that starts as a
    constant and adds a constant each trip (a scan's index, a fori_loop's)."""
    body, found = instr.attrs["body"], []
    for param, out, init in zip(body.params, body.outputs, instr.operands):
        p = out.producer
        if (p is None or p.opcode != "add" or param not in p.operands or param.shape != ()
                or not np.issubdtype(param.dtype, np.integer)):
            continue
        step = p.operands[1] if p.operands[0] is param else p.operands[0]
        if _is_constant(step) and _is_constant(init):
            found.append((param, int(init.producer.attrs["value"]), int(step.producer.attrs["value"])))
    return found


def _is_constant(v: Value) -> bool:
    return v.producer is not None and v.producer.opcode == "constant" and v.shape == ()


def _needed_carries(instr: Instr, used: list[bool]) -> list[int]:
    """Carried values a used result or the condition depends on, through the body."""
    body, cond = instr.attrs["body"], instr.attrs["cond"]
    needed = {i for i, u in enumerate(used) if u} | params_read(cond, cond.outputs)
    while True:
        more = params_read(body, [body.outputs[i] for i in needed]) - needed
        if not more:
            return sorted(needed)
        needed |= more


def _prune_while(instr: Instr, used: list[bool]) -> None:
    """Drop carried values that neither a used result nor the condition needs (JAX's
    scan transposes carry zeros nobody reads), as XLA's while-loop simplifier does."""
    keep = _needed_carries(instr, used)
    if len(keep) == len(instr.outputs):
        return
    body, cond = instr.attrs["body"], instr.attrs["cond"]
    instr.operands = [instr.operands[i] for i in keep]
    instr.outputs = [instr.outputs[i] for i in keep]
    body.params, body.outputs = [body.params[i] for i in keep], [body.outputs[i] for i in keep]
    cond.params = [cond.params[i] for i in keep]
    eliminate_dead_code(body, prune)


def _carry_factors(instr: Instr) -> list[fx.Factor]:
    """Each carried value's dims, from operand to result (they keep one layout through
    the loop, which propagation ties through the body; gspmd.auto prices the loop by these)."""
    n = len(instr.operands)
    return [fx.Factor(size, tuple(d if t in (i, n + i) else None for t in range(2 * n)))
            for i, v in enumerate(instr.operands) for d, size in enumerate(v.shape)]


register("while",
         frontend=Frontend(converts={"while": _convert_while, "scan": _convert_scan}),
         semantics=Semantics(evaluate_programs=_evaluate_while, lower=_lower_while),
         rule=Rule(factors=_carry_factors, propagate=_same_layout(_tied_places), tied=tied_values, informants=_tied_places,
                   partition=_partition_while, priority=ELEMENTWISE),
         timing=Timing(runs=_while_runs, branch_shares=_branch_shares),
         memory=Memory(storage=Storage.CARRIED),
         rewrites=Rewrites(prune=_prune_while))


# -- conditional: operands (index, *args), attrs branches (a tuple of programs over args) --
def _branch_values(instr: Instr) -> list[Value]:
    """The conditional's values beyond its operands and results: each branch's
    parameters, then its results."""
    return [v for branch in instr.attrs["branches"] for v in branch.params + branch.outputs]


def _branch_places(instr: Instr, target: int) -> list[int]:
    """Operand 1 + i is branch k's parameter i, result j is branch k's result j: the
    indices of target's other places (none for the index)."""
    n_args, n_out = len(instr.operands) - 1, len(instr.outputs)
    per_branch = n_args + n_out
    # Position within one branch's (parameters, results), or None for the index.
    slot = None if target == 0 else target - 1 if target <= per_branch else (target - 1 - per_branch) % per_branch
    if slot is None:
        return []
    places = [1 + slot] + [1 + per_branch * (k + 1) + slot for k in range(len(instr.attrs["branches"]))]
    return [p for p in places if p != target]


def branch_taken(index: int, count: int) -> int:
    """HLO's rule: an index outside [0, count) runs the last branch."""
    return index if 0 <= index < count else count - 1


def _evaluate_conditional(instr: Instr, per_device: list[list[np.ndarray]], run) -> list[list[np.ndarray]]:
    branches = instr.attrs["branches"]
    taken = {branch_taken(int(args[0]), len(branches)) for args in per_device}
    if len(taken) > 1:
        raise ShardingError("Internal error: devices disagree on a conditional's branch; please report this "
                            "program.")
    return run(branches[taken.pop()], [args[1:] for args in per_device])


def _partition_conditional(ctx, instr: Instr, operands: list[PartitionedValue], targets) -> list[PartitionedValue]:
    """Each branch gets the operands as they are laid out and leaves its results laid
    out as the targets; the scalar index is whole on every device."""
    index, args = operands[0], operands[1:]
    layouts = [a.sharding for a in args]
    branches = tuple(ctx.partition_subprogram(branch, layouts, targets) for branch in instr.attrs["branches"])
    deferred, accumulators = defer_branch_reductions(ctx, branches)
    for branch in branches if deferred else ():   # updates of zeros that may fold now, as in a loop
        ctx.tidy(branch)
    locals_ = [as_partial(ctx, a.local, accumulators[j]) if j in accumulators else a.local for j, a in enumerate(args)]
    outs = ctx.b.add("conditional", [index.local, *locals_],
                     [(t.shard_shape(o.shape), o.dtype) for t, o in zip(targets, instr.outputs)], branches=branches)
    outs = finish_reductions(ctx, outs, deferred, past="the conditional")
    return [PartitionedValue(v, t, o.shape) for v, t, o in zip(outs, targets, instr.outputs)]


def _convert_cond(b: Conversion, eqn, args: list[Value]) -> list[Value]:
    """JAX's cond (lax.cond, lax.switch): the index, then the branches' operands."""
    operands = args[1:]
    branches = tuple(b.subprogram(f"branch{k}", operands, partial(_inline_branch, jaxpr, operands), hint="arg")
                     for k, jaxpr in enumerate(eqn.params["branches"]))
    return b.add("conditional", args, [b.out_aval(eqn, i) for i in range(len(eqn.outvars))], branches=branches)


def _inline_branch(jaxpr, operands: list[Value], sb: Conversion, params: list[Value]) -> list[Value]:
    return sb.inline(jaxpr, sb.invariants(operands, params))


def _lower_conditional(instr, args, lc):
    branches = instr.attrs["branches"]
    index, last = args[0], len(branches) - 1
    # lax.switch clamps, HLO runs the last branch for any index out of range.
    index = jnp.where((index < 0) | (index > last), last, index)
    return list(lax.switch(index, [partial(_run_branch, lc, branch) for branch in branches], *args[1:]))


def _run_branch(lc, branch: Program, *args) -> tuple:
    return tuple(lc.run(branch, args))


def _prune_conditional(instr: Instr, used: list[bool]) -> None:
    """Drop the results no one reads, then the operands no branch reads. Under grad,
    JAX's cond passes the backward pass residuals it may never read (zeros made in a
    branch); left in, such a buffer would be whole on every device, since no user
    gives it a layout."""
    branches = instr.attrs["branches"]
    kept = [i for i, u in enumerate(used) if u]
    instr.outputs = [instr.outputs[i] for i in kept]
    read = set()
    for branch in branches:
        branch.outputs = [branch.outputs[i] for i in kept]
        eliminate_dead_code(branch, prune)
        read |= {p for p in branch.params if p in branch.outputs} | {v for i in branch.instrs for v in i.operands}
    needed = [i for i in range(len(instr.operands) - 1) if any(b.params[i] in read for b in branches)]
    instr.operands = instr.operands[:1] + [instr.operands[1 + i] for i in needed]
    for branch in branches:
        branch.params = [branch.params[i] for i in needed]


register("conditional",
         frontend=Frontend(converts={"cond": _convert_cond}),
         semantics=Semantics(evaluate_programs=_evaluate_conditional, lower=_lower_conditional),
         rule=Rule(propagate=_same_layout(_branch_places), tied=_branch_values, informants=_branch_places,
                   partition=_partition_conditional, priority=ELEMENTWISE),
         timing=Timing(runs=lambda instr: [(branch, 1) for branch in instr.attrs["branches"]]),
         rewrites=Rewrites(prune=_prune_conditional))
