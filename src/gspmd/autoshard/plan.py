"""A found strategy as annotations: the Plan gspmd.auto returns, the code it writes, and
the function with the annotations applied (what plan.jit() partitions)."""
from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import jax
from jax.extend import core as jcore
from jax.extend import source_info_util

from gspmd.analysis import Report
from gspmd.api import Partitioned, jit
from gspmd.autoshard.model import Estimate
from gspmd.autoshard.stacks import STAGE_AXIS, Pipelining, Stack, pipeline_code, pipelined
from gspmd.frontend import mesh_split
from gspmd.mesh import Mesh
from gspmd.spmd.cost import GiB

DimsMapping = tuple   # per dim: an axis name, a tuple of names (major to minor), or -1


@dataclass(frozen=True)
class Intermediate:
    """An annotation inside the function: the value the call at source location
    `where` (file:line:column, as jax records it) computes, each of the `count` times it
    runs, as a user who writes `value = gspmd.mesh_split(value, mesh, dims_mapping)`
    right there would annotate it (its gradient too: mesh_split's gradient is the same
    annotation)."""
    where: str
    what: str         # the primitive and the value's type
    dims_mapping: DimsMapping
    count: int = 1


@dataclass
class Site:
    """Where a call in the source went in a jaxpr: per run of the call, the equation and
    output that hold its result; per run of its gradient, the equation and operand that
    read the result's cotangent."""
    results: list = field(default_factory=list)     # [(equation index, output index)]
    gradients: list = field(default_factory=list)   # [(equation index, operand index)]


def location(eqn) -> str:
    return source_info_util.summarize(eqn.source_info)


def is_gradient(eqn) -> bool:
    return "transpose" in str(eqn.source_info.name_stack)


def call_sites(eqns: Sequence) -> dict[str, Site]:
    """Each source location's call sites among a jaxpr's equations. A run of equations
    from one location (a jnp call that became several equations) ends in the call's
    result; a run of the gradient's equations from that location reads the result's
    cotangent first (the first operand typed like the result)."""
    runs: list = []
    for i, eqn in enumerate(eqns):
        key = (location(eqn), is_gradient(eqn))
        if runs and runs[-1][0] == key:
            runs[-1][1].append(i)
        else:
            runs.append((key, [i]))
    sites: dict = {}
    for (where, gradient), indices in runs:
        if not gradient:
            last = eqns[indices[-1]]
            shaped = [j for j, v in enumerate(last.outvars) if v.aval.shape]
            sites.setdefault(where, Site()).results.append((indices[-1], shaped[0] if shaped else 0))
    for (where, gradient), indices in runs:
        if gradient and where in sites:
            eqn, out = sites[where].results[0]
            aval = eqns[eqn].outvars[out].aval
            for i in indices:
                hits = [j for j, v in enumerate(eqns[i].invars) if not isinstance(v, jcore.Literal)
                        and (v.aval.shape, v.aval.dtype) == (aval.shape, aval.dtype)]
                if hits:
                    sites[where].gradients.append((i, hits[0]))
                    break
    return sites


@dataclass
class RunnerUp:
    """A strategy the search rejected, and why."""
    description: str
    estimate: Estimate
    extra_seconds: float      # estimated step time minus the found plan's (same estimator)
    reason: str


