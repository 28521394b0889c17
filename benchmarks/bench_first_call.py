"""First call of gspmd.jit(backend="jax") against jax.jit's on a Llama-style decoder
train step (issue 24): a fresh function each time, so each call traces, completes,
partitions, lowers, XLA-compiles and runs.

The step is plain JAX written as MaxText writes it: token embedding, per layer RMSNorm,
rotary attention with a causal mask, SwiGLU MLP, a final RMSNorm, the unembedding,
softmax cross-entropy and optax.adamw. Megatron-style annotations over a 2x4 mesh
("data" x "tensor"): activations split on batch, attention heads and the MLP's hidden
dim on "tensor". Layers are a Python loop (unrolled) or a lax.scan over stacked layers.

jax.jit runs the same function with the annotations as with_sharding_constraint and our
parameter and result layouts as in_shardings/out_shardings. Each first call runs in a
fresh process, alternating between the two; printed are the medians and the median of
the per-pair ratios, in wall-clock and in CPU seconds (the process's, all threads: on a
machine others load, what the call itself costs), then one sample's seconds per phase
on each side.

    python benchmarks/bench_first_call.py [--cases 12 48 scan] [--pairs 3] [--d-model 64]

Cases `lib:LIBRARY` (LIBRARY: penzai, jraph, diffrax, keras) run a library's own train step
as tests/test_libraries.py builds it at its BENCHMARK size (`lib:LIBRARY:small`: the tests'
size) (issue 46: penzai's Llama-like transformer with its layer stack at Levanter's 4
layers, d=256, seq 128, batch 16; a jraph GCN; diffrax's heat-equation solve fitted by
jax.grad; keras-hub's LlamaBackbone under its layout map), its arguments committed to
their layouts on a data 2 x tensor 4 mesh, jax.jit taking those layouts as they are.

Cases `maxtext:DECODER:scan|unrolled` (DECODER: llama2, mixtral, mixtral-dropless) run
MaxText's own train step instead, as tests/test_maxtext.py builds it (its tiny config,
12-axis mesh with data=2 x tensor=4, Python >= 3.12 with MaxText installed), with jax's
persistent compilation cache (which MaxText's config turns on) off for both sides.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import gspmd  # noqa: E402
from gspmd import api, passes, partitioner, propagation  # noqa: E402
from gspmd.frontend.annotation import mesh_split_as  # noqa: E402
from gspmd.analysis import xla  # noqa: E402

MESH = gspmd.Mesh(np.arange(8).reshape(2, 4), ("data", "tensor"))


@dataclasses.dataclass(frozen=True)
class Config:
    layers: int = 12
    scanned: bool = False
    d_model: int = 64
    heads: int = 4
    hidden: int = 256
    vocab: int = 512
    batch: int = 8
    seq: int = 32

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads


def split(x, *axes):
    return gspmd.mesh_split(x, MESH, list(axes))


def rms_norm(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def rotary(x):
    """x: [batch, seq, heads, head_dim], rotated by position (the half-split form)."""
    seq, half = x.shape[1], x.shape[-1] // 2
    freqs = 1.0 / (10000 ** (jnp.arange(half, dtype=jnp.float32) / half))
    angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * freqs[None, :]
    sin, cos = jnp.sin(angles)[None, :, None, :], jnp.cos(angles)[None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def layer(x, p, cfg: Config):
    b, s = x.shape[:2]
    h = rms_norm(x, p["attn_norm"])
    heads = lambda w: split((h @ split(w, None, "tensor")).reshape(b, s, cfg.heads, cfg.head_dim),
                            "data", None, "tensor", None)
    q, k, v = rotary(heads(p["wq"])), rotary(heads(p["wk"])), heads(p["wv"])
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(cfg.head_dim)
    causal = jnp.arange(s)[:, None] >= jnp.arange(s)[None, :]
    probs = jax.nn.softmax(jnp.where(causal, logits, -1e9), axis=-1)
    attn = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, cfg.d_model)
    x = split(x + attn @ split(p["wo"], "tensor", None), "data", None, None)
    h = rms_norm(x, p["mlp_norm"])
    gate = split(h @ split(p["w_gate"], None, "tensor"), "data", None, "tensor")
    up = split(h @ split(p["w_up"], None, "tensor"), "data", None, "tensor")
    return split(x + (jax.nn.silu(gate) * up) @ split(p["w_down"], "tensor", None), "data", None, None)


def loss_fn(params, tokens, targets, cfg: Config):
    x = split(jnp.take(split(params["embed"], None, "tensor"), tokens, axis=0), "data", None, None)
    if cfg.scanned:
        x, _ = jax.lax.scan(lambda x, p: (layer(x, p, cfg), None), x, params["layers"])
    else:
        for p in params["layers"]:
            x = layer(x, p, cfg)
    logits = split(rms_norm(x, params["final_norm"]) @ split(params["unembed"], None, "tensor"),
                   "data", None, "tensor")
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, targets))


def make_train_step(cfg: Config) -> Callable:
    """A fresh function each call (so no cache, ours or jax's, holds it)."""
    optimizer = optax.adamw(1e-3, weight_decay=0.1)

    def train_step(params, opt_state, tokens, targets):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, targets, cfg)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    return train_step


