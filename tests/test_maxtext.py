"""MaxText unchanged through gspmd.jit (issue 24): its own config system (pyconfig over
base.yml), its 12-axis mesh with data=2 x tensor=4, its model, AdamW and train step
(`get_functional_train_with_signature`'s function and in/out shardings), for the default
Llama-2 decoder and a Mixtral-style MoE decoder (megablox off on CPU: the dense matmul
path, and sparse_matmul's dropless ragged_dot path), unrolled and scanned; the step
equals jax.jit of the same function with the same shardings, and explain() names
MaxText's logical axes (embed, mlp, ...) of its parameters. Its train loop itself runs
with gspmd.jit in place of the jax.jit it calls. Slow: MaxText's other decoders
(Gemma, Qwen3, GPT-3, OLMo 3, DeepSeek, ...), its megablox kernels, and its expert
parallelism (ragged_all_to_all, which jax.jit cannot run on CPU: against the same step
with the experts over fsdp).

And `gspmd plan examples/maxtext_plan.py:make` plans the same step on abstract inputs
for more devices than this process has (test_plans_the_step_for_devices_this_process_has_not).

MaxText needs Python >= 3.12 (the test extra installs it there); elsewhere these tests
skip. A train step costs about 30 s to compile under each of jax.jit and gspmd.jit on
CPU, so only MaxText's default configuration (Llama-2, scanned layers) runs by default;
the others are marked slow (`pytest -m slow tests/test_maxtext.py`).
"""
from __future__ import annotations

import contextlib
import os
import types
from collections import Counter
from pathlib import Path

import jax
import numpy as np
import pytest

pytest.importorskip("maxtext.trainers.pre_train.train",
                    reason="MaxText (Python >= 3.12, installed by the test extra there) is not importable")

from flax import nnx                                              # noqa: E402
from flax.linen import partitioning as nn_partitioning            # noqa: E402
from maxtext.configs import pyconfig                              # noqa: E402
from maxtext.trainers.pre_train import train                      # noqa: E402
from maxtext.utils import max_utils, maxtext_utils, sharding, train_utils    # noqa: E402
from maxtext.utils.globals import MAXTEXT_CONFIGS_DIR             # noqa: E402

import gspmd                                                      # noqa: E402
from gspmd import planning                                        # noqa: E402

TINY = dict(base_emb_dim=32, base_num_query_heads=4, base_num_kv_heads=4, base_mlp_dim=64, head_dim=8,
            base_num_decoder_layers=2, vocab_size=128, per_device_batch_size=1, max_target_length=16,
            dataset_type="synthetic", enable_checkpointing=False, attention="dot_product", dtype="float32",
            enable_dropout=False, ici_data_parallelism=2, ici_tensor_parallelism=4, hardware="cpu", steps=1,
            skip_jax_distributed_system=True, enable_goodput_recording=False, run_name="gspmd")
MOE = dict(decoder_block="mixtral", num_experts=4, num_experts_per_tok=2, base_moe_mlp_dim=64, megablox=False)
MLA = dict(attention_type="mla", q_lora_rank=0, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
           v_head_dim=8)
DECODERS = {"llama2": dict(decoder_block="llama2"),
            "mixtral": dict(MOE, sparse_matmul=False),
            "mixtral-dropless": dict(MOE, sparse_matmul=True),
            # MaxText's other decoders, as a user would switch to them
            **{name: dict(decoder_block=name) for name in ("mistral", "gemma", "gemma2", "qwen3", "gpt3", "olmo3")},
            "gemma3": dict(decoder_block="gemma3", model_name="gemma3-4b", override_model_config=True),
            "qwen3-moe": dict(MOE, decoder_block="qwen3_moe", sparse_matmul=True),
            "deepseek": dict(MOE, **MLA, decoder_block="deepseek", sparse_matmul=True, first_num_dense_layers=1,
                             shared_experts=1),
            # the grouped matmuls as Pallas kernels (interpret mode off TPU), inside MaxText's shard_map
            "mixtral-megablox": dict(MOE, sparse_matmul=True, megablox=True),
            # MaxText's circular pipeline (its stages vmapped, a shifting buffer between them:
            # the paper's 3.3), 2 stages x 2 repeats of one layer, 4 microbatches
            "llama2-pipeline": dict(decoder_block="llama2", ici_data_parallelism=1, ici_pipeline_parallelism=2,
                                    num_pipeline_microbatches=4, num_pipeline_repeats=2, base_num_decoder_layers=4,
                                    per_device_batch_size=4),
            "llama2-explicit": dict(decoder_block="llama2", shard_mode="explicit"),   # jax's Explicit axes
            # expert parallelism (tokens sent to their experts' devices by ragged_all_to_all),
            # and the same model's experts split over fsdp instead
            "mixtral-ep": dict(MOE, sparse_matmul=True, ici_expert_parallelism=4, ici_tensor_parallelism=1),
            "mixtral-fsdp": dict(MOE, sparse_matmul=True, ici_fsdp_parallelism=4, ici_tensor_parallelism=1),
            "gpt-oss": dict(MOE, decoder_block="gpt_oss", sparse_matmul=True, megablox=True)}