@dataclass
class Plan:
    """Annotations gspmd.auto proposes for `fn` on `mesh`, and what they cost.

    `report` is gspmd's own report of the annotated function on `hardware` (the
    partitioner's collectives, peak memory and step time); `estimate` the search's
    estimate of the same strategy; `runner_ups` the best rejected strategies."""
    fn: Callable
    args: tuple                        # jax.ShapeDtypeStruct pytrees
    mesh: Mesh
    parameters: list                   # [(path, DimsMapping or None)] in argument order
    intermediates: list[Intermediate]
    report: Report
    estimate: Estimate
    memory_limit: int
    runner_ups: list[RunnerUp] = field(default_factory=list)
    search_seconds: float = 0.0
    exact: bool = True                 # every decision solved exactly (no beam truncation)
    strategies_searched: int = 0       # strategies the search solved (one descent over the mesh axes each)
    # (stack, pipelining): fn's scan over stacked layers runs as a pipeline (stacks.py)
    pipeline: Optional[tuple[Stack, Pipelining]] = None

    # -- what it costs ------------------------------------------------------------------
    @property
    def step_seconds(self) -> float:
        return self.report.step_seconds

    @property
    def peak_memory_bytes(self) -> int:
        return self.report.peak_memory_bytes

    @property
    def collectives(self) -> dict:
        """kind -> (how many run per step, bytes per device per step)"""
        out: dict = {}
        for c in self.report.collectives:
            count, nbytes = out.get(c.kind, (0, 0))
            out[c.kind] = (count + c.executions, nbytes + c.bytes * c.executions)
        return dict(sorted(out.items()))

    # -- what to do with it -----------------------------------------------------------------
    def function(self) -> Callable:
        """fn with the plan's annotations applied (and its stack of layers pipelined)."""
        fn = self.fn if self.pipeline is None else pipelined(self.fn, *self.pipeline, self.mesh)
        return annotated(fn, self.mesh, [spec for _, spec in self.parameters], self.intermediates)

    def jit(self, backend: str = "sim") -> Partitioned:
        """gspmd.jit of fn with the plan applied (fitted to its memory limit, reported on its hardware)."""
        return jit(self.function(), mesh=self.mesh, backend=backend, memory_limit=self.memory_limit,
                   hardware=self.report.hardware)

    def code(self) -> str:
        """Python to paste into the model: the mesh, and `annotate(...)` splitting every
        argument (call it first thing in the function); intermediate annotations, if
        any, as comments naming the source line where each belongs; a pipelined plan's
        `pipelined_layers`, to call in place of the scan over the stacked layers."""
        return write_code(self)

    def __str__(self) -> str:
        return describe(self)


# -- applying annotations -------------------------------------------------------------------
def annotated(fn: Callable, mesh: Mesh, specs: Sequence[Optional[DimsMapping]],
              intermediates: Sequence[Intermediate] = ()) -> Callable:
    """fn whose flattened arguments are annotated with `specs` (None: left alone) and
    whose calls named by `intermediates` have their results (and those results'
    gradients) annotated, as mesh_split written at those source locations would."""
    at = {i.where: list(i.dims_mapping) for i in intermediates}

    def wrapped(*args):
        flat, tree = jax.tree_util.tree_flatten(args)
        flat = [x if spec is None else mesh_split(x, mesh, list(spec)) for x, spec in zip(flat, specs)]
        if not at:
            return fn(*jax.tree_util.tree_unflatten(tree, flat))
        closed, shape = jax.make_jaxpr(lambda *a: fn(*jax.tree_util.tree_unflatten(tree, a)),
                                       return_shape=True)(*flat)
        outs = _run(closed.jaxpr, closed.consts, flat, at, mesh)
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shape), outs)

    wrapped.__name__ = getattr(fn, "__name__", "fn")
    return wrapped


def _run(jaxpr, consts, args, at: dict, mesh: Mesh) -> list:
    """Evaluate `jaxpr`, annotating the call results `at` names right after their
    equation and their cotangents right before the gradient reads them."""
    results, gradients = {}, {}
    for where, site in call_sites(jaxpr.eqns).items():
        if where in at:
            results.update({key: at[where] for key in site.results})
            gradients.update({key: at[where] for key in site.gradients})
    env: dict = {}

    def read(atom):
        return atom.val if isinstance(atom, jcore.Literal) else env[atom]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for index, eqn in enumerate(jaxpr.eqns):
        for j, var in enumerate(eqn.invars):
            if (index, j) in gradients:
                env[var] = mesh_split(env[var], mesh, gradients[(index, j)])
        with source_info_util.user_context(eqn.source_info.traceback, name_stack=eqn.source_info.name_stack), \
                eqn.ctx.manager:
            outs = eqn.primitive.bind(*[read(a) for a in eqn.invars], **eqn.primitive.get_bind_params(eqn.params))
        outs = list(outs) if eqn.primitive.multiple_results else [outs]
        outs = [mesh_split(x, mesh, results[(index, j)]) if (index, j) in results else x for j, x in enumerate(outs)]
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


