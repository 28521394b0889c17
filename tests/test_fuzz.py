"""The differential fuzzer (tests/fuzz_programs.py) in the suites: a fixed slice of its
programs by default, on both backends, each compared with jax.jit on one device; thousands
with -m slow. A failing seed reproduces with fuzz_programs.run(random_spec(seed), backend)
and shrinks with fuzz_programs.shrink."""
import pytest

from fuzz_programs import fuzz_isolated, random_spec, run

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
