"""`gspmd plan --auto` against the published configurations: for each row of
benchmarks/PUBLISHED.md (MaxText on v5p, Megatron-LM on A100) and of PAPER.md's tables,
given the model, the chip count and the global batch, the configuration the search
finds (mesh, strategy, stages, schedule, repeats, microbatches, remat) and its
estimated step against the published configuration's, both planned by gspmd on the
same profile. Prints a markdown table.

    PYTHONPATH=src python benchmarks/plan_auto.py --source published [--rows 2] [--budget 60]
    PYTHONPATH=src python benchmarks/plan_auto.py --source paper --tables 3 4
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 1)[0])

import paper  # noqa: E402
import published  # noqa: E402

from gspmd import plan_search, planning  # noqa: E402


def semantics(sizes: planning.Sizes) -> planning.Sizes:
    """The row's model as given to the search: what it parallelizes and recomputes left open."""
    return dataclasses.replace(sizes, **{k: None for k in plan_search.SEARCHED})


def compare(label: str, model: str, sizes: planning.Sizes, devices: int, hardware: str, typed, budget: float) -> str:
    start = time.perf_counter()
    found = plan_search.search(model, semantics(sizes), devices, hardware, budget)
    seconds = time.perf_counter() - start
    auto = found.chosen.plan.report
    flags = " ".join(f"{k} {v}" for k, v in found.configuration().items())
    fits = "yes" if auto.fits_in_memory else "NO"
    typed_fits = "yes" if typed.fits_in_memory else "NO"
    line = (f"| {label} | {typed.step_seconds:.3f} ({typed_fits}) | {flags} | {auto.step_seconds:.3f} ({fits}) | "
            f"{auto.step_seconds / typed.step_seconds:.3f} | {seconds:.0f} s, {len(found.verified)} of "
            f"{found.considered} partitioned |")
    print(line, flush=True)
    return line


def published_rows(tables, rows, budget):
    for key in tables:
        table = published.TABLES[key]
        for row in table.rows[:rows]:
            typed = planning.plan("transformer", row.sizes, table.hardware).report
            yield compare(f"{key}: {row.label}", "transformer", row.sizes, row.chips, table.hardware, typed, budget)


def paper_rows(numbers, rows, budget):
    for table in paper.tables():
        if numbers and table.number not in numbers:
            continue
        for row in table.rows[:rows]:
            try:
                typed = (planning.plan_to_fit(row.model, row.sizes, "tpu-v3", table.fit) if table.fit
                         else planning.plan(row.model, row.sizes, "tpu-v3"))
            except Exception as e:      # a row the paper ran that our recipe refuses: said, not searched
                print(f"| Table {table.number}: {row.label} | refused: {e} | | | | |", flush=True)
                continue
            # (the MoE's mesh is its experts': the devices its plan runs on)
            yield compare(f"Table {table.number}: {row.label}", row.model, row.sizes, typed.lowered.num_devices,
                          "tpu-v3", typed.report, budget)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", choices=("published", "paper"), default="published")
    parser.add_argument("--tables", nargs="*", help="published: maxtext, megatron; paper: table numbers")
    parser.add_argument("--rows", type=int, help="only the first N rows of each table")
    parser.add_argument("--budget", type=float, default=60.0, help="seconds of search a row (default 60)")
    args = parser.parse_args(argv)
    print("| row | published configuration: step s (fits) | auto configuration | auto step s (fits) | "
          "auto / published | search |")
    print("|---|--:|---|--:|--:|---|")
    if args.source == "published":
        list(published_rows(args.tables or sorted(published.TABLES), args.rows, args.budget))
    else:
        list(paper_rows([int(t) for t in args.tables or []], args.rows, args.budget))
    return 0


if __name__ == "__main__":
    sys.exit(main())
