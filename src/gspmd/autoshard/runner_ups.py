"""gspmd.auto's runner-ups and why each lost: the best plan on each other mesh, and two
counterfactuals on the best mesh (the updated state data parallel; the largest input
the plan holds whole split instead), searched from the plan and partitioned for real
where the estimate puts them within its error of the plan.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence

from gspmd.analysis import Report
from gspmd.autoshard import plan as plans
from gspmd.autoshard.descent import SCREEN, Candidate, Effort, optimize, rank
from gspmd.autoshard.graph import CARRY, Graph
from gspmd.autoshard.model import UNUSED, Model
from gspmd.autoshard.traced import Traced
from gspmd.autoshard.verify import Verified, real_rank, verify_candidate
from gspmd.spmd.cost import Hardware, Pattern

NEAR = 1.02   # a counterfactual estimated within this of the plan is partitioned for real


def counterfactuals(best: Verified, traced: Traced, paths: list[str], limit: int, hw: Hardware,
                    effort: Effort) -> tuple[Verified, list[tuple]]:
    """The best plan after its counterfactuals on its mesh (one wins where gspmd's
    report prefers it; the search's own plan is then the counterfactual), and those
    counterfactuals as (description, Verified or Candidate)."""
    best, replicated = _against(best, *state_replicated(best.candidate, limit), traced, paths, limit, hw, 1.0)
    best, split = _against(best, *inputs_split(best.candidate, paths, limit, effort), traced, paths, limit, hw, NEAR)
    return best, [c for c in (replicated, split) if c is not None]


def _against(best: Verified, alternative: Optional[Candidate], text: str, traced: Traced, paths: list[str],
             limit: int, hw: Hardware, near: float) -> tuple[Verified, Optional[tuple]]:
    """A counterfactual on the best plan's mesh (described by `text`), partitioned for
    real where its estimate is within `near` times the plan's (the search decides axis
    by axis and can miss it; near ties are the estimate's error, which gspmd's report
    settles): if the report agrees, it is the plan, and the search's own plan the
    counterfactual. Returns the plan and the counterfactual as (description, Verified or
    Candidate), or None."""
    if alternative is None:
        return best, None
    plan = best.candidate
    if not alternative.fits or (plan.fits and alternative.estimate.step_seconds >= near * plan.estimate.step_seconds):
        return best, (text, alternative)
    v = verify_candidate(alternative, traced, paths, limit, hw, compare=False)
    if real_rank(v) < real_rank(best):
        return v, (f"the search's plan on mesh {plans.mesh_text(best.candidate.mesh)}", best)
    return best, (text, v)


def runner_ups(best: Verified, found: Sequence[Candidate], verified: Sequence[Verified],
                counterfactuals: Sequence[tuple], limit: int, most: int = 4) -> list:
    """The best plan on each other mesh, and the counterfactuals, each with why it lost.
    Those partitioned for real are compared by gspmd's report, the others by the
    search's estimate."""
    out = []
    seen = {best.candidate.mesh}
    for v in sorted(verified, key=real_rank):
        if v.candidate.mesh not in seen:
            seen.add(v.candidate.mesh)
            out.append(_lost_by_report(f"best on mesh {plans.mesh_text(v.candidate.mesh)} (partitioned)", v, best, limit))
    for c in found:
        if len(out) >= most - len(counterfactuals):
            break
        if c.mesh not in seen:
            seen.add(c.mesh)
            out.append(_lost_by_estimate(f"best on mesh {plans.mesh_text(c.mesh)}", c, best.candidate, limit))
    for description, c in counterfactuals:
        out.append(_lost_by_report(description, c, best, limit) if isinstance(c, Verified)
                   else _lost_by_estimate(description, c, best.candidate, limit))
    return out[:most]


def _lost_by_report(description: str, v: Verified, best: Verified, limit: int) -> plans.RunnerUp:
    return plans.RunnerUp(description, v.candidate.estimate, v.report.step_seconds - best.report.step_seconds,
                          why_not_report(v, best, limit))


def _lost_by_estimate(description: str, c: Candidate, best: Candidate, limit: int) -> plans.RunnerUp:
    return plans.RunnerUp(description, c.estimate, c.estimate.step_seconds - best.estimate.step_seconds,
                          why_not(c, best, limit))


def state_replicated(best: Candidate, limit: int) -> tuple[Optional[Candidate], str]:
    """The best plan on the same mesh with the state the function updates (the
    parameters it returns anew: weights, optimizer state) whole on every device."""
    text = f"parameters replicated on mesh {plans.mesh_text(best.mesh)} (data parallel)"
    graph = best.model.graph
    state = _state(graph)
    if not state or all(all(o == UNUSED for o in best.assignment[c]) for c in state):
        return None, text
    whole = [c for c in state if c not in best.model.allowed]
    if sum(v.nbytes for c in whole for n in graph.classes[c] for v, _ in n.values) > limit:
        return None, text     # the state whole on every device alone exceeds the limit: nothing to search
    allowed = {**best.model.allowed, **{c: [{UNUSED} for _ in best.model.axes] for c in whole}}
    start = [tuple(UNUSED for _ in o) if c in whole else o for c, o in enumerate(best.assignment)]
    model = Model(graph, best.mesh, best.model.pricing, allowed, best.model.tally)
    return optimize(model, limit, SCREEN, start, best.price, beat=best.estimate.step_seconds), text


