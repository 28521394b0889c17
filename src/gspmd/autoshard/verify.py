"""Candidates partitioned for real: gspmd.auto's estimate ranks them, gspmd's own
report decides.

A candidate becomes annotations (every parameter's layout, and intermediate ones where
sharding completion would otherwise lay a call's result out differently); gspmd
partitions and reports them (fitted to the memory limit), and where its peak differs
from the estimate, the mesh is searched again with the limit scaled by the difference.
"""
from __future__ import annotations

from dataclasses import dataclass

from gspmd import ops, propagation
from gspmd.api import jit
from gspmd.autoshard import plan as plans
from gspmd.autoshard.descent import Candidate, Effort, optimize
from gspmd.autoshard.traced import Traced
from gspmd.ir import Builder, Program, Value
from gspmd.mesh import Mesh
from gspmd.sharding import Sharding
from gspmd.spmd.cost import Hardware

CALIBRATED = 0.03   # an estimate this close to the report needs no second search


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
    return min(results, key=real_rank)


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
        v = min(v, verify_candidate(again, traced, paths, limit, hw, compare), key=real_rank)
    return v


def real_rank(v: Verified) -> tuple:
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
        propagation.complete(copy, mesh.size, c.model.pricing.hardware)   # as the jit of the plan completes
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
            new = ops.annotated(b, new, annotations[v])
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
