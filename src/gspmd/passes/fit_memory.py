"""Memory fitting: the per-device program fitted to a memory limit (jit(memory_limit=),
or what a program may use of the hardware's memory) by gathering again or recomputing,
near their later readers, values held idle across the peak."""
from __future__ import annotations

from typing import Mapping, NamedTuple, Optional

from gspmd import ops
from gspmd.analysis import memory, xla_steps
from gspmd.ir import Builder, Instr, Program, Value
from gspmd.ops.registry import Storage
from gspmd.spmd import cost as cm
from gspmd.spmd.context import DeviceContext


def fit_memory(spmd: Program, num_devices: int, limit: int, aliases: Mapping[int, int] = {},
               kernel_scratch: bool = True, hardware: Optional[cm.Hardware] = None) -> memory.BudgetChoice:
    """Fit the per-device program in `limit` bytes where it can: a value held idle across
    the peak (read before it and after it, not at it) is computed again right before its
    later readers, so that only what it is computed from stays live in between.
    A gather (a collective whose op record says how to repeat it) is done again from its
    sharded operand, trading collective bytes for memory. On a `hardware` whose compiler
    rematerializes to fit its memory (XLA on accelerators: HloRematerialization), any
    other pure instruction may be recomputed too.
    The cheapest per byte saved first (time on `hardware`; the default profile's when
    None), as many as the excess needs; repeated while the peak exceeds the limit and
    recomputing lowers it. Where the peak is inside a loop's body (a scan over layers,
    say), the body is fitted the same way in what the rest of the peak leaves it, as XLA
    fits every computation in its callers' memory. `aliases` and `kernel_scratch` as for
    memory.profile (the donated parameters, the target's kernels)."""
    fitting = _Fitting(num_devices, kernel_scratch, hardware or cm.DEFAULT,
                       hardware is not None and hardware.rematerializes)
    shared = fitting.profile(spmd, dict(aliases), True)
    held = fitting.fit(spmd, dict(aliases), True, limit, 1, shared)
    return memory.BudgetChoice(limit, shared.peak_bytes, held.peak_bytes, fitting.extra_bytes,
                               tuple(dict.fromkeys(fitting.regathered)), tuple(dict.fromkeys(fitting.recomputed)),
                               fitting.extra_flops)   # a value computed again for two sets of readers: named once


class _Fitting:
    """One fit_memory run: what it prices on, and what it has done so far."""

    def __init__(self, num_devices: int, kernel_scratch: bool, hw: cm.Hardware, recompute_any: bool):
        self.num_devices, self.kernel_scratch = num_devices, kernel_scratch
        self.hw, self.recompute_any = hw, recompute_any
        self.regathered: list[str] = []
        self.recomputed: list[str] = []
        self.extra_bytes = self.extra_flops = 0

    def fit(self, program: Program, aliases: dict, entry: bool, limit: int, times: int,
            held: memory.MemoryProfile) -> memory.MemoryProfile:
        """Fit `program` (run `times` times per step, `held` its profile) in `limit` bytes
        where it can; its profile after."""
        while held.peak_bytes > limit:
            kept, after = self.compute_idle_again(program, aliases, entry, held, limit)
            if kept:
                self.record(kept, times)
            elif not self.fit_sub_program_at_peak(program, held, limit, times):
                break
            held = after or self.profile(program, aliases, entry)
        return held

    def profile(self, program: Program, aliases: dict, entry: bool) -> memory.MemoryProfile:
        return memory.profile(program, aliases, entry=entry, kernel_scratch=self.kernel_scratch)

    def compute_idle_again(self, program: Program, aliases: dict, entry: bool, held: memory.MemoryProfile,
                           limit: int) -> tuple[list, Optional[memory.MemoryProfile]]:
        """Compute again enough of the values held idle across the peak to lower it, if
        any do: those applied, with the profile after."""
        ranked = sorted(_idle_across_peak(program, held, self.num_devices, self.hw, self.recompute_any),
                        key=lambda c: (c.seconds / c.saved, -c.saved))
        kept = _enough(ranked, held.peak_bytes - limit)
        if kept:
            undo = [_compute_again(program, self.num_devices, c.instr, c.later, held.fused) for c in kept]
            after = self.profile(program, aliases, entry)
            if _better(after, held, limit):
                return kept, after
            for restore in reversed(undo):
                restore()
        # the estimates misled: each of the best alone, exactly; the most gain per second
        best, best_rate = None, 0.0
        for c in ranked[:TRIES]:
            undo = _compute_again(program, self.num_devices, c.instr, c.later, held.fused)
            tried = self.profile(program, aliases, entry)
            undo()
            if _better(tried, held, limit):
                rate = (_over(held, limit) - _over(tried, limit)) / max(c.seconds, 1e-12)
                if rate > best_rate:
                    best, best_rate = c, rate
        if best is None:
            return [], None
        _compute_again(program, self.num_devices, best.instr, best.later, held.fused)
        return [best], None

    def fit_sub_program_at_peak(self, program: Program, held: memory.MemoryProfile, limit: int,
                                times: int) -> bool:
        """Where the peak runs a sub-program (a loop's body), fit the one that holds most
        in what the rest of the peak leaves it; whether its peak came down."""
        instr = held.schedule[held.peak_step]
        subs = [(sub, count, aliases, self.profile(sub, aliases, False))
                for sub, count, aliases in (memory.sub_programs(instr) if instr is not None else ())]
        if not subs:
            return False
        sub, count, aliases, before = max(subs, key=lambda s: s[3].peak_bytes - s[3].arguments_bytes)
        after = self.fit(sub, aliases, False, before.peak_bytes - (held.peak_bytes - limit), times * count, before)
        return after.peak_bytes < before.peak_bytes

    def record(self, kept: list, times: int) -> None:
        for c in kept:
            if ops.lookup(c.instr.opcode).timing.collective is not None:
                self.regathered.append(c.instr.output.name)
                self.extra_bytes += ops.collective_bytes(c.instr) * times
            else:
                self.recomputed.append(c.instr.output.name)
                self.extra_flops += ops.flops(c.instr) * times


