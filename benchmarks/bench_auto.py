"""gspmd.auto against the paper's hand-written strategies, on the case studies.

For each case the hand strategy (the annotated model) is lowered and reported, then
gspmd.auto searches the unannotated model under the same memory limit (the hand plan's
peak) on the same hardware profile; both are estimated by gspmd's own report (no
execution). `--measure` also runs the MLP and Transformer train steps on 8 CPU devices
(jax backend) and times hand and found plans with interleaved repeats.

    python benchmarks/bench_auto.py [--cases transformer-8 moe ...] [--measure] [--repeats 30]
    python benchmarks/bench_auto.py --limits     # the search's cost under binding memory limits
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402

import gspmd  # noqa: E402
from gspmd.spmd.cost import GiB  # noqa: E402
from gspmd.models import mlp, moe, transformer as T, unet  # noqa: E402


@dataclass
class Case:
    name: str
    hand: str                    # what the hand strategy is
    mesh: gspmd.Mesh             # the hand strategy's mesh
    annotated: Callable          # the hand-annotated step
    plain: Callable              # the same step without annotations
    args: tuple
    hardware: str = "tpu-v3"


def _mesh(shape, names) -> gspmd.Mesh:
    return gspmd.Mesh(np.arange(int(np.prod(shape))).reshape(shape), names)


def _transformer(devices: int, shape, cfg: T.Config, name: str) -> Case:
    mesh = _mesh(shape, ("x", "y"))
    return Case(name, f"Table 1 2D finalized on {shape[0]}x{shape[1]}", mesh,
                T.make_train_step(T.gspmd_annotate(mesh), cfg), T.make_train_step(None, cfg, strategy={}),
                T.example_inputs(cfg, abstract=True))


SMALL = T.Config(batch=32, seq=64, model=256, heads=64, head_dim=4, hidden=1024, layers=2)


def _paper(layers: int, devices: int = 2048) -> T.Config:
    return T.Config(batch=devices, seq=1024, model=8192, heads=128, head_dim=128, hidden=65536, layers=layers)


def _narrow(devices: int, layers: int) -> T.Config:
    """Table 3's 16B model: M=4096, H=16384, N=64, D=128; one sequence per device."""
    return T.Config(batch=devices, seq=1024, model=4096, heads=64, head_dim=128, hidden=16384, layers=layers)


def cases() -> dict[str, Callable[[], Case]]:
    moe_cfg = moe.Config(groups=8, group_size=256, model=256, hidden=1024, experts=8, capacity=64)
    rng = np.random.RandomState(0)
    image = rng.standard_normal((1, 2, 64, 128, 8)).astype(np.float32)
    unet_args = (unet.init_params(rng), image, rng.standard_normal((1, 1, 64, 128, 8)).astype(np.float32))
    mesh8 = _mesh((8,), ("x",))
    mesh24 = _mesh((2, 4), ("x", "y"))
    return {
        "mlp": lambda: Case("MLP train step (batch 512, 512-2048-256), 8 devices", "data x model on 2x4",
                            _mesh((2, 4), ("data", "model")), mlp.make_train_step(_mesh((2, 4), ("data", "model"))),
                            mlp.make_train_step(None),
                            mlp.example_inputs(batch=512, d_in=512, hidden=2048, d_out=256)),
        "transformer-8": lambda: _transformer(8, (2, 4), SMALL, "Transformer (2 layers, B=32 S=64 M=256 H=1024), 8 "
                                                                "devices"),
        "transformer-2048": lambda: _transformer(2048, (32, 64), _paper(2), "Transformer (paper size, 2 layers), "
                                                                            "2048 devices"),
        "transformer-2048-32": lambda: _transformer(2048, (32, 64), _paper(32), "Transformer (paper size, 32 "
                                                                                "layers), 2048 devices"),
        "moe": lambda: Case("MoE layer (G=E=8, S=256, M=256, H=1024, C=64), 8 devices", "expert sharding on 8",
                            mesh8, moe.make_train_step(mesh8, "x", moe_cfg), moe.make_train_step(None, "x", moe_cfg),
                            moe.example_inputs(moe_cfg)),
        "unet": lambda: Case("3D U-Net (1x2x64x128x8), 8 devices", "spatial D over x, H over y on 2x4", mesh24,
                             unet.make_train_step(mesh24, ("x", "y", -1)), unet.make_train_step(None), unet_args),
    } | {f"narrow-{n}-{x}x{y}": (lambda n=n, x=x, y=y: _transformer(
        n, (x, y), _narrow(n, 2), f"Table 3 narrow Transformer (2 layers), {n} devices"))
         for n, x, y in [(64, 4, 16), (64, 16, 4), (256, 8, 32), (256, 32, 8)]}


def compare(case: Case, tight: bool) -> dict:
    """The memory limit both plans live under: what a program may use of the hardware's
    memory where the hand plan fits in it, else (and with `tight`) the hand plan's own peak."""
    hand = gspmd.jit(case.annotated, mesh=case.mesh).lower(*case.args).report(case.hardware)
    limit = hand.peak_memory_bytes if tight or not hand.fits_in_memory else hand.hardware.usable_bytes
    try:
        plan = gspmd.auto(case.plain, *case.args, devices=case.mesh.size, hardware=case.hardware, memory_limit=limit)
    except gspmd.ShardingError as e:
        plan = e
    return {"case": case, "hand": hand, "plan": plan, "limit": limit}