def example_inputs(cfg: Config):
    rng = np.random.default_rng(0)
    w = lambda *shape: (rng.standard_normal(shape) / np.sqrt(shape[-2] if len(shape) > 1 else 1)).astype(np.float32)
    d, f = cfg.d_model, cfg.hidden

    def one_layer():
        return {"attn_norm": np.ones(d, np.float32), "wq": w(d, d), "wk": w(d, d), "wv": w(d, d), "wo": w(d, d),
                "mlp_norm": np.ones(d, np.float32), "w_gate": w(d, f), "w_up": w(d, f), "w_down": w(f, d)}
    layers = [one_layer() for _ in range(cfg.layers)]
    if cfg.scanned:
        layers = jax.tree_util.tree_map(lambda *xs: np.stack(xs), *layers)
    params = {"embed": w(cfg.vocab, d), "layers": layers, "final_norm": np.ones(d, np.float32),
              "unembed": w(d, cfg.vocab)}
    opt_state = jax.tree_util.tree_map(np.asarray, optax.adamw(1e-3, weight_decay=0.1).init(params))
    tokens = rng.integers(0, cfg.vocab, (cfg.batch, cfg.seq)).astype(np.int32)
    targets = rng.integers(0, cfg.vocab, (cfg.batch, cfg.seq)).astype(np.int32)
    return params, opt_state, tokens, targets


# -- timing ------------------------------------------------------------------------------------
def reference_jit(fn: Callable, low: api.Lowered, args) -> Callable:
    """jax.jit of fn with our parameter and result layouts (call it under mesh_split_as)."""
    exe = low.jax_executable()
    return jax.jit(fn, in_shardings=jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(args), exe.in_shardings),
                   out_shardings=jax.tree_util.tree_unflatten(low.out_tree, exe.out_shardings))


def fresh_first_calls(case: str, pairs: int, d_model: int) -> dict[str, list[tuple[float, float]]]:
    """Wall and CPU seconds of first calls of `case`, gspmd and jax.jit alternating, each
    in a fresh process, as a user's first call after a change comes (within one process,
    jax's tracing caches stay warm from call to call)."""
    times: dict[str, list[tuple[float, float]]] = {"gspmd": [], "jax.jit": []}
    for _ in range(pairs):
        for side in times:
            out = subprocess.run([sys.executable, __file__, "--d-model", str(d_model), "--one", case, side],
                                 check=True, capture_output=True, text=True).stdout
            wall, cpu = out.split()[-2:]
            times[side].append((float(wall), float(cpu)))
    return times


def config_of(case: str, d_model: int) -> Config:
    cfg = Config(layers=12, scanned=True) if case == "scan" else Config(layers=int(case))
    return dataclasses.replace(cfg, d_model=d_model)


