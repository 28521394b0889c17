"""Resharding between any two layouts of a value: the cheapest short chain of steps
(spmd/reshard_steps.py), found by a cheapest-first search over layouts (A*, guided by
the most data any device still lacks, cost.lacking), priced in seconds by the one cost
model (spmd/cost.py) on the hardware being planned for, which every entry point is given
(DeviceContext.hardware in partition rules). The common one-collective transitions are
recognised directly. A gather of a dim that the target splits again is labelled a
fallback so that reports show it; the search takes it only when nothing cheaper exists."""
from __future__ import annotations

import functools
import heapq
import itertools
import math
from dataclasses import replace
from typing import Optional, Sequence

import numpy as np

from gspmd.sharding import Sharding
from gspmd.spmd import cost as cm
from gspmd.spmd.context import DeviceContext, Why
from gspmd.spmd.cost import FREE, Cost, add_costs, lacking, rounded
from gspmd.spmd.layout import moved_layout, moves_nest, nests, subdivides
from gspmd.spmd.partitioned import PartitionedValue
from gspmd.spmd.reshard_steps import (MAX_ROUNDS, AllToAllStep, ExchangeStep, GatherStep, MakeEmptyStep, SliceStep,
                                      SumGatherStep, transfers)

MAX_STEPS = 4     # steps one plan may take
MAX_EXPANSIONS = 100   # layouts one search expands before it settles for what it has found,
EXPANDING_WORK = 25600  # up to EXPANDING_WORK / devices of them from 256 devices on (10 at least)
# A search that only tries to beat the direct gathers expands IMPROVING_WORK / devices^2
# layouts (an expansion costs in proportion to the devices, and so do the layouts worth
# trying): 128 on 8 devices, 32 on 16, none from 128 on, where the direct gathers stand
# and planning at paper scale stays seconds.
IMPROVING_WORK = 8192
ONE_COLLECTIVE_UP_TO = 64   # devices up to which plans without a search include one all-to-all or exchange
ALL_FACTORS_UP_TO = 16   # tiles of a split up to which every divisor is a factor to try


def _factors(t: int, *wanted: int) -> list[int]:
    """The split factors (>1, dividing t) worth trying out of t tiles: every divisor of
    a small split (all-to-alls that also reorder devices combine small factors); of a
    larger one, each of `wanted` and its greatest common divisor with t, those that take
    a dim toward the target's split (every divisor of a split over thousands of devices
    would be thousands of layouts to search)."""
    if t <= ALL_FACTORS_UP_TO:
        return [k for k in range(2, t + 1) if t % k == 0]
    return sorted({g for w in wanted for g in (w, math.gcd(t, w)) if g > 1 and t % g == 0})


