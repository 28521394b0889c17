"""The differential fuzzer (tests/fuzz_programs.py) in the suites: a fixed slice of its
programs by default, on both backends, each compared with jax.jit on one device; thousands
with -m slow. Each seed draws its inputs' placement too (NumPy arrays in half of them; jax
arrays over the mesh with Auto axes, with Explicit axes, or under jax.set_mesh in the
rest: about 25 of each kind in the default slice). A failing seed reproduces with
fuzz_programs.run(random_spec(seed), backend) and shrinks with fuzz_programs.shrink."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from fuzz_programs import Spec, Step, fuzz_isolated, random_spec, run

SIM_SEEDS = range(100)
JAX_SEEDS = range(100, 140)


def _check(seed: int, backend: str) -> None:
    spec = random_spec(seed)
    outcome, detail = run(spec, backend)
    assert outcome in ("ok", "invalid"), f"{outcome}: {spec!r}\n{detail}"


@pytest.mark.parametrize("seed", SIM_SEEDS)
def test_fuzzed_program_on_sim(seed):
    _check(seed, "sim")


@pytest.mark.parametrize("seed", JAX_SEEDS)
def test_fuzzed_program_on_jax(seed):
    _check(seed, "jax")


@pytest.mark.slow
@pytest.mark.parametrize("backend, n", [("sim", 3000), ("jax", 1000)])
def test_thousands_of_fuzzed_programs(backend, n):
    counts = fuzz_isolated(n, seed=10_000, backend=backend)
    assert counts["ok"] + counts["invalid"] == n, counts


# -- failures the fuzzer found, shrunk ------------------------------------------------------
def test_an_all_to_all_of_a_padded_transpose_compiles():
    """Seed 22381 (jax backend), shrunk: a reshard by all-to-all of a transposed value
    padded along the split dim, which XLA:CPU (jaxlib 0.10.2) simplified into operand
    pieces laid out differently and then rejected; gspmd's lowering keeps the operand
    whole behind an optimization barrier."""
    spec = Spec(devices=(0, 1, 2, 3, 4, 5, 6, 7), mesh_shape=(2, 4), shape=(1, 3, 5, 1), dtype="float32",
                steps=(Step("merge_or_split", 1930243621, True), Step("transpose", 1362644301, False),
                       Step("sort_by_key", 574243266, True)), wrap="plain", seed=1274580688)
    for backend in ("sim", "jax"):
        assert run(spec, backend)[0] == "ok", backend


@pytest.mark.xfail(jax.__version_info__ < (0, 12), raises=jax.errors.JaxRuntimeError, strict=True,
                   reason="XLA:CPU of jaxlib 0.10 rejects the all-to-all it simplified (fixed by 0.12.1)")
def test_xla_compiles_an_all_to_all_of_a_padded_transpose():
    """jax's own program of the case above: when this passes on the pinned jax, the
    barrier in ops/collectives.py's _lower_all_to_all can go."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("x",))

    def body(v):
        padded = jnp.pad(jnp.transpose(v, (2, 1, 0)), ((0, 0), (0, 0), (0, 3)))
        return lax.all_to_all(padded, "x", 2, 0, tiled=True)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(None, None, "x"), out_specs=P("x")))
    assert f(np.arange(16, dtype=np.float32).reshape(1, 2, 8)).shape == (32, 2, 1)
