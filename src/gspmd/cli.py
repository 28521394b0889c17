"""The `gspmd` command."""
from __future__ import annotations

import argparse
import time
from collections import Counter
from typing import Optional, Sequence

import numpy as np


def _demo_case(model: str, mesh_shape: tuple[int, ...]):
    """(mesh, annotations to print, step, args) of a case study, on simulated devices."""
    import jax.numpy as jnp

    import gspmd
    from gspmd.models import mlp, moe, pipelined, transformer, unet

    def mesh_of(names):
        return gspmd.Mesh(np.arange(int(np.prod(mesh_shape))).reshape(mesh_shape), names)

    if model == "mlp":
        mesh = mesh_of(("data", "model"))
        return mesh, mlp.annotations("data", "model"), mlp.make_train_step(mesh), mlp.example_inputs()
    if model == "transformer":
        mesh = mesh_of(("x", "y"))
        return (mesh, transformer.FINALIZED_2D, transformer.make_train_step(transformer.gspmd_annotate(mesh)),
                transformer.example_inputs())
    if model == "moe":
        mesh = gspmd.Mesh(np.arange(int(np.prod(mesh_shape))), ("x",))
        return (mesh, {"x": ["x", -1, -1], "w_in": ["x", -1, -1], "w_out": ["x", -1, -1],
                       "expert_in": ["x", -1, -1, -1]}, moe.make_train_step(mesh), moe.example_inputs())
    if model == "unet":
        mesh = mesh_of(("d", "h"))
        rng = np.random.RandomState(0)
        args = (unet.init_params(rng), rng.standard_normal((2, 2, 8, 8, 8)).astype(np.float32),
                rng.standard_normal((2, 1, 8, 8, 8)).astype(np.float32))
        return mesh, {"image": [-1, -1, "d", "h", -1]}, unet.make_train_step(mesh, ("d", "h", -1)), args
    mesh = mesh_of(("p", "x"))    # pipeline: stages over the first axis, data over the second
    cfg = transformer.Config(layers=mesh_shape[0])
    stacked, xs, targets = pipelined.example_inputs(cfg, microbatches=2 * mesh_shape[0])
    return (mesh, {"stacked layers": ["p", "..."], "microbatch": ["x", -1, -1], "stage buffer": ["p", "..."]},
            pipelined.make_train_step(mesh, cfg), (stacked, jnp.asarray(xs), jnp.asarray(targets)))


DEMOS = ("mlp", "transformer", "moe", "unet", "pipeline")


def demo(mesh_shape: tuple[int, int] = (2, 4), model: str = "mlp", memory_plot: Optional[str] = None) -> float:
    """Partition and run a case study's train step on simulated devices; print what
    happened (and plot memory over the run to `memory_plot`). Returns the max abs
    difference from the single-device run."""
    import jax

    import gspmd
    from gspmd.frontend.annotation import unpartitioned

    mesh, annotations, step, args = _demo_case(model, mesh_shape)
    print(f"{model} train step on {mesh}  devices:\n{mesh.devices}\n")
    print("annotations (mesh_split dims_mapping):")
    for name, dims in annotations.items():
        print(f"  {name:<14} {dims}")
    start = time.perf_counter()
    partitioned = gspmd.jit(step, mesh=mesh)
    lowered = partitioned.lower(*args)
    elapsed = time.perf_counter() - start
    ops = Counter(i.opcode for i in lowered.spmd.all_instrs())
    print(f"\npartitioned in {elapsed:.2f} s: {len(list(lowered.program.all_instrs()))} instructions -> "
          f"{len(list(lowered.spmd.all_instrs()))} per-device instructions")
    print("  per-device ops: " + ", ".join(f"{k} x{v}" for k, v in sorted(ops.items())))
    print("\nparameter layouts:")
    for p in lowered.program.params:
        print(f"  {lowered.label(p):<24} {p.type_str():<18} {lowered.describe(p.sharding)}")
    report = lowered.report()
    print("\n" + str(report))
    if memory_plot:
        report.memory.plot(memory_plot, title=f"{model} train step on {mesh}")
        print(f"memory over the run: {memory_plot}")
    print("\n" + lowered.summary())
    got = partitioned(*args)
    with unpartitioned():
        want = jax.jit(step)(*args)
    diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
               for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)))
    print(f"\nmax abs difference from the single-device run: {diff:.3g}")
    return diff


