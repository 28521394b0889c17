"""Peak memory per device: liveness over the per-device program in the order XLA runs
it, with the buffers XLA allocates when it compiles that program (the jax backend's
executable), so that the number can be checked against XLA's own memory_analysis()
(benchmarks/memory_vs_xla.py; within 10% on every case study).

What the model follows (each op's record in ops/ says how the op stores its results):
- Loop fusion: a fusible op whose users are all fusible computes each element where it
  is read and gets no buffer; its operands stay live until those users run. Expensive
  ones (transcendentals, reductions) fuse only into one user that reads each element once.
- Kernel layouts: where a kernel wants an operand laid out otherwise (a batched dot's
  batch dims leading, a convolution's channels last, a collective's dim outermost), a
  transposed copy is made, once for all instructions that want it (XLA:CPU transposes
  both operands of a dot that is not canonical: several contracting or free dims); some
  kernels hold scratch while they run (an all-to-all's per-destination pieces). XLA:CPU runs a
  grouped matmul as a dense product over masked per-group copies of an operand, which
  a loop fusion writes right before it (its element-wise producers fused into it).
- Combined all-reduces: XLA:CPU runs independent all-reduces of one kind as one, which
  holds all their operands until the last is ready and all their results from then on.
- Order: XLA's memory scheduler (depth first from the results, operands feeding the
  most reused values first). XLA:CPU's default concurrency scheduler (breadth first)
  holds more; accelerators schedule for memory.
- Buffer reuse: a fused element-wise result overwrites an operand of its size that dies
  there; dynamic-update-slice writes into its operand; a loop's carry is updated in place.
- Allocation: arguments and results get allocations of their own (a donated argument's
  is its aliased result's); a temporary goes into a result's allocation when it fits
  there before the result is made (largest first, as XLA's buffer assignment does),
  else into the shared heap; constants live in the executable. While a loop runs it
  adds what its body holds beyond the carry.
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Sequence

from gspmd import ops
from gspmd.analysis import schedule
from gspmd.analysis.xla_steps import Step, combine_all_reduces, fused_values, program_steps
from gspmd.ir import Instr, Program, Value
from gspmd.ops.registry import Storage, same_order
from gspmd.sharding import Sharding


class BufferKind(str, enum.Enum):
    """What a buffer's allocation is. Each compares equal to its name as a str, the
    form reports and `gspmd plan --json` give it."""
    ARGUMENT = "argument"     # the caller's: held throughout
    RESULT = "result"         # returned: an allocation of its own
    TEMPORARY = "temporary"   # on the heap while live

    def __str__(self) -> str:
        return self.value


ARGUMENT, RESULT, TEMPORARY = BufferKind.ARGUMENT, BufferKind.RESULT, BufferKind.TEMPORARY


@dataclass(frozen=True)
class LiveTensor:
    """A buffer held at the peak."""
    name: str                     # the value's %name in the per-device program
    shape: tuple[int, ...]        # per-device shape
    dtype: str
    nbytes: int
    sharding: Optional[Sharding]  # the layout of the global value it is a shard of
    origin: str                   # what made it (see xla_steps.made_by)
    kind: BufferKind
    where: str = ""               # "" at top level, else the loop it lives in
    source: str = ""              # the user's line that made it ("train.py:12 (loss)"), or an argument's pytree path

    def __str__(self):
        layout = f" {self.sharding}" if self.sharding is not None else ""
        where = f" [{self.where}]" if self.where else ""
        at = "" if not self.source else f" {self.source}" if self.kind is ARGUMENT else f", at {self.source}"
        return (f"{self.nbytes:>14,} B  %{self.name}: {self.dtype}[{','.join(map(str, self.shape))}] "
                f"{self.kind}{where}{layout}  <- {self.origin}{at}")


@dataclass
class MemoryProfile:
    """Bytes held on one device over the program's run."""
    peak_bytes: int
    arguments_bytes: int
    results_bytes: int            # results in allocations of their own
    aliased_bytes: int            # results written into donated arguments' buffers
    timeline: list[int]           # bytes held at each step (a fused instruction is no step)
    labels: list[str]             # what runs at each step
    peak_step: int
    live_at_peak: list[LiveTensor] = field(default_factory=list)   # largest first
    schedule: list[Optional[Instr]] = field(default_factory=list)  # the instruction run at each step
                                                                   # (None: a layout copy, the results)
    steps_of: dict[int, int] = field(default_factory=dict, repr=False)   # id(instr) -> its step
    held_at_peak: frozenset = field(default_factory=frozenset, repr=False)   # every Value whose buffer the peak holds
    fused: frozenset = field(default_factory=frozenset, repr=False)   # Values computed inside their readers (no buffer)
    read_at: dict = field(default_factory=dict, repr=False)   # stored Value -> the steps that read it
    layout_copies: dict = field(default_factory=dict, repr=False)   # Value -> its copies laid out for kernels

    def step_of(self, instr: Instr) -> Optional[int]:
        """The step that computes `instr` (fused ones: the first that computes them)."""
        return self.steps_of.get(id(instr))

    @property
    def fixed_bytes(self) -> int:
        """Held throughout: the arguments' and results' own allocations."""
        return self.arguments_bytes + self.results_bytes

    def top(self, n: int = 10) -> list[LiveTensor]:
        return self.live_at_peak[:n]

    def __str__(self):
        aliased = f", {self.aliased_bytes:,} of them aliased by results" if self.aliased_bytes else ""
        lines = [f"peak {self.peak_bytes:,} bytes per device at step {self.peak_step + 1} of {len(self.timeline)} "
                 f"({self.labels[self.peak_step]}); arguments {self.arguments_bytes:,}{aliased}, "
                 f"results {self.results_bytes:,}", "largest buffers held at the peak:"]
        return "\n".join(lines + [f"  {t}" for t in self.top()])

    def plot(self, path: str, title: str = "", limit_bytes: Optional[int] = None) -> None:
        """Bytes held over the run as a PNG at `path` (needs matplotlib: the `plot` extra)."""
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            raise ImportError("The memory plot needs matplotlib: pip install 'gspmd[plot]'.") from None
        scale, unit = next((s, u) for s, u in ((2 ** 30, "GiB"), (2 ** 20, "MiB"), (2 ** 10, "KiB"), (1, "B"))
                           if max(self.timeline) >= s or s == 1)
        steps = range(1, len(self.timeline) + 1)
        fig, ax = plt.subplots(figsize=(10, 4.5))
        ax.fill_between(steps, [self.fixed_bytes / scale] * len(self.timeline), color="0.8",
                        label="arguments and results")
        ax.fill_between(steps, [self.fixed_bytes / scale] * len(self.timeline), [b / scale for b in self.timeline],
                        color="tab:blue", alpha=0.6, label="temporaries")
        if limit_bytes:
            ax.axhline(limit_bytes / scale, color="tab:red", linestyle="--", label="memory")
        peak = self.peak_step + 1
        ax.annotate("\n".join([f"peak {self.peak_bytes / scale:.3g} {unit}"] +
                              [f"{t.nbytes / scale:.3g} {unit} %{t.name}" for t in self.top(3)]),
                    (peak, self.peak_bytes / scale), xytext=(0.02, 0.97), textcoords="axes fraction", va="top",
                    fontsize=8, arrowprops={"arrowstyle": "->", "color": "0.4"})
        ax.set_xlabel("step of the per-device program")
        ax.set_ylabel(f"held per device ({unit})")
        ax.set_title(title or "memory per device over one run")
        ax.legend(loc="lower right", fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)