def _row(r: dict) -> str:
    case, hand, plan = r["case"], r["hand"], r["plan"]
    head = (f"| {case.name} | {case.hand} | {r['limit'] / GiB:.3f} GiB | {hand.step_seconds * 1e3:.3f} ms, "
            f"{hand.peak_memory_bytes / GiB:.3f} GiB")
    if isinstance(plan, Exception):
        return f"{head} | none: {plan} | | NO |"
    mesh = "x".join(map(str, plan.mesh.shape))
    verdict = "yes" if plan.step_seconds <= hand.step_seconds * (1 + 1e-9) else "NO"
    return (f"{head} | {mesh}: {plan.step_seconds * 1e3:.3f} ms, {plan.peak_memory_bytes / GiB:.3f} GiB "
            f"| {plan.search_seconds:.1f} s | {verdict} |")


def measure(repeats: int) -> list[str]:
    """Hand vs found on 8 CPU devices (jax backend), interleaved; medians."""
    out = ["| train step | hand (median ms) | found (median ms) | found / hand (median of pairs) | found plan |",
           "|---|---:|---:|---:|---|"]
    for name in ("mlp", "transformer-8"):
        case = cases()[name]()
        concrete = case.args if name == "mlp" else T.example_inputs(SMALL)
        hand = gspmd.jit(case.annotated, mesh=case.mesh, backend="jax").lower(*concrete).jax_executable()
        plan = gspmd.auto(case.plain, *concrete, devices=8, hardware="cpu")
        found = plan.jit(backend="jax").lower(*concrete).jax_executable()
        flat = jax.tree_util.tree_leaves(concrete)
        times = {"hand": [], "found": []}
        for exe in (hand, found):      # compile and warm up
            jax.block_until_ready(exe(flat))
        for _ in range(repeats):
            for key, exe in (("hand", hand), ("found", found)):
                t = time.perf_counter()
                jax.block_until_ready(exe(flat))
                times[key].append(time.perf_counter() - t)
        ratio = statistics.median(f / h for f, h in zip(times["found"], times["hand"]))
        out.append(f"| {case.name} | {statistics.median(times['hand']) * 1e3:.2f} "
                   f"| {statistics.median(times['found']) * 1e3:.2f} | {ratio:.3f} | mesh "
                   f"{'x'.join(map(str, plan.mesh.shape))}, {_summary(plan)} |")
    return out


def _summary(plan) -> str:
    kinds = ", ".join(f"{k} x{n}" for k, (n, _) in plan.collectives.items()) or "no collectives"
    return f"{kinds}, {len(plan.intermediates)} intermediate annotations"


def under_limits(repeats: int = 3) -> list[str]:
    """The search's cost without a memory limit and under binding ones (below the
    unconstrained plan's peak): best of `repeats` wall-clock times, and the strategies
    it solved (Plan.strategies_searched, deterministic)."""
    out = ["| MLP, hardware | memory limit | search (best of %d) | strategies | peak | est. step | mesh |" % repeats,
           "|---|---:|---:|---:|---:|---:|---|"]
    for name, args, hardware, limits in (
            ("tests' MLP_ARGS, cpu", mlp.example_inputs(), "cpu", (None, 25_000, 20_000, 12_000)),
            ("batch 512, 512-2048-256, tpu-v3", mlp.example_inputs(batch=512, d_in=512, hidden=2048, d_out=256),
             "tpu-v3", (None, 4_000_000, 3_700_000))):
        for limit in limits:
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                plan = gspmd.auto(mlp.make_train_step(None), *args, devices=8, hardware=hardware, memory_limit=limit)
                times.append(time.perf_counter() - start)
            out.append(f"| {name} | {limit or 'none'} | {min(times):.2f} s | {plan.strategies_searched} "
                       f"| {plan.peak_memory_bytes} B | {plan.step_seconds * 1e6:.1f} us "
                       f"| {'x'.join(map(str, plan.mesh.shape))} |")
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", nargs="*", default=["mlp", "transformer-8", "transformer-2048", "moe", "unet"])
    parser.add_argument("--measure", action="store_true")
    parser.add_argument("--tight", action="store_true", help="memory limit: the hand plan's own peak")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--limits", action="store_true", help="only the search's cost under binding memory limits")
    args = parser.parse_args()
    if args.limits:
        print("\n".join(under_limits()))
        return
    print("| case | hand strategy | memory limit | hand (est. step, peak/device) | found (mesh: est. step, peak) "
          "| search | found <= hand |")
    print("|---|---|---|---|---|---:|---|")
    for name in args.cases:
        r = compare(cases()[name](), args.tight)
        print(_row(r), flush=True)
        print(r["plan"], flush=True)
        print(flush=True)
    if args.measure:
        print("\n".join(measure(args.repeats)))


if __name__ == "__main__":
    main()