def seconds_of(run: Callable[[], object]) -> tuple[float, float]:
    """Wall-clock and CPU seconds (this process's, all its threads) of run() until its
    results are ready. On a machine others load, the CPU seconds are what the call
    itself costs; its wall-clock time also holds the waits for a core."""
    wall, cpu = time.perf_counter(), time.process_time()
    jax.block_until_ready(run())
    return time.perf_counter() - wall, time.process_time() - cpu


def first_call(case: str, side: str, d_model: int) -> tuple[float, float]:
    """Wall and CPU seconds of one first call of `case` under `side` in this process."""
    if case.startswith("maxtext:"):
        return maxtext_first_call(case, side)
    if case.startswith("lib:"):
        step, args = library_step(case)
        jitted = gspmd.jit(step, backend="jax") if side == "gspmd" else jax.jit(step)
        return seconds_of(lambda: jitted(*args))
    cfg = config_of(case, d_model)
    args = example_inputs(cfg)
    if side == "gspmd":
        return seconds_of(lambda: gspmd.jit(make_train_step(cfg), backend="jax")(*args))
    # jax.jit gets our layouts, so our lowering runs first (it warms jax's caches of the
    # jnp functions' own traces a little, in jax.jit's favour).
    layouts = gspmd.jit(make_train_step(cfg), backend="jax").lower(*args)
    with mesh_split_as(xla.xla_constraint):
        return seconds_of(lambda: reference_jit(make_train_step(cfg), layouts, args)(*args))


def import_test_module(name: str):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    return __import__(name)


def library_step(case: str) -> tuple[Callable, tuple]:
    """A fresh train step of case `lib:LIBRARY[:small]` and its placed arguments."""
    libraries = import_test_module("test_libraries")
    _, library, *small = case.split(":")
    return getattr(libraries, f"{library}_step")(libraries.SMALL if small else libraries.BENCHMARK)


def maxtext_first_call(case: str, side: str) -> tuple[float, float]:
    """Wall and CPU seconds of one first call of MaxText's train step under `side`."""
    Step = import_test_module("test_maxtext").Step
    _, decoder, layers = case.split(":")
    step = Step(decoder, layers == "scan", tempfile.mkdtemp())
    from jax.experimental.compilation_cache import compilation_cache
    jax.config.update("jax_compilation_cache_dir", None)     # MaxText's config set ~/jax_cache
    compilation_cache.reset_cache()
    jit = (lambda f, **kw: gspmd.jit(f, mesh=step.mesh, backend="jax", **kw)) if side == "gspmd" else jax.jit
    return seconds_of(lambda: step.run(jit))


@contextlib.contextmanager
def timed(phases: dict[str, float], owner, name: str, phase: str):
    """Within the block, owner.name adds its seconds to phases[phase]."""
    original = getattr(owner, name)

    def wrapper(*a, **k):
        start = time.perf_counter()
        try:
            return original(*a, **k)
        finally:
            phases[phase] = phases.get(phase, 0.0) + time.perf_counter() - start
    setattr(owner, name, wrapper)
    try:
        yield
    finally:
        setattr(owner, name, original)


def gspmd_phases(step: Callable, args: tuple) -> dict[str, float]:
    """One first call of ours of a fresh `step`, by phase."""
    phases: dict[str, float] = {}
    with contextlib.ExitStack() as stack:
        for owner, name, phase in ((api, "_trace", "trace"), (propagation, "complete", "completion"),
                                   (api, "partition", "partition (with passes)"), (passes, "run", "passes")):
            stack.enter_context(timed(phases, owner, name, phase))
        start = time.perf_counter()
        low = gspmd.jit(step, backend="jax").lower(*args)
        phases["lower (all of the above)"] = time.perf_counter() - start
    exe = low.jax_executable()
    leaves = [jax.device_put(x, s) for x, s in zip(jax.tree_util.tree_leaves(args), exe.in_shardings)]
    _jax_phases(phases, exe.jitted, leaves)
    return phases


def library_jax_jit_phases(case: str) -> dict[str, float]:
    """One first call of jax.jit's of a library's step, by phase."""
    step, args = library_step(case)
    phases: dict[str, float] = {}
    _jax_phases(phases, jax.jit(step), args)
    return phases


