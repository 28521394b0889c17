"""gspmd.auto: search annotations (mesh shape and strategy) for a function.

1. Trace the function once (traced.py) and build the search graph (graph.py): ops as
   factor spaces, repeated layers tied into one class each.
2. For each candidate mesh (every factorization of the device count into up to three
   axes, or the given mesh), decide one mesh axis at a time which factor of every class
   it splits, the others held (solve.py: the integer program, or its linear relaxation
   where that is integral, where the problem is small; dynamic programming with a beam
   where not, and to screen many meshes quickly), sweeping over the axes until nothing
   changes, from two starts (descent.py). Memory first: while the estimated peak
   exceeds the limit, the bytes live at the peaks seen so far are priced ever higher (a
   Lagrangian) and the axes decided again; among plans that fit, the estimated step
   time decides. The limit prunes as well: memory is fitted from the better start
   only, not at all on a mesh whose unconstrained strategy is no faster than a plan
   that fits already, and no further once a higher price no longer moves the peak
   (Plan.strategies_searched counts the descents).
3. The best candidates become annotations: every parameter's layout, and where
   sharding completion would lay a call's result out otherwise than the strategy, an
   annotation at that call in the source. gspmd partitions and reports them for real
   (verify.py; fitted to the memory limit); where its peak differs from the estimate,
   the mesh is searched again with the limit scaled by the difference; the best that
   fits wins. So do two counterfactuals on the best mesh where gspmd's report agrees
   (runner_ups.py, which also says why each runner-up lost): the data-parallel one
   (the updated state whole on every device) where the estimate prefers it, and the
   largest input the plan holds whole split instead, where the estimate puts it within
   its error of the plan. Both start from the plan at its memory price; the
   data-parallel one is not searched where the state alone exceeds the limit.
4. Where fn's layers are a stack (a lax.scan over stacked parameters) and gspmd chooses
   the mesh, pipelines of the stack are bounded in closed form and the best that could
   beat the plan partitioned for real (stacks.py); the fastest that fits by gspmd's
   report is the plan, the other a runner-up.
"""
from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Callable, Optional, Union

import jax

from gspmd.analysis import Report
from gspmd.arguments import abstract_argument
from gspmd.autoshard import plan as plans
from gspmd.autoshard import stacks
from gspmd.autoshard.costs import Pricing
from gspmd.autoshard.descent import SCREEN, Candidate, Effort, optimize, rank
from gspmd.autoshard.graph import Graph, build
from gspmd.autoshard.model import Model, Tally, annotation_options
from gspmd.autoshard.runner_ups import counterfactuals, runner_ups, why_slower
from gspmd.autoshard.traced import Traced
from gspmd.autoshard.verify import Verified, calibrated, real_rank
from gspmd.checks import array_shape, count, describe, function, is_number_list
from gspmd.errors import ShardingError
from gspmd.ir import Program
from gspmd.mesh import Mesh, as_mesh
from gspmd.sharding import UNSPECIFIED, Sharding, normalize_dims_mapping
from gspmd.spmd.cost import Hardware, device_mesh, profile

AXIS_NAMES = ("x", "y", "z")
REFINED = 3   # meshes searched again, harder, after all were screened
SLACK = 1.25  # candidates estimated up to this much over the memory limit are still partitioned
LARGE = 1500  # instructions from which each candidate is partitioned once (costly)
Progress = Callable[[int, int, str], None]   # (done, total, what) as the search goes


