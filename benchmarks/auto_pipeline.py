"""gspmd.auto on a step whose layers are a stack (models/stacked.py): where it pipelines.

For each case, gspmd.auto searches the plan without a pipeline and the pipelines of the
stack (autoshard/stacks.py); the table gives the best of each as gspmd's own report
estimates it (no execution), which one the search chose, and the search time.

    python benchmarks/auto_pipeline.py [--cases deep-a100-32 wide-a100-16 ...]
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import gspmd  # noqa: E402
from gspmd.models import stacked  # noqa: E402

DEEP = dict(width=256, layers=32, batch=64, features=16)      # 32 narrow layers, a small batch
WIDE = dict(width=2048, layers=2, batch=512, features=16)     # 2 wide layers, a large batch
CASES = {f"{kind}-{hw}-{n}": (sizes, hw, n)
         for kind, sizes, runs in (("deep", DEEP, [("a100", 16), ("a100", 32), ("a100", 64), ("h100", 32),
                                                    ("tpu-v3", 32)]),
                                   ("wide", WIDE, [("a100", 16), ("tpu-v3", 32)]))
         for hw, n in runs}


def run(name: str) -> str:
    sizes, hardware, devices = CASES[name]
    args = stacked.example_inputs(**sizes, abstract=True)
    start = time.perf_counter()
    plan = gspmd.auto(stacked.make_train_step(), *args, devices=devices, hardware=hardware)
    seconds = time.perf_counter() - start
    mesh = "x".join(map(str, plan.mesh.shape))
    if plan.pipeline:
        other = next(u for u in plan.runner_ups if u.description.startswith("no pipeline"))
        unpipelined = f"{other.description.split('mesh ')[-1]}: {_ms(plan.step_seconds + other.extra_seconds)}"
        pipelined = f"{plan.pipeline[1].describe()} on {mesh}: {_ms(plan.step_seconds)}"
        chosen = "pipeline"
    else:
        unpipelined = f"{mesh}: {_ms(plan.step_seconds)}"
        other = next((u for u in plan.runner_ups if u.description.startswith("pipeline of")), None)
        pipelined = "none bounded under it" if other is None else \
            f"{other.description[len('pipeline of '):].replace(' (partitioned)', '').replace(' on mesh ', ' on ')}: " \
            f"{_ms(plan.step_seconds + other.extra_seconds)}"
        chosen = "no pipeline"
    w, n_layers, b = sizes["width"], sizes["layers"], sizes["batch"]
    return (f"| {n_layers} layers of width {w}, batch {b} | {devices} {hardware} | {unpipelined} | {pipelined} | "
            f"{chosen} | {seconds:.1f} s |")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", nargs="*", default=list(CASES))
    names = parser.parse_args().cases
    print("| step | devices | best without a pipeline (mesh: est. step) | best pipeline (est. step) | chosen | search |")
    print("|---|---|---|---|---|---:|")
    for name in names:
        print(run(name), flush=True)


if __name__ == "__main__":
    main()
