"""gspmd.jit(backend="jax") against jax.jit on the same annotated functions: the time of
a steady-state call (dispatch + run) and of the first call (trace + complete +
partition + compile + run), on 8 CPU devices.

jax.jit gets the same annotations (as with_sharding_constraint, via mesh_split_as) and
our input and output layouts as in_shardings/out_shardings, so both place NumPy inputs
with one transfer each and return the same layouts. Calls alternate between the two
(interleaved repeats); printed are medians and the median of per-pair ratios.

    python benchmarks/dispatch.py [--repeats 15] [--calls 50] [--first 5] [--cases tiny mlp transformer]
                                  [--separate-reduce-scatters]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402

import gspmd  # noqa: E402
from gspmd import ops  # noqa: E402
from gspmd.frontend.annotation import mesh_split_as  # noqa: E402
from gspmd.analysis import xla  # noqa: E402

MESH = gspmd.Mesh(np.arange(8).reshape(2, 4), ("x", "y"))


def tiny_case():
    """(make a fresh annotated function, its arguments)."""
    def make():
        def tiny(a, b):
            return gspmd.mesh_split(a, MESH, ["x", "y"]) * 2 + b
        return tiny
    return make, (np.ones((16, 32), np.float32), np.ones((16, 32), np.float32))


def mlp_case():
    from gspmd.models import mlp
    mesh = gspmd.Mesh(np.arange(8).reshape(2, 4), ("data", "model"))
    return (lambda: mlp.make_train_step(mesh)), mlp.example_inputs(batch=512, d_in=512, hidden=2048, d_out=256)


def transformer_case():
    from gspmd.models import transformer as T
    cfg = T.Config(batch=32, seq=64, model=256, heads=64, head_dim=4, hidden=1024, layers=2)
    return (lambda: T.make_train_step(T.gspmd_annotate(MESH), cfg)), T.example_inputs(cfg)


CASES = {"tiny": ("tiny function", tiny_case), "mlp": ("MLP train step", mlp_case),
         "transformer": ("Transformer train step (2 layers)", transformer_case)}


def _interleaved(runs: dict[str, Callable], repeats: int, calls: int) -> dict[str, list[float]]:
    """Seconds per call, `calls` back-to-back calls per sample, samples alternating."""
    for run in runs.values():
        for _ in range(3):
            jax.block_until_ready(run())
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            for _ in range(calls):
                out = run()
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - start) / calls)
    return times


def _first_calls(make: Callable, args, repeats: int) -> dict[str, list[float]]:
    """Seconds of a first call (fresh functions each time, so nothing is cached)."""
    times: dict[str, list[float]] = {"gspmd": [], "jax.jit": []}
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(gspmd.jit(make(), backend="jax")(*args))
        times["gspmd"].append(time.perf_counter() - start)
        start = time.perf_counter()
        with mesh_split_as(xla.xla_constraint):
            jax.block_until_ready(jax.jit(make())(*args))
        times["jax.jit"].append(time.perf_counter() - start)
    return times


def _line(label: str, times: dict[str, list[float]], unit: float, unit_name: str) -> str:
    a, b = times["gspmd"], times["jax.jit"]
    ratio = statistics.median(x / y for x, y in zip(a, b))
    return (f"| {label} | {statistics.median(a) / unit:,.1f} {unit_name} | {statistics.median(b) / unit:,.1f} "
            f"{unit_name} | {ratio:.2f} |")


def measure(name: str, case, repeats: int, calls: int, first: int) -> list[str]:
    make, args = case()
    f = gspmd.jit(make(), backend="jax")
    low = f.lower(*args)
    exe = low.jax_executable()
    with mesh_split_as(xla.xla_constraint):
        reference = jax.jit(make(), in_shardings=jax.tree_util.tree_unflatten(
            jax.tree_util.tree_structure(args), exe.in_shardings),
            out_shardings=jax.tree_util.tree_unflatten(low.out_tree, exe.out_shardings))
        reference.lower(*args)
    leaves = jax.tree_util.tree_leaves(args)
    placed = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(args),
                                          [jax.device_put(a, s) for a, s in zip(leaves, exe.in_shardings)])
    with mesh_split_as(xla.xla_constraint):    # trace for both input kinds with the constraints
        jax.block_until_ready(reference(*args))
        jax.block_until_ready(reference(*placed))
    lines = [f"\n### {name}", "| | gspmd.jit | jax.jit | ratio |", "|---|---:|---:|---:|"]
    for label, inputs in (("steady-state call, NumPy inputs", args), ("steady-state call, placed inputs", placed)):
        times = _interleaved({"gspmd": lambda: f(*inputs), "jax.jit": lambda: reference(*inputs)}, repeats, calls)
        lines.append(_line(label, times, 1e-6, "µs"))
    lines.append(_line("first call (trace, partition, compile, run)", _first_calls(make, args, first), 1e-3, "ms"))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--first", type=int, default=5)
    parser.add_argument("--cases", nargs="*", default=list(CASES))
    parser.add_argument("--separate-reduce-scatters", action="store_true",
                        help="lower each reduce-scatter alone (as before they ran together)")
    args = parser.parse_args()
    if args.separate_reduce_scatters:
        ops.lookup("reduce-scatter").lower_together = None
    print(f"jax {jax.__version__}, {len(jax.devices())} {jax.devices()[0].platform} devices")
    for key in args.cases:
        name, case = CASES[key]
        calls = args.calls if key == "tiny" else max(1, args.calls // 10)
        print("\n".join(measure(name, case, args.repeats, calls, args.first)), flush=True)


if __name__ == "__main__":
    main()