def plan(devices: int = 2048, hardware: str = "tpu-v3", layers: int = 2) -> None:
    """Plan a paper-scale dense Transformer train step (Table 1, 2D finalized) for
    `devices` devices on abstract inputs: no execution, no accelerator needed."""
    import gspmd
    from gspmd.models import transformer

    x = 2 ** (int(np.log2(devices)) // 2)
    mesh = gspmd.Mesh(np.arange(devices).reshape(x, devices // x), ("x", "y"))
    cfg = transformer.Config(batch=devices, seq=1024, model=8192, heads=128, head_dim=128, hidden=65536,
                             layers=layers)
    print(f"dense Transformer, {layers} layers, M={cfg.model} H={cfg.hidden} N={cfg.heads}x{cfg.head_dim}, "
          f"batch {cfg.batch} x seq {cfg.seq}, on {mesh}")
    start = time.perf_counter()
    lowered = gspmd.jit(transformer.make_train_step(transformer.gspmd_annotate(mesh), cfg), mesh=mesh).lower(
        *transformer.example_inputs(cfg, abstract=True))
    print(f"planned in {time.perf_counter() - start:.2f} s: {len(lowered.program.instrs)} instructions\n")
    report = lowered.report(hardware=hardware)
    for kind, count in sorted(report.counts().items()):
        nbytes = sum(c.bytes * c.executions for c in report.collectives if c.kind == kind)
        print(f"  {kind:<18} x{count:<4} {nbytes / 2 ** 20:10.1f} MiB per device")
    print(f"\npeak memory per device: {report.peak_memory_bytes / 2 ** 30:.2f} GiB; "
          f"flops per device: {report.flops:.3e}")
    print(f"estimated step on {hardware}: compute {report.compute_seconds * 1e3:.1f} ms + communication "
          f"{report.communication_seconds * 1e3:.1f} ms = {report.step_seconds * 1e3:.1f} ms; memory "
          f"{'fits' if report.fits_in_memory else 'does NOT fit'}")


def memory(model: str = "transformer", mesh_shape: tuple[int, int] = (2, 4), top: int = 10,
           plot: Optional[str] = None) -> None:
    """Where a case study's train step holds its memory: the peak per device and the
    buffers held then (shapes, layouts, what made them); optionally a plot over the run."""
    import gspmd

    mesh, _, step, args = _demo_case(model, mesh_shape)
    profile = gspmd.jit(step, mesh=mesh).lower(*args).report().memory
    print(f"{model} train step on {mesh}")
    print("\n".join(str(profile).splitlines()[:1] + ["largest buffers held at the peak:"] +
                    [f"  {t}" for t in profile.top(top)]))
    if plot:
        profile.plot(plot, title=f"{model} train step on {mesh}")
        print(f"memory over the run: {plot}")


def _mesh_shape(parser, text: str) -> tuple[int, ...]:
    shape = tuple(int(s) for s in text.lower().split("x"))
    if len(shape) != 2:
        parser.error("--mesh must look like 2x4")
    return shape


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="gspmd", description="GSPMD partitioner for JAX programs")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="partition an MLP train step over simulated devices")
    d.add_argument("--model", default="mlp", choices=DEMOS, help="which case study (default: mlp)")
    d.add_argument("--mesh", default="2x4", help="2-D mesh shape, e.g. 2x4 (default) or 4x2 (moe uses its size)")
    d.add_argument("--memory-plot", metavar="PNG", help="also plot memory per device over the run (needs matplotlib)")
    m = sub.add_parser("memory", help="where a case study's train step holds its memory (peak, buffers, plot)")
    m.add_argument("--model", default="transformer", choices=DEMOS)
    m.add_argument("--mesh", default="2x4", help="2-D mesh shape (default 2x4)")
    m.add_argument("--top", type=int, default=10, help="how many of the largest buffers to list")
    m.add_argument("--plot", metavar="PNG", help="plot memory per device over the run (needs matplotlib)")
    p = sub.add_parser("plan", help="plan a paper-scale Transformer step for many devices (no execution)")
    p.add_argument("--devices", type=int, default=2048, help="a power of two (default 2048)")
    p.add_argument("--hardware", default="tpu-v3", help="tpu-v3, tpu-v4, a100, h100, h200 or cpu")
    p.add_argument("--layers", type=int, default=2)
    args = parser.parse_args(argv)
    if args.command == "plan":
        if args.devices < 4 or args.devices & (args.devices - 1):
            parser.error("--devices must be a power of two, at least 4")
        plan(args.devices, args.hardware, args.layers)
        return 0
    if args.command == "memory":
        memory(args.model, _mesh_shape(parser, args.mesh), args.top, args.plot)
        return 0
    if args.command == "demo":
        return 0 if demo(_mesh_shape(parser, args.mesh), args.model, args.memory_plot) < 1e-3 else 1
    return 2