@dataclass(frozen=True)
class BudgetChoice:
    """How a program was fitted to a memory budget: where one reshard of a value (an
    all-gathered activation, say) served users far apart, it is done again near the later
    ones, trading collective bytes for memory; on accelerators, whose compiler
    rematerializes to fit, other values held idle across the peak are recomputed, trading
    FLOPs for memory. Both choices' peaks, bytes and FLOPs."""
    limit_bytes: int
    peak_bytes_shared: int        # one reshard serves every user (as partitioned)
    peak_bytes: int               # with the re-gathers and recomputations
    extra_collective_bytes: int   # per device, of the repeated collectives
    regathered: tuple[str, ...]   # the values gathered again, %names in the program
    recomputed: tuple[str, ...] = ()   # the values computed again
    extra_flops: int = 0          # per device, of the recomputations

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.limit_bytes

    def __str__(self):
        verdict = "fits" if self.fits else "STILL DOES NOT FIT"
        if not self.regathered and not self.recomputed:
            return (f"memory limit {self.limit_bytes:,} bytes: peak {self.peak_bytes:,} {verdict}; "
                    "nothing re-gathered or recomputed")
        done = []
        if self.regathered:
            done.append(f"{len(self.regathered)} reshard result(s) gathered again near their later users "
                        f"(+{self.extra_collective_bytes:,} collective bytes per device)")
        if self.recomputed:
            done.append(f"{len(self.recomputed)} value(s) recomputed near their later users "
                        f"(+{self.extra_flops:.3g} FLOPs per device)")
        return (f"memory limit {self.limit_bytes:,} bytes: {' and '.join(done)}: "
                f"peak {self.peak_bytes_shared:,} -> {self.peak_bytes:,} bytes, {verdict}")


