"""`gspmd plan`: the case studies at chosen sizes, a user's module:function, JSON output,
and clear errors for sizes a model does not vary."""
import dataclasses
import json
import math
import textwrap
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from gspmd import cli, planning
from gspmd.ir.schedule import PipelineSchedule

SMALL = ["--layers", "2", "--model-dim", "64", "--ffn-dim", "128", "--heads", "4", "--head-dim", "16",
         "--seq", "32"]


def plan_json(capsys, *argv) -> dict:
    assert cli.main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def plan_error(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["plan", *argv])
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_transformer_plan_as_json(capsys):
    out = plan_json(capsys, "transformer", *SMALL, "--mesh", "2x4", "--batch", "8")
    for key in ("peak_memory_bytes", "step_seconds", "flops_utilization", "compute_seconds",
                "communication_seconds", "collectives", "planning_seconds"):
        assert key in out
    assert out["devices"] == 8 and out["mesh"] == {"x": 2, "y": 4} and out["hardware"] == "tpu-v3"
    assert out["sizes"]["layers"] == 2 and out["sizes"]["batch"] == 8
    assert 0 < out["flops_utilization"] < 1 and out["bubble_fraction"] is None
    assert {"all-gather", "reduce-scatter"} <= set(out["collectives"])
    # Layers run in one scan: the body's collectives count once per layer.
    assert out["collectives"]["all-gather"]["count"] % 2 == 0