slow = pytest.mark.slow


class Step:
    """MaxText's train step for one configuration, as its train loop builds it."""

    def __init__(self, decoder: str, scan_layers: bool, output_dir: str):
        overrides = {**TINY, **DECODERS[decoder], "scan_layers": scan_layers,
                     "base_output_directory": output_dir}
        self.config = pyconfig.initialize(["", os.path.join(MAXTEXT_CONFIGS_DIR, "base.yml")]
                                          + [f"{k}={v}" for k, v in overrides.items()])
        _, _, shardings, _, self.mesh, _, data, _, _, _, state = train_utils.setup_train_loop(self.config, None)
        model, self.state = nnx.split(state)
        params_shardings, shardings = sharding.maybe_update_params_sharding_with_opt(self.config, shardings)
        self.fn, self.in_shardings, self.out_shardings, _, _ = maxtext_utils.get_functional_train_with_signature(
            train.train_step, sharding.get_input_data_sharding(self.config, self.mesh), shardings, model,
            self.config, params_shardings)
        self.batch = next(data)

    @contextlib.contextmanager
    def context(self):
        """MaxText's train loop runs its step under its mesh and logical axis rules."""
        with jax.set_mesh(self.mesh), nn_partitioning.axis_rules(self.config.logical_axis_rules):
            yield

    def run(self, jit):
        with self.context():
            return jit(self.fn, in_shardings=self.in_shardings, out_shardings=self.out_shardings)(self.state,
                                                                                               self.batch)


def _numbers(x) -> np.ndarray:
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x, np.float64)


def assert_same_step(got, want) -> None:
    """New train state (params, AdamW moments, step, rngs) and loss as jax.jit's, up to
    float reassociation."""
    (got_state, got_metrics), (want_state, want_metrics) = got, want
    np.testing.assert_allclose(_numbers(got_metrics["scalar"]["learning/loss"]),
                               _numbers(want_metrics["scalar"]["learning/loss"]), rtol=1e-5)
    assert_same_state(got_state, want_state)


