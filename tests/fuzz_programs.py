"""A differential fuzzer: random programs from the op pool of tests/fuzz_ops.py, random
annotations (dims mappings, PartitionSpecs, UNSPECIFIED dims, the devices' order, subsets
of the devices) on meshes of 1-3 axes over 2-8 devices, uneven dims, inputs as NumPy
arrays or jax arrays placed over the mesh (Auto axes, Explicit axes, Explicit under
jax.set_mesh), and jax.grad, jax.jvp or jax.vmap around gspmd.jit; each compared with
jax.jit given the same inputs (on one device where they are NumPy arrays).

A program is a Spec: plain data, rebuilt exactly from its seeds, so a failure prints as
a Spec to paste into a test, and shrinks (steps, annotations, the transformation, the
mesh dropped while it still fails the same way).

    python tests/fuzz_programs.py --n 10000 --seed 0 --backend sim [--shrink]

prints the counts of each outcome: ok, mismatch, nan, crash, refused (a ShardingError
where jax.jit runs the program: a failure too), invalid (jax.jit itself refuses). The
programs run in a child process, which the run replaces where a compile aborts it (XLA's
check failures do: seed 6976's convolution aborts jax.jit's own compile)."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import subprocess
import sys
import time
import traceback
from functools import partial
from typing import Callable, Optional, Sequence

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import gspmd  # noqa: E402
from gspmd.frontend.annotation import unpartitioned  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from fuzz_ops import FAMILIES, Draw  # noqa: E402

MESH_SHAPES = [(2,), (3,), (4,), (5,), (6,), (8,), (2, 2), (2, 3), (3, 2), (2, 4), (4, 2), (2, 2, 2)]
DIMS = [1, 2, 3, 4, 5, 6, 7, 8]
MAX_ELEMENTS = 512
WRAPS = ["plain"] * 4 + ["grad"] * 3 + ["jvp"] * 2 + ["vmap"] * 2
OUTCOMES = ("ok", "mismatch", "nan", "crash", "refused", "invalid")
# How the inputs arrive: NumPy arrays; jax arrays placed over the mesh with Auto axes, or
# with Explicit axes (jax.make_mesh's: layouts in the types, no jax.set_mesh needed), or
# with Explicit axes under jax.set_mesh (explicit sharding mode).
PLACEMENTS = ["numpy"] * 5 + ["auto"] * 2 + ["explicit"] * 2 + ["set_mesh"] * 2


@dataclasses.dataclass(frozen=True)
class Step:
    family: str
    seed: int
    annotate: bool          # a mesh_split of the step's result


@dataclasses.dataclass(frozen=True)
class Spec:
    devices: tuple          # jax device indices, in the mesh's order
    mesh_shape: tuple
    shape: tuple
    dtype: str
    steps: tuple            # of Step
    wrap: str               # plain, grad, jvp or vmap
    seed: int               # annotations of the input and the params, the transformation's choices
    placement: str = "numpy"   # one of PLACEMENTS; jax arrays' layouts drawn from `seed`


@dataclasses.dataclass
class Program:
    """A Spec built: the function, its inputs and the mesh."""
    fn: Callable
    args: list
    mesh: jax.sharding.Mesh
    annotated: bool     # whether it calls mesh_split (jax.jit's reference does not)


def random_spec(seed: int, families: Optional[list[str]] = None) -> Spec:
    """Program number `seed`; `families`: ops drawn from these alone (all: None)."""
    r = Draw(seed)
    mesh_shape = r.pick(MESH_SHAPES)
    n = int(np.prod(mesh_shape))
    devices = tuple(int(d) for d in r.rng.permutation(8)[:n]) if r.coin(0.5) else tuple(range(n))
    rank = r.pick([1, 2, 2, 3, 3, 4])
    shape = tuple(r.pick(DIMS) for _ in range(rank))
    while np.prod(shape) > MAX_ELEMENTS // 2:
        shape = shape[1:]
    dtype = "bfloat16" if r.coin(0.1) else "float32"
    aval = jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))
    steps = []
    for _ in range(r.int(1, 5)):
        step, aval = _next_step(r, aval, sorted(families or FAMILIES))
        steps.append(step)
    return Spec(devices, mesh_shape, shape, dtype, tuple(steps), r.pick(WRAPS), r.int(0, 2 ** 31 - 1),
                r.pick(PLACEMENTS))


def _next_step(r: Draw, aval, families: list[str]):
    """A step whose op applies to `aval` and keeps the program small; its result aval."""
    for _ in range(1000):
        step = Step(r.pick(families), r.int(0, 2 ** 31 - 1), r.coin(0.4))
        out = _apply_aval(step, aval)
        if out is not None:
            return step, out
    return _next_step(r, aval, sorted(FAMILIES))   # none of `families` applies: any op


def _apply_aval(step: Step, aval):
    built = FAMILIES[step.family](Draw(step.seed), aval)
    if built is None:
        return None
    fn, params = built
    try:
        out = jax.eval_shape(fn, aval, *params)
    except Exception:   # noqa: BLE001 - a maker's draw jax rejects: draw another
        return None
    if not jnp.issubdtype(out.dtype, jnp.floating) or out.size > MAX_ELEMENTS or out.size == 0:
        return None
    return out


# -- annotations ---------------------------------------------------------------------------
def _mapping(r: Draw, axes: tuple, rank: int):
    """A dims mapping in one of its forms: each mesh axis to one dim or to replication,
    unsplit dims None, -1 or UNSPECIFIED; a list or a PartitionSpec."""
    per_dim: list = [[] for _ in range(rank)]
    for axis in r.rng.permutation(list(axes)):
        choice = r.int(-1, rank - 1) if rank else -1
        if choice >= 0:
            per_dim[choice].append(str(axis))
    open_dims = r.coin(0.3)
    entries = [(r.pick([None, gspmd.UNSPECIFIED]) if open_dims else r.pick([None, -1])) if not a
               else a[0] if len(a) == 1 else tuple(a) for a in per_dim]
    if r.coin(0.3):
        return P(*[P.UNCONSTRAINED if e is gspmd.UNSPECIFIED else None if e == -1 else e for e in entries])
    return entries


def _as_is(x):
    return x


def _annotator(r: Draw, mesh, p: float) -> Callable:
    """x -> x (_as_is), or x annotated at random (decided now, so the program is fixed)."""
    if not r.coin(p):
        return _as_is
    seed = r.int(0, 2 ** 31 - 1)
    return lambda x: gspmd.mesh_split(x, mesh, _mapping(Draw(seed), mesh.axis_names, jnp.ndim(x)))


# -- building and running ------------------------------------------------------------------
def build(spec: Spec) -> Optional[Program]:
    """The Spec's program, or None where a step no longer applies (a shrunk Spec)."""
    names = ("x", "y", "z")[: len(spec.mesh_shape)]
    axis_type = jax.sharding.AxisType.Auto if spec.placement in ("numpy", "auto") else jax.sharding.AxisType.Explicit
    mesh = jax.sharding.Mesh(np.asarray(jax.devices())[list(spec.devices)].reshape(spec.mesh_shape), names,
                             axis_types=(axis_type,) * len(names))
    r = Draw(spec.seed)
    x = Draw(spec.seed + 1).normal(spec.shape, jnp.dtype(spec.dtype))
    aval = jax.ShapeDtypeStruct(spec.shape, x.dtype)
    fns, args, notes = [], [x], [_annotator(r, mesh, 0.7)]
    for step in spec.steps:
        built = FAMILIES[step.family](Draw(step.seed), aval)
        aval = _apply_aval(step, aval) if built else None
        if aval is None:
            return None
        fn, params = built
        fns.append((fn, len(params), _annotator(Draw(step.seed + 1), mesh, 1.0) if step.annotate else None))
        args += params
        notes += [_annotator(r, mesh, 0.3) for _ in params]

    def program(*inputs):
        inputs = [note(a) for note, a in zip(notes, inputs)]
        v, rest = inputs[0], inputs[1:]
        for fn, n, note in fns:
            v, rest = fn(v, *rest[:n]), rest[n:]
            v = note(v) if note else v
        return v

    annotated = any(note is not _as_is for note in notes) or any(note for _, _, note in fns)
    return Program(program, args, mesh, annotated)


