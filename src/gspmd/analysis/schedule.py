"""The orders in which XLA runs a program's steps (its memory schedulers), for the memory
model (analysis/memory.py). A step is anything with `outputs` and a `name`; `reads` maps
id(step) to the stored values it reads.

XLA:CPU picks breadth first by default (everything ready runs as early as it can, for
concurrency), depth first with --xla_cpu_enable_concurrency_optimized_scheduler=false;
accelerators schedule for memory (depth first, or better)."""
from __future__ import annotations

import collections
import os
from typing import Sequence

from gspmd.ir import Value

CONCURRENCY_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler"


def xla_cpu_breadth_first() -> bool:
    """Whether XLA:CPU compiles this process's programs with its breadth-first
    (concurrency) scheduler: its default, unless XLA_FLAGS turns it off."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    values = [f.partition("=")[2].lower() or "true" for f in flags if f.partition("=")[0] == CONCURRENCY_FLAG]
    return not values or values[-1] not in ("false", "0")


def depth_first(steps: Sequence, results: list[Value], reads: dict[int, list[Value]]) -> list:
    """The order XLA's memory scheduler runs `steps` in: a depth-first post-order walk
    from the results that visits first the operands with the most reused values behind
    them, then those with the most bytes behind them."""
    producer = {o: s for s in steps for o in s.outputs}
    readers: dict[Value, int] = {}
    for step in steps:
        for v in set(reads[id(step)]):
            readers[v] = readers.get(v, 0) + 1
    behind: dict[int, tuple[int, int]] = {}   # (values read again, bytes) on the paths into a step
    for step in steps:
        reused = sum(max(readers.get(o, 0) - 1, 0) for o in step.outputs)
        size = sum(o.nbytes for o in step.outputs)
        for v in set(reads[id(step)]):
            if v in producer:
                r, b = behind[id(producer[v])]
                reused, size = reused + r, size + b
        behind[id(step)] = (min(reused, len(steps)), size)

    def first(candidates) -> list:
        unique = {id(s): s for s in candidates}.values()
        return sorted(unique, key=lambda s: (-behind[id(s)][0], -behind[id(s)][1], s.name))

    order: list = []
    done: set[int] = set()
    stack = [(s, False) for s in reversed(first(producer[v] for v in results if v in producer))]
    while stack:
        step, expanded = stack.pop()
        if id(step) in done:
            continue
        if expanded:
            done.add(id(step))
            order.append(step)
            continue
        stack.append((step, True))
        stack.extend((s, False) for s in reversed(first(producer[v] for v in reads[id(step)] if v in producer))
                     if id(s) not in done)
    return order + [s for s in steps if id(s) not in done]


def breadth_first(steps: Sequence, reads: dict[int, list[Value]], producer: dict, arguments: Sequence[Value]) -> list:
    """The order XLA:CPU's concurrency scheduler runs `steps` in (its BFSMemoryScheduler, a
    first-in first-out topological order): the arguments first, then each step once the
    last of the arguments and steps it reads has run."""
    scheduled = {id(s) for s in steps}

    def awaited(step) -> set[int]:
        nodes = {id(producer[v]) if v in producer else id(v) for v in reads[id(step)]}
        return {n for n in nodes if n in scheduled or n in argument_ids}

    argument_ids = {id(v) for v in arguments}
    waits = {id(s): len(awaited(s)) for s in steps}
    readers: dict[int, list] = collections.defaultdict(list)
    for s in steps:
        for node in awaited(s):
            readers[node].append(s)
    queue = collections.deque(id(v) for v in arguments)
    queue.extend(id(s) for s in steps if not waits[id(s)])
    by_id = {id(s): s for s in steps}
    order = []
    while queue:
        node = queue.popleft()
        if node in by_id:
            order.append(by_id[node])
        for reader in readers[node]:
            waits[id(reader)] -= 1
            if not waits[id(reader)]:
                queue.append(id(reader))
    ran = {id(s) for s in order}
    return order + [s for s in steps if id(s) not in ran]