def assert_same_state(got, want) -> None:
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(want)[0]]
    assert len(jax.tree.leaves(got)) == len(paths)
    for path, g, w in zip(paths, jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(_numbers(g), _numbers(w), rtol=1e-4, atol=1e-6, err_msg=path)


def through_gspmd(step: Step, backend: str) -> tuple:
    """The step's results through gspmd.jit, and its Lowered."""
    partitioned = []

    def gspmd_jit(fn, **kw):
        partitioned.append(gspmd.jit(fn, mesh=step.mesh, backend=backend, **kw))
        return partitioned[-1]
    got = step.run(gspmd_jit)
    with step.context():
        return got, partitioned[0].lower(step.state, step.batch)   # cached: no second trace


def check(decoder: str, scan_layers: bool, backend: str, tmp_path) -> gspmd.Lowered:
    step = Step(decoder, scan_layers, str(tmp_path))
    want = step.run(jax.jit)
    got, lowered = through_gspmd(step, backend)
    assert_same_step(got, want)
    counts = Counter(c.kind for c in lowered.report().collectives)
    # data parallelism sums gradients, tensor parallelism the contractions over split features
    assert counts["all-reduce"] + counts["reduce-scatter"] > 0, counts
    return lowered


def test_llama2_scanned_jax_backend(tmp_path):
    """MaxText's default: Llama-2 decoder, layers under one scan."""
    lowered = check("llama2", True, "jax", tmp_path)
    kernel = lowered.explain("state['model']['decoder']['layers']['mlp']['wi_0']['kernel'].value")
    assert "logical axes ('embed', 'layers', 'mlp')" in kernel, kernel
    # MaxText's train loop compiles its step ahead of time and logs its memory analysis
    stats = lowered.compile(compiler_options=max_utils.parse_libtpu_flags_to_dict("")).memory_analysis()
    max_utils.print_compiled_memory_stats(stats)
    assert stats.argument_size_in_bytes > 0 and stats.temp_size_in_bytes > 0


@pytest.mark.parametrize("decoder, backend", [
    ("llama2", "jax"), pytest.param("llama2", "sim", marks=slow), pytest.param("mixtral-dropless", "jax", marks=slow)])
def test_maxtexts_own_train_loop_with_gspmd_jit(decoder, backend, tmp_path, monkeypatch):
    """MaxText's train loop itself (train.train_loop: setup, its step compiled ahead of
    time and its memory analysis logged, 3 steps with metrics), run once as it is and
    once with gspmd.jit where it calls jax.jit for its train and eval steps: the same
    final state."""
    def config(out: str):
        overrides = {**TINY, **DECODERS[decoder], "scan_layers": True, "base_output_directory": out, "steps": 3}
        return pyconfig.initialize(["", os.path.join(MAXTEXT_CONFIGS_DIR, "base.yml")]
                                   + [f"{k}={v}" for k, v in overrides.items()])
    want = train.train_loop(config(str(tmp_path / "jax")), None)
    made = []

    class JaxWithGspmdJit(types.ModuleType):
        def __getattr__(self, name):
            return getattr(jax, name)

        @staticmethod
        def jit(fn, **kw):
            made.append(gspmd.jit(fn, backend=backend, **kw))
            return made[-1]
    monkeypatch.setattr(train_utils, "jax", JaxWithGspmdJit("jax"))
    assert_same_state(train.train_loop(config(str(tmp_path / "gspmd")), None), want)
    assert made and made[0]._cache      # its train step lowered through gspmd


@slow
@pytest.mark.parametrize("decoder, scan_layers, backend", [
    ("llama2", False, "jax"), ("mixtral", False, "jax"), ("mixtral-dropless", True, "jax"), ("llama2", False, "sim"),
    ("llama2-pipeline", True, "jax"), ("llama2-pipeline", True, "sim"), ("llama2-explicit", True, "jax")])
def test_other_decoders_and_backends(decoder, scan_layers, backend, tmp_path):
    lowered = check(decoder, scan_layers, backend, tmp_path)
    if decoder == "llama2-pipeline":     # the shifting buffer: each stage's output to the next stage
        assert "collective-permute" in {c.kind for c in lowered.report().collectives}


@slow
@pytest.mark.parametrize("decoder, backend", [
    *[(name, "jax") for name in ("mistral", "gemma", "gemma2", "gemma3", "qwen3", "gpt3", "olmo3", "qwen3-moe",
                                 "deepseek", "mixtral-megablox", "gpt-oss")],
    ("gemma3", "sim"), ("deepseek", "sim")])
def test_maxtexts_other_decoders(decoder, backend, tmp_path):
    """Gemma 1-3 (soft-capping, local/global attention), Qwen3 and Qwen3-MoE, GPT-3,
    OLMo 3, DeepSeek (MLA attention, shared experts, a dense first layer) and MoEs on
    megablox kernels (GPT-OSS, Mixtral): each scanned, as MaxText runs them."""
    check(decoder, True, backend, tmp_path)


def test_plans_flash_attention_as_maxtext_runs_it_on_tpu(monkeypatch):
    """attention=flash on a TPU profile (every published v5p script): MaxText runs its
    splash attention kernel (Pallas, in a shard_map), which the plan holds as kernels of
    their own, with no [B, N, S, S] scores (the dot_product plan of the step holds them)."""
    example = Path(__file__).resolve().parents[1] / "examples" / "maxtext_plan.py"
    sizes = dict(TINY, base_emb_dim=512, head_dim=128, base_num_query_heads=4, base_num_kv_heads=4,
                 base_mlp_dim=256, max_target_length=1024)
    peaks = {}
    for attention in ("dot_product", "flash"):
        monkeypatch.setenv("MAXTEXT_OVERRIDES", " ".join(f"{k}={v}" for k, v in dict(sizes, attention=attention).items()))
        result = planning.plan(f"{example}:make", planning.Sizes(devices=32), "tpu-v5p")
        kernels = [i for i in result.lowered.spmd.all_instrs() if i.opcode == "pallas-call"]
        assert bool(kernels) == (attention == "flash") and result.report.step_seconds > 0
        peaks[attention] = result.report.peak_memory_bytes
    assert peaks["flash"] < peaks["dot_product"], peaks


@pytest.mark.parametrize("experts_over", [{}, dict(ici_expert_parallelism=4, ici_tensor_parallelism=1)])
def test_plans_a_mixture_of_experts_with_its_grouped_matmul_kernels_on_tpu(monkeypatch, experts_over):
    """MaxText's default MoE path (sparse_matmul with megablox) runs grouped matmuls as
    Pallas kernels on a TPU: a tpu-v5p plan holds them as kernels; with expert
    parallelism, tokens travel to their experts by ragged all-to-alls."""
    example = Path(__file__).resolve().parents[1] / "examples" / "maxtext_plan.py"
    sizes = {**TINY, **MOE, "base_emb_dim": 512, "head_dim": 128, "base_num_query_heads": 4, "base_num_kv_heads": 4,
             "base_moe_mlp_dim": 512, "base_mlp_dim": 512, "max_target_length": 1024, **experts_over}
    monkeypatch.setenv("MAXTEXT_OVERRIDES", " ".join(f"{k}={v}" for k, v in dict(sizes, megablox=True).items()))
    result = planning.plan(f"{example}:make", planning.Sizes(devices=32), "tpu-v5p")
    assert [i for i in result.lowered.spmd.all_instrs() if i.opcode == "pallas-call"]
    assert result.report.fits_in_memory and result.report.step_seconds > 0
    ragged = [c for c in result.report.collectives if c.kind == "ragged-all-to-all"]
    assert bool(ragged) == bool(experts_over) and all(len(c.groups[0]) == 4 for c in ragged)


def test_plans_the_step_for_devices_this_process_has_not(monkeypatch):
    """`gspmd plan examples/maxtext_plan.py:make --devices 32 --hardware tpu-v5p` with the
    tiny config as MAXTEXT_OVERRIDES: MaxText's own step and abstract train state over
    32 stand-in devices (data 2 x fsdp 4 x tensor 4), the state donated."""
    monkeypatch.setenv("MAXTEXT_OVERRIDES", " ".join(f"{k}={v}" for k, v in TINY.items()))
    example = Path(__file__).resolve().parents[1] / "examples" / "maxtext_plan.py"
    result = planning.plan(f"{example}:make", planning.Sizes(devices=32), "tpu-v5p")
    mesh = result.lowered.mesh
    assert result.lowered.num_devices == 32 and {a: s for a, s in zip(mesh.axis_names, mesh.shape) if s > 1} == \
        {"data": 2, "fsdp": 4, "tensor": 4}
    counts = Counter(c.kind for c in result.report.collectives)
    # FSDP gathers the weights per layer and scatters their gradients back
    assert counts["all-gather"] > 0 and counts["reduce-scatter"] > 0, counts
    assert result.report.fits_in_memory and result.report.memory.aliased_bytes > 0
    kernel = result.lowered.explain("state['model']['decoder']['layers']['mlp']['wi_0']['kernel'].value")
    assert "logical axes ('embed', 'layers', 'mlp')" in kernel, kernel


@slow
@pytest.mark.parametrize("backend", ["jax", "sim"])
def test_expert_parallel_moe_equals_the_step_without(backend, tmp_path):
    """MaxText's expert parallelism (ici_expert_parallelism=4): its dropless MoE sends each
    token to its experts' devices with ragged_all_to_all, which XLA:CPU lacks (jax.jit
    cannot run the step here); it equals the same model's step with the experts over
    fsdp, under jax.jit."""
    want = Step("mixtral-fsdp", True, str(tmp_path / "fsdp")).run(jax.jit)
    got, lowered = through_gspmd(Step("mixtral-ep", True, str(tmp_path / "ep")), backend)
    assert_same_step(got, want)
    kinds = Counter(c.kind for c in lowered.report().collectives)
    assert kinds["ragged-all-to-all"] >= 2, kinds     # tokens out to their experts and back


def test_searches_maxtexts_own_knobs_never_worse_than_its_defaults():
    """examples/maxtext_plan.py's search: MaxText's ici_fsdp/ici_tensor parallelism and
    remat_policy for the tiny model over 32 devices, ranked by the Transformer recipe of
    the same model and planned with MaxText's own step; the choice fits and is no
    slower than MaxText's defaults, which are planned beside it."""
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import maxtext_plan
    tiny = {k: v for k, v in TINY.items() if k not in ("ici_data_parallelism", "ici_tensor_parallelism", "hardware")}
    best, plans = maxtext_plan.search(32, "tpu-v5p", budget_s=10, verify=1, **tiny)
    assert len(plans) == 2 and set(plans[1].knobs) >= set(maxtext_plan.KNOBS)
    assert best.report.fits_in_memory and best.report.step_seconds <= plans[0].report.step_seconds
    assert plans[1].knobs["ici_fsdp_parallelism"] * plans[1].knobs["ici_tensor_parallelism"] == 32
