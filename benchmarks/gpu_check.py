"""gspmd's jax backend on a real accelerator: every case study's train step, partitioned
for the devices jax sees (a mesh over all of them; one GPU gives a 1-device mesh, so
this checks the lowering and runtime on the accelerator, not communication), against
jax.jit of the same function on the same device. Prints max difference and medians.

    python benchmarks/gpu_check.py [--repeats 20]
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

import gspmd


def _cases(n: int):
    from gspmd.models import mlp, moe, transformer as T
    mesh2 = gspmd.Mesh(np.arange(n).reshape(1, n), ("x", "y"))
    mesh_dm = gspmd.Mesh(np.arange(n).reshape(1, n), ("data", "model"))
    cfg = T.Config(batch=8, seq=128, model=512, heads=8, head_dim=64, hidden=2048, layers=2)
    moe_cfg = moe.Config(groups=n * 4, group_size=64, model=256, hidden=1024, experts=max(n, 4), capacity=32)
    return {
        "mlp": (mlp.make_train_step(mesh_dm), mlp.example_inputs(batch=1024, d_in=1024, hidden=4096, d_out=1024),
                mesh_dm),
        "transformer": (T.make_train_step(T.gspmd_annotate(mesh2), cfg), T.example_inputs(cfg), mesh2),
        "moe": (moe.make_train_step(gspmd.Mesh(np.arange(n), ("x",)), "x", moe_cfg), moe.example_inputs(moe_cfg),
                gspmd.Mesh(np.arange(n), ("x",))),
    }


def _median_seconds(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=20)
    repeats = parser.parse_args().repeats
    n = jax.device_count()
    print(f"jax {jax.__version__} on {n} x {jax.devices()[0].device_kind}")
    for name, (step, args, mesh) in _cases(n).items():
        ours = gspmd.jit(step, mesh=mesh, backend="jax")
        ref = jax.jit(step)
        placed = jax.device_put(args)
        diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in
                   zip(jax.tree_util.tree_leaves(ours(*placed)), jax.tree_util.tree_leaves(ref(*placed))))
        t_ours, t_ref = _median_seconds(ours, placed, repeats), _median_seconds(ref, placed, repeats)
        print(f"{name:<12} max |gspmd - jax.jit| = {diff:.2e}   step ms: gspmd {t_ours * 1e3:.3f}  "
              f"jax.jit {t_ref * 1e3:.3f}  ratio {t_ours / t_ref:.2f}")


if __name__ == "__main__":
    main()
