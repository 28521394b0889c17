"""Scans, sorts, top-k and cond along split dims: gspmd (jax backend) against XLA's own
partitioner on the same annotated programs, 8 CPU devices on one mesh axis (as
benchmarks/vs_xla.py compares the case studies: collective bytes per device from each
compiled HLO text, step time medians, peak memory per device).

    python benchmarks/bench_sort_scan.py [--repeats 30] [--cases cumsum sort ...]
"""
from __future__ import annotations

import argparse

import numpy as np
from jax import lax
from jax import numpy as jnp

import vs_xla  # noqa: E402  (sets up 8 CPU devices before jax starts)
import gspmd  # noqa: E402

ROWS, LONG = 64, 16384


def _case(name: str, fn, *shapes) -> vs_xla.Case:
    def inputs(n: int):
        rng = np.random.RandomState(0)
        return tuple(rng.standard_normal(s).astype(np.float32) for s in shapes)
    return vs_xla.Case(name, ("x",), fn, inputs, {8: (8,)})


def _split_long(mesh, x):
    return gspmd.mesh_split(x, mesh, [-1, "x"])


CASES = {
    "cumsum": _case(f"cumsum along the split dim of [{ROWS}, {LONG}]",
                    lambda mesh: lambda x: _split_long(mesh, jnp.cumsum(_split_long(mesh, x), axis=1)),
                    (ROWS, LONG)),
    "cummax": _case(f"reverse cummax along the split dim of [{ROWS}, {LONG}]",
                    lambda mesh: lambda x: _split_long(mesh, lax.cummax(_split_long(mesh, x), 1, reverse=True)),
                    (ROWS, LONG)),
    "sort": _case(f"sort along the split dim of [{ROWS}, {LONG}]",
                  lambda mesh: lambda x: _split_long(mesh, jnp.sort(_split_long(mesh, x), axis=1)), (ROWS, LONG)),
    "top_k": _case(f"top_k(k=2) along the split dim of [{ROWS}, {LONG}]",
                   lambda mesh: lambda x: lax.top_k(_split_long(mesh, x), 2), (ROWS, LONG)),
    "cond": _case(f"cond on a split [{ROWS}, {LONG}] (predicate from its sum)",
                  lambda mesh: lambda x: _split_long(mesh, lax.cond(_split_long(mesh, x).sum() > 0, jnp.tanh,
                                                                    jnp.sin, _split_long(mesh, x))),
                  (ROWS, LONG)),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--cases", nargs="*", choices=sorted(CASES))
    args = parser.parse_args()
    for key, case in CASES.items():
        if not args.cases or key in args.cases:
            vs_xla.compare(case, args.repeats)


if __name__ == "__main__":
    main()
