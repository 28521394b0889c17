"""`gspmd plan MODEL --auto`: the whole training configuration searched, not typed.

Given a recipe's model (its semantics fixed: dims, attention kind, dropout, optimizer,
dtypes, global batch) and a device count, choose the mesh, the strategy, pipeline stages,
schedule, repeats, microbatches and the rematerialization policy:

1. Enumerate every configuration the recipe takes (meshes over the devices, a pipeline
   axis among them, schedules and their repeats, microbatches, strategies).
2. Bound each in closed form from single-device plans of the model, one per remat
   policy: memory at least the parameters and optimizer state over the devices that
   split them; compute at least that of the least recompute spread over every device,
   stretched by the schedule's bubble (1F1B: each layer recomputed). Expect each
   policy's plan to hold its activations over every device too, and the step to take
   the compute of the least recompute so expected to fit plus the communication the one
   cost model (spmd/cost.py) gives over the mesh's device groups.
3. Prune what cannot fit; partition the rest for real in the order of their
   expectations, scaled by how far the plans so far fell from theirs (those expected
   to fit first; each with the least recompute expected to fit, planning.plan_to_fit),
   until the next one's lower bound cannot beat the best found or the time budget is
   spent; the best is planned again with each other policy, where one fits and is
   faster.

The answer says what it chose, and for each runner-up what it costs more and why.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

from gspmd import planning
from gspmd.errors import ShardingError
from gspmd.plan_bounds import Floor
from gspmd.recipes import MODELS, SCHEDULES, STRATEGIES
from gspmd.spmd.cost import Hardware

# What the search varies; the model's other sizes are its semantics.
SEARCHED = ("mesh", "strategy", "stages", "schedule", "repeats", "microbatches", "remat")
MAX_REPEATS = 4          # virtual stages per stage tried (interleaved 1F1B, circular)
MAX_MICROBATCHES = 256   # microbatches tried at most (per pipeline or accumulation)


@dataclass(frozen=True)
class Config:
    """One training configuration: the plan flags the search chooses."""
    mesh: tuple[int, ...]
    strategy: Optional[str] = None
    stages: Optional[int] = None
    schedule: Optional[str] = None
    repeats: Optional[int] = None
    microbatches: Optional[int] = None
    data_axis: int = dataclasses.field(default=0, compare=False)           # the mesh axis the batch splits over
    model_axis: Optional[int] = dataclasses.field(default=None, compare=False)   # the strategy's other axis

    def sizes(self, base: planning.Sizes) -> planning.Sizes:
        chosen = {name: getattr(self, name) for name in SEARCHED[:-1] if getattr(self, name) is not None}
        return dataclasses.replace(base, **chosen)

    @property
    def x(self) -> int:
        return self.mesh[self.data_axis]

    @property
    def y(self) -> int:
        return 1 if self.model_axis is None else self.mesh[self.model_axis]

    @property
    def pipelined(self) -> bool:
        return self.stages is not None

    def describe(self) -> str:
        parts = ["mesh " + "x".join(map(str, self.mesh))]
        if self.strategy:
            parts.append(f"strategy {self.strategy}")
        if self.pipelined:
            parts.append(f"{self.stages} stages, {self.schedule}" + (f" x{self.repeats}" if self.repeats > 1 else ""))
        if self.microbatches and self.microbatches > 1:
            parts.append(f"{self.microbatches} microbatches")
        return ", ".join(parts)


@dataclass(eq=False)     # each one itself: the search's queue finds and removes it by identity
class Candidate:
    config: Config
    lower_bound_s: float        # no plan of it can take less
    estimate_s: float           # the order plans are tried in
    memory_floor: float         # bytes per device no plan of it can hold less than
    policies: list              # the remat policies to try, least recompute first
    held: dict                  # policy -> bytes per device its plan is expected to hold (uncalibrated)
    plan: Optional[planning.CasePlan] = None

    @property
    def step_s(self) -> float:
        return self.plan.report.step_seconds


@dataclass
class Search:
    """The outcome: the chosen plan, the candidates partitioned for real (best first) and
    what the bounds set aside."""
    model: str
    chosen: Candidate
    verified: list[Candidate]
    considered: int
    pruned_by_memory: int
    pruned_by_bound: int
    unexplored: int             # left when the budget (time or plans) ran out
    refused: int                # configurations the recipe refuses (a split it needs even, say)
    seconds: float

    def configuration(self) -> dict:
        """The plan flags that reproduce the chosen plan with `gspmd plan MODEL`."""
        sizes, config = self.chosen.plan.case.sizes, self.chosen.config
        out = {"mesh": "x".join(map(str, sizes["mesh"]))}
        out.update((name, getattr(config, name)) for name in SEARCHED[1:-1] if getattr(config, name) is not None)
        out["remat"] = _remat(self.chosen.plan)
        return out

    def flags(self) -> str:
        return " ".join(f"--{k.replace('_', '-')} {v}" for k, v in self.configuration().items())

    def runners_up(self) -> list[dict]:
        best = self.chosen.plan.report
        return [{"configuration": c.config.describe(), "remat": _remat(c.plan),
                 "step_seconds": c.step_s, "slower": c.step_s / best.step_seconds - 1,
                 "fits_in_memory": c.plan.report.fits_in_memory, "why": why_slower(c.plan.report, best)}
                for c in self.verified if c is not self.chosen]

    def as_json(self) -> dict:
        return {"configuration": self.configuration(), "search_seconds": self.seconds,
                "candidates": self.considered, "pruned_by_memory": self.pruned_by_memory,
                "pruned_by_bound": self.pruned_by_bound, "unexplored": self.unexplored,
                "partitioned": len(self.verified),
                "runners_up": self.runners_up()}

    def explain(self) -> str:
        lines = [f"searched {self.considered} configurations in {self.seconds:.1f} s: {self.pruned_by_memory} cannot "
                 f"fit (parameters and optimizer state alone), {self.pruned_by_bound} cannot beat the best (compute "
                 f"and bubbles alone), {len(self.verified)} partitioned"
                 + (f", {self.unexplored} left when the budget (time or plans) ran out" if self.unexplored else ""),
                 f"chose {self.chosen.config.describe()}, remat {_remat(self.chosen.plan)}: "
                 f"gspmd plan {self.model} {self.flags()}"]
        for r in self.runners_up():
            fits = "" if r["fits_in_memory"] else ", does NOT fit"
            lines.append(f"  runner-up {r['configuration']}, remat {r['remat']}: {r['step_seconds'] * 1e3:.1f} ms, "
                         f"{r['slower']:+.1%}{fits} ({r['why']})")
        return "\n".join(lines)


def why_slower(report, best) -> str:
    """The largest of the ways `report`'s step exceeds `best`'s."""
    mine, theirs = _step_by_cause(report), _step_by_cause(best)
    causes = {cause: mine[cause] - theirs[cause] for cause in mine}
    worst = max(causes, key=causes.get)
    return f"{worst} +{causes[worst] * 1e3:.1f} ms"


def _step_by_cause(report) -> dict[str, float]:
    """A step's seconds by what they are spent on."""
    bubbles, recompute = report.bubble_fraction or 0, report.recompute_fraction or 0
    return {"compute (FLOPs per device)": report.compute_seconds * (1 - bubbles) * (1 - recompute),
            "pipeline bubbles": report.compute_seconds * bubbles,
            "recompute": report.compute_seconds * recompute,
            "exposed communication": report.exposed_communication_seconds}