TRIES = 16   # candidates fit_memory tries one by one where its estimates misled it


class _Candidate(NamedTuple):
    seconds: float       # computing it again, on the hardware
    saved: int           # bytes the peak holds less, as estimated
    instr: Instr
    later: list          # the instructions after the peak that read it


def _better(after: memory.MemoryProfile, before: memory.MemoryProfile, limit: int) -> bool:
    """Closer to fitting `limit`: a lower peak, or as high a peak with less excess over
    the run (where several steps share it)."""
    if after.peak_bytes != before.peak_bytes:
        return after.peak_bytes < before.peak_bytes
    return _over(after, limit) < _over(before, limit)


def _over(held: memory.MemoryProfile, limit: int) -> int:
    """How far the program runs over `limit`: bytes beyond it summed over the steps
    (progress where several steps share the peak)."""
    return sum(max(b - limit, 0) for b in held.timeline)


def _enough(ranked: list, excess: int) -> list:
    """The first of `ranked` candidates whose savings cover `excess` bytes."""
    batch = []
    for candidate in ranked:
        if excess <= 0:
            break
        batch.append(candidate)
        excess -= candidate.saved
    return batch


def _idle_across_peak(spmd: Program, held: memory.MemoryProfile, num_devices: int, hw: cm.Hardware,
                      recompute_any: bool) -> list[_Candidate]:
    """Values held at the peak, read before it and after it but not at it, that can be
    computed again, with the instructions after the peak that read them (directly or
    through values fused into them). Bytes saved: what the peak holds of the value and
    its layout copies, less what computing it later keeps alive across the peak."""
    peak, readers, results = held.peak_step, spmd.users(), set(spmd.outputs)
    found = []
    for instr in spmd.instrs:
        if len(instr.outputs) != 1 or instr.output in results or not _repeatable(instr, recompute_any):
            continue
        v = instr.output
        stored = [v, *held.layout_copies.get(v, ())]   # a kernel's layout copy is v computed again too
        if not any(x in held.held_at_peak for x in stored) or held.step_of(instr) >= peak:
            continue
        steps = [s for x in stored for s in held.read_at.get(x, ())]
        if not steps or not (min(steps) < peak < max(steps) and peak not in steps):
            continue
        saved = sum(x.nbytes for x in stored if x in held.held_at_peak) - sum(
            _kept_alive(o, held) for o in set(instr.operands))
        if saved > 0:
            found.append(_Candidate(_seconds(instr, num_devices, hw), saved, instr,
                                    [r for r in _stored_readers(v, readers, held) if held.step_of(r) > peak]))
    return found


def _stored_readers(v, readers: Mapping, held: memory.MemoryProfile) -> list[Instr]:
    """The instructions with buffers of their own that read `v`, directly or through
    values fused into them (which they compute where they read them)."""
    found, pending, seen = [], [v], set()
    while pending:
        for r in readers.get(pending.pop(), ()):
            if id(r) in seen:
                continue
            seen.add(id(r))
            if r.outputs and all(o in held.fused for o in r.outputs):
                pending.extend(r.outputs)
            else:
                found.append(r)
    return found


def _repeatable(instr: Instr, recompute_any: bool) -> bool:
    """A gather whose op record says how to repeat it; with `recompute_any`, also an
    instruction without side effects, collectives or sub-programs (cloned as it is)."""
    op = ops.lookup(instr.opcode)
    if op.rewrites.repeat is not None:
        return True
    return (recompute_any and op.timing.collective is None and op.timing.runs is None and not instr.has_side_effect
            and ops.storage(instr) in xla_steps.FUSIBLE + (Storage.MATERIALIZED, Storage.UPDATED))