def profile(program: Program, aliases: Mapping[int, int] = {}, entry: bool = True,
            kernel_scratch: bool = True, breadth_first: bool = False) -> MemoryProfile:
    """Buffers of the per-device `program` step by step. `aliases` maps a parameter's
    index to the index of the result that reuses its buffer (donated arguments, loop
    carries). `entry`: the executable's own program, whose results get allocations of
    their own (a loop body's results are its carry). `kernel_scratch`: XLA:CPU's program
    (gspmd.Hardware.kernel_scratch; accelerators have none): count the scratch of the
    kernels it expands, the copies its dot canonicalization makes, and combine its
    all-reduces.
    `breadth_first`: in the order of XLA:CPU's default scheduler (analysis/schedule.py),
    else in that of the memory-minimizing one."""
    return _Liveness(program, dict(aliases), entry, kernel_scratch, breadth_first).run()


def run_order(program: Program) -> tuple[dict[Value, int], dict[Value, int], set[Value]]:
    """How XLA runs `program`, for estimates that follow this model (gspmd.auto's): the
    step that makes each stored value, the last step that reads it, and the values loop
    fusion computes inside their readers instead of storing."""
    live = _Liveness(program, {}, True, kernel_scratch=False, breadth_first=False)
    made = {o: s for s, step in enumerate(live.steps) for o in step.outputs}
    return made, dict(live.last_read), set(live.fused)


def donation_aliases(program: Program, donated: Sequence[int]) -> dict[int, int]:
    """Which result each donated parameter's buffer goes to, as jax pairs them: each
    donated parameter, in order, with the first unclaimed result of its shape and dtype."""
    aliases: dict[int, int] = {}
    for i in donated:
        p = program.params[i]
        j = next((j for j, out in enumerate(program.outputs) if j not in aliases.values()
                  and out.shape == p.shape and out.dtype == p.dtype), None)
        if j is not None:
            aliases[i] = j
    return aliases


# -- liveness -------------------------------------------------------------------------------
@dataclass(eq=False)
class _Buffer:
    nbytes: int
    values: list[Value]       # the values it holds, in order (in-place updates append)
    start: int                # the step that writes its first value (-1: an argument)
    end: int                  # the last step that needs it
    kind: BufferKind = TEMPORARY
    reserved: bool = False    # a donated argument's or a loop carry's: kept for its result
    origin: str = ""
    source: str = ""          # the user's line that made it, or an argument's pytree path

    @property
    def value(self) -> Value:
        return self.values[-1]

    def live_at(self, step: int) -> bool:
        return self.start <= step <= self.end


