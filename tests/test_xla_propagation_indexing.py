"""Sharding completion on XLA's propagation tests of gathers and scatters (openxla/xla,
xla/service/sharding_propagation_test.cc): layouts carried between the data operand,
the indices, the updates and the result, and the parallel gathers and scatters whose
indices are iotas. Each case is a JAX program with the annotations of the XLA test it
is named after, asserting XLA's completed layout and that nothing moves."""
import jax.numpy as jnp
from jax import lax
import numpy as np

from util import check_priced as _run, rand
from xla_cases import layout as xla, split

RNG = np.random.RandomState(2)


# -- gathers ----------------------------------------------------------------------------------------
def _rows(rng, high: int, *shape) -> np.ndarray:
    return rng.randint(0, high, shape).astype(np.int32)


def test_gather_from_index():
    """GatherFromIndex: indices [2, 3, 4] (the index vector first) split on the 3: the
    gathered [3, 4, 9] is split [2,1,1] (the table replicated: nothing moves)."""
    def f(x, idx):
        idx = split(idx, "devices=[1,2,1]0,1")
        return x[idx[0], idx[1]]
    low, report = _run(f, rand(RNG, 2, 2, 9), _rows(RNG, 2, 2, 3, 4))
    assert low.sharding_of(0) == xla("devices=[2,1,1]0,1") and report.collective_bytes == 0


def test_gather_from_index_partial_replicate():
    low, report = _run(lambda x, i: x[split(i, "devices=[2,2]0,1,2,3 last_tile_dim_replicate")],
                       rand(RNG, 2, 9), _rows(RNG, 2, 3))
    assert low.sharding_of(0) == xla("devices=[2,1,2]0,1,2,3 last_tile_dim_replicate") and report.collective_bytes == 0


def test_gather_from_data_operand_partial_replicate():
    low, report = _run(lambda x, i: split(x, "devices=[1,2,2]0,1,2,3 last_tile_dim_replicate")[i],
                       rand(RNG, 2, 9), _rows(RNG, 2, 3))
    assert low.sharding_of(0) == xla("devices=[1,2,2]0,1,2,3 last_tile_dim_replicate") and report.collective_bytes == 0


def test_gather_to_index_partial_replicate():
    low, report = _run(lambda x, i: split(x[jnp.abs(i)], "devices=[2,1,2]0,1,2,3 last_tile_dim_replicate"),
                       rand(RNG, 2, 9), _rows(RNG, 2, 3))
    assert low.program.params[1].sharding == xla("devices=[2,2]0,1,2,3 last_tile_dim_replicate")
    assert report.collective_bytes == 0


def test_gather_to_index_of_two_index_dims():
    """GatherToIndex2 / 3: [2, 40, 4] gathered at [2, 10] pairs of indices (the index
    vector last, or in the middle), the result split on the 10: so are the indices."""
    def last(x, idx):
        idx = jnp.abs(idx)
        return split(x[idx[..., 0], idx[..., 1]], "devices=[1,2,1]0,1")

    def middle(x, idx):
        idx = jnp.abs(idx)
        return split(x[idx[:, 0], idx[:, 1]], "devices=[1,2,1]0,1")
    x = rand(RNG, 2, 40, 4)
    pairs = np.stack([_rows(RNG, 2, 2, 10), _rows(RNG, 40, 2, 10)], axis=-1)
    low, report = _run(last, x, pairs)
    assert low.program.params[1].sharding == xla("devices=[1,2,1]0,1") and report.collective_bytes == 0
    low, report = _run(middle, x, np.moveaxis(pairs, -1, 1).copy())
    assert low.program.params[1].sharding == xla("devices=[1,1,2]0,1") and report.collective_bytes == 0


def test_gather_to_data_operand():
    """GatherToDataOperand: the gathered rows split on their columns: so is the table."""
    low, report = _run(lambda x, i: split(jnp.tanh(x)[i], "devices=[1,2]0,1"), rand(RNG, 2, 9), _rows(RNG, 2, 3))
    assert low.program.params[0].sharding == xla("devices=[1,2]0,1") and report.collective_bytes == 0


# -- scatters ----------------------------------------------------------------------------------------
def test_scatter_index_to_update():
    """ScatterIndexToUpdate (and _PartialReplicate): the indices' split reaches the updates."""
    for idx_spec, upd_spec in [("devices=[2]0,1", "devices=[2,1]0,1"),
                               ("devices=[2,2]0,1,2,3 last_tile_dim_replicate",
                                "devices=[2,1,2]0,1,2,3 last_tile_dim_replicate")]:
        def f(x, i, u, idx_spec=idx_spec):
            return x.at[split(i, idx_spec)].add(jnp.tanh(u))
        low, _ = _run(f, rand(RNG, 2, 9), _rows(RNG, 2, 3), rand(RNG, 3, 9))
        assert low.program.params[2].sharding == xla(upd_spec), idx_spec


def test_scatter_update_to_index_partial_replicate():
    """ScatterUpdateToIndex_PartialReplicate: the updates' split reaches the indices."""
    def f(x, i, u):
        return x.at[jnp.abs(i)].add(split(u, "devices=[2,1,2]0,1,2,3 last_tile_dim_replicate"))
    low, _ = _run(f, rand(RNG, 2, 9), _rows(RNG, 2, 3), rand(RNG, 3, 9))
    assert low.program.params[1].sharding == xla("devices=[2,2]0,1,2,3 last_tile_dim_replicate")