def _gathers(s: Sharding, dst: Sharding, shape):
    for d, t in enumerate(s.tiles):
        for k in _factors(t, t, t // math.gcd(t, dst.tiles[d])):
            if nests(shape[d], t, k):
                if shape[d] < t:   # some pieces are only padding; at equal cost, the smaller result
                    yield SumGatherStep(d, k)
                yield GatherStep(d, k)


def _single_moves(s: Sharding, dst: Sharding, shape):
    for a, t in enumerate(s.tiles):
        for b in range(s.rank):
            wanted = dst.tiles[b] // s.tiles[b] if dst.tiles[b] % s.tiles[b] == 0 else 1
            for k in _factors(t, t, t // math.gcd(t, dst.tiles[a]), wanted):
                if b != a and moves_nest(s, ((a, b, k),), shape):
                    yield (a, b, k)


def _on_track(s: Sharding, dst: Sharding, dim: int) -> bool:
    """Does dst split `dim` as s does, or refine that split?"""
    t, u = s.tiles[dim], dst.tiles[dim]
    return u % t == 0 and np.array_equal(dst.coords()[:, dim] // (u // t), s.coords()[:, dim])


def _all_to_alls(s: Sharding, dst: Sharding, shape):
    """Every single move, and every set of moves toward dst that one all-to-all can do
    together (no dim both gives and receives)."""
    singles = list(_single_moves(s, dst, shape))
    combos = set()

    def extend(moves: tuple, layout: Sharding):
        if len(moves) > 1:
            combos.add(moves)
        for m in (singles if not moves else _single_moves(layout, dst, shape)):
            if m[0] in {x[1] for x in moves} or m[1] in {x[0] for x in moves}:
                continue
            after = moved_layout(layout, (m,))
            if after is not None and _on_track(after, dst, m[1]) and moves_nest(s, moves + (m,), shape):
                extend(moves + (m,), after)
    extend((), s)
    for moves in [(m,) for m in singles] + sorted(combos):
        target = moved_layout(s, moves)
        if target is not None:
            yield AllToAllStep(moves, target)


def _refined(dst: Sharding, src: Sharding, dim: int, k: int) -> Optional[Sharding]:
    """dst with dim split k times finer among each tile's replicas (a layout one gather
    of dim turns into dst), giving devices the sub-tile they hold in src where possible."""
    r = dst.num_replicas
    if r % k:
        return None
    t = dst.tiles[dim] * k
    dst_c = dst.coords()
    members = dst.tile_assignment.reshape(-1, r)                  # [groups, r]: one tile's holders
    held = src.coords()[:, dim] // (src.tiles[dim] // t) if src.tiles[dim] % t == 0 else np.full(len(dst_c), -1)
    wish = np.where(held // k == dst_c[:, dim], held % k, k)[members]     # k: no wish
    # Each digit goes to r/k members: first to those who wish it (in order), then to the rest.
    order = np.argsort(wish, axis=-1, kind="stable")
    members, wish = np.take_along_axis(members, order, -1), np.take_along_axis(wish, order, -1)
    rank = np.arange(r) - (wish[:, :, None] > wish[:, None, :]).sum(-1)
    granted = (wish < k) & (rank < r // k)
    digits = np.where(granted, wish, -1)
    spare = r // k - np.stack([(digits == d).sum(1) for d in range(k)], 1)
    digits[~granted] = np.repeat(np.tile(np.arange(k), len(members)), spare.ravel())
    coords = dst_c.copy()
    coords[members.ravel(), dim] = dst_c[members.ravel(), dim] * k + digits.ravel()
    tiles = list(dst.tiles)
    tiles[dim] = t
    return Sharding.from_coords(coords, tiles)


def _preimages(src: Sharding, dst: Sharding, shape) -> list[Sharding]:
    """Layouts one gather or one all-to-all turns into dst: where an exchange from the
    source should land when the rest is cheaper done on small pieces."""
    out = []
    for d, t in enumerate(dst.tiles):
        finer = src.tiles[d] // t if src.tiles[d] % t == 0 else 1
        for k in _factors(dst.num_replicas, dst.num_replicas, finer):
            if nests(shape[d], t * k, k):
                out.append(_refined(dst, src, d, k))
        for a in range(dst.rank):
            for k in _factors(t, t, src.tiles[a]):
                x = moved_layout(dst, ((d, a, k),)) if a != d else None   # the inverse move
                if x is not None and moves_nest(x, ((a, d, k),), shape):
                    out.append(x)
    return [x for x in out if x is not None and x not in (src, dst)]


def _steps_from(cur: Sharding, src: Sharding, dst: Sharding, shape, preimages: list[Sharding]):
    for target in [dst] + (preimages if cur == src else []):
        if subdivides(target, cur, shape):
            yield SliceStep(target)
        elif (t := transfers(cur, target, shape)) is not None and t.rounds() <= MAX_ROUNDS:
            yield ExchangeStep(target)
    yield from _gathers(cur, dst, shape)
    yield from _all_to_alls(cur, dst, shape)


def plan(src: Sharding, dst: Sharding, shape: Sequence[int], itemsize: int, hw: cm.Hardware) -> tuple:
    """Steps that turn a value laid out as `src` into `dst` (elements of `itemsize`
    bytes), the cheapest on `hw`."""
    return _plan(src, dst, tuple(shape), itemsize, hw)


@functools.lru_cache(maxsize=65536)
def _plan(src: Sharding, dst: Sharding, shape: tuple[int, ...], itemsize: int, hw: cm.Hardware) -> tuple:
    # Partition rules price the same few transitions over and over (each candidate
    # layout of every op): plans are immutable, so they are computed once.
    if src == dst:
        return ()
    if subdivides(dst, src, shape):
        return (SliceStep(dst),)
    if 0 in shape:   # nothing to move
        return (MakeEmptyStep(dst),)
    # The direct gathers are usually the plan; the search, bounded by them, looks for a
    # cheaper one (an all-to-all that turns a slow ring into faster sub-rings, say). The
    # one-collective plans quick_cost prices are taken where the search, comparing
    # exchanges by an upper bound of their cost, passed one by: what completion and the
    # partition rules price is never below what runs.
    direct = _direct(src, dst, shape, itemsize, hw)
    found = _search(src, dst, shape, itemsize, hw, direct)
    return _label_fallbacks(_cheapest_plan([found] + _one_collective(src, dst, shape), src, shape, itemsize, hw),
                            src, dst)


def _cheapest_plan(plans: list[tuple], src: Sharding, shape: tuple[int, ...], itemsize: int, hw: cm.Hardware) -> tuple:
    """The cheapest of `plans`, the first of those that cost the same."""
    return min(plans, key=lambda steps: rounded(_chain_cost(steps, src, shape, itemsize, hw)))


def _direct(src: Sharding, dst: Sharding, shape: tuple[int, ...], itemsize: int, hw: cm.Hardware) -> Optional[tuple]:
    """A coarser split of dims at least as long as their splits: all-gathers, each
    device receiving just what it lacks in as few collectives as there are dims."""
    if subdivides(src, dst, shape) and all(n >= t for n, t in zip(shape, src.tiles)):
        gathers = [GatherStep(d, s // t) for d, (s, t) in enumerate(zip(src.tiles, dst.tiles)) if s > t]
        return _cheapest_order(gathers, src, shape, itemsize, hw)
    return None


def _cheapest_order(gathers: list, src: Sharding, shape: tuple[int, ...], itemsize: int, hw: cm.Hardware) -> tuple:
    """Gathers of several dims in the order that moves least: a gathered uneven dim sheds
    its padding before the next."""
    return min(itertools.permutations(gathers),
               key=lambda steps: rounded(_chain_cost(steps, src, shape, itemsize, hw)))


def _search(src: Sharding, dst: Sharding, shape: tuple[int, ...], itemsize: int, hw: cm.Hardware,
            incumbent: Optional[tuple] = None) -> tuple:
    """The cheapest chain of at most MAX_STEPS steps (A* over layouts, guided by what
    devices still lack; at equal cost, fewer gathers of what is split again, then fewer
    collective-permutes), or `incumbent` where nothing is cheaper. Gathering everything
    and cutting is always possible, so a plan is always found."""
    budget = max(min(MAX_EXPANSIONS, EXPANDING_WORK // src.num_devices), 10) if incumbent is None \
        else IMPROVING_WORK // src.num_devices ** 2
    if budget == 0:
        return incumbent
    bound = rounded(_chain_cost(incumbent, src, shape, itemsize, hw)) if incumbent is not None else math.inf
    expansions = 0
    preimages = _preimages(src, dst, shape)
    start = (FREE, 0, 0)
    best = {src: start}
    frontier = [((rounded(lacking(src, dst, shape, itemsize, hw)), 0, 0), start, next(_tie), src, ())]
    expanded = []   # (steps, layout) of the layouts one step or none from src expanded so far
    while frontier:
        guess, so_far, _, cur, steps = heapq.heappop(frontier)
        if guess[0] >= bound:   # nothing left can beat the incumbent
            return incumbent
        if cur == dst:
            return steps
        if so_far > best[cur] or len(steps) == MAX_STEPS:
            continue
        if expansions == budget:
            reached = expanded + [(steps, cur)] + [(e[4], e[3]) for e in heapq.nsmallest(15, frontier)]
            return _settle(src, dst, shape, itemsize, hw, reached + ([(incumbent, dst)] if incumbent is not None else []))
        if len(steps) <= 1:
            expanded.append((steps, cur))
        expansions += 1
        for step in _steps_from(cur, src, dst, shape, preimages):
            nxt = step.result(cur)
            exchange = isinstance(step, ExchangeStep)
            seconds = so_far[0] + (step.bound if exchange else step.cost)(shape, itemsize, cur, hw)
            if rounded(seconds) > bound:   # dearer than the incumbent already: never taken
                continue
            resplit = isinstance(step, GatherStep) and dst.tiles[step.dim] > nxt.tiles[step.dim]
            total = (rounded(seconds), so_far[1] + resplit,
                     so_far[2] + (transfers(cur, nxt, shape).rounds() if exchange else 0))
            if nxt not in best or total < best[nxt]:
                best[nxt] = total
                guess = rounded(seconds + lacking(nxt, dst, shape, itemsize, hw))
                heapq.heappush(frontier, ((guess,) + total[1:], total, next(_tie), nxt, steps + (step,)))
    if incumbent is not None:
        return incumbent
    raise AssertionError(f"no reshard plan {src} -> {dst} for {shape}")


_tie = itertools.count()   # orders equal entries of the search's heap by when they came


def _settle(src: Sharding, dst: Sharding, shape: tuple[int, ...], itemsize: int, hw: cm.Hardware,
            reached: list) -> tuple:
    """A search that ran out of expansions (large device counts, where the layouts between
    two far-apart ones are many) finishes the partial plans it reached (src and the steps
    from it that it expanded, and the most promising unexpanded ones) by a cut or the
    direct gathers where those reach dst, else by gathering down to the finest split both
    share (or everything) and cutting dst out, and takes the cheapest: planning a
    2048-device program stays seconds, not minutes."""
    def finishes(cur: Sharding) -> list:
        if cur == dst:
            return [()]
        if subdivides(dst, cur, shape):
            return [(SliceStep(dst),)]
        direct = _direct(cur, dst, shape, itemsize, hw)
        if direct is not None:
            return [direct]
        # Gathering less is not always faster: a whole-mesh gather may run on shorter rings.
        return [_gather_to_common_and_cut(cur, dst, shape, itemsize, hw), _gather_all_and_cut(cur, dst)]
    plans = [steps + rest for steps, cur in reached for rest in finishes(cur)]
    return min(plans, key=lambda steps: rounded(_chain_cost(steps, src, shape, itemsize, hw)))


def _gather_to_common_and_cut(cur: Sharding, dst: Sharding, shape: tuple[int, ...], itemsize: int,
                              hw: cm.Hardware) -> tuple:
    """Gather each dim only down to the finest split that dst's split refines device by
    device (the shards nest and each device's coarse piece is the same in both), then cut
    dst out; where that layout is not one dst subdivides (replication differs), gather
    everything instead."""
    gathers = [GatherStep(d, t // m) for d, t in enumerate(cur.tiles)
               if t > (m := _common_split(cur, dst, shape, d))]
    common = functools.reduce(lambda s, g: g.result(s), gathers, cur)
    if common != dst and not subdivides(dst, common, shape):
        return _gather_all_and_cut(cur, dst)
    return _cheapest_order(gathers, cur, shape, itemsize, hw) + ((SliceStep(dst),) if common != dst else ())


def _common_split(cur: Sharding, dst: Sharding, shape: tuple[int, ...], dim: int) -> int:
    """The most pieces dim can keep for dst: a split both cur's and dst's splits nest in,
    whose piece is the same one on every device in both."""
    ts, td = cur.tiles[dim], dst.tiles[dim]
    for m in range(math.gcd(ts, td), 1, -1):
        if (ts % m == 0 and td % m == 0 and nests(shape[dim], ts, ts // m) and nests(shape[dim], td, td // m)
                and np.array_equal(cur.coords()[:, dim] // (ts // m), dst.coords()[:, dim] // (td // m))):
            return m
    return 1


def _gather_all_and_cut(cur: Sharding, dst: Sharding) -> tuple:
    """The plan that always exists: gather every split dim, then cut dst out."""
    gathers = tuple(GatherStep(d, t) for d, t in enumerate(cur.tiles) if t > 1)
    whole = functools.reduce(lambda s, g: g.result(s), gathers, cur)
    return gathers + ((SliceStep(dst),) if whole != dst else ())


def _label_fallbacks(steps: tuple, src: Sharding, dst: Sharding) -> tuple:
    """A gather of a dim that the target splits further is data gathered only to be
    split again: label it so that reports warn."""
    out, s = [], src
    for step in steps:
        if isinstance(step, GatherStep) and dst.tiles[step.dim] > step.result(s).tiles[step.dim]:
            step = replace(step, why=Why.FALLBACK, detail=f"{step.detail} then slice, {src} -> {dst}")
        out.append(step)
        s = step.result(s)
    return tuple(out)


def cost(src: Sharding, dst: Sharding, shape: Sequence[int], itemsize: int, hw: cm.Hardware) -> Cost:
    """What resharding takes, in seconds on `hw` (the estimate planning compares)."""
    return _cost(src, dst, tuple(shape), itemsize, hw)


@functools.lru_cache(maxsize=65536)
def _cost(src: Sharding, dst: Sharding, shape: tuple[int, ...], itemsize: int, hw: cm.Hardware) -> Cost:
    return _chain_cost(plan(src, dst, shape, itemsize, hw), src, shape, itemsize, hw)


def quick_cost(src: Sharding, dst: Sharding, shape: Sequence[int], itemsize: int, hw: cm.Hardware) -> Cost:
    """What resharding takes, for comparing many hypothetical layouts (completion's
    conflicts, the partition rules' candidate layouts), without searching: the cheapest
    of a cut, the direct gathers, gathering to the finest common split and cutting, and
    the one-collective plans (a single all-to-all or exchange) -- never below `cost`,
    equal to it where one collective does it. A search costs milliseconds even on 8
    devices, and most of the reshards priced never run; those that run are searched."""
    return _quick_cost(src, dst, tuple(shape), itemsize, hw)


@functools.lru_cache(maxsize=65536)
def _quick_cost(src: Sharding, dst: Sharding, shape: tuple[int, ...], itemsize: int, hw: cm.Hardware) -> Cost:
    if src == dst or 0 in shape:
        return FREE
    plans = [_settle(src, dst, shape, itemsize, hw, [((), src)])] + _one_collective(src, dst, shape)
    return _chain_cost(_cheapest_plan(plans, src, shape, itemsize, hw), src, shape, itemsize, hw)


def _one_collective(src: Sharding, dst: Sharding, shape: tuple[int, ...]) -> list[tuple]:
    """The plans of one collective a search tries first beside the gathers: each
    all-to-all (of one move or several) that lands on dst (or on a layout dst's split
    refines, then cut) and the exchange of pieces from their holders; none beyond
    ONE_COLLECTIVE_UP_TO devices (large meshes plan on the gathers alone, in seconds)."""
    if src.num_devices > ONE_COLLECTIVE_UP_TO:
        return []
    plans = []
    for step in _all_to_alls(src, dst, shape):
        if step.target == dst:
            plans.append((step,))
        elif subdivides(dst, step.target, shape):
            plans.append((step, SliceStep(dst)))
    if (t := transfers(src, dst, shape)) is not None and t.rounds() <= MAX_ROUNDS:
        plans.append((ExchangeStep(dst),))
    return plans


def _chain_cost(steps, src: Sharding, shape, itemsize: int, hw: cm.Hardware) -> Cost:
    total, s = FREE, src
    for step in steps:
        total = add_costs(total, step.cost(shape, itemsize, s, hw))
        s = step.result(s)
    return total


def reshard(ctx: DeviceContext, pv: PartitionedValue, dst: Sharding) -> PartitionedValue:
    for step in plan(pv.sharding, dst, pv.shape, pv.dtype.itemsize, ctx.hardware):
        pv = step.apply(ctx, pv)
    assert pv.sharding == dst, (pv.sharding, dst)
    return pv