def place(spec: Spec, mesh: jax.sharding.Mesh, args: Sequence[np.ndarray]) -> list:
    """The inputs as the Spec's placement has them: as they are (NumPy), or each
    device_put over `mesh` (whose axis types build() chose) in a random layout that
    splits its dims evenly."""
    if spec.placement == "numpy":
        return list(args)
    r = Draw(spec.seed + 5)
    placed = []
    for a in args:
        per_dim: list = [[] for _ in range(a.ndim)]
        for axis in r.rng.permutation(mesh.axis_names):
            d = r.int(-1, a.ndim - 1)
            if d >= 0 and a.shape[d] % (np.prod([mesh.shape[n] for n in per_dim[d]]) * mesh.shape[axis]) == 0:
                per_dim[d].append(str(axis))
        layout = P(*[tuple(n) if len(n) > 1 else n[0] if n else None for n in per_dim])
        placed.append(jax.device_put(a, jax.sharding.NamedSharding(mesh, layout)))
    return placed


def _mode(spec: Spec, mesh: jax.sharding.Mesh) -> contextlib.AbstractContextManager:
    """Explicit sharding mode over `mesh` where the Spec asks for it."""
    return jax.set_mesh(mesh) if spec.placement == "set_mesh" else contextlib.nullcontext()