def _kept_alive(v, held: memory.MemoryProfile) -> int:
    """Bytes the peak would hold more if `v` were read after it: none if it holds `v`
    already; else those of the layout copy of `v` a kernel reads (made once for all
    readers that want it), or of a fused value's stored operands (each once), or `v`'s own."""
    total, pending, seen = 0, [v], set()
    while pending:
        x = pending.pop()
        if x in seen or x in held.held_at_peak:
            continue
        seen.add(x)
        copies = held.layout_copies.get(x)
        if copies:
            total += min(0 if c in held.held_at_peak else c.nbytes for c in copies)
        elif x in held.fused:
            pending.extend(x.producer.operands)
        else:
            total += x.nbytes
    return total


def _seconds(instr: Instr, num_devices: int, hw: cm.Hardware) -> float:
    """What computing `instr` again costs on `hw`."""
    timing = ops.lookup(instr.opcode).timing
    if timing.collective is not None:
        return cm.collective_seconds(timing.collective, ops.collective_bytes(instr), instr.attrs["groups"], num_devices,
                                     hw)
    return cm.compute_seconds(timing.compute, ops.flops(instr), instr.output.nbytes, hw)


def _compute_again(spmd: Program, num_devices: int, instr: Instr, later: list[Instr], fused: frozenset):
    """Compute `instr` again right before the first of `later`, and let them read the
    copy: a gather as its op record says (by instructions no common-subexpression
    elimination merges with it), anything else as a clone marked recomputed. The fused
    values between it and `later` (which those compute where they read them) are cloned
    onto the copy too, each right before the first of `later` that reads it. Returns a
    function that undoes it."""
    position = {id(i): k for k, i in enumerate(spmd.instrs)}
    later = sorted(later, key=lambda r: position[id(r)])
    staging = Program("again", parent=spmd)
    repeat = ops.lookup(instr.opcode).rewrites.repeat
    if repeat is not None:
        copies = [repeat(DeviceContext(Builder(staging, instr.origin), num_devices), instr)]
        copies[0].sharding = instr.output.sharding
    else:
        copies = _clone(staging, instr, {})
    at = {id(i): position[id(later[0])] for i in staging.instrs}
    renamed = dict(zip(instr.outputs, copies))
    for between, first in _fused_between(set(instr.outputs), later, fused, position):
        renamed.update(zip(between.outputs, _clone(staging, between, renamed)))
        at[id(staging.instrs[-1])] = position[id(first)]
    added = staging.instrs
    for k, i in sorted(enumerate(added), key=lambda ki: (-at[id(ki[1])], -ki[0])):   # from the back
        spmd.instrs.insert(at[id(i)], i)
    before = [(r, list(r.operands)) for r in later]
    for r in later:
        r.operands = [renamed.get(o, o) for o in r.operands]

    def undo():
        spmd.instrs[:] = [i for i in spmd.instrs if i not in added]
        for r, operands in before:
            r.operands = operands
    return undo


def _fused_between(sources: set, later: list[Instr], fused: frozenset,
                   position: dict) -> list[tuple[Instr, Instr]]:
    """The fused instructions on the paths from the `sources` values to the operands of
    `later` (in program order), each with the first of `later` it feeds."""
    leads: dict[int, bool] = {}   # id(instr) -> a source reaches its result through fused values

    def on_path(x) -> bool:
        if x in sources:
            return True
        p = x.producer
        if p is None or x not in fused:
            return False
        if id(p) not in leads:
            leads[id(p)] = any([on_path(o) for o in p.operands])
        return leads[id(p)]
    first: dict[int, tuple[Instr, Instr]] = {}
    for r in later:   # in program order
        pending = [o for o in r.operands if o not in sources and on_path(o)]
        while pending:
            p = pending.pop().producer
            if id(p) not in first:
                first[id(p)] = (p, r)
                pending += [o for o in p.operands if o not in sources and on_path(o)]
    return sorted(first.values(), key=lambda pair: position[id(pair[0])])


def _clone(staging: Program, instr: Instr, renamed: dict) -> list[Value]:
    """`instr` again (reading `renamed` values in place of the originals), marked
    recomputed: its results (several for threefry's two words)."""
    b = Builder(staging, f"{instr.origin or instr.opcode} [recomputed to fit memory]", instr.source)
    b.recomputed = True
    copies = b.add(instr.opcode, [renamed.get(o, o) for o in instr.operands],
                   [(out.shape, out.dtype) for out in instr.outputs], **instr.attrs)
    for copy, out in zip(copies, instr.outputs):
        copy.sharding = out.sharding
    return copies