def _remat(plan: planning.CasePlan) -> str:
    """The --remat value of a plan."""
    return _policy_of(plan) or "none"


def _policy_of(plan: planning.CasePlan) -> Optional[str]:
    """The remat policy a plan chose (None: no rematerialization)."""
    return plan.case.sizes.get("remat")


def search(model: str, base: planning.Sizes, devices: int, hardware: Union[str, Hardware] = "tpu-v3",
           budget_s: float = 60.0, max_plans: Optional[int] = None, remat_choices: Optional[Sequence[str]] = None,
           keep: Callable[[Config], bool] = lambda config: True) -> Search:
    """The best configuration of `model` over `devices` found within `budget_s` seconds
    (a plan whose partitioning would end past it is not started; the first always is)
    and `max_plans` configurations partitioned for real. Sizes given in `base` (a mesh, stages, a strategy, ...) are kept;
    the others in SEARCHED are chosen: among `remat_choices` (least recompute first; default
    planning.FIT_ORDER) and the configurations `keep` keeps (a framework's knobs may
    reach only some)."""
    clock = _Clock(budget_s)
    if model not in MODELS:
        raise ShardingError(f"--auto searches the recipes ({', '.join(sorted(MODELS))}); for your own function "
                            "use `gspmd auto module:function` (annotations) or gspmd.auto.")
    hw = planning.profile(hardware)
    spec = MODELS[model]
    if "batch" in spec.defaults and base.batch is None and spec.defaults["batch"] is None:
        base = dataclasses.replace(base, batch=max(devices // 2, 1))   # the recipe's default, fixed up front
    policies = (tuple(remat_choices or planning.FIT_ORDER) if base.remat in (None, "auto") else (base.remat,))
    floor = Floor(model, _one_device(model, base), hw, policies)
    candidates = []
    for config in filter(keep, configurations(spec.defaults, base, devices)):
        bound, expected, memory, held = floor.bounds(config)
        allowed = [p for p in policies if planning.remat_refused(p, config.schedule, config.repeats) is None]
        candidates.append(Candidate(config, bound, expected + floor.communication(config), memory,
                                    allowed or list(policies), held))
    if not candidates:
        raise ShardingError(f"No configuration of {model} over {devices} devices: check --devices (its "
                            "factorizations) against --layers, --heads and --batch.")
    fitting = [c for c in candidates if c.memory_floor <= hw.usable_bytes] or candidates   # (none: the least bad)
    verified: list[Candidate] = []
    pruned = unexplored = refused = 0
    # The best estimate of each family (strategy, pipelined or not) first, so that each
    # family's estimates are calibrated against a real plan before the rest are ranked.
    queue = sorted(fitting, key=lambda c: (c.estimate_s, c.lower_bound_s))
    seeds = list({_family(c): c for c in reversed(queue)}.values())[::-1]
    while queue:
        best = min(verified, key=_rank, default=None)
        if best is not None and best.plan.report.fits_in_memory:
            kept = [c for c in queue if c.lower_bound_s < best.step_s]
            pruned += len(queue) - len(kept)
            queue = kept
        if not queue:
            break
        calibration = _Calibration(verified, hw.usable_bytes)
        c = next((s for s in seeds if s in queue), None) or _neighbour(best, queue, calibration) \
            or min(queue, key=calibration.order)
        # (time kept for one more plan: the best's with the policies it did not try)
        if verified and (not clock.allows(_family(c), plans=2) or len(verified) == (max_plans or math.inf)):
            unexplored = len(queue)
            break
        queue.remove(c)
        try:
            with clock.timing(_family(c)):
                c.plan = planning.plan_to_fit(model, c.config.sizes(base), hw, calibration.may_fit(c))
        except ShardingError:        # a configuration the recipe refuses (a split it needs even, say)
            refused += 1
            continue
        verified.append(c)
    if not verified:
        raise ShardingError(f"No configuration of {model} over {devices} devices could be planned.")
    verified.sort(key=_rank)
    _other_policies_if_faster(model, base, hw, verified[0], clock)
    verified.sort(key=_rank)
    return Search(model, verified[0], verified, len(candidates), len(candidates) - len(fitting), pruned, unexplored,
                  refused, clock.elapsed())


class _Clock:
    """The search's time budget: another plan is started only where it would end within
    the budget, were it to take a fifth longer than the longest of its family so far
    (strategy, pipelined or not), or half as long again as the longest of any where its
    family has none (a pipeline's plans take longer)."""

    def __init__(self, budget_s: float):
        self.budget_s, self.start, self.longest = budget_s, time.perf_counter(), {}

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def allows(self, family: tuple, plans: int = 1) -> bool:
        """Whether `plans` more plans of `family` would end within the budget."""
        guess = 1.2 * self.longest[family] if family in self.longest else 1.5 * max(self.longest.values(), default=0)
        return self.elapsed() + plans * guess <= self.budget_s

    @contextlib.contextmanager
    def timing(self, family: tuple):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.longest[family] = max(self.longest.get(family, 0.0), time.perf_counter() - started)


def _other_policies_if_faster(model: str, base: planning.Sizes, hw: Hardware, best: Candidate,
                              clock: _Clock) -> None:
    """The best plan with the policies it did not try, where one fits and is faster (and
    time allows): first those recomputing less that the memory calibration passed over
    (expectations err), the nearest first, down to the first that fits; then those
    recomputing more (recomputing an element-wise op can cost less than writing it to
    memory and reading it back)."""
    tried = {policy for policy, _ in best.plan.remat_tried}
    policy = _policy_of(best.plan)
    chosen = best.policies.index(policy) if policy in best.policies else 0
    sizes = best.config.sizes(base)
    less, more = best.policies[:chosen][::-1], best.policies[chosen + 1:]
    for group in (less, more):
        for policy in group:
            if policy in tried or planning.remat_refused(policy, sizes.schedule, sizes.repeats) is not None:
                continue
            if not clock.allows(_family(best)):
                return
            with clock.timing(_family(best)):
                other = planning.plan(model, dataclasses.replace(sizes, remat=policy), hw)
            if other.report.fits_in_memory and other.report.step_seconds < best.step_s:
                best.plan = other
            if group is less and not other.report.fits_in_memory:
                break       # recomputing less still, it would hold more


def _family(c: Candidate) -> tuple:
    return c.config.strategy, c.config.pipelined


class _Calibration:
    """A candidate's estimates scaled by how far those of the plans partitioned so far
    nearest it fell from theirs (of its family, the geometric mean of their ratios; all
    plans' where its family has none yet): its step, and the bytes each remat policy's
    plan would hold (by the plans with that policy). Nearest: the fewest doublings apart in mesh axes, microbatches and
    repeats, up to NEAR (the cost model's errors vary with a split); farther, the mean
    of its family's."""

    def __init__(self, verified: list[Candidate], usable_bytes: float):
        self.usable = usable_bytes
        self.step = self._ratios(verified, lambda c: c.step_s / c.estimate_s)
        # (per policy: what a plan holds beyond its expectation differs with what it saves)
        self.held = {policy: self._ratios([c for c in verified if _policy_of(c.plan) == policy],
                                          lambda c: c.plan.report.peak_memory_bytes / c.held[_policy_of(c.plan)])
                     for policy in {_policy_of(c.plan) for c in verified}}

    @staticmethod
    def _ratios(plans: list[Candidate], ratio: Callable[[Candidate], float]) -> Callable[[Candidate], float]:
        def mean(some: list[Candidate]) -> float:
            return math.exp(sum(math.log(ratio(c)) for c in some) / len(some)) if some else 1.0
        overall = mean(plans)

        def scale(c: Candidate) -> float:
            kin = [v for v in plans if _family(v) == _family(c)]
            near = [v for v in kin if _doublings(c, v) <= NEAR]
            if not near:
                return mean(kin) if kin else overall
            nearest = min(_doublings(c, v) for v in near)
            return mean([v for v in near if _doublings(c, v) == nearest])
        return scale

    def holds(self, c: Candidate, policy: Optional[str]) -> float:
        """The bytes c's plan with `policy` is expected to hold, calibrated by the plans
        with that policy (uncalibrated where none has it)."""
        return c.held[policy] * (self.held[policy](c) if policy in self.held else 1.0)

    def may_fit(self, c: Candidate) -> list:
        """The policies that may fit c, calibrated (its most recompute where none may)."""
        return [p for p in c.policies if self.holds(c, p) <= self.usable] or c.policies[-1:]

    def order(self, c: Candidate) -> tuple:
        """Candidates expected to fit first, then by calibrated estimate."""
        fits = any(self.holds(c, p) <= self.usable for p in c.policies)
        return not fits, c.estimate_s * self.step(c)


NEAR = 2              # doublings apart within which plans calibrate a candidate by themselves
NEIGHBOURHOOD = 1.1   # a neighbour of the best is tried first where expected within 10% of it


def _neighbour(best: Optional[Candidate], queue: list[Candidate], calibration: _Calibration) -> Optional[Candidate]:
    """The best plan's nearest kin still queued (its family, one axis halved and another
    doubled, or its microbatches or repeats doubled or halved), the most promising
    first, where expected within NEIGHBOURHOOD of it: the estimates' errors vary with
    the mesh's shape, so a step from the best so far is worth more than a far one
    ranked a little better."""
    if best is None or not best.plan.report.fits_in_memory:
        return None
    ranked = [(calibration.order(c), c) for c in queue if _family(c) == _family(best) and _doublings(c, best) <= 2]
    near = [(rank, c) for rank, c in ranked if not rank[0] and rank[1] <= NEIGHBOURHOOD * best.step_s]
    return min(near, key=lambda pair: pair[0], default=(None, None))[1]


def _doublings(a: Candidate, b: Candidate) -> float:
    """How many doublings apart two configurations of a family are (mesh axes,
    microbatches, repeats)."""
    def sizes(c: Candidate) -> tuple:
        return (*c.config.mesh, c.config.microbatches or 1, c.config.repeats or 1)
    return sum(abs(math.log2(x / y)) for x, y in zip(sizes(a), sizes(b)))


def _rank(c: Candidate) -> tuple:
    """Plans that fit first, then the fastest."""
    return (not c.plan.report.fits_in_memory, c.plan.report.step_seconds)


# -- the space ------------------------------------------------------------------------------
def configurations(defaults: dict, base: planning.Sizes, devices: int):
    """Every configuration of the recipe over `devices`, keeping what `base` gives."""
    given = base.given()
    sizes = {**defaults, **given}
    layers, heads, batch = sizes.get("layers"), sizes.get("heads"), sizes.get("batch")
    strategies = [given["strategy"]] if "strategy" in given else \
        (sorted(STRATEGIES) if "strategy" in defaults else [None])
    for shape, stages, data, model in _meshes(given.get("mesh"), devices, defaults):
        if "stages" in given and given["stages"] != stages:
            continue
        x, y = shape[data], 1 if model is None else shape[model]
        if (heads and heads % y) or (layers and stages and layers % stages) or (batch and batch % x):
            continue
        for strategy in strategies:
            for schedule, repeats in _schedules(stages, layers, given):
                for m in _microbatches(stages, batch, x, given, "microbatches" in defaults):
                    yield Config(shape, strategy, stages, schedule, repeats, m, data, model)


def _meshes(given: Optional[tuple], devices: int, defaults: dict):
    """(shape, stages, data axis, model axis) of each mesh over the devices, in the form
    the recipe takes: its default mesh's rank (a 1-D expert axis, data x model); with a
    pipeline a stage axis first (3-D, or 2-D where the model splits nothing over a second
    axis). A model always pipelined (a default stage count) is pipelined over 1 to all
    of the devices."""
    arity = len(defaults.get("mesh") or (0,))
    pipelines, always = "stages" in defaults, defaults.get("stages") is not None
    model_axis = "strategy" in defaults or (arity == 2 and not always)
    shapes = []
    if not always:
        for y in _divisors(devices) if model_axis else [1]:
            shapes.append(((devices // y, y)[:arity], None, 0, 1 if model_axis else None))
    if pipelines:
        for stages in _divisors(devices)[0 if always else 1:]:
            rest = devices // stages
            for y in _divisors(rest) if model_axis else [1]:
                shape = (stages, rest // y, y) if model_axis else (stages, rest)
                shapes.append((shape, stages, 1, 2 if model_axis else None))
    for shape, stages, data, model in shapes:
        if given is None or tuple(given) == shape:
            yield shape, stages, data, model


def _schedules(stages: Optional[int], layers: Optional[int], given: dict):
    if stages is None:
        yield None, None
        return
    per_stage = layers // stages
    for schedule in ([given["schedule"]] if "schedule" in given else SCHEDULES):
        repeats = [1] if schedule == "gpipe" else [r for r in range(1, MAX_REPEATS + 1) if per_stage % r == 0]
        if schedule == "circular":
            repeats = [r for r in repeats if r > 1]
        for r in ([given["repeats"]] if "repeats" in given else repeats):
            yield schedule, r


def _microbatches(stages: Optional[int], batch: Optional[int], x: int, given: dict, accumulates: bool):
    """Microbatch counts: a pipeline's, multiples of its stages; without one, gradient
    accumulation (None: none) where the recipe takes it. Each microbatch splits evenly
    over x: the counts divide the batch a data-parallel replica takes."""
    if "microbatches" in given:
        yield given["microbatches"]
        return
    if not stages:
        yield None
        if not accumulates:
            return
    if batch is None or batch % x:
        return
    for m in _divisors(batch // x):
        if m <= MAX_MICROBATCHES and (m % stages == 0 if stages else m > 1):
            yield m


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _one_device(model: str, base: planning.Sizes) -> planning.Sizes:
    """The model of `base` (what it parallelizes and recomputes left open) on one device."""
    model_only = dataclasses.replace(base, **{k: None for k in SEARCHED})
    return next(configurations(MODELS[model].defaults, model_only, 1)).sizes(model_only)
