"""gspmd.auto's pipelines: a step whose layers are a stack (a `jax.lax.scan` over
stacked layer parameters, what gspmd.pipeline takes) may run that scan as a pipeline.

1. Find the stack: trace the step once with `jax.lax.scan` watched; a scan whose
   carry is one array [batch, ...], whose `xs` leaves all lead with the layer count and
   whose body returns no per-layer outputs is a stack of layers.
2. Enumerate pipelines: L stages (dividing the devices and the layer count) on a mesh
   (stage, x), the data axis x splitting each microbatch; gpipe, or circular with R
   repeats (L*R dividing the layers; where there are more layers, each of the L*R
   pipeline layers is a run of them); M microbatches dividing the batch.
3. Bound each in closed form with the one cost model: the step's compute over every
   device stretched by the schedule's bubble, each step's activations passed on over
   the stage axis (forward and backward, on the links that axis crosses) and the
   stage's layers' gradients summed over the data axis. The best bounds that could beat
   the plan without a pipeline are partitioned for real; gspmd's report decides.

Layers must treat each example on its own (no statistics across the batch): a
pipeline runs them on microbatches.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import math
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import jax
import numpy as np

from gspmd.analysis import Report
from gspmd.api import jit
from gspmd.autoshard.model import Estimate
from gspmd.frontend import mesh_split
from gspmd.mesh import Mesh
from gspmd.pipeline import pipeline
from gspmd.pipeline_buffers import schedule_steps
from gspmd.spmd import cost as cm

STAGE_AXIS, DATA_AXIS = "stage", "x"
MAX_REPEATS = 4              # virtual stages per stage tried (circular)
MAX_MICROBATCHES_PER_STAGE = 8


@dataclass(frozen=True)
class Stack:
    """The step's stack of layers: how many, the carry they pass on, their bytes."""
    layers: int
    carry: jax.ShapeDtypeStruct
    parameter_bytes: int
    where: str               # the scan's call in the source (file:line)


@dataclass(frozen=True)
class Pipelining:
    """How the stack runs as a pipeline (gspmd.pipeline's arguments)."""
    stages: int
    microbatches: int
    schedule: str = "gpipe"
    repeats: int = 1

    def runs(self, layers: int) -> bool:
        """Whether each of the L*R pipeline layers is a run of several stacked layers
        (gspmd.pipeline's scan_layers; not for one: the scan's per-layer gradients
        would be summed over the data axis every step instead of once)."""
        return layers > self.stages * self.repeats

    def describe(self) -> str:
        repeats = f" x{self.repeats}" if self.repeats > 1 else ""
        return f"{self.stages} stages, {self.schedule}{repeats}, {self.microbatches} microbatches"


# -- finding the stack ------------------------------------------------------------------------
def find_stack(fn: Callable, args: tuple) -> Optional[Stack]:
    """The first scan over stacked layers fn(*args) runs, if any."""
    with stacks_watched() as found:
        jax.eval_shape(fn, *args)
    return found[0] if found else None


@contextlib.contextmanager
def stacks_watched() -> Iterator[list[Stack]]:
    """Within: the scans over stacked layers that run, in order (a trace of the step
    finds its stack)."""
    found: list = []

    def watch(f, init, xs, where):
        stack = _stack_of(f, init, xs, where)
        if stack is not None:
            found.append(stack)
        return None

    with scan_replaced(watch):
        yield found


def _stack_of(f, init, xs, where: str) -> Optional[Stack]:
    leaves = jax.tree_util.tree_leaves(xs)
    if not getattr(init, "shape", None) or not leaves or not leaves[0].shape:
        return None    # (the carry a pytree or a scalar, or nothing stacked)
    layers = leaves[0].shape[0]
    if layers < 2 or any(not x.shape or x.shape[0] != layers for x in leaves):
        return None
    one = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), xs)
    carry, ys = jax.eval_shape(f, jax.ShapeDtypeStruct(init.shape, init.dtype), one)
    if jax.tree_util.tree_leaves(ys) or (carry.shape, carry.dtype) != (init.shape, init.dtype):
        return None
    if not _per_example(f, init, one):
        return None
    nbytes = sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in leaves)
    return Stack(layers, jax.ShapeDtypeStruct(init.shape, init.dtype), nbytes, where)