def auto(fn: Callable, *args, devices: Optional[int] = None, mesh: Optional[Mesh] = None,
         hardware: Union[str, Hardware] = "tpu-v3", memory_limit: Optional[int] = None,
         fixed: Optional[dict] = None, progress: Optional[Progress] = None, effort: Effort = Effort(),
         verify: int = 3) -> plans.Plan:
    """Propose annotations for fn(*args) on `devices` devices (the mesh among the
    factorizations of that count into up to three axes) or on `mesh`.

    args may be arrays or jax.ShapeDtypeStruct. `fixed` maps parameter paths (as
    plan.parameters names them, e.g. "params[0]['wq']") to dims_mappings or
    PartitionSpecs over the mesh's axis names ("x", "y", "z" when gspmd chooses the
    mesh) that the plan must keep; annotations already inside fn are kept too.
    Plans whose estimated peak memory per device exceeds `memory_limit` (default: what
    a program may use of the hardware's memory) are infeasible; among feasible ones the
    estimated step time on `hardware` decides. `verify` is how many of the best candidates gspmd partitions
    and reports for real (the search's estimate ranks them; gspmd's report decides)."""
    start = time.perf_counter()
    _check_options(fn, args, fixed, progress, effort, verify)
    hw = profile(hardware)
    limit = hw.usable_bytes if memory_limit is None else count(memory_limit, "gspmd.auto(memory_limit=...)",
                                                                 example="memory_limit=8 * 2**30 (bytes per device)")
    mesh = None if mesh is None else as_mesh(mesh, "for gspmd.auto(mesh=...)")
    meshes = candidate_meshes(devices, mesh, hw)
    paths = plans.parameter_paths(fn, args)
    leaves, tree = jax.tree_util.tree_flatten(args)
    abstract = jax.tree_util.tree_unflatten(tree, [abstract_argument(x, path) for x, path in zip(leaves, paths)])
    with stacks.stacks_watched() as found_stacks:
        traced = Traced(fn, abstract, mesh)
    fixed_params = _fixed_parameters(fixed or {}, paths, traced.program, meshes[0])
    graph = build(traced.program, {traced.program.params[i]: repr(m) for i, m in fixed_params.items()},
                  traced.carried_state())
    stack = None if mesh is not None or fixed or _annotated(graph) or not found_stacks else found_stacks[0]
    steps = Steps(progress or (lambda done, total, what: None),
                  len(meshes) + min(REFINED, len(meshes)) + 2 + (stack is not None))
    tally = Tally()
    found = _search_meshes(graph, meshes, fixed_params, hw, limit, effort, steps, tally)
    best, verified = _partition_best(found, traced, paths, limit, hw, effort, verify, steps)
    steps("runner-ups")
    best, tried = counterfactuals(best, traced, paths, limit, hw, effort)
    others = runner_ups(best, found, verified, tried, limit)
    plan = plans.Plan(fn, abstract, best.candidate.mesh, best.parameters, best.intermediates, best.report,
                      best.candidate.estimate, limit, others, 0.0, all(c.exact for c in found), tally.strategies)
    if stack is not None:
        steps("pipelines")
        plan = _pipelined_if_faster(plan, stack, meshes[0].size, hw, verify)
    steps("done")
    plan.search_seconds = time.perf_counter() - start
    return plan


def _annotated(graph: Graph) -> bool:
    """Whether fn annotates values itself (over axes a pipeline's mesh may not have)."""
    return any(node.annotation is not None for node in graph.nodes)


def _pipelined_if_faster(plan: plans.Plan, stack: stacks.Stack, devices: int, hw: Hardware,
                         verify: int) -> plans.Plan:
    """The plan, or the fastest pipeline of fn's stack of layers that fits where gspmd's
    report finds one faster; the other as a runner-up (stacks.py)."""
    tried = stacks.pipelines(plan.fn, plan.args, stack, devices, hw, plan.memory_limit, plan.step_seconds,
                             max(verify, 1))
    ranked = sorted(tried, key=lambda p: (not p.fits, p.report.step_seconds))
    if not ranked or not ranked[0].fits or ranked[0].report.step_seconds >= plan.step_seconds:
        plan.runner_ups += [_pipeline_lost(p, plan.report, plan.memory_limit) for p in ranked[:1]]
        return plan
    chosen = ranked[0]
    unpipelined = plans.RunnerUp(f"no pipeline: the plan on mesh {plans.mesh_text(plan.mesh)}", plan.estimate,
                                 plan.step_seconds - chosen.report.step_seconds,
                                 why_slower(plan.report, chosen.report, plan.memory_limit))
    return replace(plan, mesh=chosen.mesh, parameters=[(path, None) for path, _ in plan.parameters],
                   intermediates=[], report=chosen.report, estimate=chosen.estimate,
                   runner_ups=[unpipelined] + [_pipeline_lost(p, chosen.report, plan.memory_limit) for p in ranked[1:2]],
                   pipeline=(stack, chosen.how))


