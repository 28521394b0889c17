"""`gspmd plan MODEL --auto`: the training configuration searched (mesh, strategy, pipeline,
schedule, microbatches, remat), the flags it prints reproducing its plan, never slower
than a hand configuration of the same model."""
import json

import pytest

from gspmd import cli, plan_search, planning

SMALL = dict(layers=4, model_dim=64, ffn_dim=256, heads=4, head_dim=16, seq=32, batch=16)
FLAGS = [f"--{k.replace('_', '-')}={v}" for k, v in SMALL.items()]


@pytest.fixture(scope="module")
def found():
    return plan_search.search("transformer", planning.Sizes(**SMALL), 4, "a100", budget_s=600.0, max_plans=4)


def test_the_search_partitions_the_best_candidates_and_explains_its_choice(found):
    assert found.considered > 20 and len(found.verified) >= 3
    assert found.considered == (found.pruned_by_memory + found.pruned_by_bound + found.unexplored
                                + len(found.verified) + found.refused)
    best = found.chosen.plan.report
    assert best.fits_in_memory
    assert all(best.step_seconds <= c.plan.report.step_seconds for c in found.verified if c.plan.report.fits_in_memory)
    for runner_up in found.runners_up():
        assert runner_up["slower"] >= 0 or not runner_up["fits_in_memory"]
        assert "ms" in runner_up["why"]
    text = found.explain()
    assert text.startswith(f"searched {found.considered} configurations") and "gspmd plan transformer --mesh" in text
    # every candidate's lower bound is below what partitioning it found
    assert all(c.lower_bound_s <= c.plan.report.step_seconds * (1 + 1e-9) for c in found.verified)


def test_its_flags_reproduce_its_plan(found, capsys):
    configuration = found.configuration()
    assert set(configuration) >= {"mesh", "remat"} and configuration["remat"] in ("none", *planning.FIT_ORDER[1:])
    flags = [f"--{k}={v}" for k, v in configuration.items()]
    assert cli.main(["plan", "transformer", *FLAGS, *flags, "--hardware", "a100", "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["step_seconds"] == pytest.approx(found.chosen.plan.report.step_seconds, rel=1e-9)


@pytest.mark.parametrize("hand", [dict(mesh=(4, 1), strategy="megatron"), dict(mesh=(2, 2), strategy="2d"),
                                  dict(mesh=(2, 2, 1), stages=2, microbatches=4, schedule="gpipe",
                                       strategy="megatron")])
def test_never_slower_than_a_hand_configuration(found, hand):
    typed = planning.plan_to_fit("transformer", planning.Sizes(**SMALL, **hand), "a100")
    assert found.chosen.plan.report.step_seconds <= typed.report.step_seconds * (1 + 1e-9)


def test_what_is_given_is_kept():
    kept = plan_search.search("transformer", planning.Sizes(**SMALL, strategy="megatron", stages=2), 4, "a100",
                              budget_s=600.0, max_plans=3)
    assert all(c.config.strategy == "megatron" and c.config.stages == 2 for c in kept.verified)
    assert kept.configuration()["stages"] == 2 and kept.configuration()["mesh"].startswith("2x")


def test_the_command_line(capsys):
    assert cli.main(["plan", "transformer", *FLAGS, "--auto", "--devices", "4", "--hardware", "a100",
                     "--budget", "0", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"configuration", "search_seconds", "candidates", "runners_up", "step_seconds"} <= set(out)
    assert out["devices"] == 4
    assert cli.main(["plan", "transformer", *FLAGS, "--auto", "--devices", "4", "--hardware", "a100",
                     "--budget", "0", "--top", "0"]) == 0
    assert "chose mesh" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["plan", "transformer", "--auto"])
    assert "--auto needs --devices" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["plan", "examples/llama.py:make", "--auto", "--devices", "8"])
    assert "gspmd auto" in capsys.readouterr().err


@pytest.mark.parametrize("model, sizes, shapes", [
    ("moe", dict(experts=8, layers=2, model_dim=64, ffn_dim=128, heads=4, head_dim=16, seq=32, batch=16), {(8,)}),
    ("conformer", dict(layers=4, model_dim=64, ffn_dim=128, heads=4, head_dim=16, seq=32, batch=16),
     {(1, 8), (2, 4), (4, 2)})])   # (8 stages would not divide 4 layers)
def test_each_recipe_searches_the_meshes_it_takes(model, sizes, shapes):
    """A 1-D expert mesh for the MoE; stages over the first axis always for the Conformer,
    whose recipe is a pipeline (one stage included)."""
    configs = list(plan_search.configurations(planning.MODELS[model].defaults, planning.Sizes(**sizes), 8))
    assert {c.mesh for c in configs} == shapes
    if model == "conformer":
        assert all(c.stages == c.mesh[0] and c.x == c.mesh[1] and c.y == 1 for c in configs)
    found = plan_search.search(model, planning.Sizes(**sizes), 8, "tpu-v3", budget_s=600.0, max_plans=3)
    assert found.chosen.plan.report.fits_in_memory and found.chosen.plan.case.mesh.size == 8


def test_no_plan_starts_that_would_end_past_the_budget():
    """A budget too small for a second plan: the first is still partitioned (there is an
    answer), and nothing after it; every candidate is accounted for."""
    found = plan_search.search("transformer", planning.Sizes(**SMALL), 4, "a100", budget_s=0.0)
    assert len(found.verified) == 1 and found.unexplored > 0 and found.chosen.plan is not None


def test_candidates_expected_not_to_fit_go_last():
    """Memory calibrated by the plans so far: a candidate whose every policy is expected
    to overflow is ordered after one expected to fit, whatever its estimate; and
    plan_to_fit is handed only the policies expected to fit."""
    config, policies = plan_search.Config((4, 1)), [None, "nothing_saveable"]
    fast = plan_search.Candidate(config, 1.0, 1.0, 1.0, policies, {None: 10.0, "nothing_saveable": 8.0})
    slow = plan_search.Candidate(config, 2.0, 2.0, 1.0, policies, {None: 5.0, "nothing_saveable": 4.0})
    calibration = plan_search._Calibration([], usable_bytes=6.0)
    assert calibration.may_fit(slow) == policies and calibration.may_fit(fast) == ["nothing_saveable"]
    assert min([fast, slow], key=calibration.order) is slow
    assert min([fast, slow], key=plan_search._Calibration([], usable_bytes=20.0).order) is fast
