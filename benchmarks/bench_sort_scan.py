"""Scans, sorts, top-k and cond along split dims: gspmd (jax backend) against XLA's own
partitioner on the same annotated programs, 8 CPU devices on one mesh axis (as
benchmarks/vs_xla.py compares the case studies: collective bytes per device from each
compiled HLO text, step time medians, peak memory per device).

    python benchmarks/bench_sort_scan.py [--repeats 30] [--cases cumsum sort ...]
"""
from __future__ import annotations

import argparse
import dataclasses

import numpy as np
from jax import lax
from jax import numpy as jnp

import vs_xla  # noqa: E402  (sets up 8 CPU devices before jax starts)
import gspmd  # noqa: E402

ROWS, LONG = 64, 16384
EVEN = 15 << 16   # 983,040: divides over 3, 5 and 6 devices (an uneven result is gathered to be returned)


# A device too small for the whole [ROWS * LONG] vector (and its sorted copy): 6 MiB.
SMALL_DEVICE = dataclasses.replace(gspmd.analysis.PROFILES["tpu-v3"], name="tpu-v3 with 6 MiB",
                                   memory_bytes=6 << 20, reserved_bytes=0)


def _case(name: str, fn, *shapes, dtype=np.float32, hardware=None, devices=8) -> vs_xla.Case:
    def inputs(n: int):
        rng = np.random.RandomState(0)
        return tuple((rng.standard_normal(s) * 1000).astype(dtype) for s in shapes)
    return vs_xla.Case(name, ("x",), fn, inputs, {8: (devices,)}, hardware)


def _split_long(mesh, x):
    return gspmd.mesh_split(x, mesh, [-1, "x"])


def _sorted_vector(mesh):
    """A vector sorted along its split: no other dim can take the split."""
    return lambda x: gspmd.mesh_split(jnp.sort(gspmd.mesh_split(x, mesh, ["x"])), mesh, ["x"])


def _sorted_vector_as_it_comes(mesh):
    """The same with no layout asked for the result (it stays split)."""
    return lambda x: jnp.sort(gspmd.mesh_split(x, mesh, ["x"]))


CASES = {
    "cumsum": _case(f"cumsum along the split dim of [{ROWS}, {LONG}]",
                    lambda mesh: lambda x: _split_long(mesh, jnp.cumsum(_split_long(mesh, x), axis=1)),
                    (ROWS, LONG)),
    "cummax": _case(f"reverse cummax along the split dim of [{ROWS}, {LONG}]",
                    lambda mesh: lambda x: _split_long(mesh, lax.cummax(_split_long(mesh, x), 1, reverse=True)),
                    (ROWS, LONG)),
    "sort": _case(f"sort along the split dim of [{ROWS}, {LONG}]",
                  lambda mesh: lambda x: _split_long(mesh, jnp.sort(_split_long(mesh, x), axis=1)), (ROWS, LONG)),
    "sort_1d": _case(f"sort of a split [{ROWS * LONG}] vector", _sorted_vector, (ROWS * LONG,)),
    "sort_1d_small": _case(f"sort of a split [{ROWS * LONG}] vector, 6 MiB devices", _sorted_vector,
                           (ROWS * LONG,), hardware=SMALL_DEVICE),
    "sort_1d_int_small": _case(f"sort of a split [{ROWS * LONG}] int32 vector, 6 MiB devices", _sorted_vector,
                               (ROWS * LONG,), dtype=np.int32, hardware=SMALL_DEVICE),
    "sort_1d_6_small": _case(f"sort of a [{EVEN}] vector split 6 ways, no layout asked for the result, "
                             "6 MiB devices", _sorted_vector_as_it_comes, (EVEN,), hardware=SMALL_DEVICE, devices=6),
    "sort_1d_6_int_small": _case(f"sort of a [{EVEN}] int32 vector split 6 ways, no layout asked for the result, "
                                 "6 MiB devices", _sorted_vector_as_it_comes, (EVEN,), dtype=np.int32,
                                 hardware=SMALL_DEVICE, devices=6),
    "sort_1d_5_int_small": _case(f"sort of a [{EVEN}] int32 vector split 5 ways, no layout asked for the result, "
                                 "6 MiB devices", _sorted_vector_as_it_comes, (EVEN,), dtype=np.int32,
                                 hardware=SMALL_DEVICE, devices=5),
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
