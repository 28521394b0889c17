"""MaxText's own train step planned at the published v5p rows' configurations
(benchmarks/published.py's MaxText table), next to the published TF/s and to our
Transformer recipe's estimate of the same row. Needs MaxText (Python >= 3.12):

    PYTHONPATH=src /work/venv312/bin/python benchmarks/maxtext_plans.py            # every row
    PYTHONPATH=src /work/venv312/bin/python benchmarks/maxtext_plans.py --rows 3 7 --no-recipe

Each row is planned in a process of its own (`--row I --json`), so that its time and
peak resident memory are its own: MaxText's config, mesh and abstract state
(examples/maxtext_plan.py's make), then gspmd.jit(...).lower() and report() on tpu-v5p.
TF/s per chip = the row's model FLOPs (MaxText's formula, published.maxtext_flops) /
(our step x chips). Prints a Markdown table (for benchmarks/RESULTS.md).
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))

import published    # noqa: E402  (benchmarks/published.py: the rows, their FLOPs, our recipe)

HARDWARE = "tpu-v5p"
REMAT = {policy: name for name, policy in published.MAXTEXT_REMAT.items()}   # jax policy -> MaxText's name


def overrides(row: published.Row) -> dict:
    """The row's MaxText configuration (its v5p/*.sh flags), read back from the row:
    scale (the label's size), per-device batch, tensor parallelism, remat policy, flash
    attention (MaxText's splash kernel, planned as a kernel: examples/maxtext_plan.py)."""
    tensor = row.sizes.mesh[1]
    return dict(global_parameter_scale=int(row.label.split("B")[0]), per_device_batch_size=row.sizes.batch // row.chips,
                ici_fsdp_parallelism=-1, ici_tensor_parallelism=tensor, remat_policy=REMAT[row.sizes.remat],
                max_target_length=row.sizes.seq, use_iota_embed=True, quantization="", attention=row.sizes.attention)


def plan_row(index: int) -> dict:
    """Plan one row of MaxText's table with MaxText's program; its figures."""
    import gspmd
    import maxtext_plan

    row = published.MAXTEXT.rows[index]
    start = time.perf_counter()
    step, args, donate = maxtext_plan.make(devices=row.chips, hardware=HARDWARE, **overrides(row))
    built = time.perf_counter()
    lowered = gspmd.jit(step, hardware=HARDWARE, donate_argnums=donate).lower(*args)
    report = lowered.report()
    done = time.perf_counter()
    return dict(step_s=report.step_seconds, peak_gb=report.peak_memory_bytes / 1e9, fits=report.fits_in_memory,
                recompute=report.recompute_fraction, instructions=len(list(lowered.program.all_instrs())),
                build_s=built - start, lower_s=done - built,
                rss_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9)


def in_own_process(index: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--row", str(index), "--json"], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"row {index} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def tflops(row: published.Row, step_s: float) -> float:
    return row.model_flops / (step_s * row.chips) / 1e12


def mfu(value: float) -> float:
    return 100 * value * 1e12 / published.profile(HARDWARE).flops_per_s


def table(indices: list[int], recipe: bool) -> list[str]:
    lines = ["| row | chips | MaxText flags | published TF/s (MFU) | our recipe TF/s (MFU) | MaxText's program "
             "TF/s (MFU) | its step (s) | its peak GB (fits) | recompute | plan: MaxText build + gspmd lower (s) "
             "| peak RSS GB |", "|---|---:|---|---|---|---|---:|---|---:|---|---:|"]
    for i in indices:
        row = published.MAXTEXT.rows[i]
        ours = in_own_process(i)
        print(f"{row.label}: {ours}", file=sys.stderr, flush=True)
        rec: Optional[published.Estimate] = published.estimate(row, HARDWARE) if recipe else None
        flags = " ".join(f"{k}={v}" for k, v in overrides(row).items()
                         if k in ("global_parameter_scale", "per_device_batch_size", "ici_tensor_parallelism",
                                  "remat_policy"))
        mine = tflops(row, ours["step_s"])
        lines.append(
            f"| {row.label} | {row.chips} | {flags} | {row.tflops:.0f} ({row.mfu:.1f}%) | "
            + ("-" if rec is None else f"{rec.tflops:.0f} ({rec.mfu:.1f}%)")
            + f" | {mine:.0f} ({mfu(mine):.1f}%) | {ours['step_s']:.2f} | {ours['peak_gb']:.1f} "
            f"({'yes' if ours['fits'] else 'no'}) | {ours['recompute'] or 0:.1%} | {ours['build_s']:.1f} + "
            f"{ours['lower_s']:.1f} | {ours['rss_gb']:.2f} |")
    return lines


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="*", help="which rows of the MaxText table (default: all)")
    parser.add_argument("--no-recipe", action="store_true", help="leave out our recipe's estimate")
    parser.add_argument("--row", type=int, help=argparse.SUPPRESS)       # one row, in this process
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.row is not None:
        print(json.dumps(plan_row(args.row)))
        return 0
    indices = args.rows if args.rows else list(range(len(published.MAXTEXT.rows)))
    print("\n".join(table(indices, not args.no_recipe)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