# -- gathers whose indices are iotas (parallel gathers) ------------------------------------------------
ORDER8 = "0,1,4,5,2,3,6,7"


def _parallel_gather(x):
    """x[i, j] at every (i, j) of its two leading dims: XLA's concatenate of iotas as indices."""
    return x[jnp.arange(x.shape[0])[:, None], jnp.arange(x.shape[1])[None, :]]


def test_parallel_gather_from_operand_forward_pass():
    """ParallelGatherFromOperandForwardPass (and its partial twin): the operand's split
    of the gathered dim is the result's: nothing moves."""
    for spec in [f"devices=[8,1,1,1]{ORDER8}", f"devices=[4,1,1,1,2]{ORDER8} last_tile_dim_replicate"]:
        low, report = _run(lambda x, spec=spec: _parallel_gather(split(x, spec)), _rows(RNG, 9, 8, 4, 2, 2))
        assert low.sharding_of(0) == xla(spec) and report.collective_bytes == 0, spec


def test_parallel_gather_backward_pass():
    """ParallelGatherBackwardPass (and its partial twin): the result's split reaches the operand."""
    for spec in [f"devices=[8,1,1,1]{ORDER8}", f"devices=[4,1,1,1,2]{ORDER8} last_tile_dim_replicate"]:
        low, report = _run(lambda x, spec=spec: split(_parallel_gather(x * 2), spec), _rows(RNG, 9, 8, 4, 2, 2))
        assert low.program.params[0].sharding == xla(spec) and report.collective_bytes == 0, spec


def test_parallel_gather_backward_pass_of_swapped_dims():
    """ParallelGatherBackwardPass2: the result's dim 1 (the operand's dim 0, indexed by
    the second iota) split 4 ways (devices 0,2,1,3: XLA's 0,1,4,5 are not ids 0..3): the
    operand's dim 0 is split so."""
    def f(x):
        y = (x * 2)[jnp.arange(4)[None, :], jnp.arange(8)[:, None]]
        return split(y, "devices=[1,4,1,1]0,2,1,3")
    low, report = _run(f, _rows(RNG, 9, 4, 8, 2, 2))
    assert low.program.params[0].sharding == xla("devices=[4,1,1,1]0,2,1,3") and report.collective_bytes == 0


def test_parallel_gathers_and_scatters_with_iotas_made_outside_a_loop_or_branch():
    """The iotas made once outside and read inside a fori_loop, a scan or a cond's branch
    (jax passes them in as operands): made again inside, as XLA's while-loop constant
    sinking does, the gathers and scatters there stay parallel: nothing moves (8 rows
    over 8 devices, and 6 over 4, uneven)."""
    def gathers_in(loop, spec):
        def f(x, u):
            rows, cols = jnp.arange(x.shape[0])[:, None], jnp.arange(x.shape[1])[None, :]
            x, u = split(x, spec), split(u, spec)
            return loop(lambda c: c.at[rows, cols].add(x[rows, cols] * u[rows, cols]), jnp.zeros_like(x))
        return f
    loops = {"fori_loop": lambda step, c: lax.fori_loop(0, 3, lambda i, c: step(c), c),
             "scan": lambda step, c: lax.scan(lambda c, _: (step(c), None), c, None, length=3)[0],
             "cond": lambda step, c: lax.cond(True, step, lambda c: c, c)}
    for rows, spec in [(8, f"devices=[8,1,1,1]{ORDER8}"), (6, "devices=[4,1,1,1]0,1,2,3")]:
        for name, loop in loops.items():
            low, report = _run(gathers_in(loop, spec), _rows(RNG, 9, rows, 4, 2, 2), _rows(RNG, 9, rows, 4, 2, 2))
            assert low.sharding_of(0) == xla(spec) and report.collective_bytes == 0, (rows, name)


def _parallel_scatter_add(x, u):
    """x.at[i, j] += u[i, j] at every (i, j) of their two leading dims."""
    return x.at[jnp.arange(x.shape[0])[:, None], jnp.arange(x.shape[1])[None, :]].add(u)


def test_parallel_scatter_from_operand_or_update_forward_pass():
    """ParallelScatterFromOperandForwardPass / FromUpdateForwardPass (and their partial
    twins): the operand's or the updates' split of the scattered dim is the result's."""
    x, u = _rows(RNG, 9, 8, 4, 2, 2), _rows(RNG, 9, 8, 4, 2, 2)
    for spec in [f"devices=[8,1,1,1]{ORDER8}", f"devices=[4,1,1,1,2]{ORDER8} last_tile_dim_replicate"]:
        for which in (0, 1):
            def f(x, u, spec=spec, which=which):
                return _parallel_scatter_add(*(split(v, spec) if k == which else v * 2 for k, v in enumerate((x, u))))
            low, report = _run(f, x, u)
            assert low.sharding_of(0) == xla(spec) and report.collective_bytes == 0, (spec, which)


def test_parallel_scatter_backward_pass():
    """ParallelScatterBackwardPass (and its partial twin): the result's split reaches the
    operand and the updates."""
    for spec in [f"devices=[8,1,1,1]{ORDER8}", f"devices=[4,1,1,1,2]{ORDER8} last_tile_dim_replicate"]:
        low, report = _run(lambda x, u, spec=spec: split(_parallel_scatter_add(x * 2, u * 2), spec),
                           _rows(RNG, 9, 8, 4, 2, 2), _rows(RNG, 9, 8, 4, 2, 2))
        assert all(p.sharding == xla(spec) for p in low.program.params) and report.collective_bytes == 0, spec
