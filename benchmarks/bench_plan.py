"""Time `gspmd plan` (trace + complete + partition + report, abstract inputs) for the
paper's configurations at 2048 devices and for a pipeline, to check that planning stays
flat in the layer count (layers run under one scan).

    PYTHONPATH=src python benchmarks/bench_plan.py
"""
from __future__ import annotations

import os
import time

from gspmd import planning

T2 = dict(model_dim=8192, ffn_dim=65536, heads=128, head_dim=256, seq=1024)
T3 = dict(layers=64, model_dim=4096, ffn_dim=16384, heads=64, head_dim=128, seq=1024)

CASES = [(f"transformer, {layers} layers, 32x64", "transformer",
          planning.Sizes(layers=layers, mesh=(32, 64), batch=1024, **T2)) for layers in (2, 32, 64, 128)] + [
    ("pipelined transformer (Table 4), 4x16x4, 16 microbatches", "transformer",
     planning.Sizes(mesh=(4, 16, 4), stages=4, microbatches=16, batch=1024, **T3)),
    ("moe, 2048 experts on 2048 devices", "moe", planning.Sizes(experts=2048, batch=8192)),
    ("hybrid-moe, 64x32", "hybrid-moe", planning.Sizes(mesh=(64, 32), experts=64, ffn_dim=131072, heads=512,
                                                         batch=512)),
    ("unet, 2x32, 256^3", "unet", planning.Sizes(mesh=(2, 32), image_size=256, batch=8)),
]


def main() -> None:
    print(f"load average before: {os.getloadavg()[0]:.1f}")
    print("| plan | instructions | seconds (best of 2) |\n|:--|--:|--:|")
    for label, model, sizes in CASES:
        times = []
        for _ in range(2):
            start = time.perf_counter()
            p = planning.plan(model, sizes)
            times.append(time.perf_counter() - start)
        print(f"| {label} | {len(list(p.lowered.program.all_instrs()))} | {min(times):.2f} |", flush=True)


if __name__ == "__main__":
    main()