def inputs_split(best: Candidate, paths: list[str], limit: int, effort: Effort) -> tuple[Optional[Candidate], str]:
    """The best plan on the same mesh with the largest input the plan holds whole on
    every device (data, not updated state) split instead, on its best dim and axis.
    The axis-by-axis search can keep such an input whole where the estimate puts the
    two within its error (it sees slicing the input as free, computing on the whole
    as the only cost), though the partitioner then splits the work anyway."""
    model, graph = best.model, best.model.graph
    state = _state(graph)
    value_of = {c: members[0].values[0][0] for c, members in enumerate(graph.classes) if members[0].instr is None}
    whole = [c for c, v in value_of.items() if c not in state and c not in model.allowed and v.rank
             and all(o == UNUSED for o in best.assignment[c])]
    if not whole:
        return None, ""
    c = max(whole, key=lambda c: value_of[c].nbytes)
    found, effort = [], replace(effort, refine=False)   # (from the plan's price: a counterfactual, not a plan)
    for axis in model.splitting:
        for option in model.options(c, best.assignment[c], axis):
            if option != UNUSED:
                held = tuple(option if a == axis else UNUSED for a in model.axes)
                pinned = Model(graph, best.mesh, model.pricing, {**model.allowed, c: [{o} for o in held]}, model.tally)
                start = [held if k == c else o for k, o in enumerate(best.assignment)]
                found.append(optimize(pinned, limit, effort, start, best.price, beat=NEAR * best.estimate.step_seconds))
    if not found:
        return None, ""
    alternative = min(found, key=rank)
    path = paths[graph.program.params.index(value_of[c])]
    spec = list(plans.dims_mapping(alternative.model.value_layouts(alternative.assignment)[value_of[c]], best.mesh))
    return alternative, f"{path} split as {spec} on mesh {plans.mesh_text(best.mesh)}"


def _state(graph: Graph) -> set:
    """The classes of the parameters the function returns anew."""
    return {e.target for e in graph.edges if e.operand_index == CARRY}


def why_not_report(v: Verified, best: Verified, limit: int) -> str:
    """Why a plan partitioned for real lost, from gspmd's reports."""
    return why_slower(v.report, best.report, limit)


def why_slower(a: Report, b: Report, limit: int) -> str:
    """Why the plan reported `a` lost to the one reported `b`."""
    if a.peak_memory_bytes > limit:
        return f"does not fit: peak {plans.bytes_text(a.peak_memory_bytes)} > limit {plans.bytes_text(limit)}"
    compute, communication = a.compute_seconds - b.compute_seconds, a.communication_seconds - b.communication_seconds
    if max(compute, communication) <= 0:
        return "no faster"
    if compute > communication:
        return f"compute +{plans.seconds_text(compute)} (less of the work split)"
    return (f"communication +{plans.seconds_text(communication)} "
            f"({_signed_bytes(a.collective_bytes - b.collective_bytes)} per device)")


def why_not(c: Candidate, best: Candidate, limit: int) -> str:
    """The counterfactual's verdict: what it would take, or what it costs more."""
    if not c.fits:
        slower = c.estimate.step_seconds >= best.estimate.step_seconds   # (then the search stops fitting it)
        return (f"does not fit: estimated peak {plans.bytes_text(c.estimate.peak_memory_bytes)} > limit "
                f"{plans.bytes_text(limit)}" + (" and no faster than the plan even so" if slower else ""))
    a, b = c.estimate, best.estimate
    compute = a.compute_seconds - b.compute_seconds
    mine, theirs = a.by_kind(), b.by_kind()
    seconds = _seconds_by_kind(c), _seconds_by_kind(best)
    slower = {p: seconds[0].get(p, 0.0) - seconds[1].get(p, 0.0) for p in set(mine) | set(theirs)}
    worst = max(slower, key=lambda p: slower[p], default=None)
    if worst is not None and slower[worst] > max(compute, 0.0):   # (a tie goes to compute)
        nbytes = mine.get(worst, (0, 0))[1] - theirs.get(worst, (0, 0))[1]
        return f"{worst.value} +{plans.seconds_text(slower[worst])} ({_signed_bytes(nbytes)} per device)"
    if compute > 0:
        return f"compute +{plans.seconds_text(compute)} (less of the work split)"
    return "no faster"


def _signed_bytes(nbytes: float) -> str:
    return ("+" if nbytes >= 0 else "-") + plans.bytes_text(abs(nbytes))


def _seconds_by_kind(c: Candidate) -> dict[Pattern, float]:
    """Pattern -> the step time its collectives add (what compute does not hide)."""
    out: dict = {}
    for (pattern, axes, nbytes), n in c.estimate.collectives.items():
        out[pattern] = out.get(pattern, 0.0) + n * c.estimate.exposed * c.model.pricing.seconds([(pattern, axes, nbytes)])
    return out
