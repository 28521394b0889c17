"""The `gspmd` command."""
from __future__ import annotations

import argparse
import time
from collections import Counter
from typing import Optional, Sequence

import numpy as np


def demo(mesh_shape: tuple[int, int] = (2, 4)) -> float:
    """Partition and run the MLP train step on simulated devices; print what happened.
    Returns the max abs difference from the single-device run."""
    import jax

    import gspmd
    from gspmd.models import mlp

    mesh = gspmd.Mesh(np.arange(int(np.prod(mesh_shape))).reshape(mesh_shape), ("data", "model"))
    print(f"mesh: {mesh}  devices:\n{mesh.devices}\n")
    print("annotations (mesh_split dims_mapping):")
    for name, dims in mlp.annotations("data", "model").items():
        print(f"  {name:<3} {dims}")
    step = mlp.make_train_step(mesh)
    args = mlp.example_inputs()
    start = time.perf_counter()
    partitioned = gspmd.jit(step, mesh=mesh)
    lowered = partitioned.lower(*args)
    elapsed = time.perf_counter() - start
    ops = Counter(i.opcode for i in lowered.spmd.instrs)
    print(f"\npartitioned in {elapsed:.2f} s: {len(lowered.program.instrs)} instructions -> "
          f"{len(lowered.spmd.instrs)} per-device instructions")
    print("  per-device ops: " + ", ".join(f"{k} x{v}" for k, v in sorted(ops.items())))
    print("\n" + str(lowered.report()))
    got = partitioned(*args)
    want = jax.jit(step)(*args)
    diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
               for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)))
    print(f"\nmax abs difference from the single-device run: {diff:.3g}")
    return diff


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="gspmd", description="GSPMD partitioner for JAX programs")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="partition an MLP train step over simulated devices")
    d.add_argument("--mesh", default="2x4", help="data x model mesh shape, e.g. 2x4 (default) or 4x2")
    args = parser.parse_args(argv)
    if args.command == "demo":
        shape = tuple(int(s) for s in args.mesh.lower().split("x"))
        if len(shape) != 2:
            parser.error("--mesh must look like 2x4")
        return 0 if demo(shape) < 1e-3 else 1
    return 2
