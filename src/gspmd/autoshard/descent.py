"""gspmd.auto on one mesh: the fastest strategy whose estimated peak fits a limit.

The mesh axes are decided one at a time, the others held (solve.py: the integer
program where small, else dynamic programming with a beam), sweeping until nothing
changes. Memory is fitted by pricing the bytes live at the peaks seen so far ever
higher (a Lagrangian) and deciding the axes again.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from gspmd.autoshard.graph import Graph
from gspmd.autoshard.model import UNUSED, Assignment, Estimate, Model
from gspmd.autoshard.solve import BEAM, solve, solve_exact
from gspmd.mesh import Mesh
from gspmd.spmd.cost import Pattern


@dataclass
class Candidate:
    mesh: Mesh
    model: Model
    assignment: Assignment
    estimate: Estimate
    fits: bool
    exact: bool
    price: float = 0.0    # what a byte of peak memory cost when it was found (seconds)


@dataclass(frozen=True)
class Effort:
    beam: int = BEAM      # partial solutions the dynamic program keeps
    rounds: int = 2       # sweeps over the axes
    refine: bool = True   # after memory fits, try pricing it less
    exact: bool = True    # also solve each axis as an integer program (where small enough)
    seeds: bool = True    # also search from every parameter split on its first dim


SCREEN = Effort(beam=32, rounds=1, refine=False, exact=False, seeds=False)
EXACT_SIZE = 400_000      # variables up to which an axis is also solved exactly
EXACT_SECONDS = 10.0


def optimize(model: Model, limit: int, effort: Effort = Effort(), start: Optional[Assignment] = None,
             price: float = 0.0, beat: float = math.inf) -> Candidate:
    """The fastest strategy on this mesh whose estimated peak fits `limit` (else the one
    with the smallest peak found), from `start` with memory priced at `price`; without a
    start, from nothing split and (with effort.seeds) from every parameter split on its
    first dim over the largest axis (the axes are decided one at a time, so where the
    search starts matters). Memory is fitted from the best start only, and not at all
    where that is already no faster than `beat` (a plan that fits elsewhere): pricing
    memory only slows a strategy down."""
    starts = [start] if start is not None else [_start(model)] + ([_seed(model)] if effort.seeds else [])
    peaks: list = []    # when the strategies seen so far peak: memory there is priced

    def run(begin: Assignment, at: float) -> Candidate:
        assignment, solved = descend(model, begin, at, effort.beam, effort.rounds, effort.exact, peaks)
        est = model.estimate(assignment)
        when = model.peak(assignment)[1]
        if when not in peaks:
            peaks.append(when)
        return Candidate(model.mesh, model, assignment, est, est.peak_memory_bytes <= limit, solved, at)

    best = min((run(s, price) for s in starts), key=rank)
    if not best.fits:
        smallest, stuck = best, 0
        # Start where a peak's worth of bytes costs about a step, or one collective.
        latency = model.pricing.rate(Pattern.ALL_GATHER, tuple(model.axes))[0]
        price = price or 0.25 * (best.estimate.step_seconds + latency) / max(best.estimate.peak_memory_bytes, 1)
        # Price memory higher until the peak fits; stop where it stops shrinking, where a
        # higher price no longer moves it, or where the strategy is no faster than `beat`.
        cand = best
        while not best.fits and stuck < 3 and cand.estimate.step_seconds < beat:
            price *= 8
            last, cand = cand, run(smallest.assignment, price)
            if cand.fits:
                best = cand
            elif cand.estimate.peak_memory_bytes == last.estimate.peak_memory_bytes:
                break
            elif cand.estimate.peak_memory_bytes < smallest.estimate.peak_memory_bytes:
                smallest, stuck = cand, 0
            else:
                stuck += 1
        if not best.fits:
            return smallest
    if effort.refine and best.price:     # a little less weight on memory
        best = min(best, run(best.assignment, best.price / 2), key=rank)
    return best


def _seed(model: Model) -> Assignment:
    """Each parameter split on its first dim the largest axis divides (weight-update
    sharding, or data parallelism for inputs); the rest as _start."""
    seed = _start(model)
    axis = max(model.axes, key=lambda a: model.axis_sizes[a])
    for c, members in enumerate(model.graph.classes):
        if members[0].instr is None and c not in model.allowed:
            choices = [o for o in model.options(c, seed[c], axis) if o != UNUSED]
            if choices:
                seed[c] = seed[c][:axis] + (min(choices),) + seed[c][axis + 1:]
    return seed


def _start(model: Model) -> Assignment:
    """Nothing split, except what annotations fix."""
    start = []
    for c in range(len(model.graph.classes)):
        allowed = model.allowed.get(c)
        start.append(tuple(UNUSED if allowed is None or UNUSED in allowed[a] else min(allowed[a])
                           for a in model.axes))
    return start


def descend(model: Model, assignment: Assignment, memory_price: float, beam: int, rounds: int,
            exact_solver: bool = False, peaks: Optional[list] = None):
    """Decide the axes one at a time (largest first), others held, until a sweep changes nothing."""
    model.tally.strategies += 1
    assignment = list(assignment)
    order = _order(model.graph)
    exact = True
    axes = sorted(model.splitting, key=lambda a: -model.axis_sizes[a])
    for _ in range(rounds):
        changed = False
        for axis in axes:
            times = []
            if memory_price:
                peaks = [] if peaks is None else peaks
                when = model.peak(assignment)[1]
                if when not in peaks:
                    peaks.append(when)
                times = peaks
            weights = model.weights(assignment, times)
            options, node_costs, edges = model.axis_problem(assignment, axis, memory_price, weights)
            solution = None
            if exact_solver and sum(m.size for _, _, m in edges) <= EXACT_SIZE:
                solution = solve_exact(node_costs, edges, EXACT_SECONDS)
            if solution is None:
                solution = solve(node_costs, edges, order, beam)
            exact &= solution.exact
            new = [options[c][k] for c, k in enumerate(solution.choice)]
            changed |= new != assignment
            assignment = new
        if not changed:
            break
    return assignment, exact


def _order(graph: Graph) -> list[int]:
    """Classes in program order; a parameter right before the first op that reads it."""
    key = [float(min(n.position for n in members)) for members in graph.classes]
    first_read: dict = {}
    for e in graph.edges:
        if graph.representative(e.source).instr is None:
            first_read[e.source] = min(first_read.get(e.source, math.inf), key[e.target] - 0.5)
    key = [first_read.get(c, k) for c, k in enumerate(key)]
    return sorted(range(len(key)), key=lambda c: key[c])


def rank(c: Candidate) -> tuple:
    return (not c.fits, c.estimate.step_seconds if c.fits else c.estimate.peak_memory_bytes)
