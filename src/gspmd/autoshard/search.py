"""gspmd.auto: search annotations (mesh shape and strategy) for a function.

1. Trace the function once and build the search graph (graph.py): ops as factor
   spaces, repeated layers tied into one class each.
2. For each candidate mesh (every factorization of the device count into up to three
   axes, or the given mesh), decide one mesh axis at a time which factor of every class
   it splits, the others held (solve.py: the integer program, or its linear relaxation
   where that is integral, where the problem is small; dynamic programming with a beam
   where not, and to screen many meshes quickly), sweeping over the axes until nothing
   changes, from two starts. Memory first: while the estimated peak exceeds the limit,
   the bytes live at the peaks seen so far are priced ever higher (a Lagrangian) and
   the axes decided again; among plans that fit, the estimated step time decides.
   The limit prunes as well: memory is fitted from the better start only, not at all
   on a mesh whose unconstrained strategy is no faster than a plan that fits already,
   and no further once a higher price no longer moves the peak (Plan.strategies_searched
   counts the descents).
3. The best candidates become annotations: every parameter's layout, and where
   sharding completion would lay a call's result out otherwise than the strategy, an
   annotation at that call in the source. gspmd partitions and reports them for real
   (fitted to the memory limit); where its peak differs from the estimate, the mesh is
   searched again with the limit scaled by the difference; the best that fits wins.
   So do two counterfactuals on the best mesh where gspmd's report agrees: the data-
   parallel one (the updated state whole on every device) where the estimate prefers
   it, and the largest input the plan holds whole split instead, where the estimate
   puts it within its error of the plan. Both start from the plan at its memory price;
   the data-parallel one is not searched where the state alone exceeds the limit.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Callable, Optional, Sequence, Union

import jax

from gspmd import propagation
from gspmd.spmd.cost import Hardware, Pattern, device_mesh, profile
from gspmd.api import jit
from gspmd.autoshard import plan as plans
from gspmd.autoshard.costs import Pricing
from gspmd.autoshard.graph import CARRY, Graph, build
from gspmd.autoshard.model import UNUSED, Assignment, Estimate, Model, Tally, annotation_options
from gspmd.arguments import abstract_argument
from gspmd.autoshard.solve import BEAM, solve, solve_exact
from gspmd.checks import array_shape, count, describe, function, is_number_list
from gspmd.errors import ShardingError
from gspmd.frontend import trace
from gspmd.ir import Builder, Program, Value
from gspmd.ir.dce import eliminate_dead_code
from gspmd.mesh import Mesh, as_mesh
from gspmd.passes.cse import eliminate_common_subexpressions
from gspmd.sharding import UNSPECIFIED, Sharding, normalize_dims_mapping

AXIS_NAMES = ("x", "y", "z")
REFINED = 3   # meshes searched again, harder, after all were screened
SLACK = 1.25  # candidates estimated up to this much over the memory limit are still partitioned
CALIBRATED = 0.03   # an estimate this close to the report needs no second search
NEAR = 1.02   # a counterfactual estimated within this of the plan is partitioned for real
LARGE = 1500  # instructions from which each candidate is partitioned once (costly)
Progress = Callable[[int, int, str], None]   # (done, total, what) as the search goes


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
    traced = Traced(fn, abstract, mesh)
    fixed_params = _fixed_parameters(fixed or {}, paths, traced.program, meshes[0])
    graph = build(traced.program, {traced.program.params[i]: repr(m) for i, m in fixed_params.items()},
                  traced.carried_state())
    steps = Steps(progress or (lambda done, total, what: None), len(meshes) + min(REFINED, len(meshes)) + 2)
    tally = Tally()
    found = _search_meshes(graph, meshes, fixed_params, hw, limit, effort, steps, tally)
    best, verified = _partition_best(found, traced, paths, limit, hw, effort, verify, steps)
    steps("runner-ups")
    best, replicated = _against(best, *_state_replicated(best.candidate, limit), traced, paths, limit, hw, 1.0)
    best, split = _against(best, *_inputs_split(best.candidate, paths, limit, effort), traced, paths, limit, hw, NEAR)
    runner_ups = _runner_ups(best, found, verified, [c for c in (replicated, split) if c is not None], limit)
    steps("done")
    return plans.Plan(fn, abstract, best.candidate.mesh, best.parameters, best.intermediates, best.report,
                      best.candidate.estimate, limit, runner_ups, time.perf_counter() - start,
                      all(c.exact for c in found), tally.strategies)


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
        steps(f"mesh {_mesh_text(m)}")
        model = Model(graph, m, Pricing(m, hw), _allowed(graph, fixed_params, m), tally)
        if model.expressible and all(a is not None for a in model.allowed.values()):
            fastest = min((c.estimate.step_seconds for c in screened if c.fits), default=math.inf)
            screened.append(optimize(model, limit, _screening(len(meshes), effort), beat=fastest))
    if not screened:
        raise ShardingError(f"No candidate mesh ({', '.join(_mesh_text(m) for m in meshes)}) can express the "
                            "annotations in the function or in fixed=; name mesh axes that exist "
                            f"({', '.join(AXIS_NAMES)} when gspmd chooses the mesh) or pass mesh=.")
    found = sorted(screened, key=_rank)
    if len(meshes) > REFINED:
        for i, c in enumerate(found[:REFINED]):
            steps(f"refining mesh {_mesh_text(c.mesh)}")
            found[i] = min(c, optimize(c.model, limit, effort, c.assignment, c.price), key=_rank)
        found.sort(key=_rank)
    return found


def _partition_best(found: list[Candidate], traced: "Traced", paths: list[str], limit: int, hw: Hardware,
                    effort: Effort, verify: int, steps: Steps) -> tuple["Verified", list]:
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
    best = min(verified, key=_real_rank)
    if not best.fits:
        _no_plan_fits(limit, best.report.peak_memory_bytes, "partitioned")
    return best, verified


def _no_plan_fits(limit: int, smallest: int, how: str):
    raise ShardingError(
        f"No plan fits the memory limit of {plans.bytes_text(limit)} per device: the smallest peak found is "
        f"{plans.bytes_text(smallest)} ({how}). Raise memory_limit, use more devices, or make the step smaller "
        "(batch, rematerialization).")


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


def _mesh_text(mesh: Mesh) -> str:
    return "x".join(map(str, mesh.shape))


# -- the traced function ----------------------------------------------------------------------
class Traced:
    """fn traced once: its program, and where each call in its source went (to annotate
    intermediate values where the source computes them)."""

    def __init__(self, fn: Callable, args: tuple, mesh: Optional[Mesh]):
        self.fn, self.args = fn, args
        flat, tree = jax.tree_util.tree_flatten(args)
        equations: list = []     # per equation of fn's jaxpr: (equation, operand values, result values)
        self.program, self.out_tree = trace(lambda *a: fn(*jax.tree_util.tree_unflatten(tree, a)), flat,
                                            getattr(fn, "__name__", "main"), mesh,
                                            on_equation=lambda i, eqn, ins, outs: equations.append((eqn, ins, outs)))
        eliminate_dead_code(self.program)
        # The partitioner merges repeated instructions (a broadcast the gradient repeats)
        # after partitioning, which keeps the first alive longer; so does the search.
        eliminate_common_subexpressions(self.program)
        self.results: dict = {}      # source location -> the values its call computes, each run
        self.gradients: dict = {}    # source location -> those values' cotangents as read
        self.what: dict = {}
        for where, site in plans.call_sites([eqn for eqn, _, _ in equations]).items():
            self.results[where] = [equations[i][2][j] for i, j in site.results]
            self.gradients[where] = [equations[i][1][j] for i, j in site.gradients]
            eqn, _, outs = equations[site.results[0][0]]
            self.what[where] = f"{eqn.primitive.name} {outs[site.results[0][1]].type_str()}"
        self.location = {v: where for where, values in self.results.items() for v in values}
        self.position = {instr: i for i, instr in enumerate(self.program.instrs)}

    def carried_state(self) -> list[tuple]:
        """(result, parameter) pairs of state fn updates: a result (or an element of a
        tuple of results) shaped exactly like one of its arguments (new parameters,
        optimizer state) is that argument's next value."""
        outs = jax.tree_util.tree_unflatten(self.out_tree, self.program.outputs)
        parts = list(outs) if isinstance(outs, (tuple, list)) else [outs]
        ins = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(self.args), self.program.params)
        free = list(ins)
        pairs = []
        for part in parts:
            for arg in free:
                if _same_shapes(part, arg):
                    pairs += list(zip(jax.tree_util.tree_leaves(part), jax.tree_util.tree_leaves(arg)))
                    free.remove(arg)
                    break
        return pairs

    def intermediate(self, where: str, layouts: dict, mesh: Mesh) -> Optional[plans.Intermediate]:
        """The annotation at `where`, if the strategy lays out every value the call
        there computes alike (one line of code annotates them all)."""
        found = {layouts.get(v) for v in self.results[where]}
        if len(found) != 1 or None in found:
            return None
        return plans.Intermediate(where, self.what[where], plans.dims_mapping(found.pop(), mesh),
                                  len(self.results[where]))


