"""Dimension factors: one declarative description per op (as Shardy's OpShardingRule)
from which forward/backward propagation and the common partitioning both derive.

A factor is one loop dimension of the op: it names the dim it occupies in each tensor
(operands first, then outputs; None where absent). A dim may hold several factors, in
order major to minor (a reshape's [16] -> [2, 8]: factors of 2 and 8, both on the 16).
`pass` factors can be split freely;
`reduce` factors (contracting/reduced dims) leave partial results that a collective
combines; `replicate` factors must stay whole; `permute` factors (a concatenated dim)
carry splits in propagation, but move data between shards, so the common partitioning
keeps them whole (a rule may move the pieces itself first).

Partitioning chooses a layout of the *factor space* — itself a Sharding, of rank
len(factors) — from which every tensor's layout follows by `Sharding.remap`.
"""
from __future__ import annotations

import enum
import functools
import math
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Sequence

import numpy as np

from gspmd.ir import Instr, Value
from gspmd.ir.reducer import ADD, Reducer
from gspmd.sharding import Sharding
from gspmd.spmd import cost as cm
from gspmd.spmd import reshard as rs
from gspmd.spmd.context import DeviceContext, Why
from gspmd.spmd.cost import Cost, add_costs, at_least, rounded
from gspmd.spmd.layout import coarsen_to, groups_along
from gspmd.spmd.padding import is_padded, mask_padding
from gspmd.spmd.partitioned import PartitionedValue

class FactorKind(enum.Enum):
    PASS = "pass"              # split freely: each device computes its part
    REDUCE = "reduce"          # split: partial results that a collective combines
    REPLICATE = "replicate"    # must stay whole
    GROUP = "group"            # like pass, but only into whole groups: size = number of groups
    PERMUTE = "permute"        # elements move along it (concatenate): a split propagates
                               # through it, but the common partitioning keeps it whole


PASS, REDUCE, REPLICATE, GROUP, PERMUTE = (FactorKind.PASS, FactorKind.REDUCE, FactorKind.REPLICATE, FactorKind.GROUP,
                                           FactorKind.PERMUTE)


@dataclass(frozen=True)
class Factor:
    size: int
    dims: tuple[Optional[int], ...]   # per tensor: operands, then outputs
    kind: FactorKind = PASS
    reducer: Reducer = ADD            # how REDUCE partials combine


_WHOLE_IN_PROPAGATION = (REPLICATE,)
_WHOLE_IN_PARTITIONING = (REPLICATE, PERMUTE)


def _by_dim(factors: Sequence[Factor], t: int) -> dict[int, list[int]]:
    """Tensor t's dims -> the factors on each, major to minor."""
    out: dict[int, list[int]] = {}
    for f, fac in enumerate(factors):
        if fac.dims[t] is not None:
            out.setdefault(fac.dims[t], []).append(f)
    return out


def _factor_view(factors: Sequence[Factor], t: int, s: Sharding, whole=_WHOLE_IN_PARTITIONING) -> Sharding:
    """Tensor t's layout seen on the factor space, without splits of factors of the
    kinds kept `whole` (nor of a dim whose split does not fall on its factors)."""
    by_dim = _by_dim(factors, t)
    if any(len(fs) > 1 for fs in by_dim.values()):
        return _view_of_several(factors, by_dim, s, whole)
    dim_to_factor: list[Optional[int]] = [None] * s.rank
    for d, (f,) in by_dim.items():
        if factors[f].kind not in whole:
            dim_to_factor[d] = f
    return s.remap(dim_to_factor, len(factors))


def split_over(sizes: Sequence[int], tiles: int) -> Optional[list[int]]:
    """How a dim made of factors of `sizes` (major first), split `tiles` ways, splits
    them: its shards are contiguous runs of whole factors only where the major factors
    are split whole (one element each), then one factor evenly, the minor ones not at
    all; None where not so (one factor alone may split unevenly)."""
    nontrivial = [i for i, size in enumerate(sizes) if size > 1]
    if len(nontrivial) <= 1:
        if not nontrivial:
            return [1] * len(sizes) if tiles == 1 else None
        return [tiles if i == nontrivial[0] else 1 for i in range(len(sizes))]
    out = []
    for size in sizes:
        take = size if tiles % size == 0 else tiles if size % tiles == 0 else None
        if take is None:
            return None
        out.append(take)
        tiles //= take
    return out if tiles == 1 else None


