"""gspmd.jit next to jax.jit on committed (sharded) inputs: bytes a step moves before
and inside the program, and what donation leaves alive.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/bench_jit_semantics.py

Prints, per step: the collective bytes of our program and of XLA's, whether each
argument was used in place (no relayout before the call), and for the donated train
step which inputs were deleted and the compiled memory of both (XLA's memory_analysis:
arguments + temporaries + outputs not aliased to arguments).
"""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import gspmd  # noqa: E402
from gspmd.analysis.xla import hlo_collective_bytes  # noqa: E402

MESH = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("x", "y"))


def committed(shape, spec, seed=0):
    return jax.device_put(np.random.default_rng(seed).standard_normal(shape).astype(np.float32),
                          NamedSharding(MESH, spec))


def held_bytes(compiled) -> int:
    m = compiled.memory_analysis()
    return m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes


def steps():
    def train(w, x):
        return w - 0.1 * jax.grad(lambda v: jnp.sum(jnp.tanh(x @ v) ** 2))(w)
    return {
        "identity": (lambda a: a, [committed((1024, 1024), P("x", "y"))], ()),
        "elementwise": (lambda a, b: a * b + 1, [committed((1024, 1024), P("x", "y")),
                                                 committed((1024, 1024), P("x", "y"), 1)], ()),
        "donated train step": (train, [committed((1024, 1024), P(None, "y")), committed((256, 1024), P("x"), 1)],
                               (0,)),
    }


def main() -> None:
    print(f"{'step':<20} {'ours: bytes':>12} {'XLA: bytes':>11} {'in place':>9} {'deleted (ours/jax)':>31} "
          f"{'held ours/XLA':>14}")
    for name, (fn, args, donate) in steps().items():
        ours = gspmd.jit(fn, backend="jax", donate_argnums=donate)
        low = ours.lower(*args)
        exe = low.jax_executable()
        in_place = all(a.sharding.is_equivalent_to(exe.input_sharding(i), a.ndim) for i, a in enumerate(args))
        ours_bytes = sum(c.bytes for c in low.report().collectives)
        theirs = jax.jit(fn, donate_argnums=donate)
        compiled = theirs.lower(*args).compile()
        xla_bytes = sum(hlo_collective_bytes(compiled.as_text()).values())
        ratio = held_bytes(exe.compiled) / held_bytes(compiled)
        mine = [jax.device_put(a, a.sharding) + 0 for a in args]
        jaxs = [jax.device_put(a, a.sharding) + 0 for a in args]
        ours(*mine)
        theirs(*jaxs)
        deleted = f"{[a.is_deleted() for a in mine]}/{[a.is_deleted() for a in jaxs]}"
        print(f"{name:<20} {ours_bytes:>12} {xla_bytes:>11} {str(in_place):>9} {deleted:>31} {ratio:>13.2f}x")


if __name__ == "__main__":
    main()