def _same_shapes(a, b) -> bool:
    leaves_a, tree_a = jax.tree_util.tree_flatten(a)
    leaves_b, tree_b = jax.tree_util.tree_flatten(b)
    return tree_a == tree_b and bool(leaves_a) and all(
        (x.shape, x.dtype) == (y.shape, y.dtype) for x, y in zip(leaves_a, leaves_b))


# -- one mesh -------------------------------------------------------------------------------
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

    best = min((run(s, price) for s in starts), key=_rank)
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
        best = min(best, run(best.assignment, best.price / 2), key=_rank)
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


def _rank(c: Candidate) -> tuple:
    return (not c.fits, c.estimate.step_seconds if c.fits else c.estimate.peak_memory_bytes)


def _screening(meshes: int, effort: Effort) -> Effort:
    """How hard to search each mesh before the best are searched again: as hard as
    asked when there are few, the dynamic program alone when there are many."""
    return effort if meshes <= REFINED else SCREEN if meshes > 2 * REFINED + 1 else replace(SCREEN, exact=True)


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


# -- verification and pinning ---------------------------------------------------------------------
@dataclass
class Verified:
    candidate: Candidate
    parameters: list
    intermediates: list
    report: object
    fits: bool


def verify_candidate(c: Candidate, traced: Traced, paths: list[str], limit: int, hw: Hardware,
                     compare: bool) -> Verified:
    """Annotate every parameter as the candidate lays it out; where sharding
    completion then leaves values in other layouts than the candidate's, annotate those
    too (one source line per repeated layer); partition and report for real. With
    `compare`, also report the plan without those and keep the better."""
    layouts = c.model.value_layouts(c.assignment)
    params = [(path, plans.dims_mapping(layouts[p], c.mesh) if p.rank else None)
              for path, p in zip(paths, traced.program.params)]
    specs = [spec for _, spec in params]
    pins = pins_for(c, traced, layouts, rounds=3 if compare else 1)
    tries = [pins, []] if compare and pins else [pins]
    results = []
    for intermediates in tries:
        report = jit(plans.annotated(traced.fn, c.mesh, specs, intermediates), mesh=c.mesh, memory_limit=limit,
                     hardware=hw).lower(*traced.args).report()
        results.append(Verified(c, params, intermediates, report, report.peak_memory_bytes <= limit))
    return min(results, key=_real_rank)


