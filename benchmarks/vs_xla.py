"""gspmd (jax backend) against XLA's own partitioner, on the same annotated programs.

For each model available, both get the same annotations (ours: mesh_split; XLA's: the
same calls as with_sharding_constraint via mesh_split_as) and the same input/output
layouts, on 8 CPU devices. Printed per case: collective bytes per device (parsed from
each compiled HLO text), step time (interleaved runs: medians, and the median ratio of
back-to-back pairs; wall clock and the CPU time of all threads), peak memory per device
(compiled.memory_analysis(): arguments + outputs + temporaries - aliased). Then our
propagate+partition time for the same program at 8, 64, 512 and 2048 devices (abstract
inputs, nothing executed; best of 5).

    python benchmarks/vs_xla.py [--repeats 30] [--cases mlp transformer ...] [--no-scaling]

With --patterns: instead, per case ported from XLA's partitioner tests
(tests/xla_cases.py), the collective bytes per device of ours and of XLA's classic GSPMD
partitioner given the same shardings.

    python benchmarks/vs_xla.py --patterns
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax._src.lib import xla_client  # noqa: E402
from jax._src.sharding_impls import GSPMDSharding  # noqa: E402

import gspmd  # noqa: E402
import gspmd.api  # noqa: E402
from gspmd import propagation  # noqa: E402
from gspmd.frontend.annotation import mesh_split_as  # noqa: E402
from gspmd.analysis.xla import hlo_collective_bytes, xla_constraint  # noqa: E402
from gspmd.runtime import jax_backend  # noqa: E402

DEVICE_COUNTS = (8, 64, 512, 2048)
MESHES_2D = {8: (2, 4), 64: (8, 8), 512: (16, 32), 2048: (32, 64)}


@dataclass
class Case:
    name: str
    axes: tuple[str, ...]
    make_step: Callable[[gspmd.Mesh], Callable]      # the annotated step for a mesh
    inputs: Callable[[int], tuple]                    # arguments for a mesh of n devices
    mesh_shapes: dict = field(default_factory=lambda: MESHES_2D)
    hardware: Optional[gspmd.Hardware] = None        # what our choices are priced on (None: tpu-v3)


def _mlp() -> Case:
    from gspmd.models import mlp
    return Case("MLP train step", ("data", "model"), mlp.make_train_step,
                lambda n: mlp.example_inputs(batch=512, d_in=512, hidden=2048, d_out=256))


def _transformer() -> Case:
    from gspmd.models import transformer as T
    cfg = T.Config(batch=32, seq=64, model=256, heads=64, head_dim=4, hidden=1024, layers=2)
    return Case("Transformer train step (2 layers)", ("x", "y"),
                lambda mesh: T.make_train_step(T.gspmd_annotate(mesh), cfg), lambda n: T.example_inputs(cfg))


def _moe() -> Case:
    from gspmd.models import moe

    def cfg(n: int):   # as in GShard: one expert and one token group per device
        return moe.Config(groups=n, group_size=256, model=256, hidden=1024, experts=n, capacity=64)
    return Case("MoE layer train step (E = G = devices)", ("x",),
                lambda mesh: moe.make_train_step(mesh, "x", cfg(mesh.size)), lambda n: moe.example_inputs(cfg(n)),
                {n: (n,) for n in DEVICE_COUNTS})


def _dropless_moe() -> Case:
    from gspmd.models import moe

    def cfg(n: int):   # groups over x, one expert per device of y
        x, y = MESHES_2D[n]
        return moe.Config(groups=2 * x, group_size=256, model=256, hidden=1024, experts=y)
    return Case("dropless MoE train step (lax.ragged_dot; groups over x, experts over y)", ("x", "y"),
                lambda mesh: moe.make_train_step(mesh, "x", cfg(mesh.size), expert_axis="y", dropless=True),
                lambda n: moe.example_inputs(cfg(n)))


def _unet() -> Case:
    from gspmd.models import unet

    def inputs(n: int):
        rng = np.random.RandomState(0)
        x = rng.standard_normal((1, 2, 64, 128, 8)).astype(np.float32)     # D over x, H over y
        return unet.init_params(rng), x, rng.standard_normal((1, 1) + x.shape[2:]).astype(np.float32)
    return Case("3D U-Net train step (spatial partitioning)", ("x", "y"),
                lambda mesh: unet.make_train_step(mesh, ("x", "y", -1)), inputs)


BUILDERS = {"mlp": _mlp, "transformer": _transformer, "moe": _moe, "dropless-moe": _dropless_moe, "unet": _unet}


def available_cases() -> dict[str, Case]:
    """Models that exist in this checkout (others are still being written)."""
    cases = {}
    for key, build in BUILDERS.items():
        try:
            cases[key] = build()
        except (ImportError, AttributeError) as e:
            print(f"skipping {key}: {e}")
    return cases


def _mesh(case: Case, n: int) -> gspmd.Mesh:
    shape = case.mesh_shapes[n]   # over the first of the n devices where it holds fewer
    return gspmd.Mesh(np.arange(math.prod(shape)).reshape(shape), case.axes)


# -- 8 devices: ours vs XLA --------------------------------------------------------------
def _ours(case: Case, args):
    mesh = _mesh(case, 8)
    low = gspmd.jit(case.make_step(mesh), mesh=mesh, backend="jax", hardware=case.hardware).lower(*args)
    exe = low.jax_executable()
    placed = [jax.device_put(a, s) for a, s in zip(jax.tree_util.tree_leaves(args), exe.in_shardings)]
    return low, exe, (lambda: exe.jitted(*placed))


def _xla(case: Case, args, low: gspmd.Lowered, exe: jax_backend.Executable):
    """XLA gets our annotations as sharding constraints, and our input and output
    layouts (so both start and end with the same data on each device)."""
    mesh, in_tree = _mesh(case, 8), jax.tree_util.tree_structure(args)
    ins, outs = exe.in_shardings, exe.out_shardings
    with mesh_split_as(xla_constraint):
        jitted = jax.jit(case.make_step(mesh), in_shardings=jax.tree_util.tree_unflatten(in_tree, ins),
                         out_shardings=jax.tree_util.tree_unflatten(low.out_tree, outs))
        compiled = jitted.lower(*args).compile()
    placed = jax.tree_util.tree_unflatten(
        in_tree, [jax.device_put(a, s) for a, s in zip(jax.tree_util.tree_leaves(args), ins)])
    return compiled, (lambda: compiled(*placed))


def _step_times(runs: dict[str, Callable], repeats: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Wall-clock and CPU seconds (all of the process's threads) of each run, interleaved so
    that drift hits both alike. On a loaded machine the wall clock also counts the waits
    for a core, which the CPU time leaves out."""
    for run in runs.values():
        for _ in range(3):
            jax.block_until_ready(run())
    wall, cpu = {name: [] for name in runs}, {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            jax.block_until_ready(run())
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    return wall, cpu


def _peak(compiled) -> int:
    m = compiled.memory_analysis()
    return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes


def _max_difference(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)), initial=0))
               for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


