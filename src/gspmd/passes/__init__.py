"""Rewrites of a program that keep what it computes. AFTER_PARTITION is the pipeline
the partitioner runs on every per-device program it makes (a loop's body and a manual
region's body too), in this order; fit_memory (passes.fit_memory) runs on its own, with
the limit, when one is given."""
from __future__ import annotations

from functools import partial
from typing import Callable, Sequence

from gspmd import ops
from gspmd.ir import Program
from gspmd.ir.dce import eliminate_dead_code
from gspmd.passes.accumulate import fold_updates_into_accumulators
from gspmd.passes.cse import eliminate_common_subexpressions
from gspmd.passes.reassociate import reassociate_all_reduces

# pass(program): rewrites the program in place and returns it
Pass = Callable[[Program], Program]

AFTER_PARTITION: tuple[Pass, ...] = (
    eliminate_common_subexpressions,          # one reshard of a value serves all its users
    fold_updates_into_accumulators,           # a + scatter(0, i, u) -> scatter(a, i, u), likewise slices
    reassociate_all_reduces,                  # ar(a) + ar(b) -> ar(a + b)
    partial(eliminate_dead_code, prune=ops.prune),   # what those left unread; loops' unused carries
)


def run(program: Program, pipeline: Sequence[Pass]) -> Program:
    """Rewrite `program` in place by each pass of `pipeline` in turn; returns it."""
    for rewrite in pipeline:
        rewrite(program)
    return program