def _placed_like(t: np.ndarray, primal):
    """A tangent laid out as its primal (jax.jvp wants their types equal)."""
    return jax.device_put(t, primal.sharding) if isinstance(primal, jax.Array) else t


def transformed(spec: Spec, program: Program) -> tuple[Callable, list]:
    """The Spec's transformation around a function f of the program's inputs: a function
    of the inputs that takes f (jax.jit's or gspmd.jit's) and its inputs."""
    r = Draw(spec.seed + 2)
    args = program.args
    floats = [i for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.floating)]
    chosen = tuple(sorted({0} | {i for i in floats if r.coin(0.3)})) if r.coin(0.7) else (r.pick(floats),)
    if spec.wrap == "grad":
        weights = Draw(spec.seed + 3).normal((MAX_ELEMENTS,), np.float32)

        def loss(f, *a):   # no ravel: explicit sharding mode refuses reshapes of split dims
            out = f(*a).astype(jnp.float32)
            return jnp.sum(jnp.tanh(out) * weights[: out.size].reshape(out.shape))

        return (lambda f, *a: jax.grad(loss, argnums=tuple(i + 1 for i in chosen))(f, *a)), args
    if spec.wrap == "jvp":
        tangents = [Draw(spec.seed + 4 + i).normal(args[i].shape, args[i].dtype) for i in chosen]

        def jvp(f, *a):
            def of_chosen(*c):
                full = list(a)
                for i, v in zip(chosen, c):
                    full[i] = v
                return f(*full)
            placed = [_placed_like(t, a[i]) for t, i in zip(tangents, chosen)]
            return jax.jvp(of_chosen, [a[i] for i in chosen], placed)

        return jvp, args
    if spec.wrap == "vmap":
        batch = r.int(1, 3)
        batched = [np.stack([a * (1 + 0.5 * b) for b in range(batch)]) if i in chosen else a
                   for i, a in enumerate(args)]
        axes = [0 if i in chosen else None for i in range(len(args))]
        return (lambda f, *a: jax.vmap(f, in_axes=axes)(*a)), batched
    return (lambda f, *a: f(*a)), args


def run(spec: Spec, backend: str, phase: Callable[[str], None] = lambda name: None) -> tuple[str, str]:
    """(outcome, detail) of one program on one backend; `phase` hears "reference" and
    "gspmd" as each starts (where a process that aborts was)."""
    program = build(spec)
    if program is None:
        return "invalid", "a step does not apply"
    wrap, args = transformed(spec, program)
    try:
        args = place(spec, program.mesh, args)
    except Exception as e:   # noqa: BLE001 - jax refuses the layout: not a program to compare
        return "invalid", f"device_put: {type(e).__name__}: {str(e)[:200]}"
    phase("reference")
    try:
        with unpartitioned(), _mode(spec, program.mesh):
            theirs = wrap(jax.jit(program.fn), *args)
        expected = jax.tree_util.tree_map(np.asarray, theirs)
    except Exception as e:   # noqa: BLE001 - jax.jit refuses: not a program to compare
        return "invalid", f"jax.jit: {type(e).__name__}: {str(e)[:200]}"
    phase("gspmd")
    try:
        with _mode(spec, program.mesh):
            ours = wrap(gspmd.jit(program.fn, mesh=program.mesh, backend=backend), *args)
        actual = jax.tree_util.tree_map(np.asarray, ours)
    except gspmd.ShardingError as e:
        return "refused", str(e)[:2000]
    except Exception as e:   # noqa: BLE001 - every other error is a crash to report
        return "crash", "".join(traceback.format_exception(e))[-3000:]
    outcome = compare(actual, expected)
    # Explicit axes type every value, and jax.jit's result layouts are its types: ours must
    # be the same where the program is the same one (no mesh_split, which jax.jit's
    # reference drops). Elsewhere XLA's propagation and gspmd's completion may differ.
    if outcome[0] == "ok" and backend == "jax" and spec.placement in ("explicit", "set_mesh") and not program.annotated:
        return compare_layouts(ours, theirs)
    return outcome


