"""The paper's case studies reshard without the replicate-then-slice fallback: the small
configurations of benchmarks/memory_vs_xla.py (2D-sharded MLP and Transformer, MoE,
dropless MoE with experts over a second axis, the U-Net's spatial partitioning, a
pipelined stack, scanned layers with and without remat), each lowered and its report
asked for the collectives labelled "reshard fallback" (pipeline schedules:
test_pipeline.py; sorts: test_sort.py)."""
import sys
from pathlib import Path

import pytest

import gspmd

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import memory_vs_xla  # noqa: E402

CASES = memory_vs_xla.cases("small")


@pytest.mark.parametrize("name", sorted(CASES))
def test_case_study_reshards_without_the_fallback(name):
    step, args = CASES[name]
    report = gspmd.jit(step).lower(*args).report()
    assert report.collectives and report.fallbacks == [], report