def calibrated(c: Candidate, traced: Traced, paths: list[str], limit: int, hw: Hardware, effort: Effort,
               compare: bool, tries: int = 1) -> Verified:
    """Verify the candidate; where gspmd's report finds another peak than the search
    estimated (higher: buffers the estimate does not see; lower: ones it counts that
    the partitioner avoids), search this mesh again with the limit scaled by that ratio."""
    v = verify_candidate(c, traced, paths, limit, hw, compare)
    for _ in range(tries):
        ratio = v.report.peak_memory_bytes / max(v.candidate.estimate.peak_memory_bytes, 1)
        # (Found with memory free, a plan that fits gains nothing from a looser limit.)
        if v.fits and (ratio > 1 - CALIBRATED or (ratio <= 1 and not v.candidate.price)):
            break
        target = int(limit / ratio)
        # Its own price would find the candidate again: where it fits the new target, the
        # search starts where memory costs less (it may be faster), else more.
        fits = v.candidate.estimate.peak_memory_bytes <= target
        price = v.candidate.price * (0.5 if fits else 8) if v.candidate.price else 0.0
        again = optimize(c.model, target, effort, v.candidate.assignment, price)
        if not again.fits or again.assignment == v.candidate.assignment:   # (nothing new to partition)
            break
        v = min(v, verify_candidate(again, traced, paths, limit, hw, compare), key=_real_rank)
    return v


def _real_rank(v: Verified) -> tuple:
    return (not v.fits, v.report.step_seconds if v.fits else v.report.peak_memory_bytes)


def pins_for(c: Candidate, traced: Traced, layouts: dict, rounds: int = 3, most: int = 8) -> list:
    """Intermediate annotations that make sharding completion reproduce the candidate:
    annotate the parameters, complete, and annotate the calls in the source whose
    results came out laid out otherwise, largest first, where the candidate lays out
    every result of the call alike; complete again with those, up to `rounds` times and
    `most` source locations."""
    mesh, graph = c.mesh, c.model.graph
    pins: dict = {}     # source location -> Intermediate
    for _ in range(rounds):
        annotations = {p: _sharding(layouts[p], p, mesh) for p in traced.program.params if p.rank}
        for where, pin in pins.items():
            for v in traced.results[where] + traced.gradients[where]:
                annotations[v] = Sharding.from_mesh(mesh, list(pin.dims_mapping), v.shape)
        copy, counterpart = annotated_copy(traced.program, annotations)
        propagation.complete(copy, mesh.size)
        strays: dict = {}
        for v, layout in layouts.items():
            where = traced.location.get(v)
            if (where is not None and where not in pins and v.rank and v in graph.node_of and v in counterpart
                    and counterpart[v].sharding.mesh_axes(mesh) != layout):
                strays[where] = strays.get(where, 0) + v.nbytes
        found = [traced.intermediate(where, layouts, mesh) for where in sorted(strays, key=lambda w: -strays[w])]
        found = [pin for pin in found if pin is not None][:max(most - len(pins), 0)]
        if not found:
            break
        # The earliest stray first (later ones often follow from it), and the largest.
        first = min(found, key=lambda pin: min(_position(traced, v) for v in traced.results[pin.where]))
        for pin in [first] + [p for p in found if p is not first][:1]:
            pins[pin.where] = pin
    return sorted(pins.values(), key=lambda pin: min(_position(traced, v) for v in traced.results[pin.where]))