def _view_of_several(factors: Sequence[Factor], by_dim: dict[int, list[int]], s: Sharding, whole) -> Sharding:
    coords, tiles = np.zeros((s.num_devices, len(factors)), np.int64), [1] * len(factors)
    own = s.coords()
    for d, fs in by_dim.items():
        split = split_over([factors[f].size for f in fs], s.tiles[d])
        if split is None or any(factors[f].kind in whole and n > 1 for f, n in zip(fs, split)):
            continue
        rest = own[:, d]
        for f, n in reversed(list(zip(fs, split))):    # minor factors vary fastest
            coords[:, f], rest, tiles[f] = rest % n, rest // n, n
    return Sharding.from_coords(coords, tiles)


def tensor_layout(factors: Sequence[Factor], t: int, space: Sharding, rank: int) -> Sharding:
    """Tensor t's layout when the op runs with factor-space layout `space`: a dim
    holding several factors is split by all of theirs, major factor first (contiguous
    shards only as `split_over` says; `carried` checks)."""
    by_dim = _by_dim(factors, t)
    if all(len(fs) == 1 for fs in by_dim.values()):
        return space.remap([fac.dims[t] for fac in factors], rank)
    coords, tiles = np.zeros((space.num_devices, rank), np.int64), [1] * rank
    own = space.coords()
    for d, fs in by_dim.items():
        for f in fs:
            coords[:, d] = coords[:, d] * space.tiles[f] + own[:, f]
            tiles[d] *= space.tiles[f]
    return Sharding.from_coords(coords, tiles)


def carried(factors: Sequence[Factor], s: Sharding, src: int, dst: int, rank: int) -> Optional[Sharding]:
    """Tensor dst's layout that splits the factors exactly as s splits them on tensor
    src, so that each device holds the same elements of both (a reshape is then
    local); None where no layout of dst does."""
    space = _factor_view(factors, src, s, whole=())
    if tensor_layout(factors, src, space, s.rank) != s or any(
            n > 1 and fac.dims[dst] is None for n, fac in zip(space.tiles, factors)):
        return None      # a split that does not fall on whole factors, or not on dst's
    by_dim = _by_dim(factors, dst)
    if any(split_over([factors[f].size for f in fs], math.prod(space.tiles[f] for f in fs)) !=
           [space.tiles[f] for f in fs] for fs in by_dim.values() if len(fs) > 1):
        return None      # split into shards of dst that are not contiguous
    return tensor_layout(factors, dst, space, rank)


def major_part(factors: Sequence[Factor], s: Sharding, src: int, dst: int) -> Sharding:
    """s with each dim's split coarsened to its major part that falls on factors tensor
    dst holds too (XLA's reshape rule: [12, 8] -> [8, 12] shares a major factor of 4, so
    a 2-way split of the 12 carries to the result's 8; the minor 3 does not): whole
    factors major first, then a divisor of the next one."""
    by_dim = _by_dim(factors, src)
    return coarsen_to(s, [_major_tiles([factors[f] for f in by_dim.get(d, [])], t, dst)
                          for d, t in enumerate(s.tiles)])


def _major_tiles(dim_factors: Sequence[Factor], tiles: int, dst: int) -> int:
    kept = 1
    for fac in dim_factors:
        if fac.dims[dst] is None or fac.kind in _WHOLE_IN_PROPAGATION:
            break
        g = math.gcd(fac.size, tiles)
        kept, tiles = kept * g, tiles // g
        if g < fac.size:      # a factor split in part: the minor ones are not contiguous
            break
    return kept


def propose(factors: Sequence[Factor], shardings: Sequence[Optional[Sharding]], ranks: Sequence[int],
            target: int) -> list[Sharding]:
    """Layouts for tensor `target` implied by every other tensor that has one."""
    return [tensor_layout(factors, target, _factor_view(factors, t, s, _WHOLE_IN_PROPAGATION), ranks[target])
            for t, s in enumerate(shardings) if t != target and s is not None]


