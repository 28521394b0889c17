"""report() against the compiled program on the jax backend: `backend_collectives` (each
collective once, as the jax backend's lowering runs it, plus the gathers that assemble
uneven results) equals, kind and bytes, what the compiled HLO text holds
(analysis.xla.hlo_collectives: XLA's combined tuples split back into their parts).

What differs by design, and is compared accordingly: `collectives` is the plan and
counts each collective as often as it runs (x trip count in loops, every branch of a
conditional once), while program text lists each once; the jax backend lowers some
collectives as more than one (a float max all-reduce also reduces NaN flags, a bool one
runs on int32, a product gathers the group's values, a host callback gathers device 0's
results) and runs reduce-scatters that XLA:CPU would not combine as one. Not compared:
XLA's CPU rewrites that change bytes (none in these programs) and ragged all-to-alls
(XLA:CPU runs them as padded all-to-alls)."""
from collections import Counter

import jax
from jax.experimental import io_callback
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import gspmd
from gspmd.analysis import xla

MESH = gspmd.Mesh(np.arange(8).reshape(2, 4), ("x", "y"))


def compared(fn, *args, mesh=MESH) -> gspmd.analysis.Report:
    """fn's report, once its backend_collectives matched the compiled program's."""
    low = gspmd.jit(fn, mesh=mesh, backend="jax").lower(*args)
    report = low.report()
    compiled = Counter(xla.hlo_collectives(low.compile().as_text()))
    ours = Counter((c.kind, c.bytes) for c in report.backend_collectives)
    assert ours == compiled, f"report only: {ours - compiled}; compiled only: {compiled - ours}\n{report}"
    return report


def _rand(*shape):
    return np.random.RandomState(sum(shape)).standard_normal(shape).astype(np.float32)


def test_a_collective_in_one_branch_of_a_cond():
    def f(p, x, w):
        x = gspmd.mesh_split(x, MESH, ["x", "y"])
        w = gspmd.mesh_split(w, MESH, [-1, "y"])
        y = x @ w.T
        return lax.cond(p > 0, lambda y: y * 2, lambda y: gspmd.mesh_split(y, MESH, [-1, -1]) + 1, y)
    report = compared(f, np.float32(1), _rand(64, 128), _rand(256, 128))
    gather, = [c for c in report.collectives if c.kind == "all-gather"]   # branch 0: lax.cond's false branch
    assert gather.within == "f.branch0.spmd" and gather.bytes == 64 * 256 * 4, str(report)
    assert "in f.branch0.spmd" in str(report)


def test_collectives_in_both_branches_of_a_cond():
    """The max all-reduce of branch 0 runs as two on the jax backend (its NaN flags)."""
    def f(p, x):
        x = gspmd.mesh_split(x, MESH, ["x", "y"])
        return lax.cond(p > 0, lambda x: jnp.sum(x, 0), lambda x: jnp.max(x, 1)[:32], x)
    report = compared(f, np.float32(1), _rand(64, 32))
    assert {c.within.split(".")[-2] for c in report.collectives} == {"branch0", "branch1"}, str(report)
    assert len(report.backend_collectives) == len(report.collectives) + 1


def test_a_callback_in_a_branch_that_never_runs():
    """An io_callback in a branch that never runs gathers device 0's results on the jax
    backend, which the plan does not hold; the report says so. (A pure_callback, as
    equinox's error_if binds, runs on every device and gathers nothing.)"""
    def fail(x):
        raise RuntimeError("never called")

    def f(x):
        x = gspmd.mesh_split(x, MESH, ["x", -1])
        checked = lax.cond(jnp.all(jnp.isfinite(x)), lambda x: x,
                           lambda x: io_callback(fail, jax.ShapeDtypeStruct(x.shape, x.dtype), x), x)
        return checked * 2
    x = _rand(64, 128)
    report = compared(f, x)
    gathers = [c for c in report.backend_collectives if c.kind == "all-gather" and c.bytes == 8 * x.nbytes]
    assert len(gathers) == 1 and "branch" in gathers[0].within, str(report)
    assert "the jax backend runs besides" in str(report)
    np.testing.assert_allclose(gspmd.jit(f, mesh=MESH, backend="jax")(x), x * 2)