def _per_example(f, init, one) -> bool:
    """Whether a layer maps a batch of one example to one example: its stacked inputs
    are parameters, not per-example data (a scan over time steps of a batch's inputs
    broadcasts them against the one example, or fails)."""
    single = jax.ShapeDtypeStruct((1, *init.shape[1:]), init.dtype)
    try:
        carry, _ = jax.eval_shape(f, single, one)
    except (TypeError, ValueError):
        return False
    return carry.shape == single.shape


@contextlib.contextmanager
def scan_replaced(replacement: Callable) -> Iterator[None]:
    """Within: `jax.lax.scan(f, init, xs)` as the user calls it asks
    replacement(f, init, xs, where) first, which answers (carry, ys) or None (scan as
    usual). Scans inside the replacement, and jax's own, run as they are."""
    original = jax.lax.scan

    def scan(f, init, xs=None, length=None, reverse=False, unroll=1, **kwargs):
        jax.lax.scan = original
        try:
            if xs is not None and not reverse and not kwargs:
                caller = inspect.currentframe().f_back
                out = replacement(f, init, xs, f"{caller.f_code.co_filename}:{caller.f_lineno}")
                if out is not None:
                    return out
            return original(f, init, xs, length, reverse, unroll, **kwargs)
        finally:
            jax.lax.scan = scan

    jax.lax.scan = scan
    try:
        yield
    finally:
        jax.lax.scan = original


# -- running it ----------------------------------------------------------------------------------
def pipelined(fn: Callable, stack: Stack, how: Pipelining, mesh: Mesh) -> Callable:
    """fn with its stack's scan run by gspmd.pipeline on `mesh` (axes stage, x)."""
    def replacement(f, init, xs, where):
        if _stack_of(f, init, xs, where) != stack:
            return None
        return pipelined_scan(f, init, xs, how, mesh)

    @functools.wraps(fn)      # (its parameters' names name the values of what it lowers to)
    def wrapped(*args):
        with scan_replaced(replacement):
            return fn(*args)
    return wrapped


def pipelined_scan(layer: Callable, carry, stacked, how: Pipelining, mesh: Mesh):
    """jax.lax.scan(layer, carry, stacked) as gspmd.pipeline runs it: each stage's layers
    whole on its devices (data parallel within the stage), the batch in microbatches of
    every M-th example (so that the data axis splits each microbatch as it splits the
    batch: no data moves), the L*R pipeline layers each a run of the stacked layers in
    turn where there are more layers. (Plan.code() writes this function with the plan's
    numbers.)"""
    runs = how.runs(jax.tree_util.tree_leaves(stacked)[0].shape[0])
    params = jax.tree_util.tree_map(lambda p: mesh_split(p, mesh, [STAGE_AXIS] + [-1] * (p.ndim - 1)), stacked)
    if runs:
        params = jax.tree_util.tree_map(lambda p: p.reshape(how.stages * how.repeats, -1, *p.shape[1:]), params)
    microbatches = carry.reshape(-1, how.microbatches, *carry.shape[1:]).swapaxes(0, 1)
    microbatches = mesh_split(microbatches, mesh, [-1, DATA_AXIS] + [-1] * (carry.ndim - 1))
    ys = pipeline(lambda p, x: layer(x, p)[0], params, microbatches, mesh=mesh, stage_axis=STAGE_AXIS,
                  schedule=how.schedule, repeats=how.repeats, scan_layers=runs)
    return ys.swapaxes(0, 1).reshape(carry.shape), None


def pipeline_code(stack: Stack, how: Pipelining) -> list[str]:
    """pipelined_scan with `how`'s numbers, as Plan.code() writes it for the user to call."""
    runs = how.runs(stack.layers)
    reshape = f".reshape({how.stages * how.repeats}, -1, *p.shape[1:])" if runs else ""
    return [
        "def pipelined_layers(layer, carry, stacked):",
        f'    """gspmd.auto\'s pipeline ({how.describe()}): call it in place of',
        f"    `jax.lax.scan(layer, carry, stacked)` at {stack.where} (same arguments and",
        "    results). Each stage's layers whole on its devices; microbatch m holds every",
        '    M-th example, which the data axis splits as it splits the batch."""',
        f"    params = jax.tree_util.tree_map(lambda p: gspmd.mesh_split(p, mesh, [{STAGE_AXIS!r}] + [-1] * (p.ndim - 1))"
        f"{reshape}, stacked)",
        f"    microbatches = carry.reshape(-1, {how.microbatches}, *carry.shape[1:]).swapaxes(0, 1)",
        f"    microbatches = gspmd.mesh_split(microbatches, mesh, [-1, {DATA_AXIS!r}] + [-1] * (carry.ndim - 1))",
        "    ys = gspmd.pipeline(lambda p, x: layer(x, p)[0], params, microbatches, mesh=mesh, "
        f"stage_axis={STAGE_AXIS!r},",
        f"                        schedule={how.schedule!r}, repeats={how.repeats}, scan_layers={runs})",
        "    return ys.swapaxes(0, 1).reshape(carry.shape), None"]


