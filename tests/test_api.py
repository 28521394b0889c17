"""The public surface: jit, lower, as_text, sharding_of, explain, report, the CLI."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gspmd
from gspmd import cli

MESH = gspmd.Mesh(np.arange(8).reshape(2, 4), ("x", "y"))


def mlp(x, w1, w2):
    x = gspmd.mesh_split(x, MESH, ["x", -1])
    w1 = gspmd.mesh_split(w1, MESH, [-1, "y"])
    return jax.nn.relu(x @ w1) @ w2


ARGS = (np.ones((8, 16), np.float32), np.ones((16, 32), np.float32), np.ones((32, 4), np.float32))


def test_lower_accepts_abstract_inputs_and_is_cached():
    step = gspmd.jit(mlp, mesh=MESH)
    abstract = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in ARGS]
    assert step.lower(*abstract) is step.lower(*ARGS)


def test_as_text_shows_every_sharding_and_the_spmd_program():
    text = gspmd.jit(mlp, mesh=MESH).lower(*ARGS).as_text()
    assert "{devices=[2,4]<=[8]}" in text            # the hidden activation, completed
    assert "all-reduce(" in text and "partition" not in text.split("SPMD")[0]
    assert "float32[4,8]" in text                    # per-device shapes


def test_sharding_of_by_index_and_name_and_explain():
    low = gspmd.jit(mlp, mesh=MESH).lower(*ARGS)
    out = low.sharding_of(0)
    assert out == gspmd.Sharding.from_mesh(MESH, ["x", -1], (8, 4))
    assert low.sharding_of(low.program.outputs[0].name) == out
    explanation = low.explain(0)
    assert "annotation" in explanation and "dot" in explanation
    with pytest.raises(gspmd.ShardingError, match="No value named"):
        low.sharding_of("nope")


def test_report_lists_collectives_with_origin():
    report = gspmd.jit(mlp, mesh=MESH).lower(*ARGS).report()
    (kind, nbytes, groups), = report.collectives
    assert (kind, nbytes) == ("all-reduce", 4 * 4 * 4)
    assert set(groups) == {(0, 1, 2, 3), (4, 5, 6, 7)}
    assert "dot" in report.collectives[0].origin
    relu = 4 * 8     # one operation per element of the [8 (batch) / 2, 8 (hidden)] activation
    assert report.peak_memory_bytes > 0 and report.flops == 2 * 4 * 16 * 8 + 2 * 4 * 4 * 8 + relu
    assert report.memory_bound_flops == relu


def test_unannotated_program_runs_on_one_device_and_needs_no_collectives():
    f = gspmd.jit(lambda a: a * 2)
    np.testing.assert_array_equal(f(np.ones(3, np.float32)), np.full(3, 2, np.float32))
    assert f.lower(np.ones(3, np.float32)).report().collectives == []


def test_bad_backend_and_mismatched_meshes_raise():
    with pytest.raises(gspmd.ShardingError, match="backend"):
        gspmd.jit(mlp, mesh=MESH, backend="tpu")
    small = gspmd.Mesh(np.arange(4), ("a",))
    with pytest.raises(gspmd.ShardingError, match="different sizes"):
        gspmd.jit(mlp, mesh=small).lower(*ARGS)


def test_wrong_argument_count_raises():
    f = gspmd.jit(mlp, mesh=MESH)
    low = f.lower(*ARGS)
    with pytest.raises(gspmd.ShardingError, match="Expected 3"):
        low(*ARGS[:2])
    with pytest.raises(gspmd.ShardingError, match=r"shape \(4, 16\)"):
        low(np.ones((4, 16), np.float32), *ARGS[1:])


def test_demo_matches_one_device(capsys):
    assert cli.main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "all-reduce" in out and "max abs difference" in out and "Mesh(data=2, model=4)" in out
    # Reports speak the user's terms: source lines, parameter paths, mesh-axis specs.
    assert "at mlp.py:" in out and "params[0]" in out and "P(None, 'model') over Mesh(data=2, model=4)" in out


def test_a_failing_partition_rule_names_the_instruction(monkeypatch):
    from gspmd import ops

    def broken(ctx, instr, operands, targets):
        raise RuntimeError("boom")

    monkeypatch.setattr(ops.OPS["maximum"].rule, "partition", broken)
    with pytest.raises(gspmd.ShardingError, match=r"Internal error partitioning %maximum.*boom"):
        gspmd.jit(mlp, mesh=MESH).lower(*ARGS)


@pytest.mark.parametrize("model", ["transformer", "moe", "unet", "pipeline"])
def test_demo_runs_every_case_study(model, capsys):
    assert cli.main(["demo", "--model", model]) == 0
    assert "max abs difference" in capsys.readouterr().out


def test_help_explains_backends_caching_and_inspection():
    doc = gspmd.jit.__doc__
    for words in ("Backends", '"sim"', '"jax"', "Caching", "lower(", "report(", "explain(", "jax.grad", "static"):
        assert words in doc, words
    for name in gspmd.__all__:
        assert getattr(gspmd, name).__doc__, name
    for method in ("as_text", "report", "summary", "explain", "sharding_of", "value", "jax_executable"):
        assert getattr(gspmd.Lowered, method).__doc__, method


def test_reports_speak_the_users_terms():
    def train_step(params, x):
        def loss(params):
            h = gspmd.mesh_split(x, MESH, ["x", None]) @ gspmd.mesh_split(params["w1"], MESH, [None, "y"])
            return (jax.nn.relu(h) @ params["w2"]).sum()     # the line of the all-reduce
        return jax.grad(loss)(params)

    params = {"w1": np.ones((16, 32), np.float32), "w2": np.ones((32, 4), np.float32)}
    low = gspmd.jit(train_step, mesh=MESH).lower(params, ARGS[0])
    line = train_step.__code__.co_firstlineno + 3
    report = low.report()
    assert any(c.source == f"test_api.py:{line} (loss)" for c in report.collectives), report
    assert f"at test_api.py:{line} (loss)" in str(report)
    assert f"test_api.py:{line} (loss)" in low.summary() and "total" in low.summary()
    explanation = low.explain("params['w1']")
    assert explanation.startswith("params['w1'] (%") and "P(None, 'y') over Mesh(x=2, y=4)" in explanation
    assert f"at test_api.py:{line - 1} (loss)" in explanation            # the annotation's line
    assert low.sharding_of("result['w2']") == low.sharding_of(1)
    with pytest.raises(gspmd.ShardingError, match=r"names several values \(params\['w1'\], result\['w1'\]\)"):
        low.explain("w1")
    assert "params['w2']" in low.as_text() and "result['w1']" in low.as_text()


def test_collectives_inside_library_functions_name_the_calling_line():
    """jnp.take runs as a jitted function whose equations carry no line of the caller's
    code: its all-reduce is charged to the line that called it."""
    def lookup(table, ids):
        return jnp.take(gspmd.mesh_split(table, MESH, ["y", None]), ids, axis=0)   # the line of the all-reduce

    low = gspmd.jit(lookup, mesh=MESH).lower(np.ones((10, 4), np.float32), np.zeros(6, np.int32))
    line = lookup.__code__.co_firstlineno + 1
    assert [c.source for c in low.report().collectives] == [f"test_api.py:{line} (lookup)"], low.report()