def tolerance(dtype) -> float:
    return 5e-2 if np.dtype(dtype).itemsize <= 2 else 2e-3


def compare(actual, expected) -> tuple[str, str]:
    a_leaves, a_tree = jax.tree_util.tree_flatten(actual)
    e_leaves, e_tree = jax.tree_util.tree_flatten(expected)
    if a_tree != e_tree:
        return "mismatch", f"structure {a_tree} != {e_tree}"
    for a, e in zip(a_leaves, e_leaves):
        if a.shape != e.shape or a.dtype != e.dtype:
            return "mismatch", f"{a.shape} {a.dtype} != {e.shape} {e.dtype}"
        a64, e64 = a.astype(np.float64), e.astype(np.float64)
        if np.any(np.isnan(a64) & ~np.isnan(e64)):
            return "nan", f"NaN at {np.argwhere(np.isnan(a64) & ~np.isnan(e64))[:4].tolist()}"
        finite = np.isfinite(e64)
        scale = max(1.0, float(np.max(np.abs(e64[finite]), initial=0)))
        tol = tolerance(e.dtype)
        with np.errstate(invalid="ignore"):
            close = np.abs(a64 - e64) <= tol * (scale + np.abs(e64))
        bad = np.where(finite, ~close, ~((a64 == e64) | (np.isnan(a64) & np.isnan(e64))))
        if np.any(bad):
            where = np.argwhere(bad)[:3].tolist()
            return "mismatch", f"at {where}: {a64[bad][:3]} != {e64[bad][:3]} (of {bad.sum()}/{bad.size})"
    return "ok", ""


def compare_layouts(ours, theirs) -> tuple[str, str]:
    for a, e in zip(jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(theirs)):
        if not a.sharding.is_equivalent_to(e.sharding, e.ndim):
            return "mismatch", f"layout {a.sharding} != jax.jit's {e.sharding}"
    return "ok", ""


# -- shrinking -----------------------------------------------------------------------------
def smaller(spec: Spec):
    """Specs one step simpler than `spec`, simplest first."""
    if spec.wrap != "plain":
        yield dataclasses.replace(spec, wrap="plain")
    for i in range(len(spec.steps)):
        yield dataclasses.replace(spec, steps=spec.steps[:i] + spec.steps[i + 1:])
    for i, s in enumerate(spec.steps):
        if s.annotate:
            yield dataclasses.replace(spec, steps=spec.steps[:i] + (dataclasses.replace(s, annotate=False),)
                                      + spec.steps[i + 1:])
    if spec.placement != "numpy":
        yield dataclasses.replace(spec, placement="numpy")
    if spec.devices != tuple(range(len(spec.devices))):
        yield dataclasses.replace(spec, devices=tuple(range(len(spec.devices))))
    for i, d in enumerate(spec.shape):
        for smaller_d in sorted({1, 2, d - 1} - {d}):
            if 0 < smaller_d < d:
                yield dataclasses.replace(spec, shape=spec.shape[:i] + (smaller_d,) + spec.shape[i + 1:])


def shrink(spec: Spec, backend: str, outcome: str) -> Spec:
    """The simplest Spec found that still fails with `outcome`."""
    progress = True
    while progress:
        progress = False
        for candidate in smaller(spec):
            if run(candidate, backend)[0] == outcome:
                spec, progress = candidate, True
                break
    return spec