def compare(case: Case, repeats: int) -> None:
    args = case.inputs(8)
    low, exe, run_ours = _ours(case, args)
    xla, run_xla = _xla(case, args, low, exe)
    ours_bytes = hlo_collective_bytes(exe.compiled.as_text())
    xla_bytes = hlo_collective_bytes(xla.as_text())
    times, cpu = _step_times({"ours": run_ours, "xla": run_xla}, repeats)
    diff = _max_difference(exe(jax.tree_util.tree_leaves(args)), jax.tree_util.tree_leaves(run_xla()))
    shape = case.mesh_shapes[8]
    print(f"\n## {case.name} ({math.prod(shape)} devices, mesh {shape}; max |ours - XLA| = {diff:.1e})")
    print("| | gspmd | XLA | ratio |\n|---|---:|---:|---:|")
    _row("collective bytes / device", sum(ours_bytes.values()), sum(xla_bytes.values()))
    for kind in sorted(set(ours_bytes) | set(xla_bytes)):
        _row(f"  {kind}", ours_bytes.get(kind, 0), xla_bytes.get(kind, 0))
    ours_ms, xla_ms = (statistics.median(times[k]) * 1e3 for k in ("ours", "xla"))
    # Ratio: median over back-to-back pairs, steadier than a ratio of medians under load.
    paired = statistics.median(a / b for a, b in zip(times["ours"], times["xla"]))
    print(f"| step time (ms, median) | {ours_ms:,.2f} | {xla_ms:,.2f} | {paired:.2f} |")
    cpu_paired = statistics.median(a / b for a, b in zip(cpu["ours"], cpu["xla"]))
    ours_cpu, xla_cpu = (statistics.median(cpu[k]) * 1e3 for k in ("ours", "xla"))
    print(f"| CPU time per step (ms, median, all threads) | {ours_cpu:,.2f} | {xla_cpu:,.2f} | {cpu_paired:.2f} |")
    _row("peak memory / device (bytes)", _peak(exe.compiled), _peak(xla))


