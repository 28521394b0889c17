"""Sharding completion time for the dense Transformer train step (Table 1's 2D-finalized
annotations, 7 per layer) on a 2x4 mesh, as layers grow: it should grow linearly.

    python benchmarks/bench_propagation.py [--layers 1 2 4 8 16 32] [--repeat 3]
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402

import gspmd  # noqa: E402
from gspmd import propagation  # noqa: E402
from gspmd.frontend import trace  # noqa: E402
from gspmd.models import transformer as T  # noqa: E402

MESH = gspmd.Mesh(np.arange(8).reshape(2, 4), ("x", "y"))


def traced_step(layers: int) -> gspmd.ir.Program:
    cfg = T.Config(layers=layers)
    step = T.make_train_step(T.gspmd_annotate(MESH), cfg)
    flat, tree = jax.tree_util.tree_flatten(T.example_inputs(cfg, abstract=True))
    program, _ = trace(lambda *a: step(*jax.tree_util.tree_unflatten(tree, a)), flat)
    return program


def time_completion(layers: int, repeat: int) -> tuple[int, float]:
    """(instructions, best seconds of `repeat` completions of a fresh trace)."""
    best = float("inf")
    for _ in range(repeat):
        program = traced_step(layers)
        start = time.perf_counter()
        propagation.complete(program, MESH.size)
        best = min(best, time.perf_counter() - start)
    return len(program.instrs), best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(f"{'layers':>6} {'instrs':>8} {'seconds':>9} {'us/instr':>9}")
    for layers in args.layers:
        n, seconds = time_completion(layers, args.repeat)
        print(f"{layers:>6} {n:>8} {seconds:>9.3f} {1e6 * seconds / n:>9.1f}")


if __name__ == "__main__":
    main()