# -- names --------------------------------------------------------------------------------
def argument_names(fn: Callable, count: int) -> list[str]:
    """fn's positional parameter names when it has them, else arg0, arg1, ..."""
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    names = [p.name for p in params[:count]]
    return names + [f"arg{i}" for i in range(len(names), count)]


def parameter_paths(fn: Callable, args: tuple) -> list[str]:
    """Each array of `args` by its path in fn's call: params[0]['wq'], x, ..."""
    names = argument_names(fn, len(args))
    leaves = jax.tree_util.tree_flatten_with_path(args)[0]
    return [names[path[0].idx] + jax.tree_util.keystr(path[1:]) for path, _ in leaves]


def dims_mapping(layout, mesh: Mesh) -> DimsMapping:
    """A layout (mesh axis indices per dim) as a dims_mapping of axis names."""
    return tuple(-1 if not axes else mesh.axis_names[axes[0]] if len(axes) == 1
                 else tuple(mesh.axis_names[a] for a in axes) for axes in layout)


# -- code ------------------------------------------------------------------------------------
def write_code(plan: Plan) -> str:
    names = argument_names(plan.fn, len(plan.args))
    specs = iter(spec for _, spec in plan.parameters)
    mesh = plan.mesh
    shape = ", ".join(map(str, mesh.shape))
    lines = [*(["import jax"] if plan.pipeline else []), "import numpy as np", "", "import gspmd", "",
             f"mesh = gspmd.Mesh(np.arange({mesh.size}).reshape({shape}{',' if mesh.ndim == 1 else ''}), "
             f"{tuple(mesh.axis_names)!r})", "", "",
             f"def annotate({', '.join(names)}):",
             f'    """gspmd.auto\'s plan for {getattr(plan.fn, "__name__", "the function")}: call',
             f"    `{', '.join(names)} = annotate({', '.join(names)})` first thing in it.",
             f"    Estimated {seconds_text(plan.step_seconds)} per step and {bytes_text(plan.peak_memory_bytes)} "
             f"per device on {plan.report.hardware.name}.\"\"\""]
    for name, arg in zip(names, plan.args):
        arg, own = _take(arg, specs)
        if any(spec is not None for spec in own):
            lines.append(f"    {name} = {_expression(arg, name, iter(own))}")
    lines.append(f"    return {', '.join(names)}{',' if len(names) == 1 else ''}")
    fn_name = getattr(plan.fn, "__name__", "fn")
    if plan.pipeline:
        lines += ["", ""] + pipeline_code(*plan.pipeline)
    lines += ["", "", f"# Partition with: gspmd.jit({fn_name}, mesh=mesh, memory_limit={plan.memory_limit}, "
              f"hardware={plan.report.hardware.name!r})"]
    if plan.intermediates:
        lines += ["", "", f"# Inside {getattr(plan.fn, '__name__', 'the function')}, also annotate the result of the "
                  "call at each of these places (file:line:column; every time it runs):"]
        for i in plan.intermediates:
            lines += [f"#   {i.where}: {i.what}{f' (runs {i.count} times)' if i.count > 1 else ''}",
                      f"#       value = gspmd.mesh_split(value, mesh, {_mapping_text(i.dims_mapping)})"]
    return "\n".join(lines) + "\n"


def _parameters_by_layout(parameters: list) -> list:
    """Parameters whose paths differ only in list indices (layers) and share a layout, as one
    line: params[*]['wq']."""
    merged: dict = {}
    for path, spec in parameters:
        if spec is not None:
            merged.setdefault((re.sub(r"\[\d+\]", "[*]", path), spec), []).append(path)
    return [(paths[0] if len(paths) == 1 else pattern, spec) for (pattern, spec), paths in merged.items()]


def _mapping_text(spec: DimsMapping) -> str:
    return "[" + ", ".join(repr(e) for e in spec) + "]"


def _leaf(path: str, spec) -> str:
    return path if spec is None else f"gspmd.mesh_split({path}, mesh, {_mapping_text(spec)})"


