"""Our memory model against XLA's own: peak bytes per device of every case study's train
step (and of a gradient through scanned layers under jax.checkpoint), from `Lowered.report().memory` (liveness over the per-device program, no
compilation) and from XLA's `memory_analysis()` of the jax backend's compiled executable
(arguments + outputs + temporaries - aliased), on 8 CPU devices. Each case runs as is
and with its parameters donated (the new parameters reuse their buffers).

XLA:CPU schedules for concurrency by default (breadth first: everything ready runs as
early as it can, which holds far more at once); accelerators schedule for memory. By
default this script runs XLA with --xla_cpu_enable_concurrency_optimized_scheduler=false
against the model's memory-minimizing schedule; with --bfs, XLA:CPU's default scheduler
against the model's breadth-first one. (The flag is process-wide: XLA:CPU ignores it
among a compilation's compiler_options.)

    python benchmarks/memory_vs_xla.py [--sizes small medium] [--cases mlp ...] [--no-donation] [--json] [--bfs]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import gspmd  # noqa: E402
from gspmd.analysis import memory  # noqa: E402
from gspmd.models import mlp, moe, pipelined, transformer, unet  # noqa: E402
from gspmd.runtime import jax_backend  # noqa: E402


def _mesh(shape, names):
    return gspmd.Mesh(np.arange(int(np.prod(shape))).reshape(shape), names)


def _scanned_stack(mesh, layers: int, batch: int, model: int, hidden: int, remat: bool):
    """A scan over stacked layers. remat: each layer under jax.checkpoint (nothing saved),
    the backward pass recomputes every layer: (its gradient, arguments); else an SGD train
    step of the stacked parameters (which donation updates in place): (step, arguments)."""
    def layer(x, w1, w2):
        h = jax.nn.gelu(x @ gspmd.mesh_split(w1, mesh, [-1, "y"]))
        return x + jnp.tanh(h @ w2)

    def loss(x, w1s, w2s):
        step = jax.checkpoint(layer, policy=jax.checkpoint_policies.nothing_saveable) if remat else layer
        y, _ = jax.lax.scan(lambda c, ws: (step(c, *ws), None), gspmd.mesh_split(x, mesh, ["x", -1]), (w1s, w2s))
        return jnp.mean(y ** 2)

    rng = np.random.RandomState(0)
    x = rng.standard_normal((batch, model)).astype(np.float32)
    ws = ((rng.standard_normal((layers, model, hidden)) * 0.3).astype(np.float32),
          (rng.standard_normal((layers, hidden, model)) * 0.3).astype(np.float32))
    if remat:
        return jax.grad(loss, argnums=(1, 2)), (x, *ws)

    def train_step(ws, x):
        grads = jax.grad(lambda ws: loss(x, *ws))(ws)
        return jax.tree_util.tree_map(lambda w, g: w - 0.1 * g, ws, grads)
    return train_step, (ws, x)


def cases(size: str) -> dict:
    """name -> (train step, arguments, mesh); `small` are the demo's configurations."""
    small = size == "small"
    rng = np.random.RandomState(0)
    tcfg = transformer.Config() if small else transformer.Config(batch=8, seq=64, model=128, heads=8,
                                                                 head_dim=16, hidden=512, layers=2)
    mcfg = moe.Config() if small else moe.Config(groups=8, group_size=64, model=64, hidden=128, capacity=16)
    dcfg = moe.Config(groups=4, group_size=16, model=8, hidden=32, experts=4) if small else \
        moe.Config(groups=4, group_size=256, model=256, hidden=1024, experts=4)
    # batch 4: its microbatches split evenly over x (an uneven split makes the jax backend
    # take the whole batch and pad it in its body, which the per-device program does not hold)
    pcfg = transformer.Config(batch=4, layers=2) if small else transformer.Config(batch=8, seq=32, model=64, heads=4,
                                                                         head_dim=16, hidden=256, layers=2)
    width, side = (4, 8) if small else (8, 16)
    mesh2 = _mesh((2, 4), ("x", "y"))
    stacked, xs, targets = pipelined.example_inputs(pcfg, microbatches=4)
    mlp_args = mlp.example_inputs() if small else mlp.example_inputs(batch=256, d_in=512, hidden=1024, d_out=128)
    return {
        "mlp": (mlp.make_train_step(_mesh((2, 4), ("data", "model"))), mlp_args),
        "transformer": (transformer.make_train_step(transformer.gspmd_annotate(mesh2), tcfg),
                        transformer.example_inputs(tcfg)),
        "moe": (moe.make_train_step(_mesh((8,), ("x",)), cfg=mcfg), moe.example_inputs(mcfg)),
        "dropless-moe": (moe.make_train_step(mesh2, "x", dcfg, expert_axis="y", dropless=True),
                         moe.example_inputs(dcfg)),
        "unet": (unet.make_train_step(_mesh((2, 4), ("d", "h")), ("d", "h", -1)),
                 (unet.init_params(rng, width=width), rng.standard_normal((2, 2, side, side, side)).astype(np.float32),
                  rng.standard_normal((2, 1, side, side, side)).astype(np.float32))),
        "pipeline": (pipelined.make_train_step(_mesh((2, 4), ("p", "x")), pcfg), (stacked, xs, targets)),
        "scan": _scanned_stack(mesh2, 3, *((16, 8, 32) if small else (256, 64, 512)), remat=False),
        "remat": _scanned_stack(mesh2, 3, *((16, 8, 32) if small else (256, 64, 512)), remat=True),
    }