class _Liveness:
    """The buffers of one program: which values share one, and from which step to which."""

    def __init__(self, program: Program, aliases: dict[int, int], entry: bool, kernel_scratch: bool,
                 breadth_first: bool):
        self.program, self.aliases, self.entry, self.kernel_scratch = program, aliases, entry, kernel_scratch
        self.breadth_first = breadth_first
        every, self.stored = program_steps(program, kernel_scratch)
        if kernel_scratch:
            every = combine_all_reduces(every)
        self.results = set(program.outputs)
        self.fused = fused_values(every, self.results, kernel_scratch)
        self.producer = {o: step for step in every for o in step.outputs}
        stored = [s for s in every if not all(o in self.fused for o in s.outputs)]
        self.reads = {id(s): self._reads(s) for s in stored}
        self.steps = (schedule.breadth_first(stored, self.reads, self.producer, program.params) if breadth_first
                      else schedule.depth_first(stored, program.outputs, self.reads))
        self.last_read: dict[Value, int] = {}
        for s, step in enumerate(self.steps):
            for v in self.reads[id(step)]:
                self.last_read[v] = s
        self.aliased_param = {program.outputs[j]: program.params[i] for i, j in aliases.items()}

    def _reads(self, step: Step) -> list[Value]:
        """The stored values `step` reads, through the fused values it computes itself."""
        return self._stored_behind(step)

    def _stored_behind(self, step: Step, wanted: Callable[[Value], bool] = lambda v: True,
                       enters: Callable[[Step], bool] = lambda producer: True) -> list[Value]:
        """The stored values behind `step`'s operands, in order, through the fused values
        whose producer `enters`; each once (fused values share operands: a dropout mask's
        hash reads its key words along many paths). A value not `wanted` is passed over."""
        out: list[Value] = []
        pending, seen = list(reversed(step.operands)), set()
        while pending:
            v = pending.pop()
            if v in seen or not wanted(v):
                continue
            seen.add(v)
            if v not in self.fused:
                out.append(v)
            elif enters(self.producer[v]):
                pending.extend(reversed(self.producer[v].operands))
        return out

    def _in_place_candidates(self, step: Step, index: int) -> list[Value]:
        """Stored operands whose buffer output `index` of `step` may overwrite."""
        if step.storage is Storage.CARRIED:
            return [step.operands[index]]
        if step.storage in (Storage.IN_PLACE, Storage.UPDATED):
            return [step.operands[0]] if step.operands[0] not in self.fused else []
        if step.storage is Storage.ELEMENTWISE:
            return self._elementwise_reads(step, step.outputs[0].shape)
        return []

    def _elementwise_reads(self, step: Step, shape) -> list[Value]:
        """Stored values `step` reads element for element (through fused element-wise ops)."""
        return self._stored_behind(step, lambda v: v.shape == shape, lambda p: p.storage is Storage.ELEMENTWISE)

    # -- pass 1: buffers and their live ranges ------------------------------------------
    def buffers(self) -> tuple[list[_Buffer], list[tuple[int, Optional[MemoryProfile]]]]:
        """Every buffer with its live range, and per step what it holds beyond them (a
        loop's body, a kernel's scratch). A last step copies results that cannot be
        their own buffers."""
        program, copies = self.program, self._result_copies()
        last = len(self.steps) - 1 + bool(copies)
        donated = {program.params[i] for i in self.aliases}
        holding = {p: _Buffer(p.nbytes, [p], -1, last, ARGUMENT, p in donated, "argument", program.labels.get(p, ""))
                   for p in program.params}
        buffers = list(holding.values())
        extra = []
        for s, step in enumerate(self.steps):
            held, loop = self._loop_temporaries(step)
            extra.append((held + step.scratch, loop))
            for index, out in enumerate(step.outputs):
                end = last if out in self.results else max(self.last_read.get(out, s), s)
                viewed = self._viewed(step, index)
                if viewed is not None:   # that stored value itself, under another name
                    buf = holding[viewed]
                    end = max(end, buf.end)
                else:
                    buf = self._reuse(step, index, out, s, holding)
                if buf is None:
                    buf = _Buffer(_stored_bytes(out, step), [], s, s, origin=step.origin, source=step.source)
                    buffers.append(buf)
                buf.values.append(out)
                buf.end = end
                holding[out] = buf
        if copies:
            buffers += [_Buffer(v.nbytes, [v], last, last, origin="copy of a returned value") for v in copies]
            extra.append((0, None))
        for buf in buffers:
            if buf.kind is not ARGUMENT and self.entry and buf.value in self.results:
                buf.kind = RESULT
        return buffers, extra

    def _viewed(self, step: Step, index: int) -> Optional[Value]:
        """The stored value whose buffer output `index` of `step` is, if any: an
        optimization barrier's or a loop's unchanged carry's operand, or what a stored
        bitcast (a reshape, say) reinterprets, through the fused bitcasts before it, when
        that value is laid out row-major."""
        if step.storage is Storage.BITCAST:
            v = step.operands[0]
            while v in self.fused and self.producer[v].storage is Storage.BITCAST:
                v = self.producer[v].operands[0]
            row_major = v not in self.fused and same_order(v.shape, self.stored.get(v), tuple(range(v.rank)))
            return v if row_major else None
        if step.storage is Storage.VIEW or index in _passed_through(step):
            return step.operands[index]
        return None

    def _reuse(self, step: Step, index: int, out: Value, s: int, holding) -> Optional[_Buffer]:
        """The buffer `out` takes over: a dying operand's, or its donated argument's."""
        param = self.aliased_param.get(out)
        if param is not None:
            # the argument's buffer, once nothing reads it any more under any of its names
            # (a loop that passes it through unchanged returns it as a view)
            buf, overwritten = holding[param], self._in_place_candidates(step, index)
            if all(self.last_read.get(v, -1) < s or (self.last_read[v] == s and v in overwritten)
                   for v in buf.values):
                return buf
            return None   # still read later: XLA copies it first
        for v in self._in_place_candidates(step, index):
            buf = holding.get(v)
            if (buf is not None and buf.value is v and buf.kind is TEMPORARY and buf.end == s
                    and buf.nbytes == out.nbytes):
                return buf
        return None

    def _loop_temporaries(self, step: Step) -> tuple[int, Optional[MemoryProfile]]:
        """What a step's sub-programs (a loop's body and condition, a conditional's
        branches) hold beyond their parameters while it runs, and the profile of the one
        that holds most. A loop body's results are its carry."""
        best: tuple[int, Optional[MemoryProfile]] = (0, None)
        for sub, _, aliases in (sub_programs(step.instr) if step.instr else ()):
            prof = profile(sub, aliases, entry=False, kernel_scratch=self.kernel_scratch,
                           breadth_first=self.breadth_first)
            if best[1] is None or prof.peak_bytes - prof.arguments_bytes > best[0]:
                best = (prof.peak_bytes - prof.arguments_bytes, prof)
        return max(best[0], 0), best[1]

    def _result_copies(self) -> list[Value]:
        """Results that cannot be their own buffers: an argument returned as is (not
        donated to that result), or a value returned twice, is copied at the end."""
        seen: set[Value] = set()
        copies = []
        for j, v in enumerate(self.program.outputs):
            if v in seen or (v in self.program.params and self.aliases.get(self.program.params.index(v)) != j):
                copies.append(v)
            seen.add(v)
        return copies

    # -- pass 2: allocations -----------------------------------------------------------
    def run(self) -> MemoryProfile:
        buffers, extra = self.buffers()
        fixed = [b for b in buffers if b.kind is not TEMPORARY]
        heap = _pack_into_results([b for b in buffers if b.kind is TEMPORARY], [b for b in buffers if b.kind is RESULT])
        change = [0] * (len(extra) + 1)
        for b in heap:
            change[max(b.start, 0)] += b.nbytes
            change[b.end + 1] -= b.nbytes
        held, timeline = sum(b.nbytes for b in fixed), []
        for s, (more, _) in enumerate(extra):
            held += change[s]
            timeline.append(held + more)
        labels = [step.origin for step in self.steps] + ["copies of returned values"] * (len(extra) - len(self.steps))
        if not timeline:
            timeline, labels, extra = [held], ["start"], [(0, None)]
        peak = max(range(len(timeline)), key=timeline.__getitem__)
        at_peak = fixed + [b for b in heap if b.live_at(peak)]
        return MemoryProfile(
            peak_bytes=timeline[peak], arguments_bytes=sum(p.nbytes for p in self.program.params),
            results_bytes=sum(b.nbytes for b in buffers if b.kind is RESULT),
            aliased_bytes=sum(self.program.outputs[j].nbytes for j in self.aliases.values()),
            timeline=timeline, labels=labels, peak_step=peak,
            live_at_peak=self._tensors(at_peak, extra[peak][1]),
            schedule=[step.instr for step in self.steps] + [None] * (len(timeline) - len(self.steps)),
            steps_of=self._steps_of(), held_at_peak=frozenset(v for b in at_peak for v in b.values),
            fused=frozenset(self.fused), read_at=self._read_at(), layout_copies=self._layout_copies())

    def _steps_of(self) -> dict[int, int]:
        at: dict[int, int] = {}
        for s, step in enumerate(self.steps):
            pending, seen = [step], set()
            while pending:
                computed = pending.pop()
                if id(computed) in seen:
                    continue
                seen.add(id(computed))
                for instr in (computed.instr, *computed.combined) if computed.instr is not None else ():
                    at.setdefault(id(instr), s)
                pending += [self.producer[v] for v in computed.operands if v in self.fused]
        return at

    def _read_at(self) -> dict[Value, list[int]]:
        at: dict[Value, list[int]] = {}
        for s, step in enumerate(self.steps):
            for v in self.reads[id(step)]:
                at.setdefault(v, []).append(s)
        return at

    def _layout_copies(self) -> dict[Value, list[Value]]:
        copies: dict[Value, list[Value]] = {}
        for step in self.steps:
            if step.instr is None and step.storage is Storage.INDEXED:
                copies.setdefault(step.operands[0], []).append(step.outputs[0])
        return copies

    def _tensors(self, held: list[_Buffer], loop: Optional[MemoryProfile]) -> list[LiveTensor]:
        tensors = [LiveTensor(b.value.name, b.value.shape, b.value.dtype.name, b.nbytes, b.value.sharding,
                              b.origin, b.kind, source=b.source) for b in held if b.nbytes]
        if loop is not None:
            tensors += [dataclasses.replace(t, where=t.where or f"in a loop of {self.program.name}")
                        for t in loop.live_at_peak if t.kind is not ARGUMENT]
        return sorted(tensors, key=lambda t: -t.nbytes)