def fuzz(n: int, seed: int, backend: str, shrink_failures: bool = False, log=None,
         families: Optional[list[str]] = None, progress: Callable[[int, str], None] = lambda i, what: None) -> dict:
    """Runs programs seed..seed+n-1; the counts of each outcome. Failures print to `log`;
    `progress(seed, what)` hears each program's phases and then its outcome."""
    counts = dict.fromkeys(OUTCOMES, 0)
    started = time.time()
    for i in range(seed, seed + n):
        spec = random_spec(i, families)
        outcome, detail = run(spec, backend, partial(progress, i))
        progress(i, f"done {outcome} {spec.placement}")
        counts[outcome] += 1
        if outcome not in ("ok", "invalid") and log:
            found = shrink(spec, backend, outcome) if shrink_failures else spec
            print(f"\n#{i} {outcome}: {[s.family for s in spec.steps]} {spec.wrap} {spec.placement}\n{found!r}\n"
                  f"{detail}\n",
                  file=log, flush=True)
        if i % 50 == 49:
            jax.clear_caches()
            if log:
                print(f"[{i + 1 - seed}/{n} {time.time() - started:.0f}s] {counts}", file=log, flush=True)
    return counts


def fuzz_isolated(n: int, seed: int, backend: str, options: Sequence[str] = (), log=sys.stdout) -> dict:
    """fuzz() in child processes, so that a program whose compile aborts the process (an
    XLA check failure takes Python with it) is counted -- invalid where jax.jit's own
    compile aborted (XLA's bug, as any other error of jax.jit), a crash where ours did --
    and the run goes on from the next seed. `options`: more command-line flags."""
    counts = dict.fromkeys(OUTCOMES, 0)
    placements: dict = {}   # the completed programs' outcomes per placement, printed at the end
    start, end = seed, seed + n
    while start < end:
        child = subprocess.Popen([sys.executable, __file__, "--child", "--n", str(end - start), "--seed",
                                  str(start), "--backend", backend, *options], stdout=subprocess.PIPE, text=True)
        last = (start, "reference")
        for line in child.stdout:
            if not line.startswith("@"):
                print(line, end="", file=log, flush=True)
                continue
            i, what = line[1:].split(" ", 1)
            last = (int(i) + 1, "reference") if what.startswith("done") else (int(i), what.strip())
            if what.startswith("done"):
                _, outcome, placement = what.split()
                counts[outcome] += 1
                placements.setdefault(placement, dict.fromkeys(OUTCOMES, 0))[outcome] += 1
        if child.wait() == 0:
            break
        aborted, where = last
        outcome = "invalid" if where == "reference" else "crash"
        counts[outcome] += 1
        print(f"\n#{aborted} {outcome}: the process aborted in {'jax.jit' if outcome == 'invalid' else 'gspmd.jit'}"
              f" (exit {child.returncode})\n", file=log, flush=True)
        start = aborted + 1
    for placement, of_placement in sorted(placements.items()):
        print(f"{placement}: {of_placement}", file=log, flush=True)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=["sim", "jax"], default="sim")
    parser.add_argument("--shrink", action="store_true", help="shrink each failure before printing it")
    parser.add_argument("--families", nargs="*", choices=sorted(FAMILIES), help="draw ops from these alone")
    parser.add_argument("--in-process", action="store_true",
                        help="no child processes (an aborting compile then ends the run)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)   # fuzz_isolated's
    args = parser.parse_args()
    np.seterr(all="ignore")   # the sim backend's NaN padding, and what programs compute on it
    if args.child:
        fuzz(args.n, args.seed, args.backend, args.shrink, log=sys.stdout, families=args.families,
             progress=lambda i, what: print(f"@{i} {what}", flush=True))
        return
    if args.in_process:
        counts = fuzz(args.n, args.seed, args.backend, args.shrink, log=sys.stdout, families=args.families)
    else:
        options = (["--shrink"] if args.shrink else []) + (["--families", *args.families] if args.families else [])
        counts = fuzz_isolated(args.n, args.seed, args.backend, options)
    print(f"backend={args.backend} seeds {args.seed}..{args.seed + args.n - 1}: {counts}", flush=True)


if __name__ == "__main__":
    main()
