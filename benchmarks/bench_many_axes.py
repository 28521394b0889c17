"""Lowering time on a 2-axis mesh against the same mesh with size-1 axes added, as
MaxText builds it (13 axes) and beyond (16): the same programs, the same shardings
(benchmarks/RESULTS.md, "Many mesh axes"). Nothing is executed: inputs are abstract.

    python benchmarks/bench_many_axes.py [--repeat 3] [--timeout 120] [--cases NAME ...]

Cases: the 2-line matmul of issue 24, the MLP train step (gspmd.models.mlp) and a
2-layer Transformer train step (Table 1's 2D finalized), on 8 devices (data=2 x
tensor=4) and on 2048 devices (data=32 x tensor=64, planned without devices); and
gspmd.auto's search for the unannotated MLP step on the given 8-device mesh.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import time
from typing import Callable

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402

import gspmd  # noqa: E402
from gspmd.models import mlp, transformer  # noqa: E402

# MaxText's mesh axes (base.yml), then more: 13 and 16 axes take the first 13 and 16.
MAXTEXT_AXES = ("data", "stage", "fsdp", "fsdp_transpose", "sequence", "context", "context_autoregressive",
                "tensor", "tensor_transpose", "tensor_sequence", "expert", "autoregressive", "pipeline",
                "replica", "slice", "extra")


def mesh(data: int, tensor: int, axes: int) -> gspmd.Mesh:
    """data x tensor, with size-1 axes added up to `axes` axes (2: none)."""
    names = ("data", "tensor") if axes == 2 else MAXTEXT_AXES[:axes]
    shape = tuple(data if n == "data" else tensor if n == "tensor" else 1 for n in names)
    return gspmd.Mesh(np.arange(data * tensor).reshape(shape), names)


def abstract(args):
    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype), args)


def inspected(lowered: gspmd.Lowered) -> None:
    """What a user looks at: the program with its layouts (named in the mesh's axes), the report."""
    lowered.as_text(), lowered.report()


def matmul(m: gspmd.Mesh) -> Callable[[], None]:
    def f(x, w):
        return gspmd.mesh_split(x, m, ["data", None]) @ gspmd.mesh_split(w, m, [None, "tensor"])
    args = (jax.ShapeDtypeStruct((64, 256), np.float32), jax.ShapeDtypeStruct((256, 512), np.float32))
    return lambda: inspected(gspmd.jit(f, mesh=m).lower(*args))


MLP_ARGS = abstract(mlp.example_inputs(batch=64, d_in=128, hidden=512, d_out=128))


def mlp_step(m: gspmd.Mesh) -> Callable[[], None]:
    return lambda: inspected(gspmd.jit(mlp.make_train_step(m, "data", "tensor"), mesh=m).lower(*MLP_ARGS))


def transformer_step(m: gspmd.Mesh) -> Callable[[], None]:
    names = {"x": "data", "y": "tensor"}
    strategy = {k: [names.get(e, e) for e in v] for k, v in transformer.FINALIZED_2D.items()}
    cfg = transformer.Config(batch=64, seq=16, model=128, heads=64, head_dim=8, hidden=512, layers=2)
    step = transformer.make_train_step(transformer.gspmd_annotate(m), cfg, strategy)
    return lambda: inspected(gspmd.jit(step, mesh=m).lower(*transformer.example_inputs(cfg, abstract=True)))


def auto_mlp(m: gspmd.Mesh) -> Callable[[], None]:
    """gspmd.auto's search on the given mesh (it partitions its best plans)."""
    step = mlp.make_train_step(None)
    return lambda: gspmd.auto(step, *MLP_ARGS, mesh=m)


CASES = {"matmul x @ w": matmul, "MLP train step": mlp_step, "Transformer train step (2 layers)": transformer_step}
SEARCHES = {"gspmd.auto, MLP train step": auto_mlp}   # on 8 devices only
MESHES = {8: (2, 4), 2048: (32, 64)}


def seconds(case: str, devices: int, axes: int) -> float:
    """One run of a case on a fresh mesh: a new jit lowered (trace, completion,
    partitioning), printed and reported; or a search."""
    work = {**CASES, **SEARCHES}[case](mesh(*MESHES[devices], axes))
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def _timed(queue, *args) -> None:
    queue.put(seconds(*args))


def first_run(timeout: float, *args) -> float:
    """Seconds of the case run first thing in a fresh process (what a user waits for:
    no memo cache holds its layouts yet), or inf when it did not finish in `timeout`."""
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    proc = context.Process(target=_timed, args=(queue,) + args)
    proc.start()
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join()
        return float("inf")
    return queue.get() if proc.exitcode == 0 else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="fresh processes per case; the best is shown")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per case before giving up")
    parser.add_argument("--cases", nargs="+", choices=[*CASES, *SEARCHES], default=[*CASES, *SEARCHES])
    args = parser.parse_args()
    print("| case | devices | 2 axes (s) | 13 axes (s) | 16 axes (s) |\n|---|---:|---:|---:|---:|")
    runs = [(case, devices) for devices in MESHES for case in CASES] + [(case, 8) for case in SEARCHES]
    runs = [(case, devices) for case, devices in runs if case in args.cases]
    for case, devices in runs:
        best = [min(first_run(args.timeout, case, devices, axes) for _ in range(args.repeat)) for axes in (2, 13, 16)]
        times = [f"> {args.timeout:.0f}" if t == float("inf") else f"{t:.3f}" for t in best]
        print(f"| {case} | {devices} | {' | '.join(times)} |", flush=True)


if __name__ == "__main__":
    main()