def sub_programs(instr: Instr) -> list[tuple[Program, int, dict[int, int]]]:
    """The sub-programs one run of `instr` runs (a loop's body and condition, a
    conditional's branches), each with how often and the aliases its profile takes: a
    loop body's results are its carry, in its parameters' buffers."""
    body = _carried_body(instr)
    return [(sub, count, {i: i for i in range(len(sub.params))} if sub is body else {})
            for sub, count in ops.runs(instr)]


def _passed_through(step: Step) -> set[int]:
    """Carried values a loop's body returns unchanged: the loop reads them in place, whoever
    else still does (XLA copies no read-only carry)."""
    body = _carried_body(step.instr)
    return set() if body is None else {i for i, (p, out) in enumerate(zip(body.params, body.outputs)) if out is p}


def _carried_body(instr: Optional[Instr]) -> Optional[Program]:
    """A loop's body: the sub-program whose results are its parameters' next values."""
    if instr is None or ops.storage(instr) is not Storage.CARRIED:
        return None
    return next((sub for sub, _ in ops.runs(instr)
                 if [(v.shape, v.dtype) for v in sub.outputs] == [(v.shape, v.dtype) for v in sub.params]), None)


def _pack_into_results(temporaries: list[_Buffer], results: list[_Buffer]) -> list[_Buffer]:
    """XLA's buffer assignment puts a temporary into a result's allocation when it fits
    and lives before the result is made (largest first); returns those left for the heap."""
    occupied = {id(r): [(r.start, r.end)] for r in results}
    by_size = sorted(results, key=lambda r: r.nbytes)
    heap = []
    for t in sorted(temporaries, key=lambda b: -b.nbytes):
        home = next((r for r in by_size if r.nbytes >= t.nbytes and
                     all(t.end < start or t.start > end for start, end in occupied[id(r)])), None)
        if home is None:
            heap.append(t)
        else:
            occupied[id(home)].append((t.start, t.end))
    return heap


def _stored_bytes(v: Value, step: Step) -> int:
    """Constants live in the executable, not in the buffers."""
    return 0 if step.storage is Storage.LITERAL else v.nbytes