def test_loops_count_once_in_the_compiled_program():
    """A fori_loop's body and a while_loop's: the report counts a trip count's worth
    (a while_loop's once), the compiled program text each once."""
    def fori(x, w):
        x = gspmd.mesh_split(x, MESH, ["x", "y"])
        w = gspmd.mesh_split(w, MESH, ["y", -1])
        return lax.fori_loop(0, 3, lambda i, x: jnp.tanh(x @ w), x)

    def while_(x, w):
        x = gspmd.mesh_split(x, MESH, ["x", "y"])
        w = gspmd.mesh_split(w, MESH, ["y", -1])
        return lax.while_loop(lambda c: jnp.sum(c[1]) < 100., lambda c: (c[0], jnp.abs(c[1] @ c[0]) + 1), (w, x))
    x, w = _rand(16, 64), _rand(64, 64)
    report = compared(fori, x, w)
    assert report.collective_bytes == 3 * sum(c.bytes for c in report.backend_collectives), str(report)
    assert all(c.within for c in compared(while_, x, w).collectives)


def test_scan_with_collectives_in_its_body():
    def f(x, ws):
        x = gspmd.mesh_split(x, MESH, ["x", -1])
        ws = gspmd.mesh_split(ws, MESH, [-1, -1, "y"])
        return lax.scan(lambda x, w: (jnp.tanh(x @ w), x.sum()), x, ws)
    report = compared(f, _rand(16, 64), _rand(3, 64, 64))
    assert any(c.executions == 3 for c in report.collectives), str(report)


def test_mlp_train_step_whose_all_reduces_xla_combines():
    def step(x, w1, w2):
        def loss(w1, w2):
            h = gspmd.mesh_split(x, MESH, ["x", -1]) @ gspmd.mesh_split(w1, MESH, [-1, "y"])
            return jnp.mean((jax.nn.relu(h) @ gspmd.mesh_split(w2, MESH, ["y", -1])) ** 2)
        g1, g2 = jax.grad(loss, (0, 1))(w1, w2)
        return w1 - 0.1 * g1, w2 - 0.1 * g2
    report = compared(step, _rand(32, 64), _rand(64, 128), _rand(128, 64))
    assert report.counts()["all-reduce"] == 3, str(report)


def test_reduce_scatters_the_jax_backend_runs_as_one():
    """Fully sharded weights: their gradients' reduce-scatters (same groups and dtype,
    neither reading the other) run as one on the jax backend (XLA:CPU combines none);
    the report lists them apart and backend_collectives as the one they run as."""
    def step(x, w1, w2):
        def loss(w1, w2):
            h = gspmd.mesh_split(x, MESH, [("x", "y"), -1]) @ w1
            return jnp.mean((jax.nn.relu(h) @ w2) ** 2)
        g1, g2 = jax.grad(loss, (0, 1))(w1, w2)
        return w1 - 0.1 * gspmd.mesh_split(g1, MESH, [("x", "y"), -1]), \
            w2 - 0.1 * gspmd.mesh_split(g2, MESH, [("x", "y"), -1])
    report = compared(step, _rand(32, 64), _rand(64, 128), _rand(128, 64))
    assert [c.bytes for c in report.collectives if c.kind == "reduce-scatter"] == [4096, 4096], str(report)
    assert [c.bytes for c in report.backend_collectives if c.kind == "reduce-scatter"] == [8192], str(report)


def test_attention_with_a_split_softmax_and_uneven_results():
    """Keys split: the softmax's max and sum are all-reduced (the max with its NaN
    flags); 13 heads over 4 devices leave uneven results, assembled by gathers."""
    def attention(q, k, v):
        q = gspmd.mesh_split(q, MESH, ["x", -1, "y", -1])
        k = gspmd.mesh_split(k, MESH, ["x", "y", -1, -1])
        v = gspmd.mesh_split(v, MESH, ["x", "y", -1, -1])
        scores = gspmd.mesh_split(jnp.einsum("bqhd,bkhd->bhqk", q, k) / 4.0, MESH, ["x", -1, -1, "y"])
        return gspmd.mesh_split(jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v), MESH,
                                ["x", -1, "y", -1])
    q, kv = _rand(4, 8, 13, 16), _rand(4, 32, 13, 16)
    report = compared(attention, q, kv, kv)
    nan_flags = 4 * 13 * 8 // 2 * 4           # one int32 per row of a device's scores
    assert ("all-reduce", nan_flags) in [(c.kind, c.bytes) for c in report.backend_collectives], str(report)
    assert any("assembled" in c.origin for c in report.backend_collectives), str(report)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["cond_mlp", "equinox_block", "linen_cnn", "linen_lstm", "lm", "moe", "nnx_mlp",
                                  "shard_map_ring", "sharding_constraints"])
def test_corpus_programs(name):
    import importlib

    from test_corpus import meshes
    program = importlib.import_module(f"corpus.{name}")
    mesh, context = meshes(program)
    with context:
        compared(program.train_step, *program.example_inputs(), mesh=mesh)
