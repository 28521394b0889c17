"""Pipelines at paper scale, planned without execution.

    python benchmarks/bench_pipeline.py plan        # Table 4's (4,16,4): lowering time
    python benchmarks/bench_pipeline.py schedules   # every schedule side by side
    python benchmarks/bench_pipeline.py memory      # peak memory of GPipe and 1F1B as M grows

The model is the pipelined 16B Transformer of the paper's Table 4 (M=4096, H=16384,
N=64, D=128, 64 layers, sequence 1024) on the (L=4, X=16, Y=4) mesh of 256 devices:
Table 1's 2D-finalized annotations inside every stage, 16 layers per stage written out
(not a loop), 16 microbatches of 64. `plan` times gspmd.jit(...).lower() (trace,
completion, partitioning); `schedules` reports bubble, recompute, memory, collective
bytes and the estimated step on TPU v3 for GPipe, circular, 1F1B and interleaved 1F1B.
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402

import gspmd  # noqa: E402
from gspmd.models import pipelined, transformer  # noqa: E402

PAPER = transformer.Config(batch=64, seq=1024, model=4096, heads=64, head_dim=128, hidden=16384)


def paper_pipeline(schedule: str = "gpipe", repeats: int = 1, microbatches: int = 16, layers: int = 64,
                   mesh_shape=(4, 16, 4), cfg: transformer.Config = PAPER):
    stages = mesh_shape[0]
    mesh = gspmd.Mesh(np.arange(int(np.prod(mesh_shape))).reshape(mesh_shape), ("p", "x", "y"))
    per_entry = layers // (stages * repeats)
    step = pipelined.make_train_step(mesh, cfg, schedule=schedule, repeats=repeats, strategy=transformer.FINALIZED_2D,
                                     layers_per_stage=per_entry)
    params, x, _ = transformer.example_inputs(cfg, abstract=True)
    stacked = {k: jax.ShapeDtypeStruct((stages * repeats, per_entry) + v.shape, v.dtype) for k, v in params[0].items()}
    xs = jax.ShapeDtypeStruct((microbatches,) + x.shape, x.dtype)
    return mesh, step, (stacked, xs, xs)


def timed_lower(schedule="gpipe", repeats=1, **kw):
    mesh, step, args = paper_pipeline(schedule, repeats, **kw)
    wall, cpu = time.perf_counter(), time.process_time()
    low = gspmd.jit(step, mesh=mesh).lower(*args)
    return low, time.perf_counter() - wall, time.process_time() - cpu


def plan(repeat: int) -> None:
    runs = [timed_lower() for _ in range(repeat)]
    low = runs[0][0]
    times = ", ".join(f"{wall:.2f} s wall / {cpu:.2f} s CPU" for _, wall, cpu in runs)
    print(f"(4,16,4) GPipe pipeline, 256 devices: lowered in {times} (first run cold); "
          f"{sum(1 for _ in low.program.all_instrs())} instructions -> {sum(1 for _ in low.spmd.all_instrs())} "
          "per device")
    print(low.report(hardware="tpu-v3"))


def schedules() -> None:
    print("| schedule | L x M x R | steps | bubble | recompute | peak memory / device | collective bytes / device "
          "| step on TPU v3 (compute + exposed comm) | utilization raw / effective | lowered in |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, repeats in (("gpipe", 1), ("circular", 2), ("1f1b", 1), ("1f1b", 2)):
        low, wall, _ = timed_lower(name, repeats)
        r = low.report(hardware="tpu-v3")
        (p,) = r.pipelines
        label = name if name != "1f1b" or repeats == 1 else "1f1b interleaved"
        print(f"| {label} | {p.stages} x {p.microbatches} x {p.repeats} | {p.steps} | {r.bubble_fraction:.1%} | "
              f"{r.recompute_fraction:.1%} | {r.peak_memory_bytes / 2 ** 30:.2f} GiB | "
              f"{r.collective_bytes / 2 ** 30:.2f} GiB | {r.step_seconds:.2f} s ({r.compute_seconds:.2f} + "
              f"{r.exposed_communication_seconds:.2f}) | {r.flops_utilization:.1%} / {r.effective_utilization:.1%} | "
              f"{wall:.1f} s |")


def memory() -> None:
    """Peak memory as the microbatches grow (the batch grows with them)."""
    print("| schedule | M=8 | M=16 | M=32 | growth 8 -> 32 |")
    print("|---|---:|---:|---:|---:|")
    for name, repeats in (("gpipe", 1), ("1f1b", 1)):
        peaks = [timed_lower(name, repeats, microbatches=m)[0].report().peak_memory_bytes / 2 ** 30 for m in (8, 16, 32)]
        print(f"| {name} | " + " | ".join(f"{p:.2f} GiB" for p in peaks) + f" | {peaks[-1] - peaks[0]:+.2f} GiB |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["plan", "schedules", "memory"])
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    {"plan": lambda: plan(args.repeat), "schedules": schedules, "memory": memory}[args.what]()


if __name__ == "__main__":
    main()
