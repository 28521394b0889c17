"""Memory-aware partitioning on Table 1's finalized 2D Transformer: peak memory per device
and collective traffic with one reshard of each activation serving all its users (as
partitioned) and under jit(memory_limit=...) (activations gathered again for the
backward pass), planned at paper scale (2048 devices, abstract inputs, the dense
Transformer of `gspmd plan`: M=8192, H=65536, N=128x128, batch 2048 x seq 1024) and, on
8 CPU devices, measured by XLA's memory_analysis() of the jax backend's executable (with
XLA's memory-minimizing scheduler). Then the same paper-scale step with the paper's
mixed precision (bfloat16 activations) and optimizers.

    python benchmarks/memory_budget.py [--layers 2 8] [--no-cpu] [--no-precision]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ["XLA_FLAGS"] = (f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8 "
                           "--xla_cpu_enable_concurrency_optimized_scheduler=false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import gspmd  # noqa: E402
from gspmd.models import transformer as T  # noqa: E402
from gspmd.models.optimizers import Adafactor, AdamW  # noqa: E402

GiB = 2 ** 30


def plan_row(layers: int, limit, dtype=np.float32, optimizer=None) -> dict:
    mesh = gspmd.Mesh(np.arange(2048).reshape(32, 64), ("x", "y"))
    cfg = T.Config(batch=2048, seq=1024, model=8192, heads=128, head_dim=128, hidden=65536, layers=layers,
                   dtype=dtype)
    start = time.perf_counter()
    kwargs = {"hardware": limit} if isinstance(limit, str) else {"memory_limit": limit}
    params, x, target = T.example_inputs(cfg, abstract=True)
    args = (params, x, target) if optimizer is None else (params, jax.eval_shape(optimizer.init, params), x, target)
    low = gspmd.jit(T.make_train_step(T.gspmd_annotate(mesh), cfg, optimizer=optimizer), mesh=mesh,
                    **kwargs).lower(*args)
    report = low.report()
    return {"layers": layers, "limit": limit, "seconds": time.perf_counter() - start, "report": report,
            "choice": low.memory_budget}


def cpu_rows(limit: int):
    """The small 2D Transformer (2 layers) on a 2x4 mesh: ours and XLA's peak, both choices."""
    mesh = gspmd.Mesh(np.arange(8).reshape(2, 4), ("x", "y"))
    cfg = T.Config(batch=8, seq=64, model=128, heads=8, head_dim=16, hidden=512, layers=2)
    step, args = T.make_train_step(T.gspmd_annotate(mesh), cfg), T.example_inputs(cfg)
    for memory_limit in (None, limit):
        low = gspmd.jit(step, mesh=mesh, backend="jax", memory_limit=memory_limit).lower(*args)
        m = low.jax_executable().compiled.memory_analysis()
        xla = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
        yield memory_limit, low.report(), xla


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", nargs="+", type=int, default=[2, 8])
    parser.add_argument("--no-cpu", action="store_true")
    parser.add_argument("--no-precision", action="store_true")
    args = parser.parse_args(argv)
    print("| layers | memory limit | peak (GiB) | all-gathers | collective GiB/device | re-gathered | plan s |")
    print("|--:|---|--:|--:|--:|--:|--:|")
    for layers in args.layers:
        for limit in (None, "tpu-v3", 8 * GiB):
            row = plan_row(layers, limit)
            r, choice = row["report"], row["choice"]
            name = ("none (shared)" if limit is None else "tpu-v3 (15.48 GiB usable)" if limit == "tpu-v3"
                    else f"{limit / GiB:.0f} GiB")
            print(f"| {layers} | {name} | {r.peak_memory_bytes / GiB:.2f} | {r.counts()['all-gather']} | "
                  f"{r.collective_bytes / GiB:.1f} | {len(choice.regathered) if choice else 0} | "
                  f"{row['seconds']:.1f} |")
    if not args.no_precision:
        print("\n| layers | activations | optimizer | peak, shared (GiB) | peak, tpu-v3 limit (GiB) | re-gathered |")
        print("|--:|---|---|--:|--:|--:|")
        for dtype, optimizer in [(np.float32, None), (jnp.bfloat16, None), (jnp.bfloat16, Adafactor()),
                                 (jnp.bfloat16, AdamW())]:
            shared, fitted = (plan_row(args.layers[0], limit, dtype, optimizer) for limit in (None, "tpu-v3"))
            print(f"| {args.layers[0]} | {np.dtype(dtype).name} | {type(optimizer).__name__ if optimizer else 'SGD'} | "
                  f"{shared['report'].peak_memory_bytes / GiB:.2f} | {fitted['report'].peak_memory_bytes / GiB:.2f} | "
                  f"{len(fitted['choice'].regathered)} |")
    if not args.no_cpu:
        print("\n| memory limit | ours (bytes) | XLA (bytes) | ours / XLA | all-gathers | collective bytes |")
        print("|---|--:|--:|--:|--:|--:|")
        for limit, report, xla in cpu_rows(limit=1):
            print(f"| {'none (shared)' if limit is None else f'{limit} B (re-gather all)'} | "
                  f"{report.peak_memory_bytes:,} | {xla:,} | {report.peak_memory_bytes / xla:.3f} | "
                  f"{report.counts()['all-gather']} | {report.collective_bytes:,} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
