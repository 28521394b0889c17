"""Step time of a per-device program on a hardware profile, from the shared cost model
(spmd/cost.py): every op timed, collectives overlapped with independent compute.

Each device runs two streams, compute and the network (collectives), and a latency-
hiding scheduler (as XLA's) keeps both busy: whenever a stream is free it starts the
first instruction, in program order, whose operands are ready. So a collective overlaps
with whatever compute does not depend on it, up to the hardware's `overlap` share of
its time (the rest contends with compute for the core: DMA issue, reductions, HBM). A loop runs its body as often as its trip
count, its body's own overlap included; it holds both streams while it runs. A
conditional counts each branch once, or, in a loop whose counter alone picks the
branch (the op's branch_shares), each for the share of the trips that takes it.

Memory-bound ops are fused as XLA fuses element-wise chains: a value made by one
memory-bound op and used only by others never goes through HBM, so only values that a
matmul, a collective, a loop or the program's boundary touches are read or written;
and an op that only feeds matmuls (an operand transpose, slice or convert) is fused into
them. Nothing fuses across an optimization barrier: what passes one goes through HBM.
Where a profile gives a vector rate, a kernel whose arithmetic outlasts its bytes (a
PRNG hash's rounds, fused into the kernel that reads the bits) takes its arithmetic's time.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from gspmd import ops
from gspmd.ops.registry import Storage
from gspmd.ir import Instr, Program
from gspmd.spmd import cost as cm

# conditional -> the share of its executions that takes each branch
Shares = Mapping[Instr, Sequence[float]]


@dataclass(frozen=True)
class Timing:
    compute_seconds: float          # every op's time, one after another
    communication_seconds: float    # every collective's time, one after another
    step_seconds: float             # both streams overlapped


def time_program(program: Program, hw: cm.Hardware, num_devices: int, shares: Optional[Shares] = None) -> Timing:
    """shares: for conditionals of `program`, the share of its executions that runs each
    branch, where known (the loop around it knows them); else every branch counts once."""
    shares = shares or {}
    durations, streams = _durations(program, hw, num_devices, shares)
    ends = _schedule(program, durations, streams, hw.overlap)
    compute = sum(d for d, s in zip(durations, streams) if s is not _NETWORK)
    network = sum(d for d, s in zip(durations, streams) if s is _NETWORK)
    for i, instr in enumerate(program.instrs):   # loops: what their bodies spent on each
        if ops.lookup(instr.opcode).timing.runs is not None:
            inner = [(time_program(p, hw, num_devices, within), n) for p, n, within in _runs(instr, shares)]
            compute += sum(t.compute_seconds * n for t, n in inner) - durations[i]
            network += sum(t.communication_seconds * n for t, n in inner)
    return Timing(compute, network, max(ends, default=0.0))


_COMPUTE, _NETWORK, _BOTH = "compute", "network", "both"


def _runs(instr: Instr, shares: Shares) -> list[tuple[Program, float, Shares]]:
    """(sub-program, how often one execution runs it, its conditionals' branch shares)."""
    op = ops.lookup(instr.opcode).timing
    runs = op.runs(instr)
    if instr in shares:
        runs = [(p, share) for (p, _), share in zip(runs, shares[instr])]
    within = op.branch_shares(instr) if op.branch_shares is not None else {}
    return [(p, n, within) for p, n in runs]


def _durations(program: Program, hw: cm.Hardware, num_devices: int, shares: Shares) -> tuple[list[float], list[str]]:
    materialized, into_matmul = _materialized(program), _into_matmul(program, hw.fuses_into_matmul)
    durations, streams = [], []
    for instr in program.instrs:
        op = ops.lookup(instr.opcode).timing
        if op.collective is not None:
            durations.append(cm.collective_seconds(op.collective, ops.collective_bytes(instr), _groups(instr),
                                                   num_devices, hw))
            streams.append(_NETWORK)
        elif op.runs is not None:
            durations.append(sum(time_program(p, hw, num_devices, within).step_seconds * n
                                 for p, n, within in _runs(instr, shares)))
            streams.append(_BOTH)
        else:
            durations.append(0.0 if instr in into_matmul else op_seconds(instr, hw, materialized))
            streams.append(_COMPUTE)
    if hw.vector_ops_per_s is not None:
        _add_arithmetic(program, durations, materialized, hw.vector_ops_per_s)
    return durations, streams


def _add_arithmetic(program: Program, durations: list[float], materialized: set, rate: float) -> None:
    """A fused kernel takes the longer of its bytes and its vector arithmetic: where an
    op's vector instructions (a hash's rounds) outlast the bytes of the kernel that
    reads its results, the kernel's last op takes the difference."""
    for indices in _reading_kernels(program, materialized):
        extra = sum(_vector_ops(program.instrs[i]) for i in indices) / rate - sum(durations[i] for i in indices)
        if extra > 0:
            durations[max(indices)] += extra


def _vector_ops(instr: Instr) -> int:
    count = ops.lookup(instr.opcode).timing.vector_ops
    return 0 if count is None else count(instr)


def _reading_kernels(program: Program, materialized: set) -> list[list[int]]:
    """Kernels (instruction indices): each instruction with vector arithmetic, with those
    that read its results on chip, through fusible ops, up to the values written to HBM.
    Cheap producers the kernel shares with others (loop
    counters, indices) are left out: XLA computes those again in each fusion."""
    index = {instr: i for i, instr in enumerate(program.instrs)}
    root: dict[int, int] = {}

    def find(i: int) -> int:
        while root[i] != i:
            root[i] = root[root[i]]
            i = root[i]
        return i

    for i, instr in enumerate(program.instrs):
        if not _fusible(instr):
            continue
        if ops.lookup(instr.opcode).timing.vector_ops is not None:
            root[i] = i
        for v in instr.operands:
            p = index.get(v.producer) if v.producer is not None else None
            if v not in materialized and p in root:
                root.setdefault(i, i)
                a, b = sorted((find(p), find(i)))
                root[b] = a
    kernels: dict[int, list[int]] = {}
    for i in root:
        kernels.setdefault(find(i), []).append(i)
    return list(kernels.values())


def _schedule(program: Program, durations: list[float], streams: list[str], overlap: float) -> list[float]:
    """List scheduling on the two streams: whenever a stream is free it starts, of the
    instructions whose operands are ready, the first in program order (a loop takes
    both streams). A collective also takes the compute stream for the share of its time
    that cannot overlap (1 - overlap), as soon as that stream is free, and completes
    when that is done too. Returns each instruction's end time."""
    producer = {v: i for i, instr in enumerate(program.instrs) for v in instr.outputs}
    users: dict[int, list[int]] = {i: [] for i in range(len(program.instrs))}
    waiting_on = []
    for i, instr in enumerate(program.instrs):
        deps = {producer[v] for v in instr.operands if v in producer}
        waiting_on.append(len(deps))
        for d in deps:
            users[d].append(i)
    ready_at = [0.0] * len(durations)
    ends = [0.0] * len(durations)
    free = {_COMPUTE: 0.0, _NETWORK: 0.0}
    pending = {_COMPUTE: [], _NETWORK: []}      # (ready time, index): operands known
    runnable = {_COMPUTE: [], _NETWORK: []}     # (index,): operands ready by the stream's time
    queue = lambda i: _NETWORK if streams[i] is _NETWORK else _COMPUTE   # noqa: E731
    for i, n in enumerate(waiting_on):
        if n == 0:
            heapq.heappush(pending[queue(i)], (0.0, i))
    left = len(durations)
    while left:
        choice = None
        for stream in (_COMPUTE, _NETWORK):
            start = _next_start(free[stream], pending[stream], runnable[stream])
            if start is not None and (choice is None or start < choice[0]):
                choice = (start, stream)
        start, stream = choice
        while pending[stream] and pending[stream][0][0] <= start:
            heapq.heappush(runnable[stream], heapq.heappop(pending[stream])[1])
        i = heapq.heappop(runnable[stream])
        if streams[i] is _BOTH:
            start = max(start, free[_NETWORK])
            free[_NETWORK] = start + durations[i]
        ends[i] = free[stream] = start + durations[i]
        if streams[i] is _NETWORK:   # its core work: done on the compute stream before it completes
            free[_COMPUTE] = max(free[_COMPUTE], start) + (1 - overlap) * durations[i]
            ends[i] = max(ends[i], free[_COMPUTE])
        left -= 1
        for u in users[i]:
            ready_at[u] = max(ready_at[u], ends[i])
            waiting_on[u] -= 1
            if waiting_on[u] == 0:
                heapq.heappush(pending[queue(u)], (ready_at[u], u))
    return ends


def _next_start(free: float, pending: list, runnable: list):
    """When a stream can start its next instruction (None: nothing left for it yet)."""
    if runnable:
        return free
    if pending:
        return max(free, pending[0][0])
    return None


def op_seconds(instr: Instr, hw: cm.Hardware, materialized: set) -> float:
    op = ops.lookup(instr.opcode).timing
    flops = ops.flops(instr)
    if op.bytes_accessed is not None:
        nbytes = op.bytes_accessed(instr, materialized)
    else:
        nbytes = sum(v.nbytes for v in set(instr.operands) | set(instr.outputs) if v in materialized)
    return cm.compute_seconds(op.compute, flops, nbytes, hw)


def _groups(instr: Instr):
    return instr.attrs["pairs"] if "pairs" in instr.attrs else instr.attrs["groups"]


def _fusible(instr: Instr) -> bool:
    op = ops.lookup(instr.opcode).timing
    return op.fuses and op.compute is not cm.ComputeKind.MATMUL and op.collective is None and op.runs is None


def _into_matmul(program: Program, producers: bool = True) -> set:
    """Fusible instructions that XLA folds into a dot or convolution: those whose
    results only matmuls read (through bitcasts: operand slices, converts, transposes;
    without `producers`, as on GPUs, only operand transposes), and transposes of a
    matmul's result that nothing else reads (layout assignment gives the matmul that
    output layout)."""
    readers: dict = {}
    for instr in program.instrs:
        for v in instr.operands:
            readers.setdefault(v, []).append(instr)
    outputs, folded = set(program.outputs), set()

    def matmul(instr) -> bool:      # (a custom kernel, which fuses nothing, is not one)
        timing = ops.lookup(instr.opcode).timing
        return timing.compute is cm.ComputeKind.MATMUL and timing.fuses

    for instr in reversed(program.instrs):      # readers before the values they read
        if not _fusible(instr) or not (producers or ops.lookup(instr.opcode).kernel.transposes):
            continue
        if all(v not in outputs and v in readers and all(matmul(r) or r in folded for r in readers[v])
               for v in instr.outputs):
            folded.add(instr)
    for instr in program.instrs:
        if ops.lookup(instr.opcode).kernel.transposes and all(
                v.producer is not None and matmul(v.producer) and readers[v] == [instr] for v in instr.operands):
            folded.add(instr)
    return folded


def _materialized(program: Program) -> set:
    """Values that live in HBM: parameters, results, and whatever a matmul, collective
    or loop makes or uses (a value only passed between fusible ops stays on chip), and
    what a reshape of such a value views (a bitcast: the kernel before it writes it)."""
    keep = set(program.params) | set(program.outputs)
    for instr in program.instrs:
        if not _fusible(instr):
            keep.update(instr.operands)
            keep.update(instr.outputs)
    for instr in reversed(program.instrs):
        if ops.lookup(instr.opcode).memory.storage is Storage.BITCAST and keep.issuperset(instr.outputs):
            keep.update(instr.operands)
    return keep