def _row(label: str, ours: float, xla: float) -> None:
    ratio = f"{ours / xla:.2f}" if xla else ("-" if not ours else "inf")
    fmt = "{:,.2f}" if isinstance(ours, float) else "{:,}"
    print(f"| {label} | {fmt.format(ours)} | {fmt.format(xla)} | {ratio} |")


# -- propagate + partition time as the mesh grows -------------------------------------------
@contextmanager
def _timed(module, name: str, seconds: list):
    """Add the time spent in module.name to `seconds` while inside the block."""
    original = getattr(module, name)

    def timed(*a, **k):
        start = time.perf_counter()
        try:
            return original(*a, **k)
        finally:
            seconds.append(time.perf_counter() - start)
    setattr(module, name, timed)
    try:
        yield
    finally:
        setattr(module, name, original)


def partition_seconds(case: Case, n: int, repeats: int = 5) -> tuple[float, float]:
    """(propagate+partition seconds, whole lower() seconds), best of `repeats`: the
    least disturbed by other processes on a shared machine."""
    abstract = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), case.inputs(n))
    core, total = [], []
    for _ in range(repeats):
        mesh = _mesh(case, n)
        spent: list[float] = []
        with _timed(propagation, "complete", spent), _timed(gspmd.api, "partition", spent):
            start = time.perf_counter()
            gspmd.jit(case.make_step(mesh), mesh=mesh).lower(*abstract)
            total.append(time.perf_counter() - start)
        core.append(sum(spent))
    return min(core), min(total)


def scaling(case: Case) -> None:
    print(f"\n## {case.name}: propagate + partition time (abstract inputs, no execution)")
    print("| devices | mesh | propagate+partition (s) | whole lower() (s) | vs 8 devices |\n|---:|---|---:|---:|---:|")
    base = None
    for n in DEVICE_COUNTS:
        core, total = partition_seconds(case, n)
        base = base or core
        shape = "x".join(map(str, case.mesh_shapes[n]))
        print(f"| {n} | {shape} | {core:.3f} | {total:.3f} | {core / base:.2f}x |")


# -- per pattern: the cases ported from XLA's partitioner tests ------------------------------
@contextmanager
def _classic_gspmd():
    """XLA's GSPMD partitioner (the one spmd_partitioner_test.cc tests) instead of
    Shardy, which cannot take shardings over arbitrary device orders."""
    before = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", False)
    try:
        yield
    finally:
        jax.config.update("jax_use_shardy_partitioner", before)


def _hlo_sharding(s: gspmd.Sharding) -> GSPMDSharding:
    """Our sharding as XLA's, over jax.devices()[:n] (device id d is the d-th)."""
    devices = jax.devices()[:s.num_devices]
    if s.is_replicated:
        return GSPMDSharding.get_replicated(devices)
    dims = list(s.tiles) + ([s.num_replicas] if s.num_replicas > 1 else [])
    text = (f"{{devices=[{','.join(map(str, dims))}]{','.join(map(str, s.tile_assignment.ravel()))}"
            f"{' last_tile_dim_replicate' if s.num_replicas > 1 else ''}}}")
    return GSPMDSharding(devices, xla_client.HloSharding.from_string(text))


def _uneven(v) -> bool:
    return any(n % t for n, t in zip(v.shape, v.sharding.tiles))