def _pipeline_lost(p: stacks.Pipelined, best: Report, limit: int) -> plans.RunnerUp:
    return plans.RunnerUp(f"pipeline of {p.how.describe()} on mesh {plans.mesh_text(p.mesh)} (partitioned)",
                          p.estimate, p.report.step_seconds - best.step_seconds, why_slower(p.report, best, limit))


def _check_options(fn, args: tuple, fixed, progress, effort, verify) -> None:
    """auto's arguments other than the mesh and hardware, up front."""
    function(fn, "gspmd.auto(fn, ...)", arity=len(args))
    for i, a in enumerate(args):
        if isinstance(a, list) and is_number_list(a):
            array_shape(a, f"Argument {i} of gspmd.auto")
    if fixed is not None and not isinstance(fixed, dict):
        raise ShardingError(f"gspmd.auto(fixed=...) needs a dict from parameter path to dims_mapping, got "
                            f"{describe(fixed)}; e.g. fixed={{'x': ['x', None]}}.")
    if progress is not None:
        function(progress, "gspmd.auto(progress=...) (it gets (done, total, what))", arity=3)
    if not isinstance(effort, Effort):
        raise ShardingError(f"gspmd.auto(effort=...) needs a gspmd.autoshard.search.Effort, got {describe(effort)}; "
                            "e.g. Effort(beam=64).")
    count(verify, "gspmd.auto(verify=...) (candidates partitioned for real)")


class Steps:
    """Reports each step of the search to a Progress callback."""

    def __init__(self, progress: Progress, total: int):
        self.progress, self.total, self.done = progress, total, 0

    def __call__(self, what: str) -> None:
        self.progress(min(self.done, self.total), self.total, what)
        self.done += 1


def _search_meshes(graph: Graph, meshes: list[Mesh], fixed_params: dict, hw: Hardware, limit: int, effort: Effort,
                   steps: Steps, tally: Tally) -> list[Candidate]:
    """The best strategy on each mesh, best first: every mesh screened, the best few
    searched again, harder, from where screening ended."""
    screened: list[Candidate] = []
    for m in meshes:
        steps(f"mesh {plans.mesh_text(m)}")
        model = Model(graph, m, Pricing(m, hw), _allowed(graph, fixed_params, m), tally)
        if model.expressible and all(a is not None for a in model.allowed.values()):
            fastest = min((c.estimate.step_seconds for c in screened if c.fits), default=math.inf)
            screened.append(optimize(model, limit, _screening(len(meshes), effort), beat=fastest))
    if not screened:
        raise ShardingError(f"No candidate mesh ({', '.join(plans.mesh_text(m) for m in meshes)}) can express the "
                            "annotations in the function or in fixed=; name mesh axes that exist "
                            f"({', '.join(AXIS_NAMES)} when gspmd chooses the mesh) or pass mesh=.")
    found = sorted(screened, key=rank)
    if len(meshes) > REFINED:
        for i, c in enumerate(found[:REFINED]):
            steps(f"refining mesh {plans.mesh_text(c.mesh)}")
            found[i] = min(c, optimize(c.model, limit, effort, c.assignment, c.price), key=rank)
        found.sort(key=rank)
    return found


