"""The `gspmd` command."""
from __future__ import annotations

import argparse
import contextlib
import sys
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


def plan(model: str = "transformer", sizes=None, hardware: str = "tpu-v3", as_json: bool = False, top: int = 5,
         memory_plot: Optional[str] = None) -> None:
    """Plan a case study (or module:function) on abstract inputs: no execution, no
    accelerator needed. Prints a summary with the `top` largest buffers held at the
    peak, or the plan as JSON; plots memory over the run to `memory_plot` (a PNG)."""
    import json

    from gspmd import planning

    # what a user's module prints while it loads and builds (MaxText's notices) goes to
    # stderr, so that --json prints JSON alone
    with contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext():
        result = planning.plan(model, sizes or planning.Sizes(), hardware)
    if memory_plot:
        result.report.memory.plot(memory_plot, title=result.case.description,
                                  limit_bytes=result.report.hardware.usable_bytes)
    if as_json:
        print(json.dumps(result.as_json(top), indent=2))
        return
    _print_plan(result, top)
    if memory_plot:
        print(f"memory over the run: {memory_plot}")


def _print_plan(result, top: int) -> None:
    """A plan's summary: mesh, collectives, memory, the estimated step, the largest buffers."""
    from gspmd import planning

    report, case = result.report, result.case
    where = "" if case.mesh is None else f" on a {'x'.join(map(str, case.mesh.shape))} mesh " \
        f"({', '.join(case.mesh.axis_names)})"
    print(f"{case.description}{where}, {result.lowered.num_devices} devices")
    print(f"planned in {result.planning_seconds:.2f} s: {len(list(result.lowered.program.all_instrs()))} "
          "instructions\n")
    for kind, count in sorted(planning._executions(report).items()):
        nbytes = sum(c.bytes * c.executions for c in report.collectives if c.kind == kind)
        print(f"  {kind:<18} x{count:<6} {nbytes / 2 ** 20:12.1f} MiB per device")
    print(f"\npeak memory per device: {report.peak_memory_bytes / 2 ** 30:.2f} GiB; "
          f"flops per device: {report.flops:.3e}")
    print(f"estimated step on {report.hardware.name}: compute {report.compute_seconds * 1e3:.1f} ms + exposed "
          f"communication {report.exposed_communication_seconds * 1e3:.1f} ms (of "
          f"{report.communication_seconds * 1e3:.1f}) = {report.step_seconds * 1e3:.1f} ms; "
          f"flops utilization {report.flops_utilization:.1%}; memory "
          f"{'fits' if report.fits_in_memory else 'does NOT fit'} in {report.hardware.usable_bytes / 2 ** 30:.2f} GiB")
    if result.remat_tried:
        print(_remat_choice(result))
    shares = [f"{name}: {value:.1%} of compute" for name, value in
              (("pipeline bubbles", report.bubble_fraction), ("recompute", report.recompute_fraction))
              if value is not None]
    if shares:
        print(f"{'; '.join(shares)}; effective utilization {report.effective_utilization:.1%}")
    if top:
        print("largest buffers held at the peak (per device):\n" + "\n".join(f"  {t}" for t in report.memory.top(top)))


def auto_plan(model: str, sizes, devices: int, hardware: str, budget: float, as_json: bool, top: int) -> int:
    """`gspmd plan MODEL --auto`: search the training configuration (mesh, strategy,
    pipeline, schedule, microbatches, remat), print the best plan and why it won."""
    import json

    from gspmd import plan_search

    with contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext():
        found = plan_search.search(model, sizes, devices, hardware, budget)
    if as_json:
        print(json.dumps({**found.chosen.plan.as_json(top), **found.as_json()}, indent=2))
        return 0
    _print_plan(found.chosen.plan, top)
    print("\n" + found.explain())
    return 0


def _remat_choice(result) -> str:
    """What --remat auto (the default) tried and chose, or which flags fix a plan that
    does not fit even with the most recompute."""
    tried = ", ".join(f"{policy or 'none'} {peak / 2 ** 30:.2f} GiB" for policy, peak in result.remat_tried)
    chosen = result.case.sizes["remat"] or "none"
    if result.report.fits_in_memory and chosen == "none":
        return "remat: none needed, the plan fits without recompute (--remat names a policy)"
    if result.report.fits_in_memory:
        return (f"remat: {chosen}, the least recompute that fits (tried {tried}; --remat names another "
                "policy, --remat none turns it off)")
    return (f"remat: even {chosen} does not fit (tried {tried}): plan over more devices (--devices or --mesh), "
            "pipeline the layers (--stages with a 3-D --mesh and --microbatches), accumulate gradients "
            "(--microbatches), or shrink --batch")


