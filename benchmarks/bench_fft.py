"""FFTs over split dims: the collectives and peak memory per device of gspmd's plan
(`report()`, nothing compiled) for 2-D FFTs of [8, 256, 256] with its rows split over 8
CPU devices (benchmarks/RESULTS.md, "FFTs over split dims").

    python benchmarks/bench_fft.py
"""
from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax import numpy as jnp  # noqa: E402

import gspmd  # noqa: E402

MESH = gspmd.Mesh(np.arange(8), ("y",))
CASES = {
    "jnp.fft.fft2 (complex64)": lambda x: jnp.fft.fft2(gspmd.mesh_split(x, MESH, [-1, "y", -1])),
    "jnp.fft.rfft2 (float32 in)": lambda x: jnp.fft.rfft2(gspmd.mesh_split(jnp.real(x), MESH, [-1, "y", -1])),
}


def main() -> None:
    x = jax.ShapeDtypeStruct((8, 256, 256), np.complex64)
    print("| [8, 256, 256], rows split 8 ways | collectives | peak |\n|---|---|---:|")
    for name, fn in CASES.items():
        r = gspmd.jit(fn, mesh=MESH).lower(x).report()
        kinds = ", ".join(f"{c.kind} {c.bytes:,} B" for c in r.collectives)
        print(f"| `{name}` | {kinds} | {r.peak_memory_bytes / 1e6:.1f} MB |")


if __name__ == "__main__":
    main()