def _even_boundary(fn: Callable, low: gspmd.Lowered) -> Callable:
    """fn with the arguments and results that jax cannot pass split (their split does not
    divide them) passed replicated instead, on both sides alike: replicated arguments
    are cut for free, replicated results cost both the same final gather."""
    n = low.num_devices
    mesh = gspmd.Mesh(np.arange(n), ("all",))
    args_in = [_uneven(p) for p in low.program.params]
    results_out = [_uneven(v) for v in low.program.outputs]

    def whole(x):
        return gspmd.mesh_split(x, mesh, [-1] * np.ndim(x))

    def wrapped(*args):
        flat, tree = jax.tree_util.tree_flatten(args)
        flat = [whole(a) if replicate else a for a, replicate in zip(flat, args_in)]
        outs, out_tree = jax.tree_util.tree_flatten(fn(*jax.tree_util.tree_unflatten(tree, flat)))
        return jax.tree_util.tree_unflatten(out_tree, [whole(o) if r else o for o, r in zip(outs, results_out)])
    return wrapped


def pattern_bytes(case, hardware) -> tuple[int, Optional[int], bool]:
    """(ours, XLA's or None where XLA fails, whether the boundary was made replicated)
    collective bytes per device of one ported case: ours from our partitioned program
    (choices priced on `hardware`); XLA's parsed from its compiled HLO, from jax.jit with the same annotations as sharding constraints and the same
    argument and result layouts."""
    args = case.arguments()
    fn = case.fn
    low = gspmd.jit(fn, backend="jax", hardware=hardware).lower(*args)
    evened = any(map(_uneven, low.program.params)) or any(map(_uneven, low.program.outputs))
    if evened:
        fn = _even_boundary(fn, low)
        low = gspmd.jit(fn, backend="jax", hardware=hardware).lower(*args)
    # Ours from the partitioned program itself: where a result's device order is one the
    # jax mesh cannot name, our jax backend returns it gathered (a boundary cost of the
    # runtime that XLA's GSPMDSharding results do not pay).
    ours = sum(c.bytes for c in low.report().collectives)

    def constraint(x, mesh, dims_mapping):
        return jax.lax.with_sharding_constraint(x, _hlo_sharding(gspmd.Sharding.from_mesh(mesh, dims_mapping,
                                                                                            np.shape(x))))
    ins = tuple(_hlo_sharding(p.sharding) for p in low.program.params)
    outs = jax.tree_util.tree_unflatten(low.out_tree, [_hlo_sharding(v.sharding) for v in low.program.outputs])
    try:
        with _classic_gspmd(), mesh_split_as(constraint):
            text = jax.jit(fn, in_shardings=ins, out_shardings=outs).lower(*args).compile().as_text()
    except jax.errors.JaxRuntimeError:
        return ours, None, evened
    return ours, sum(hlo_collective_bytes(text).values()), evened


def patterns() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from util import BYTES_RECEIVED
    from xla_cases import CASES
    print("\n## Ported XLA partitioner cases: collective bytes per device (compiled HLO)")
    print("(ours priced by the bytes each device receives, as the tests do: these arrays are small)")
    print("(*: an argument or result that its split does not divide is passed replicated, on both sides)\n")
    print("| case | gspmd | XLA | ratio |\n|---|---:|---:|---:|")
    above = []
    for case in CASES:
        ours, xla, evened = pattern_bytes(case, BYTES_RECEIVED)
        name = case.name + (" *" if evened else "")
        if xla is None:
            print(f"| {name} | {ours:,} | XLA fails | - |")
            continue
        ratio = ours / xla if xla else (1.0 if not ours else float("inf"))
        above += [case.name] if ratio > 1.0 else []
        print(f"| {name} | {ours:,} | {xla:,} | {'-' if not (ours or xla) else f'{ratio:.2f}'} |")
    print(f"\n{len(above)} of {len(CASES)} rows above 1.00: {', '.join(above) or 'none'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--cases", nargs="*", choices=sorted(BUILDERS))
    parser.add_argument("--no-scaling", action="store_true")
    parser.add_argument("--patterns", action="store_true", help="only the per-pattern table of ported XLA cases")
    args = parser.parse_args()
    if args.patterns:
        patterns()
        return
    cases = available_cases()
    for key, case in cases.items():
        if args.cases and key not in args.cases:
            continue
        try:
            compare(case, args.repeats)
            if not args.no_scaling:
                scaling(case)
        except gspmd.ShardingError as e:   # a model whose ops are still being written
            print(f"\n## {case.name}: skipped: {e}")


if __name__ == "__main__":
    main()