def xla_peak(low: gspmd.Lowered, donated: tuple[int, ...]) -> int:
    """XLA's bytes per device for the jax backend's program (compiled again with the
    donated parameters' buffers given to the results, as jax.jit(donate_argnums) does)."""
    ex = low.jax_executable()
    if donated:
        ex = jax_backend.Executable(low.spmd, low.program.params, low.program.outputs, low.mesh, donated)
    m = ex.compiled.memory_analysis()
    return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes


def measure(name: str, step, args, donate: bool, breadth_first: bool = False) -> dict:
    low = gspmd.jit(step, backend="jax").lower(*args)
    donated = tuple(range(len(jax.tree_util.tree_leaves(args[0])))) if donate else ()
    ours = memory.profile(low.spmd, memory.donation_aliases(low.spmd, donated), breadth_first=breadth_first).peak_bytes
    xla = xla_peak(low, donated)
    return {"case": name, "donated": donate, "ours": ours, "xla": xla, "ratio": ours / xla}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["small", "medium"], choices=["small", "medium"])
    parser.add_argument("--cases", nargs="+", default=None)
    parser.add_argument("--no-donation", action="store_true", help="only the runs without donated parameters")
    parser.add_argument("--json", action="store_true", help="print one JSON list instead of a table")
    parser.add_argument("--bfs", action="store_true", help="leave XLA:CPU's default (concurrency) scheduler on")
    args = parser.parse_args(argv)
    # Set in main, not on import (tests import cases()): XLA reads XLA_FLAGS when jax makes
    # its CPU devices, which cases() does first.
    flags = [] if args.bfs else [SCHEDULER_FLAG]
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *flags,
                                        "--xla_force_host_platform_device_count=8"])
    rows = []
    for size in args.sizes:
        for name, (step, inputs) in cases(size).items():
            if args.cases and name not in args.cases:
                continue
            for donate in (False,) if args.no_donation or name == "remat" else (False, True):
                rows.append({"size": size, **measure(name, step, inputs, donate, args.bfs)})
    if args.json:
        print(json.dumps(rows))
        return 0
    print("| size | case | donated | ours (bytes) | XLA (bytes) | ours / XLA |\n|---|---|---|--:|--:|--:|")
    for r in rows:
        print(f"| {r['size']} | {r['case']} | {'yes' if r['donated'] else 'no'} | {r['ours']:,} | {r['xla']:,} "
              f"| {r['ratio']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