def _greedy_merge(views: Sequence[Sharding], sizes: tuple[int, ...]) -> Sharding:
    """The views merged in order (on the factor space of `sizes`), each where it can."""
    space = views[0]
    for v in views[1:]:
        space = space.merge(v, sizes) or space
    return space


def _reduce_factors(factors, space: Sharding) -> list[int]:
    """The split factors whose partial results combine (none where the reduced elements
    are none: every part is the reducer's identity already)."""
    if any(fac.kind == REDUCE and not fac.size for fac in factors):
        return []
    return [f for f, fac in enumerate(factors) if fac.kind == REDUCE and space.tiles[f] > 1]


def _scattered(space: Sharding, red: list[int], out: Sharding, shape) -> dict[int, Sharding]:
    """Per output dim, where a reduce-scatter over the reduce groups along it lands (the
    position in the group becomes the minor factor of the dim's split); dims whose
    local part does not divide into whole shards are left out."""
    groups = groups_along(space, red)
    k = groups.shape[1]
    position = np.empty(space.num_devices, np.int64)
    position[groups] = np.arange(k)
    out_layouts = {}
    for d in range(out.rank):
        local = -(-shape[d] // out.tiles[d])
        if local % k or -(-shape[d] // (out.tiles[d] * k)) != local // k:
            continue
        coords = out.coords().copy()
        coords[:, d] = coords[:, d] * k + position
        tiles = list(out.tiles)
        tiles[d] *= k
        out_layouts[d] = Sharding.from_coords(coords, tiles)
    return out_layouts


def _combine_plan(space: Sharding, red: list[int], out: Sharding, target: Sharding, shape,
                  itemsize: int, hw: cm.Hardware, reshard: Callable) -> tuple[Optional[int], Cost]:
    """How to combine partial results on their way to `target`: a reduce-scatter along
    some dim (then a reshard) or an all-reduce (dim None, then a reshard), whichever
    costs less; at equal cost, the reduce-scatter that lands on the target, then the
    all-reduce, then the first dim, on `hw`. `reshard` prices the reshards (quick_cost;
    at_least: a lower bound of the cost)."""
    groups = groups_along(space, red)
    local_bytes = math.prod(out.shard_shape(shape)) * itemsize
    options = [(None, cm.collective_seconds(cm.Pattern.ALL_REDUCE, local_bytes, groups, space.num_devices, hw), out)]
    options += [(d, cm.collective_seconds(cm.Pattern.REDUCE_SCATTER, local_bytes // groups.shape[1], groups,
                                          space.num_devices, hw), landed)
                for d, landed in _scattered(space, red, out, shape).items()]

    def key(i: int, price: Callable) -> tuple:
        d, combining, landed = options[i]
        seconds = add_costs(combining, price(landed, target, shape, itemsize, hw))
        return rounded(seconds), not (d is not None and landed == target), i, seconds
    i, (*_, seconds) = _cheapest(range(len(options)), lambda i: key(i, at_least), lambda i: key(i, reshard))
    return options[i][0], seconds


def _cheapest(options, bound: Callable, exact: Callable):
    """(the option with the least exact key, that key), trying the options in the order
    of bound (a lower bound of the key) and stopping at the first that cannot beat the
    best so far: pricing an option may search reshard plans, and most never need to."""
    bounds = {i: bound(o) for i, o in enumerate(options)}
    best = None
    for i in sorted(bounds, key=bounds.get):
        if best is not None and bounds[i] > best[1]:
            break
        key = exact(options[i])
        if best is None or key < best[1]:
            best = (options[i], key)
    return best


LocalEmitter = Callable[[DeviceContext, Instr, list[Value], list[tuple[int, ...]]], list[Value]]


def emit_same_op(ctx: DeviceContext, instr: Instr, operands: list[Value],
                 shapes: list[tuple[int, ...]]) -> list[Value]:
    """The op itself on local shards (valid for ops whose attrs do not name sizes)."""
    return ctx.b.add(instr.opcode, operands, [(s, o.dtype) for s, o in zip(shapes, instr.outputs)],
                     **instr.attrs)


def partition(ctx: DeviceContext, instr: Instr, factors: Sequence[Factor],
              operands: Sequence[PartitionedValue], targets: Sequence[Sharding],
              emit_local: LocalEmitter = emit_same_op, pinned: Optional[Sharding] = None) -> list[PartitionedValue]:
    """Choose the cheapest factor-space layout, reshard operands to it, run the op
    locally, combine partial results, reshard to the targets. `pinned`, a factor-space
    layout, is merged first into every candidate: the op's local code relies on those
    splits (convolution spatial dims after halo exchange)."""
    space = choose_space(instr, factors, operands, targets, ctx.hardware, pinned, shared=ctx.sharers(instr))
    return run(ctx, instr, factors, space, operands, targets, emit_local)


def choose_space(instr: Instr, factors: Sequence[Factor], operands: Sequence[PartitionedValue],
                 targets: Sequence[Sharding], hw: cm.Hardware, pinned: Optional[Sharding] = None,
                 candidates: Sequence[Sharding] = (), shared: Sequence[int] = ()) -> Sharding:
    """The cheapest factor-space layout on `hw` among those each tensor's layout
    suggests and the given `candidates`; `shared`, per operand, how many ops alike share
    what resharding it takes (DeviceContext.sharers)."""
    return cheapest_space(instr, factors, operands, targets, hw, pinned, candidates, shared)[0]


def cheapest_space(instr: Instr, factors: Sequence[Factor], operands: Sequence[PartitionedValue],
                   targets: Sequence[Sharding], hw: cm.Hardware, pinned: Optional[Sharding] = None,
                   candidates: Sequence[Sharding] = (), shared: Sequence[int] = ()) -> tuple[Sharding, Cost]:
    """choose_space's layout, with what it costs."""
    return _cheapest_space(tuple(factors), _described(operands, shared=shared),
                           _described(instr.outputs, with_layout=False), tuple(targets), pinned, tuple(candidates), hw)


class _Tensor(NamedTuple):
    """What choosing and pricing a layout reads of a value (layout None: the op's results;
    shared: how many ops alike share what resharding it takes, see DeviceContext.sharers)."""
    sharding: Optional[Sharding]
    shape: tuple[int, ...]
    itemsize: int
    shared: int = 1

    @property
    def rank(self) -> int:
        return len(self.shape)


def _described(values: Sequence, with_layout: bool = True, shared: Sequence[int] = ()) -> tuple[_Tensor, ...]:
    shared = shared or (1,) * len(values)
    return tuple(_Tensor(v.sharding if with_layout else None, tuple(v.shape), v.dtype.itemsize, n)
                 for v, n in zip(values, shared))


@functools.lru_cache(maxsize=16384)
def _cheapest_space(factors: tuple[Factor, ...], operands: tuple[_Tensor, ...], outputs: tuple[_Tensor, ...],
                    targets: tuple[Sharding, ...], pinned: Optional[Sharding], candidates: tuple[Sharding, ...],
                    hw: cm.Hardware) -> tuple[Sharding, Cost]:
    # A program repeats itself (layers, their gradients): the same op on the same layouts
    # and shapes is priced once.
    n_in = len(operands)
    shardings = [o.sharding for o in operands] + list(targets)
    views = [_factor_view(factors, t, s) for t, s in enumerate(shardings)]
    first = [pinned] if pinned is not None else []
    sizes = tuple(fac.size for fac in factors)
    merged = {_greedy_merge(first + [views[lead]] + views[:lead] + views[lead + 1:], sizes)
              for lead in range(len(views))}
    merged.add(_greedy_merge(first + views[n_in:] + views[:n_in], sizes))
    merged = {_whole_groups(factors, c) for c in merged.union(candidates)}

    def key(c: Sharding, price: Callable) -> tuple:
        seconds = _cost(factors, c, operands, outputs, targets, hw, price)
        return rounded(seconds), c.order_key(), seconds
    best, (*_, seconds) = _cheapest(list(merged), lambda c: key(c, at_least), lambda c: key(c, rs.quick_cost))
    return best, seconds


def _whole_groups(factors: Sequence[Factor], space: Sharding) -> Sharding:
    """space without the splits of group factors that would cut a group."""
    cut = [f for f, fac in enumerate(factors) if fac.kind == GROUP and fac.size % space.tiles[f]]
    return space.keep_dims([f for f in range(space.rank) if f not in cut]) if cut else space


def cost(factors: Sequence[Factor], space: Sharding, operands: Sequence[PartitionedValue], instr: Instr,
         targets: Sequence[Sharding], hw: cm.Hardware, reshard: Callable = rs.cost) -> Cost:
    """What running `instr` in factor-space layout `space` takes in communication
    (seconds on `hw`): resharding the operands, combining partial results, resharding
    the results to `targets`. `reshard` prices each reshard (at_least: a lower bound
    of the cost)."""
    return _cost(factors, space, _described(operands), _described(instr.outputs, with_layout=False), targets, hw,
                 reshard)


def _cost(factors: Sequence[Factor], space: Sharding, operands: Sequence[_Tensor], outputs: Sequence[_Tensor],
          targets: Sequence[Sharding], hw: cm.Hardware, reshard: Callable) -> Cost:
    costs = [reshard(o.sharding, tensor_layout(factors, t, space, o.rank), o.shape, o.itemsize, hw) / o.shared
             for t, o in enumerate(operands)]
    red = _reduce_factors(factors, space)
    for j, (out, target) in enumerate(zip(outputs, targets)):
        local = tensor_layout(factors, len(operands) + j, space, out.rank)
        if red:
            costs.append(_combine_plan(space, red, local, target, out.shape, out.itemsize, hw, reshard)[1])
        else:
            costs.append(reshard(local, target, out.shape, out.itemsize, hw))
    return add_costs(*costs)


def run(ctx: DeviceContext, instr: Instr, factors: Sequence[Factor], space: Sharding,
        operands: Sequence[PartitionedValue], targets: Sequence[Sharding],
        emit_local: LocalEmitter = emit_same_op) -> list[PartitionedValue]:
    """Reshard operands to `space`, run the op locally, combine partials, reshard."""
    n_in = len(operands)
    red = _reduce_factors(factors, space)
    locals_ = []
    for t, o in enumerate(operands):
        pv = rs.reshard(ctx, o, tensor_layout(factors, t, space, o.rank))
        for f in red:
            dim = factors[f].dims[t]
            if dim is not None and is_padded(pv, dim):
                pv = mask_padding(ctx, pv, dim, factors[f].reducer.identity(pv.dtype))
        locals_.append(pv.local)
    out_layouts = [tensor_layout(factors, n_in + j, space, out.rank) for j, out in enumerate(instr.outputs)]
    shapes = [lay.shard_shape(out.shape) for lay, out in zip(out_layouts, instr.outputs)]
    results = emit_local(ctx, instr, locals_, shapes)
    outs = []
    for value, layout, out, target in zip(results, out_layouts, instr.outputs, targets):
        pv = PartitionedValue(value, layout, out.shape)
        if red:
            pv = _combine_partials(ctx, pv, space, red, factors[red[0]].reducer, target)
        outs.append(rs.reshard(ctx, pv, target))
    return outs


def _combine_partials(ctx, pv: PartitionedValue, space, red, reducer, target) -> PartitionedValue:
    groups = groups_along(space, red)
    d, _ = _combine_plan(space, red, pv.sharding, target, pv.shape, pv.dtype.itemsize, ctx.hardware, rs.quick_cost)
    if d is not None:
        y = ctx.reduce_scatter(pv.local, d, groups, reducer, Why.PARTIAL_RESULTS, "reduce-scatter")
        return PartitionedValue(y, _scattered(space, red, pv.sharding, pv.shape)[d], pv.shape)
    y = ctx.all_reduce(pv.local, groups, reducer, Why.PARTIAL_RESULTS, "all-reduce")
    return PartitionedValue(y, pv.sharding, pv.shape)