def _partition_best(found: list[Candidate], traced: Traced, paths: list[str], limit: int, hw: Hardware,
                    effort: Effort, verify: int, steps: Steps) -> tuple[Verified, list]:
    """Partition the best few candidates for real (more while none fits) and keep the
    fastest that fits by gspmd's own report."""
    worth = [c for c in found if c.estimate.peak_memory_bytes <= limit * SLACK]
    if not worth:
        _no_plan_fits(limit, min(c.estimate.peak_memory_bytes for c in found), "estimated")
    steps("partitioning the best candidates")
    count = max(verify, 1)
    small = len(traced.program.instrs) < LARGE
    verified: list = []
    for c in worth:
        if len(verified) >= count and (any(v.fits for v in verified) or len(verified) >= 2 * count):
            break
        verified.append(calibrated(c, traced, paths, limit, hw, effort, small, tries=2 if small else 1))
    best = min(verified, key=real_rank)
    if not best.fits:
        _no_plan_fits(limit, best.report.peak_memory_bytes, "partitioned")
    return best, verified


def _no_plan_fits(limit: int, smallest: int, how: str):
    raise ShardingError(
        f"No plan fits the memory limit of {plans.bytes_text(limit)} per device: the smallest peak found is "
        f"{plans.bytes_text(smallest)} ({how}). Raise memory_limit, use more devices, or make the step smaller "
        "(batch, rematerialization).")


def _screening(meshes: int, effort: Effort) -> Effort:
    """How hard to search each mesh before the best are searched again: as hard as
    asked when there are few, the dynamic program alone when there are many."""
    return effort if meshes <= REFINED else SCREEN if meshes > 2 * REFINED + 1 else replace(SCREEN, exact=True)


# -- meshes -------------------------------------------------------------------------------
def candidate_meshes(devices: Optional[int], mesh: Optional[Mesh], hardware: Hardware) -> list[Mesh]:
    """The given mesh, or each factorization of the device count laid onto the
    hardware's network as jax's mesh_utils would (spmd.cost.device_mesh)."""
    n = jax.device_count() if devices is None else count(devices, "gspmd.auto(devices=...) (a device count)")
    if mesh is not None:
        if devices is not None and devices != mesh.size:
            raise ShardingError(f"auto got devices={devices} and a mesh of {mesh.size}; pass one of them.")
        return [mesh]
    return [Mesh(device_mesh(shape, hardware), AXIS_NAMES[:len(shape)]) for shape in factorizations(n)]


def factorizations(n: int, most: int = 3) -> list[tuple[int, ...]]:
    """n as a product of up to `most` factors of at least 2, largest first (each
    multiset once: which axis does what is the strategy's choice)."""
    if n == 1:
        return [(1,)]
    found = []

    def extend(rest: int, prefix: tuple, largest: int):
        if rest == 1:
            found.append(prefix)
            return
        if len(prefix) == most:
            return
        for f in range(min(rest, largest), 1, -1):
            if rest % f == 0:
                extend(rest // f, prefix + (f,), f)
    extend(n, (), n)
    return sorted(found, key=lambda s: (len(s), s))



# -- fixed layouts ------------------------------------------------------------------------------
def _fixed_parameters(fixed: dict, paths: list[str], program: Program, mesh: Mesh) -> dict:
    """Parameter index -> (its dims_mapping with UNSPECIFIED entries, as given)."""
    out = {}
    for path, spec in fixed.items():
        if path not in paths:
            raise ShardingError(f"fixed names {path!r}, which is not a parameter; parameters are "
                                f"{', '.join(paths[:8])}{', ...' if len(paths) > 8 else ''}.")
        i = paths.index(path)
        shape = program.params[i].shape
        out[i] = normalize_dims_mapping(spec, shape, mesh, f"fixed[{path!r}] (shape {shape})")
    return out


def _allowed(graph: Graph, fixed_params: dict, mesh: Mesh) -> dict:
    """Class -> per axis the options `fixed` leaves (None: not expressible on this mesh).
    Fixed parameters were kept out of other parameters' classes (build's `marks`)."""
    allowed = {}
    for i, mapping in fixed_params.items():
        p = graph.program.params[i]
        c = graph.class_of[graph.node_of[p][0].index]
        try:
            sharding = Sharding.from_mesh(mesh, mapping, p.shape)
        except ShardingError:
            allowed[c] = None
            continue
        allowed[c] = annotation_options(sharding, [d for d, e in enumerate(mapping) if e is UNSPECIFIED], mesh)
    return allowed
