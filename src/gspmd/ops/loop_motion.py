"""Loop-invariant collective motion: a loop that accumulates all-reduced values
(acc = acc + all_reduce(x), as the gradient of a scan over data-parallel layers does)
carries the unreduced partial sums instead and all-reduces once, after the loop.

A carried value qualifies when
- it is only read after the loop: inside the body its parameter feeds nothing but the
  expression that becomes its next value, and the loop condition does not read it;
- that expression is built from the parameter, results of add-all-reduces over one set
  of device groups G, and zeros, by ops linear in those (their records' `linear`),
  every other operand being the same on all devices of a group ("uniform").
Then summing over G commutes with the whole expression, so each device can add its own
part and the sum happens once. The initial value enters as a partial sum too: whole
on the first device of each group, zero on the others; or, when an all-reduce over
the same groups made it (an earlier loop's deferred sum), what that all-reduce reduced.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from gspmd.ir import Builder, Instr, Program, Value
from gspmd.ir.dce import eliminate_dead_code
from gspmd.ir.reducer import ADD
from gspmd.ops.registry import is_zero, lookup
from gspmd.spmd.context import DeviceContext, Why


@dataclass(frozen=True)
class Deferred:
    """Carry `index` leaves the loop as partial sums over `groups` (real devices)."""
    index: int
    groups: np.ndarray


def defer_reductions(ctx: DeviceContext, body: Program, cond: Program, init: list[Value]) -> tuple[list[Value], list[Deferred]]:
    """Rewrite the partitioned loop `body` so that qualifying carries hold partial sums;
    returns the loop's initial values (as partial sums where deferred) and what to
    all-reduce after the loop (`finish_reductions`)."""
    deferred: list[Deferred] = []
    uniform = Uniformity(body, ctx.virtual)
    for i, (param, out) in enumerate(zip(body.params, body.outputs)):
        if _reads(cond, cond.params[i]):
            continue
        for groups in _reduction_groups(body, out):
            expr = _partial_expression(body, param, out, groups, uniform)
            if expr is not None and _only_feeds(body, param, i, expr, groups):
                _rewrite(body, param, i, expr, groups)
                uniform.exclude(param)
                init = init[:i] + [as_partial(ctx, init[i], groups)] + init[i + 1:]
                deferred.append(Deferred(i, groups))
                break
    if deferred:
        eliminate_dead_code(body)
    return init, deferred


def finish_reductions(ctx: DeviceContext, results: list[Value], deferred: list[Deferred],
                      past: str = "the loop") -> list[Value]:
    results = list(results)
    for d in deferred:
        results[d.index] = ctx.all_reduce(results[d.index], ctx.virtual_groups(d.groups), ADD, Why.PARTIAL_RESULTS,
                                          f"all-reduce deferred past {past}")
    return results


def defer_branch_reductions(ctx: DeviceContext,
                            branches: tuple[Program, ...]) -> tuple[list[Deferred], dict[int, np.ndarray]]:
    """Results that every branch of a conditional makes from add-all-reduces over the
    same groups (through linear ops, as a gradient's cast), or as zeros: each branch
    returns them as partial sums instead and the sum runs once, after the conditional
    (finish_reductions), where a loop around it can defer it further (a pipeline takes
    its loss and the loss's gradient only in the steps that finish a microbatch, and sums
    that gradient over data-parallel devices once, after its loop).

    A result may also add its partial sums to one of the conditional's arguments, which
    a branch returns as it is where it adds nothing (an accumulator, as a loop's carry):
    that argument must then enter as partial sums, and the second value returned maps
    its index among the branches' parameters to the groups (for `as_partial`; a loop
    around the conditional that defers the same sum enters its own partial sums there)."""
    deferred, accumulators = [], {}
    uniform = [Uniformity(b, ctx.virtual) for b in branches]
    for k in range(len(branches[0].outputs)):
        made = [(b, u) for b, u in zip(branches, uniform) if not is_zero(b.outputs[k])]
        summing = [(b, u) for b, u in made if b.outputs[k] not in b.params]
        groups = [_reduction_groups(b, b.outputs[k]) for b, _ in summing]
        if not summing or any(len(g) != 1 for g in groups) or len({_groups_key(g[0]) for g in groups}) != 1:
            continue
        for j in _accumulator_candidates(made, k, accumulators):
            found = _branch_expressions(made, k, j, groups[0][0])
            if found is not None:
                for (b, _), e in zip(made, found):
                    if e is not None:
                        _rewrite(b, None if j is None else b.params[j], k, e, groups[0][0])
                deferred.append(Deferred(k, groups[0][0]))
                if j is not None:
                    accumulators[j] = groups[0][0]
                    for b, u in zip(branches, uniform):
                        u.exclude(b.params[j])
                break
    if deferred:
        for b in branches:
            eliminate_dead_code(b)
    return deferred, accumulators


def _accumulator_candidates(made: list, k: int, taken: dict) -> list[Optional[int]]:
    """None (no accumulator), then the parameters result k of a branch is, or that feed it."""
    b = made[0][0]
    reached = params_read(b, [b.outputs[k]])
    return [None] + [j for j in sorted(reached) if j not in taken]


def params_read(program: Program, values: list[Value]) -> set[int]:
    """Indices of `program`'s parameters that `values` are computed from."""
    producer = {o: i for i in program.instrs for o in i.outputs}
    index = {p: i for i, p in enumerate(program.params)}
    found, stack, seen = set(), list(values), set()
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        if v in index:
            found.add(index[v])
        elif v in producer:
            stack.extend(producer[v].operands)
    return found


def _branch_expressions(made: list, k: int, j: Optional[int], groups: np.ndarray) -> Optional[list]:
    """Per branch that makes result k, its expression as partial sums (None where the
    branch returns parameter j as it is), or None when one does not qualify."""
    found = []
    for b, u in made:
        param = None if j is None else b.params[j]
        if param is not None and b.outputs[k] is param:
            if any(param in instr.operands for instr in b.instrs):   # it would read partial sums
                return None
            found.append(None)
            continue
        e = _partial_expression(b, param, b.outputs[k], groups, u if param is None else u.excluding(param))
        if e is None or (param is not None and not _only_feeds(b, param, k, e, groups)):
            return None
        found.append(e)
    if j is not None and any(b.outputs[i] is b.params[j] for b, _ in made for i in range(len(b.outputs)) if i != k):
        return None
    return found


# -- finding the expression ------------------------------------------------------------------
def _is_add_all_reduce(instr: Optional[Instr]) -> bool:
    return instr is not None and instr.opcode == "all-reduce" and instr.attrs["reducer"] is ADD


def _reduction_groups(body: Program, out: Value) -> list[np.ndarray]:
    """Distinct groups of the add-all-reduces `out` depends on within the body."""
    seen, found, todo = set(), {}, [out]
    while todo:
        v = todo.pop()
        if v in seen or v.producer is None:
            continue
        seen.add(v)
        if _is_add_all_reduce(v.producer):
            groups = np.asarray(v.producer.attrs["groups"])
            found.setdefault(_groups_key(groups), groups)
        elif lookup(v.producer.opcode).rewrites.linear is not None:
            todo.extend(v.producer.operands)
    return list(found.values())


def _groups_key(groups: np.ndarray) -> tuple:
    return tuple(sorted(tuple(sorted(int(d) for d in g)) for g in np.asarray(groups)))


@dataclass
class _Expression:
    """Instructions (in program order) whose results are partial sums over the groups;
    `leaves` maps each all-reduce result used to what it reduced."""
    instrs: list[Instr]
    leaves: dict[Value, Value]
    from_accumulator: set[Value]


def _partial_expression(body: Program, param: Value, out: Value, groups: np.ndarray,
                        uniform: "Uniformity") -> Optional[_Expression]:
    """The expression giving `out` as partial sums over `groups`, if there is one."""
    key = _groups_key(groups)
    partial: dict[Value, bool] = {param: True}    # value -> derived from the accumulator
    leaves: dict[Value, Value] = {}
    instrs: list[Instr] = []
    for instr in body.instrs:
        if _is_add_all_reduce(instr) and _groups_key(instr.attrs["groups"]) == key:
            leaves[instr.output] = instr.operands[0]
            partial[instr.output] = False
            continue
        linear = lookup(instr.opcode).rewrites.linear
        if linear is None or len(instr.outputs) != 1:
            continue
        summed = {k for k, o in enumerate(instr.operands) if o in partial}
        if not summed:
            continue
        for jointly in linear(instr):
            fill = set(jointly) - summed
            if summed <= set(jointly) and all(is_zero(instr.operands[k]) for k in fill) and all(
                    uniform(o, groups) for k, o in enumerate(instr.operands) if k not in jointly):
                partial[instr.output] = any(partial[instr.operands[k]] for k in summed)
                instrs.append(instr)
                break
    if out not in partial or not leaves:
        return None
    needed = _cone(out, partial)
    if not needed & set(leaves):
        return None
    return _Expression([i for i in instrs if i.output in needed], {v: x for v, x in leaves.items() if v in needed},
                       {v for v in needed if partial[v]} | {param})


def _cone(out: Value, partial: dict) -> set[Value]:
    """The partial values `out` is computed from (through partial operands only)."""
    needed, todo = set(), [out]
    while todo:
        v = todo.pop()
        if v in needed or v not in partial:
            continue
        needed.add(v)
        if v.producer is not None and not _is_add_all_reduce(v.producer):
            todo.extend(v.producer.operands)
    return needed


def _reads(program: Program, v: Value) -> bool:
    return any(v in instr.operands for instr in program.instrs) or v in program.outputs


def _only_feeds(body: Program, param: Value, index: int, expr: _Expression, groups: np.ndarray) -> bool:
    """The accumulator `param` and what is computed from it reach nothing but the
    expression, the body's result `index` and inner loops or conditionals that accumulate
    into it (_inner_inits)."""
    inside = set(expr.instrs) | set(_inner_inits(body, param, groups))
    for instr in body.instrs:
        if instr not in inside and any(o in expr.from_accumulator for o in instr.operands):
            return False
    return all(v not in expr.from_accumulator for k, v in enumerate(body.outputs) if k != index)


def _inner_inits(body: Program, param: Value, groups: np.ndarray) -> list[Instr]:
    """The initial values that `param` gives inner loops whose carry defers the same sum:
    param as partial sums (as_partial). Once param holds partial sums itself, each is
    param: the inner loop then adds its part in place, and the sum over the groups of
    what it returns is the same either way."""
    key = _groups_key(groups)
    return [instr for instr in body.instrs
            if "partial_sums_over" in instr.attrs and instr.operands[1] is param
            and _groups_key(instr.attrs["partial_sums_over"]) == key]


def _rewrite(body: Program, param: Optional[Value], index: int, expr: _Expression, groups: np.ndarray) -> None:
    """The loop's (or branch's) result `index` as partial sums; inner loops and
    conditionals start from the accumulator `param`'s partial sums."""
    entered = {instr.output: param for instr in _inner_inits(body, param, groups)} if param is not None else {}
    for instr in body.instrs:
        if any(o in entered for o in instr.operands):
            instr.operands = [entered.get(o, o) for o in instr.operands]
    _emit_partial(body, index, expr)


def _emit_partial(body: Program, index: int, expr: _Expression) -> None:
    """Append the expression again with each all-reduce replaced by what it reduced,
    as the program's result `index`."""
    b = Builder(body)
    clone: dict[Value, Value] = dict(expr.leaves)
    for instr in expr.instrs:
        b.origin, b.recomputed = instr.origin, instr.recomputed
        operands = [clone.get(o, o) for o in instr.operands]
        clone[instr.output] = b.add1(instr.opcode, operands, instr.output.shape, instr.output.dtype, **instr.attrs)
    out = body.outputs[index]
    body.outputs[index] = clone.get(out, out)


def as_partial(ctx: DeviceContext, init: Value, groups: np.ndarray) -> Value:
    """init as partial sums over groups: whole on each group's first device, else zero.
    An init that an add-all-reduce over the same groups made (the previous loop's
    deferred sum, as when a pipeline's phases accumulate one gradient) is entered as
    what it reduced: its sum over the groups is init, and the two loops reduce once."""
    if is_zero(init):
        return init
    if _is_add_all_reduce(init.producer) and _groups_key(init.producer.attrs["groups"]) == _groups_key(groups):
        return init.producer.operands[0]
    first = np.zeros(ctx.num_devices, np.int32)
    first[ctx.virtual_groups(groups)[:, 0]] = 1
    is_first = ctx.b.add1("compare", [ctx.table_lookup(first), ctx.constant(1, np.int32)], (), np.bool_,
                          direction="EQ")
    zero = ctx.b.add1("broadcast", [ctx.constant(0, init.dtype)], init.shape, init.dtype, dims=())
    pred = ctx.b.add1("broadcast", [is_first], init.shape, np.bool_, dims=())
    # (marked: a loop around this one that defers the same sum enters its own partial sums)
    return ctx.b.add1("select", [pred, init, zero], init.shape, init.dtype, partial_sums_over=np.asarray(groups))


# -- uniformity ------------------------------------------------------------------------------
class Uniformity:
    """Whether a body value is the same on every device of each group: constants, loop
    counters and other carries whose layout gives a group's devices the same tile,
    partition-id table lookups whose table agrees within groups, collectives over
    groups that contain them, and what is computed from such values alone (operands
    for which `follows` holds; others count as varying: the jax backend's epilogue
    follows scalars only, not a whole program's worth of tensors)."""

    def __init__(self, body: Program, virtual: np.ndarray, follows: Callable[[Value], bool] = lambda v: True):
        self.body = body
        self.virtual = virtual      # real device -> the device the layouts are written over
        self.follows = follows
        self.excluded: set[Value] = set()
        self.memo: dict[tuple, bool] = {}

    def exclude(self, param: Value) -> None:
        """A carry now holding partial sums."""
        self.excluded.add(param)
        self.memo.clear()

    def excluding(self, param: Value) -> "Uniformity":
        """This analysis as if `param` held partial sums (a candidate accumulator, tried)."""
        trial = Uniformity(self.body, self.virtual, self.follows)
        trial.excluded = self.excluded | {param}
        return trial

    def __call__(self, v: Value, groups: np.ndarray) -> bool:
        key = (v, _groups_key(groups))
        if key not in self.memo:
            self.memo[key] = self._uniform(v, np.asarray(groups))
        return self.memo[key]

    def _uniform(self, v: Value, groups: np.ndarray) -> bool:
        p = v.producer
        if p is None:
            return (v not in self.excluded and v.sharding is not None
                    and same_within(v.sharding.coords()[self.virtual], groups))
        if any(isinstance(a, Program) for a in p.attrs.values()):
            return False
        rule = lookup(p.opcode).facets.uniform    # constants, partition-id, collectives, table lookups
        if rule is not None:
            return rule(p, groups, self)
        return all(self.follows(o) and self(o, groups) for o in p.operands)


def same_within(per_device: np.ndarray, groups: np.ndarray) -> bool:
    """per_device[d] (rows) equal for all devices d of each group."""
    rows = np.asarray(per_device)[groups]
    return bool(np.all(rows == rows[:, :1]))


def groups_within(groups: np.ndarray, outer: np.ndarray) -> bool:
    """Every group lies inside one group of `outer`."""
    owner = np.full(int(outer.max()) + 1, -1)
    for k, g in enumerate(outer):
        owner[g] = k
    members = owner[groups]
    return bool(np.all(members >= 0) and np.all(members == members[:, :1]))