def test_a_plan_shows_where_its_peak_is(capsys, tmp_path):
    """The largest buffers held at the peak, with shapes, layouts and the user's line that
    made them (JSON and text), and memory over the run as a PNG."""
    out = plan_json(capsys, "transformer", *SMALL, "--mesh", "2x4", "--batch", "8", "--top", "3")
    top = out["largest_buffers_at_peak"]
    assert len(top) == 3 and [t["bytes"] for t in top] == sorted((t["bytes"] for t in top), reverse=True)
    assert all(t["bytes"] == math.prod(t["shape"]) * jnp.dtype(t["dtype"]).itemsize for t in top), top
    assert all(t["source"] and t["sharding"] and t["made_by"] for t in top), top
    pytest.importorskip("matplotlib")
    png = tmp_path / "memory.png"
    assert cli.main(["plan", "transformer", *SMALL, "--mesh", "2x4", "--batch", "8", "--memory-plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "largest buffers held at the peak" in text and f"memory over the run: {png}" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_pipeline_plan_reports_its_bubbles(capsys):
    out = plan_json(capsys, "transformer", *SMALL, "--mesh", "2x2x2", "--stages", "2", "--microbatches", "4",
                    "--batch", "8", "--schedule", "gpipe")
    assert out["bubble_fraction"] == pytest.approx(1 / 5)     # (L - 1) / (M + L - 1)
    assert out["effective_utilization"] == pytest.approx(out["flops_utilization"] * 4 / 5)
    assert "collective-permute" in out["collectives"]
    # the one formula, the schedule's own: a circular pipeline's repeats shrink the bubble as microbatches do
    assert PipelineSchedule("gpipe", 4, 16, 1, steps=16 + 3).bubble_fraction == pytest.approx(3 / 19)
    assert PipelineSchedule("circular", 4, 8, 2, steps=8 * 2 + 3).bubble_fraction == pytest.approx(3 / 19)


def test_a_1f1b_plan_holds_activations_independent_of_the_microbatches(capsys):
    def peak(schedule, microbatches):
        return plan_json(capsys, "transformer", *SMALL, "--mesh", "2x2x2", "--stages", "2", "--microbatches",
                         str(microbatches), "--batch", str(2 * microbatches), "--schedule", schedule,
                         "--remat", "nothing_saveable")
    few, many = peak("1f1b", 4), peak("1f1b", 16)
    assert many["bubble_fraction"] == pytest.approx(1 / 17) and "collective-permute" in many["collectives"]
    assert 0.2 < many["recompute_fraction"] < 0.3     # each stage's forward once more, not each layer's twice
    growth = many["peak_memory_bytes"] - few["peak_memory_bytes"]
    assert growth < 0.5 * (peak("gpipe", 16)["peak_memory_bytes"] - peak("gpipe", 4)["peak_memory_bytes"])


def test_the_optimizer_state_is_planned_too(capsys):
    sgd = plan_json(capsys, "transformer", *SMALL, "--mesh", "2x4", "--batch", "8", "--optimizer", "sgd")
    adafactor = plan_json(capsys, "transformer", *SMALL, "--mesh", "2x4", "--batch", "8")
    adamw = plan_json(capsys, "transformer", *SMALL, "--mesh", "2x4", "--batch", "8", "--optimizer", "adamw")
    assert adafactor["sizes"]["optimizer"] == "adafactor"           # the paper's, by default
    assert sgd["peak_memory_bytes"] < adafactor["peak_memory_bytes"] < adamw["peak_memory_bytes"]


def test_remat_reports_its_recompute_share(capsys):
    plain = plan_json(capsys, "transformer", *SMALL, "--mesh", "2x4", "--batch", "8")
    remat = plan_json(capsys, "transformer", *SMALL, "--mesh", "2x4", "--batch", "8", "--remat", "nothing_saveable")
    assert plain["recompute_fraction"] is None
    assert 0.1 < remat["recompute_fraction"] < 0.4                 # the forward pass again, in the backward
    assert remat["flops_per_device"] > plain["flops_per_device"]
    assert remat["peak_memory_bytes"] < plain["peak_memory_bytes"]
    assert remat["effective_utilization"] == pytest.approx(remat["flops_utilization"] * (1 - remat["recompute_fraction"]))
    # torch's checkpoint: the whole forward pass again, the layer's last matmul included; the same inputs kept
    rerun = plan_json(capsys, "transformer", *SMALL, "--mesh", "2x4", "--batch", "8", "--remat", "rerun")
    assert rerun["recompute_fraction"] > remat["recompute_fraction"]
    assert rerun["peak_memory_bytes"] < plain["peak_memory_bytes"]


@pytest.mark.parametrize("argv, collective", [
    (["moe", "--layers", "2", "--model-dim", "32", "--ffn-dim", "64", "--heads", "2", "--head-dim", "16",
      "--seq", "16", "--experts", "8", "--batch", "16"], "all-to-all"),
    (["hybrid-moe", "--layers", "2", "--model-dim", "32", "--ffn-dim", "64", "--heads", "4", "--head-dim", "8",
      "--seq", "16", "--mesh", "4x2", "--batch", "8"], "all-to-all"),
    (["unet", "--mesh", "2x4", "--image-size", "16", "--batch", "2", "--model-dim", "4"], "collective-permute"),
    (["conformer", *SMALL, "--mesh", "2x2", "--stages", "2", "--microbatches", "4", "--batch", "4",
      "--schedule", "circular", "--repeats", "1"], "collective-permute"),
])
def test_every_case_study_plans(capsys, argv, collective):
    out = plan_json(capsys, *argv)
    assert collective in out["collectives"] and out["step_seconds"] > 0


def test_summary_and_the_devices_shortcut(capsys):
    assert cli.main(["plan", "--devices", "64", "--layers", "1", "--hardware", "a100"]) == 0
    out = capsys.readouterr().out
    assert "8x8 mesh (x, y), 64 devices" in out and "estimated step on a100" in out and "all-gather" in out
    assert "flops utilization" in out


def test_a_users_function(capsys, tmp_path, monkeypatch):
    (tmp_path / "my_model.py").write_text(textwrap.dedent("""
        import jax, numpy as np, gspmd
        mesh = gspmd.Mesh(np.arange(8).reshape(2, 4), ("data", "model"))

        def step(x, w):
            x = gspmd.mesh_split(x, mesh, ["data", -1])
            w = gspmd.mesh_split(w, mesh, [-1, "model"])
            return jax.nn.relu(x @ w).sum()

        def plan_args():
            return (jax.ShapeDtypeStruct((64, 128), np.float32), jax.ShapeDtypeStruct((128, 256), np.float32))
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    out = plan_json(capsys, "my_model:step")
    assert out["devices"] == 8 and out["mesh"] == {"data": 2, "model": 4} and out["collectives"]["all-reduce"]["count"] >= 1
    assert "plan_args" in plan_error(capsys, "my_model:plan_args_missing")
    (tmp_path / "no_args.py").write_text("def f(x):\n    return x\n")
    assert "must define plan_args()" in plan_error(capsys, "no_args:f")
    assert "do not apply to a user function" in plan_error(capsys, "my_model:step", "--layers", "2")


def test_a_factory_plans_at_the_devices_given(capsys, tmp_path):
    """module:function without plan_args(): function(devices=N) -> (step, args); a .py path works."""
    path = tmp_path / "factory_model.py"
    path.write_text(textwrap.dedent("""
        from dataclasses import dataclass
        import jax, numpy as np, gspmd

        @dataclass(frozen=True)          # needs the module registered while it loads
        class Dims:
            rows: int = 64

        def make(devices=8):
            mesh = gspmd.Mesh(np.arange(devices).reshape(2, devices // 2), ("data", "model"))

            def step(x, w):
                x = gspmd.mesh_split(x, mesh, ["data", -1])
                w = gspmd.mesh_split(w, mesh, [-1, "model"])
                return jax.nn.relu(x @ w).sum()
            return step, (jax.ShapeDtypeStruct((Dims().rows, 128), np.float32),
                          jax.ShapeDtypeStruct((128, 256), np.float32))

        def not_a_factory(x):
            return x
    """))
    out = plan_json(capsys, f"{path}:make", "--devices", "256", "--hardware", "tpu-v5p")
    assert out["devices"] == 256 and out["hardware"] == "tpu-v5p" and out["sizes"] == {"devices": 256}
    assert plan_json(capsys, f"{path}:make")["devices"] == 8
    assert "factory" in plan_error(capsys, f"{path}:not_a_factory")
    assert "Cannot import" in plan_error(capsys, f"{tmp_path / 'missing.py'}:make")


def test_a_factory_may_take_the_hardware_and_name_what_it_updates_in_place(capsys, tmp_path):
    """function(devices=N, hardware=NAME) -> (step, args, donate): here its arguments are
    laid out over a mesh of stand-in devices of that hardware (as MaxText's abstract
    train state is), and the donated weights are updated in place. What it prints goes to
    stderr under --json."""
    path = tmp_path / "stand_in_model.py"
    path.write_text(textwrap.dedent("""
        import jax, numpy as np
        from jax.sharding import NamedSharding, PartitionSpec as P
        from gspmd import planning

        print("a notice while loading")

        def make(devices=8, hardware="cpu"):
            print("a notice while building")
            mesh = planning.stand_in_mesh((devices // 4, 4), ("data", "model"), hardware)

            def step(w, x):
                return w - 0.1 * jax.grad(lambda w: jax.nn.relu(x @ w).sum())(w)
            w = jax.ShapeDtypeStruct((128, 256), np.float32, sharding=NamedSharding(mesh, P(None, "model")))
            x = jax.ShapeDtypeStruct((512, 128), np.float32, sharding=NamedSharding(mesh, P("data")))
            return step, (w, x), (0,)
    """))
    out = plan_json(capsys, f"{path}:make", "--devices", "512", "--hardware", "tpu-v5p")
    assert out["devices"] == 512 and out["collectives"]["all-reduce"]["count"] == 1   # the weights' gradient
    assert out["mesh"] == {"data": 128, "model": 4}     # the arguments' mesh
    p = planning.plan(f"{path}:make", planning.Sizes(devices=512), "tpu-v5p")
    assert p.lowered.mesh.devices.tolist() == planning.device_mesh((128, 4), "tpu-v5p").tolist()
    assert p.report.memory.aliased_bytes == 128 * 256 * 4 // 4


def test_the_llama_example_builds_for_the_devices_given():
    example = Path(__file__).resolve().parents[1] / "examples" / "llama_train_step.py"
    case = planning.build(f"{example}:make", planning.Sizes(devices=2048), planning.profile("tpu-v5p"))
    params, moments, tokens, labels = case.args
    assert tokens.shape == (2048, 8192) and params["layers"]["wq"].shape == (32, 4096, 32, 128)
    assert case.sizes == {"devices": 2048} and callable(case.step)


@pytest.mark.parametrize("argv, message", [
    (["unet", "--vocab", "32000"], "does not vary --vocab"),
    (["transformer", "--image-size", "64"], "does not vary --image-size"),
    (["unet", "--heads", "8"], "does not vary --heads"),
    (["transformer", "--remat", "offload_dot_with_no_batch_dims"], "host memory"),
    (["unet", "--experts", "8"], "does not vary --experts"),
    (["resnet"], "Unknown model"),
    (["transformer", "--mesh", "4x4", "--batch", "6", "--microbatches", "4"], "does not divide into 4"),
    (["transformer", "--mesh", "2x2x2", "--stages", "4"], "first dim"),
    (["transformer", "--mesh", "2x2x2", "--schedule", "zigzag"], "gpipe"),
    (["transformer", "--mesh", "2x2x2", "--layers", "3"], "does not divide"),
    (["moe", "--mesh", "4x2"], "2 dims"),
    (["transformer", "--activation-dtype", "int8"], "bfloat16"),
    (["transformer", "--optimizer", "lion"], "adafactor"),
    (["transformer", "--attention", "ring"], "dot_product, flash"),
    (["moe", "--attention", "flash"], "does not vary --attention"),
    (["transformer", "--dropout", "1.5"], "a rate in [0, 1)"),
    (["transformer", "--mesh", "2x2x2", "--schedule", "1f1b", "--remat", "dots_saveable"], "gpipe or circular"),
    (["transformer", "--mesh", "2x2x2", "--schedule", "circular", "--repeats", "2", "--remat", "rerun"],
     "1f1b or gpipe"),
    (["conformer", "--dropout", "0.1"], "does not vary --dropout"),
    (["--mesh", "2by4"], "must look like"),
    (["--devices", "48"], "power of two"),
    (["--devices", "64", "--mesh", "8x8"], "not both"),
])
def test_bad_flags_are_clear_errors(capsys, argv, message):
    assert message in plan_error(capsys, *argv)


def test_a_transformer_with_an_embedding_and_softmax(capsys):
    """--vocab: tokens embedded by a table split on vocabulary (Y) and model dim (X), the
    tied logits split on vocabulary, a log-softmax reduced across Y: more flops than the
    plan without them, and the table stays split over all 8 devices."""
    without = plan_json(capsys, "transformer", *SMALL, "--mesh", "2x4", "--batch", "8")
    out = plan_json(capsys, "transformer", *SMALL, "--mesh", "2x4", "--batch", "8", "--vocab", "512")
    assert out["sizes"]["vocab"] == 512 and "vocabulary 512" in out["model"]
    assert out["flops_per_device"] > without["flops_per_device"]
    sizes = planning.Sizes(layers=2, model_dim=64, ffn_dim=128, heads=4, head_dim=16, seq=32, vocab=512, batch=8,
                           mesh=(2, 4))
    lowered = planning.plan("transformer", sizes).lowered
    table = next(p for p in lowered.program.params if lowered.label(p).endswith("['embedding']"))
    assert table.sharding.tiles == (4, 2)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_a_pipelined_transformer_with_an_embedding_and_softmax(capsys, schedule):
    """--vocab with --stages: tokens in (not activations), embedded on the first stage,
    logits and the softmax on the last; the table's gradient reduced once after the loop."""
    flags = [*SMALL, "--mesh", "2x2x2", "--stages", "2", "--microbatches", "4", "--strategy", "megatron",
             "--schedule", schedule]
    without = plan_json(capsys, "transformer", *flags)
    out = plan_json(capsys, "transformer", *flags, "--vocab", "512")
    assert "vocabulary 512" in out["model"] and out["flops_per_device"] > without["flops_per_device"]
    sizes = planning.Sizes(layers=2, model_dim=64, ffn_dim=128, heads=4, head_dim=16, seq=32, vocab=512,
                           mesh=(2, 2, 2), stages=2, microbatches=4, strategy="megatron", schedule=schedule)
    lowered = planning.plan("transformer", sizes).lowered
    data = [p for p in lowered.program.params if lowered.label(p).startswith("args[")]
    assert [(p.shape, p.dtype) for p in data] == [((4, 2, 32), np.int32)] * 2   # [microbatches, batch, seq] tokens
    table = next(p for p in lowered.program.params if lowered.label(p).endswith("['embedding']"))
    assert table.sharding.tiles[0] == 2                                # vocabulary over Y, as Megatron splits it


def test_vocab_is_refused_where_it_is_not_planned(capsys):
    assert "does not vary --vocab" in plan_error(capsys, "conformer", "--vocab", "512")


def test_flash_attention_holds_no_whole_score_matrix(capsys):
    """--attention flash: 512 queries at a time, each block recomputed in the backward
    pass; no [B, N, S, S] buffer at the peak, which is lower than dot_product's."""
    flags = ["transformer", "--layers", "2", "--model-dim", "64", "--ffn-dim", "128", "--heads", "4", "--head-dim",
             "16", "--seq", "2048", "--mesh", "2x4", "--batch", "8", "--top", "20"]
    plain = plan_json(capsys, *flags)
    flash = plan_json(capsys, *flags, "--attention", "flash")
    scores = lambda plan: [t for t in plan["largest_buffers_at_peak"] if t["shape"][-2:] == [2048, 2048]]  # noqa: E731
    assert scores(plain) and not scores(flash)
    assert flash["peak_memory_bytes"] < plain["peak_memory_bytes"] / 2
    assert flash["sizes"]["attention"] == "flash"


def test_dropout_draws_from_the_steps_key_and_communicates_nothing_more(capsys):
    """--dropout (Megatron-LM's GPT: 0.1): the step takes a key, each layer's masks are
    hashed where their shards live: the same collectives as without dropout."""
    flags = ["transformer", *SMALL, "--mesh", "2x4", "--batch", "8", "--strategy", "megatron", "--vocab", "512"]
    without = plan_json(capsys, *flags)
    out = plan_json(capsys, *flags, "--dropout", "0.1")
    assert out["sizes"]["dropout"] == 0.1 and "dropout 0.1" in out["model"]
    assert out["collectives"] == without["collectives"]
    sizes = planning.Sizes(layers=2, model_dim=64, ffn_dim=128, heads=4, head_dim=16, seq=32, batch=8, mesh=(2, 4),
                           dropout=0.1)
    lowered = planning.plan("transformer", sizes).lowered
    assert any(i.opcode == "threefry2x32" for i in lowered.spmd.all_instrs())
    assert lowered.label(lowered.program.params[-1]) == "args[4]"    # the key, after the activations and targets


def test_pipelined_dropout_draws_each_microbatchs_masks_and_communicates_nothing_more(capsys):
    """--dropout with --stages: pipeline_loss(key=...) gives each microbatch's layers their
    own keys (Megatron-LM's pipelined runs keep their dropout), rerun with the layer."""
    flags = ["transformer", *SMALL, "--mesh", "2x2x2", "--stages", "2", "--microbatches", "4", "--batch", "8",
             "--schedule", "1f1b", "--strategy", "megatron", "--vocab", "512", "--remat", "rerun"]
    without = plan_json(capsys, *flags)
    out = plan_json(capsys, *flags, "--dropout", "0.1")
    assert "dropout 0.1" in out["model"] and out["collectives"] == without["collectives"]
    assert out["flops_per_device"] > without["flops_per_device"]   # the masks' hashing, forward and rerun


def test_megatron_attention_writes_the_probabilities_between_its_kernels(capsys):
    """--attention megatron: the softmax a kernel of its own (Megatron-LM's fused
    scale-mask-softmax), so the dropout after it, which would fuse with it, reads the
    probabilities back from HBM: more compute time, the same FLOPs."""
    flags = ["transformer", *SMALL[:-2], "--seq", "512", "--mesh", "2x4", "--batch", "8", "--dropout", "0.1",
             "--hardware", "a100"]
    fused = plan_json(capsys, *flags)
    unfused = plan_json(capsys, *flags, "--attention", "megatron")
    assert unfused["flops_per_device"] == fused["flops_per_device"]
    assert unfused["compute_seconds"] > fused["compute_seconds"]


def test_microbatches_without_a_pipeline_accumulate_gradients(capsys):
    """--microbatches without --stages: gradient accumulation (run_table_1.sh's micro-batch
    size), one microbatch's activations at a time: a lower peak, the same FLOPs up to the
    accumulation's adds, the weights' gradients reduced across X once, after the loop."""
    flags = ["transformer", *SMALL, "--mesh", "2x4", "--batch", "16", "--strategy", "megatron", "--dropout", "0.1",
             "--remat", "nothing_saveable", "--optimizer", "adamw"]
    whole = plan_json(capsys, *flags)
    out = plan_json(capsys, *flags, "--microbatches", "4")
    assert "in 4 microbatches (gradient accumulation)" in out["model"]
    assert out["peak_memory_bytes"] < whole["peak_memory_bytes"]
    assert out["flops_per_device"] == pytest.approx(whole["flops_per_device"], rel=0.02)
    sizes = planning.Sizes(layers=2, model_dim=64, ffn_dim=128, heads=4, head_dim=16, seq=32, batch=16, mesh=(2, 4),
                           strategy="megatron", microbatches=4)
    spmd = planning.plan("transformer", sizes).lowered.spmd
    wq = (2, 64, 1, 16)   # [layers, M, N / Y, D]

    def reduced(program):
        return [i for i in program.instrs if i.opcode == "all-reduce" and i.output.shape == wq]
    assert len(reduced(spmd)) == 3                     # wq, wk, wv: once, after the loop
    assert not any(reduced(p) for p in spmd.subprograms() if p is not spmd)


def test_plan_rematerializes_as_little_as_fits_by_default(capsys):
    """Without --remat, gspmd plan takes the least recompute that fits (the README's
    2048-device Transformer does not fit without any) and says what it tried."""
    chosen = plan_json(capsys, "transformer", "--devices", "2048")
    assert chosen["fits_in_memory"] and chosen["sizes"]["remat"] == "dots_saveable"
    assert [t["remat"] for t in chosen["remat_tried"]] == [None, "dots_saveable"]
    assert chosen["remat_tried"][0]["peak_memory_bytes"] > chosen["peak_memory_bytes"]
    plain = plan_json(capsys, "transformer", "--devices", "2048", "--remat", "none")
    assert not plain["fits_in_memory"] and plain["remat_tried"] == [] and "remat" not in plain["sizes"]
    assert plain["peak_memory_bytes"] == chosen["remat_tried"][0]["peak_memory_bytes"]
    assert cli.main(["plan", "--devices", "2048", "--top", "0"]) == 0
    assert "remat: dots_saveable, the least recompute that fits" in capsys.readouterr().out


def test_plan_says_which_flags_fix_a_plan_that_cannot_fit(capsys):
    assert cli.main(["plan", "transformer", *SMALL, "--mesh", "2x4", "--batch", "8", "--hardware", "cpu",
                     "--top", "0"]) == 0
    assert "remat: none needed" in capsys.readouterr().out
    assert cli.main(["plan", "transformer", "--devices", "64", "--batch", "4096", "--top", "0"]) == 0
    out = capsys.readouterr().out
    assert "does NOT fit" in out and "even nothing_saveable does not fit" in out
    assert "--devices" in out and "--stages" in out and "--microbatches" in out


def test_remat_auto_passes_over_policies_the_schedule_refuses():
    tiny = dataclasses.replace(planning.profile("tpu-v3"), name="tiny", memory_bytes=1, reserved_bytes=0)
    sizes = planning.Sizes(layers=2, model_dim=64, ffn_dim=128, heads=4, head_dim=16, seq=32, mesh=(2, 2, 2),
                           schedule="1f1b", remat="auto")
    chosen = planning.plan("transformer", sizes, tiny)
    assert [policy for policy, _ in chosen.remat_tried] == [None, "nothing_saveable"]
    assert not chosen.report.fits_in_memory and chosen.case.sizes["remat"] == "nothing_saveable"