# -- choosing one ----------------------------------------------------------------------------------
def pipeline_mesh(devices: int, stages: int, hw: cm.Hardware) -> Mesh:
    """(stage, x) over the devices, laid onto the network as the other candidates are:
    on hosts, the stage axis across them and the data axis within."""
    shape = (stages, devices // stages)
    return Mesh(cm.device_mesh(shape, hw), (STAGE_AXIS, DATA_AXIS))


def candidates(stack: Stack, devices: int) -> list[Pipelining]:
    """Every pipeline of the stack over the devices (see the module's 2.)."""
    batch = stack.carry.shape[0]
    found = []
    for stages in range(2, devices + 1):
        if devices % stages or stack.layers % stages:
            continue
        data = devices // stages
        for m in range(1, batch + 1):
            if batch % m or (batch // m) % data or m > MAX_MICROBATCHES_PER_STAGE * stages:
                continue
            found.append(Pipelining(stages, m))
            found += [Pipelining(stages, m, "circular", r) for r in range(2, MAX_REPEATS + 1)
                      if stack.layers % (stages * r) == 0 and m % stages == 0]
    return found


@dataclass
class Pipelined:
    """A pipeline of the stack partitioned for real: its bound and gspmd's report."""
    how: Pipelining
    mesh: Mesh
    estimate: Estimate
    report: Report
    fits: bool


def pipelines(fn: Callable, args: tuple, stack: Stack, devices: int, hw: cm.Hardware, limit: int, beat: float,
              most: int) -> list[Pipelined]:
    """The `most` pipelines of the stack with the lowest bounds under `beat` (the step
    time to beat), partitioned and reported for real, fitted to the memory limit."""
    tried = candidates(stack, devices)
    if not any(bound(stack, how, devices, 0.0, hw).step_seconds < beat for how in tried):
        return []     # (none could beat it even computing nothing: the step need not be timed)
    one = Mesh(np.arange(1), (DATA_AXIS,))
    compute_seconds = jit(fn, mesh=one, hardware=hw).lower(*args).report().compute_seconds
    bounds = sorted(((bound(stack, how, devices, compute_seconds, hw), how) for how in tried),
                    key=lambda pair: pair[0].step_seconds)
    found = []
    for estimate, how in bounds[:most]:
        if estimate.step_seconds >= beat:
            break
        mesh = pipeline_mesh(devices, how.stages, hw)
        report = jit(pipelined(fn, stack, how, mesh), mesh=mesh, memory_limit=limit, hardware=hw).lower(*args).report()
        found.append(Pipelined(how, mesh, estimate, report, report.peak_memory_bytes <= limit))
    return found


def bound(stack: Stack, how: Pipelining, devices: int, compute_seconds: float, hw: cm.Hardware) -> Estimate:
    """A closed-form estimate of the pipelined step: `compute_seconds` (the whole step's
    on one device) over every device, stretched by the bubble; each step's activations
    passed on over the stage axis both ways and the stage's layer gradients summed over
    the data axis, of which compute hides the hardware's overlap."""
    mesh = pipeline_mesh(devices, how.stages, hw)
    data = devices // how.stages
    slots = how.microbatches * how.repeats
    steps = schedule_steps(how.stages, how.microbatches, how.repeats)
    compute = compute_seconds / devices * steps / slots
    carry = math.prod(stack.carry.shape) * np.dtype(stack.carry.dtype).itemsize
    shift = cm.axes_seconds(cm.Pattern.PERMUTE, carry / how.microbatches / data, mesh.devices, (0,), hw)
    gradients = cm.axes_seconds(cm.Pattern.ALL_REDUCE, stack.parameter_bytes / how.stages, mesh.devices, (1,), hw) \
        if data > 1 else 0.0
    return Estimate(1 - hw.overlap, compute, communication_seconds=2 * steps * shift + gradients)