def _position(traced: Traced, v: Value) -> int:
    return traced.position.get(v.producer, len(traced.position))


def _sharding(layout, v: Value, mesh: Mesh) -> Sharding:
    return Sharding.from_mesh(mesh, list(plans.dims_mapping(layout, mesh)), v.shape)


def annotated_copy(program: Program, annotations: dict) -> tuple[Program, dict]:
    """A copy of `program`'s top level (sub-programs shared) with each value in
    `annotations` annotated with its Sharding right where it is made; and each
    original value's counterpart (the annotated one, where annotated)."""
    copy = Program(program.name)
    b = Builder(copy)
    counterpart: dict = {}

    def place(v: Value, new: Value) -> None:
        if v in annotations:
            new = b.add1("sharding", [new], v.shape, v.dtype, sharding=annotations[v], unspecified=())
        counterpart[v] = new

    for p in program.params:
        counterpart[p] = b.param(p.shape, p.dtype, hint="arg")
    for p in program.params:
        place(p, counterpart[p])
    for instr in program.instrs:
        outs = b.add(instr.opcode, [counterpart[o] for o in instr.operands],
                     [(o.shape, o.dtype) for o in instr.outputs], **instr.attrs)
        for v, new in zip(instr.outputs, outs):
            place(v, new)
    copy.outputs = [counterpart[o] for o in program.outputs]
    return copy, counterpart


# -- runner-ups --------------------------------------------------------------------------------
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
    if _real_rank(v) < _real_rank(best):
        return v, (f"the search's plan on mesh {_mesh_text(best.candidate.mesh)}", best)
    return best, (text, v)


def _runner_ups(best: Verified, found: Sequence[Candidate], verified: Sequence[Verified],
                counterfactuals: Sequence[tuple], limit: int, most: int = 4) -> list:
    """The best plan on each other mesh, and the counterfactuals, each with why it lost.
    Those partitioned for real are compared by gspmd's report, the others by the
    search's estimate."""
    out = []
    seen = {best.candidate.mesh}
    for v in sorted(verified, key=_real_rank):
        if v.candidate.mesh not in seen:
            seen.add(v.candidate.mesh)
            out.append(_lost_by_report(f"best on mesh {_mesh_text(v.candidate.mesh)} (partitioned)", v, best, limit))
    for c in found:
        if len(out) >= most - len(counterfactuals):
            break
        if c.mesh not in seen:
            seen.add(c.mesh)
            out.append(_lost_by_estimate(f"best on mesh {_mesh_text(c.mesh)}", c, best.candidate, limit))
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


def _state_replicated(best: Candidate, limit: int) -> tuple[Optional[Candidate], str]:
    """The best plan on the same mesh with the state the function updates (the
    parameters it returns anew: weights, optimizer state) whole on every device."""
    text = f"parameters replicated on mesh {_mesh_text(best.mesh)} (data parallel)"
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


def _inputs_split(best: Candidate, paths: list[str], limit: int, effort: Effort) -> tuple[Optional[Candidate], str]:
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
    alternative = min(found, key=_rank)
    path = paths[graph.program.params.index(value_of[c])]
    spec = list(plans.dims_mapping(alternative.model.value_layouts(alternative.assignment)[value_of[c]], best.mesh))
    return alternative, f"{path} split as {spec} on mesh {_mesh_text(best.mesh)}"


def _state(graph: Graph) -> set:
    """The classes of the parameters the function returns anew."""
    return {e.target for e in graph.edges if e.operand_index == CARRY}


def why_not_report(v: Verified, best: Verified, limit: int) -> str:
    """Why a plan partitioned for real lost, from gspmd's reports."""
    if not v.fits:
        return f"does not fit: peak {plans.bytes_text(v.report.peak_memory_bytes)} > limit {plans.bytes_text(limit)}"
    a, b = v.report, best.report
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