def _mesh_arg(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(s) for s in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--mesh {text!r} must look like 32x64 or 4x16x4") from None
    if not shape or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"--mesh {text!r} must look like 32x64 or 4x16x4")
    return shape


def _plan_command(parser: argparse.ArgumentParser, args) -> int:
    import gspmd
    from gspmd import planning

    mesh, devices = args.mesh, None
    if ":" in args.model:        # a user function's factory makes its own mesh for --devices
        devices = args.devices
    elif args.auto:
        if args.devices is None:
            parser.error("--auto needs --devices N: how many devices to plan the run for")
    elif args.devices is not None:
        if args.mesh is not None:
            parser.error("give --devices or --mesh, not both")
        if args.devices < 4 or args.devices & (args.devices - 1):
            parser.error("--devices must be a power of two, at least 4")
        x = 2 ** (int(np.log2(args.devices)) // 2)
        mesh = (x, args.devices // x)
    fields = {f: getattr(args, f) for f in ("layers", "model_dim", "ffn_dim", "heads", "head_dim", "seq", "vocab",
                                            "experts", "batch", "stages", "microbatches", "schedule", "repeats",
                                            "image_size", "remat", "activation_dtype", "optimizer", "strategy",
                                            "attention", "dropout")}
    if fields["remat"] is None and ":" not in args.model:
        fields["remat"] = "auto"     # the least recompute that fits, said in the plan
    elif fields["remat"] == "none":
        fields["remat"] = None
    try:
        if args.auto:
            return auto_plan(args.model, planning.Sizes(mesh=mesh, **fields), args.devices, args.hardware,
                             args.budget, args.json, args.top)
        plan(args.model, planning.Sizes(mesh=mesh, devices=devices, **fields), args.hardware, args.json, args.top, args.memory_plot)
    except gspmd.ShardingError as e:
        parser.exit(2, f"gspmd plan: error: {e}\n")
    return 0


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


def parse_bytes(text: str) -> int:
    """'16GiB', '512MiB', '1.5GB' or a plain number of bytes."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "kb": 10 ** 3, "mb": 10 ** 6,
             "gb": 10 ** 9, "tb": 10 ** 12, "b": 1}
    low = text.strip().lower()
    for unit, factor in units.items():
        if low.endswith(unit):
            return int(float(low[:-len(unit)]) * factor)
    return int(float(low))


def _progress_printer():
    """A progress callback for gspmd.auto: a rich progress bar when rich is installed,
    plain lines otherwise; and what to call when done."""
    try:
        from rich.progress import Progress
    except ImportError:
        def plain(done: int, total: int, what: str) -> None:
            print(f"[{done}/{total}] {what}", flush=True)
        return plain, lambda: None
    bar = Progress(transient=True)
    bar.start()
    task = bar.add_task("searching", total=1)

    def update(done: int, total: int, what: str) -> None:
        bar.update(task, completed=done, total=total, description=what)
    return update, bar.stop


def auto_command(spec: str, devices: Optional[int], mesh_shape: Optional[tuple[int, ...]], hardware: str,
                 memory_limit: Optional[int]) -> None:
    """Search annotations for module:function; print the plan and its code."""
    import gspmd
    from gspmd import planning

    case = planning.build(spec, planning.Sizes(), planning.profile(hardware))
    fn, args = case.step, case.args
    mesh = None
    if mesh_shape is not None:
        mesh = gspmd.Mesh(planning.device_mesh(mesh_shape, hardware), ("x", "y", "z")[:len(mesh_shape)])
    update, stop = _progress_printer()
    try:
        plan = gspmd.auto(fn, *args, devices=devices, mesh=mesh, hardware=hardware, memory_limit=memory_limit,
                          progress=update)
    finally:
        stop()
    print(plan)
    print("\n# --- code ---")
    print(plan.code())


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
    from gspmd.planning import USER_FUNCTION
    p = sub.add_parser("plan", help="plan a paper-scale train step for many devices (no execution)",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Plan a case study of the paper, or your own function, on abstract inputs, "
                       "without running it.\n\n" + USER_FUNCTION)
    p.add_argument("model", nargs="?", default="transformer",
                   help="transformer (default), moe, hybrid-moe, conformer, unet, or module:function")
    p.add_argument("--devices", type=int, help="transformer: a near-square 2D mesh over this many devices; "
                   "module:factory: passed as factory(devices=N)")
    p.add_argument("--mesh", type=_mesh_arg, help="mesh shape, e.g. 32x64 (X x Y) or 4x16x4 (L x X x Y)")
    for flag, what in [("layers", "layers"), ("model-dim", "model dim M"), ("ffn-dim", "feed-forward dim H"),
                       ("heads", "attention heads N"), ("head-dim", "head dim D"), ("seq", "sequence length"),
                       ("vocab", "vocabulary"), ("experts", "experts E"), ("batch", "global batch"),
                       ("stages", "pipeline stages L"),
                       ("microbatches", "pipeline microbatches; without a pipeline, steps of gradient accumulation"),
                       ("repeats", "circular or 1f1b schedule: layers per stage per microbatch pass"),
                       ("image-size", "U-Net: side of the cubic image")]:
        p.add_argument(f"--{flag}", type=int, help=what)
    p.add_argument("--schedule", help="pipeline schedule: gpipe, circular or 1f1b (interleaved with --repeats)")
    p.add_argument("--remat", help="rematerialize each layer with a jax.checkpoint policy: nothing_saveable, "
                   "dots_saveable, dots_with_no_batch_dims_saveable, everything_saveable; rerun: its whole "
                   "forward pass again, as torch.utils.checkpoint (Megatron-LM's --checkpoint-activations); "
                   "auto (the default for the case studies): the least recompute that fits what a program may use of the "
                   "hardware's memory; none: no rematerialization")
    p.add_argument("--strategy", help="transformer: 2d (default: the paper's 2D finalized sharding, weights over "
                   "X and Y, as FSDP + tensor parallelism) or megatron (weights over Y only, data parallel over X)")
    p.add_argument("--attention", help="transformer, conformer: dot_product (default: all queries at once), "
                   "flash (512 queries at a time, recomputed in the backward pass: no [B, N, S, S] scores held) "
                   "or megatron (all at once, the softmax a kernel of its own as Megatron-LM's)")
    p.add_argument("--dropout", type=float, help="transformer: dropout rate on the attention probabilities and "
                   "each sublayer's output (Megatron-LM's GPT: 0.1), masks from the step's key")
    p.add_argument("--activation-dtype", help="bfloat16 (default, as the paper) or float32")
    p.add_argument("--optimizer", help="adafactor (default, as the paper), adamw or sgd")
    p.add_argument("--hardware", default="tpu-v3", help="tpu-v3 (default), tpu-v4, a100, h100, h200 or cpu")
    p.add_argument("--auto", action="store_true", help="search the training configuration for --devices N: mesh, "
                   "strategy, pipeline stages, schedule, repeats, microbatches and remat (those given are kept); "
                   "prints the best plan, the flags that reproduce it and why the runners-up lost")
    p.add_argument("--budget", type=float, default=60.0, help="--auto: seconds to search (default 60: no plan is "
                   "started that would end past it, the first excepted)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--top", type=int, default=5, help="how many of the largest buffers at the peak to list (default 5)")
    p.add_argument("--memory-plot", metavar="PNG", help="plot memory per device over the run (needs matplotlib)")
    a = sub.add_parser("auto", help="search annotations (mesh and strategy) for module:function and print them as code")
    a.add_argument("function", help="module:function; the module also defines plan_args() (the arguments)")
    a.add_argument("--devices", type=int, help="device count (the mesh is chosen among its factorizations)")
    a.add_argument("--mesh", type=_mesh_arg, help="a fixed mesh shape instead, e.g. 2x4 (axes x, y, z)")
    a.add_argument("--hardware", default="tpu-v3", help="tpu-v3, tpu-v4, a100, h100, h200 or cpu")
    a.add_argument("--memory-limit", help="bytes per device, e.g. 16GiB (default: what a program may use of "
                   "the hardware's memory)")
    args = parser.parse_args(argv)
    if args.command == "auto":
        from gspmd.errors import ShardingError
        if args.devices is not None and args.mesh is not None:
            parser.error("give --devices or --mesh, not both")
        try:
            auto_command(args.function, args.devices, args.mesh, args.hardware,
                         None if args.memory_limit is None else parse_bytes(args.memory_limit))
        except ShardingError as e:
            print(f"error: {e}")
            return 1
        return 0
    if args.command == "plan":
        return _plan_command(parser, args)
    if args.command == "memory":
        memory(args.model, _mesh_shape(parser, args.mesh), args.top, args.plot)
        return 0
    if args.command == "demo":
        return 0 if demo(_mesh_shape(parser, args.mesh), args.model, args.memory_plot) < 1e-3 else 1
    return 2