def jax_jit_phases(cfg: Config) -> dict[str, float]:
    args = example_inputs(cfg)
    low = gspmd.jit(make_train_step(cfg), backend="jax").lower(*args)
    phases: dict[str, float] = {}
    with mesh_split_as(xla.xla_constraint):
        jitted = reference_jit(make_train_step(cfg), low, args)
        exe = low.jax_executable()
        placed = [jax.device_put(x, s) for x, s in zip(jax.tree_util.tree_leaves(args), exe.in_shardings)]
        placed = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(args), placed)
        _jax_phases(phases, jitted, placed)
    return phases


def _jax_phases(phases: dict[str, float], jitted, args) -> None:
    """jax's phases of a first call of `jitted` on `args` (placed as it expects them)."""
    start = time.perf_counter()
    traced = jitted.trace(*args)
    phases["jax trace (shard_map body)"] = time.perf_counter() - start
    start = time.perf_counter()
    lowered = traced.lower()
    phases["jax lowering to StableHLO"] = time.perf_counter() - start
    start = time.perf_counter()
    compiled = lowered.compile()
    phases["XLA compile"] = time.perf_counter() - start
    phases["HLO ops (optimized)"] = _count_ops(compiled.as_text())
    phases["StableHLO ops"] = _count_ops(lowered.as_text())
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    phases["run"] = time.perf_counter() - start


def _count_ops(text: str) -> int:
    return sum(1 for line in text.splitlines() if " = " in line and not line.lstrip().startswith(("//", "#")))


def print_times(label: str, times: dict[str, list[tuple[float, float]]]) -> None:
    """Medians of both sides and of the per-pair ratios, and the pairs: wall-clock, then
    CPU seconds."""
    print(f"\n### {label} (load {os.getloadavg()[0]:.1f})")
    for k, clock in enumerate(("wall", "cpu")):
        ours, theirs = [t[k] for t in times["gspmd"]], [t[k] for t in times["jax.jit"]]
        ratio = statistics.median(a / b for a, b in zip(ours, theirs))
        print(f"{clock}: first call {statistics.median(ours):.2f} s vs jax.jit {statistics.median(theirs):.2f} s, "
              f"ratio {ratio:.2f} (pairs {[f'{a:.2f}/{b:.2f}' for a, b in zip(ours, theirs)]})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", nargs="*", default=["12", "48", "scan"],
                        help="layer counts (unrolled) or 'scan' (12 layers scanned)")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--no-phases", action="store_true")
    parser.add_argument("--one", nargs=2, metavar=("CASE", "SIDE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(*first_call(*args.one, args.d_model))
        return
    print(f"jax {jax.__version__}, {len(jax.devices())} {jax.devices()[0].platform} devices, "
          f"load average {os.getloadavg()[0]:.1f}")
    for case in args.cases:
        times = fresh_first_calls(case, args.pairs, args.d_model)
        if case.startswith("maxtext:"):
            print_times(f"MaxText {case[8:]}", times)
            continue
        if case.startswith("lib:"):
            print_times(case[4:], times)
            phases = lambda: (gspmd_phases(*library_step(case)), library_jax_jit_phases(case))
        else:
            cfg = config_of(case, args.d_model)
            print_times(f"{cfg.layers} layers {'scanned' if cfg.scanned else 'unrolled'}, d_model {cfg.d_model}", times)
            phases = lambda: (gspmd_phases(make_train_step(cfg), example_inputs(cfg)), jax_jit_phases(cfg))
        if not args.no_phases:
            ours, theirs = phases()
            print("| phase | gspmd.jit | jax.jit |\n|---|---:|---:|")
            for phase in list(ours) + [p for p in theirs if p not in ours]:
                fmt = lambda x: "" if x is None else (f"{x:d}" if isinstance(x, int) else f"{x:.3f} s")
                print(f"| {phase} | {fmt(ours.get(phase))} | {fmt(theirs.get(phase))} |", flush=True)


if __name__ == "__main__":
    main()