def _expression(tree, path: str, specs) -> str:
    """An expression that rebuilds `tree` (found at `path`) with its leaves annotated;
    a list of like elements (layers) becomes one comprehension."""
    if type(tree) in (list, tuple) and tree:
        items = [_take(x, specs) for x in tree]
        texts = [_expression(x, "p", iter(s)) for x, s in items]
        if len(tree) > 1 and len(set(texts)) == 1:
            body = texts[0]
            return (f"[{body} for p in {path}]" if type(tree) is list else f"tuple({body} for p in {path})")
        parts = [_expression(x, f"{path}[{i}]", iter(s)) for i, (x, s) in enumerate(items)]
        inner = ", ".join(parts) + ("," if type(tree) is tuple and len(parts) == 1 else "")
        return f"[{inner}]" if type(tree) is list else f"({inner})"
    if type(tree) is dict:
        parts = [f"{k!r}: {_expression(tree[k], f'{path}[{k!r}]', specs)}" for k in sorted(tree)]
        return "{" + ", ".join(parts) + "}"
    leaves = jax.tree_util.tree_leaves(tree)
    if len(leaves) == 1 and leaves[0] is tree:
        return _leaf(path, next(specs))
    mapped = [next(specs) for _ in leaves]
    if all(s is None for s in mapped):
        return path
    return (f"jax.tree_util.tree_unflatten(jax.tree_util.tree_structure({path}), "
            f"[x if s is None else gspmd.mesh_split(x, mesh, s) for x, s in "
            f"zip(jax.tree_util.tree_leaves({path}), {[None if s is None else list(s) for s in mapped]!r})])")


def _take(tree, specs) -> tuple:
    """(tree, the specs of its leaves) taken from the iterator `specs`."""
    return tree, [next(specs) for _ in jax.tree_util.tree_leaves(tree)]


# -- the report ------------------------------------------------------------------------------
def mesh_text(mesh: Mesh) -> str:
    return "x".join(map(str, mesh.shape))


def seconds_text(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3)):
        if abs(seconds) >= scale:
            return f"{seconds / scale:.3f} {unit}"
    return f"{seconds / 1e-6:.1f} us"


def bytes_text(nbytes: float) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", 1 << 20)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.3f} {unit}"
    return f"{nbytes / 1024:.1f} KiB"


def describe(plan: Plan) -> str:
    r, mesh = plan.report, plan.mesh
    axes = ", ".join(f"{n}={s}" for n, s in zip(mesh.axis_names, mesh.shape))
    lines = [f"plan for {getattr(plan.fn, '__name__', 'fn')} on mesh ({axes}), {r.hardware.name}, "
             f"memory limit {bytes_text(plan.memory_limit)} "
             f"(searched in {plan.search_seconds:.1f} s{'' if plan.exact else ', beam search'})",
             f"  estimated step {seconds_text(plan.step_seconds)} (compute {seconds_text(r.compute_seconds)} + "
             f"communication {seconds_text(r.communication_seconds)}); peak memory "
             f"{bytes_text(plan.peak_memory_bytes)} per device"]
    if plan.pipeline:
        stack, how = plan.pipeline
        lines.append(f"  pipeline: {how.describe()}, the {stack.layers} layers scanned at {stack.where}; "
                     f"bubble {r.bubble_fraction or 0:.1%}")
    for kind, (count, nbytes) in plan.collectives.items():
        lines.append(f"  {kind:<18} x{count:<5} {bytes_text(nbytes):>14} per device")
    by_layout = _parameters_by_layout(plan.parameters)
    if plan.pipeline and not by_layout:
        lines.append(f"parameters: the stacked layers split over {STAGE_AXIS!r} (pipelined_layers), the others "
                     "as sharding completion lays them out")
    else:
        lines.append("parameters:")
    for path, spec in by_layout:
        lines.append(f"  {path:<28} {_mapping_text(spec)}")
    if plan.intermediates:
        lines.append("intermediate annotations:")
        for i in plan.intermediates:
            lines.append(f"  {i.where}: {i.what} {_mapping_text(i.dims_mapping)}"
                         f"{f' (runs {i.count} times)' if i.count > 1 else ''}")
    if plan.runner_ups:
        lines.append("runner-ups:")
        for u in plan.runner_ups:
            sign = "+" if u.extra_seconds >= 0 else "-"
            lines.append(f"  {u.description}: {sign}{seconds_text(abs(u.extra_seconds))}, {u.reason}")
    return "\n".join(lines)
