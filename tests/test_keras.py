"""Keras 3 models on the JAX backend, as their users train them (issue 24: real libraries a
user brings): keras-hub backbones placed by their own layout maps under
keras.distribution.ModelParallel, and a Keras model stepped by its own optimizer's
stateless_apply, through gspmd.jit on both backends, equal to jax.jit.

keras-hub is installed without its dependencies (README's test command): its one
TensorFlow dependency, tensorflow-text, serves only its string preprocessing layers."""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

os.environ.setdefault("KERAS_BACKEND", "jax")   # before keras is imported
keras = pytest.importorskip("keras")
if keras.backend.backend() != "jax":
    pytest.skip(f"Keras runs on its {keras.backend.backend()} backend here (KERAS_BACKEND)",
                allow_module_level=True)

import gspmd  # noqa: E402
from gspmd.frontend.annotation import unpartitioned  # noqa: E402
from test_libraries import SMALL, keras_backbone_step, keras_step  # noqa: E402
from util import assert_close  # noqa: E402


def device_mesh() -> "keras.distribution.DeviceMesh":
    return keras.distribution.DeviceMesh((2, 4), ["batch", "model"], keras.distribution.list_devices())


def collective_groups(lowered: gspmd.Lowered, kind: str) -> set:
    return {c.groups for c in lowered.report().collectives if c.kind == kind}


BATCH_GROUPS = ((0, 4), (1, 5), (2, 6), (3, 7))   # devices that differ along "batch" only
MODEL_GROUPS = ((0, 1, 2, 3), (4, 5, 6, 7))       # ... along "model" only


def check_backbone(backbone_class, batch: int, **config) -> gspmd.Lowered:
    """The backbone's SGD step as test_libraries.keras_backbone_step builds it (under its
    own layout map, or data parallel), by gspmd.jit on the keras mesh on both backends."""
    return check_step(*keras_backbone_step(backbone_class, batch, **config))


def check_step(step, args) -> gspmd.Lowered:
    expected = jax.jit(step)(*args)
    mesh = device_mesh().backend_mesh
    for backend in ("jax", "sim"):
        partitioned = gspmd.jit(step, mesh=mesh, backend=backend)
        assert_close(partitioned(*args), expected)
    return partitioned.lower(*args)


def keras_hub_models():
    return pytest.importorskip("keras_hub", reason="install keras-hub (README's test command: --no-deps)").models


def test_llama_backbone_with_its_layout_map():
    """The step of benchmarks/bench_first_call.py's case lib:keras:small."""
    keras_hub_models()
    lowered = check_step(*keras_step(SMALL))
    # Data parallel: weight gradients summed over "batch"; tensor parallel (the layout
    # map splits heads and the MLP over "model"): partial sums over "model".
    assert BATCH_GROUPS in collective_groups(lowered, "all-reduce")
    assert MODEL_GROUPS in collective_groups(lowered, "all-reduce")


def test_llama_backbone_results_lie_as_xla_lays_them():
    """The anchor for layouts is XLA's GSPMD propagation: under it, jax.jit's results lie
    as ours. Shardy (jax's default partitioner) returns two of the 21 (a layer-norm scale
    per layer, 64 floats, whose gradient comes split over "batch" from the embedding's
    layout) replicated instead; the values are equal either way."""
    keras_hub_models()
    from jax._src import config
    if not hasattr(config, "use_shardy_partitioner"):
        pytest.skip("this jax has no GSPMD propagation to compare with")
    step, args = keras_step(SMALL)
    with config.use_shardy_partitioner(False):
        expected = jax.jit(step)(*args)
    ours = gspmd.jit(step, backend="jax")(*args)
    for mine, theirs in zip(jax.tree.leaves(ours), jax.tree.leaves(expected)):
        assert mine.sharding.is_equivalent_to(theirs.sharding, mine.ndim), (mine.sharding, theirs.sharding)


def test_gemma_backbone_uneven_batch():
    """3 sequences over batch=2 divide unevenly (the variables must divide: jax places
    them, keras's layout map splits them)."""
    lowered = check_backbone(keras_hub_models().GemmaBackbone, batch=3, vocabulary_size=128, num_layers=1,
                             num_query_heads=4, num_key_value_heads=4, hidden_dim=32, intermediate_dim=64,
                             head_dim=8)
    assert BATCH_GROUPS in collective_groups(lowered, "all-reduce")


@pytest.mark.slow
@pytest.mark.parametrize("backbone, config", [
    ("MistralBackbone", dict(num_query_heads=4, num_key_value_heads=2)),
    ("Gemma3Backbone", dict(num_query_heads=4, num_key_value_heads=2, head_dim=8, image_size=16,
                            vision_encoder=None)),
    ("Qwen3Backbone", dict(num_query_heads=4, num_key_value_heads=2, head_dim=8)),
    ("QwenMoeBackbone", dict(num_query_heads=4, num_key_value_heads=2, moe_intermediate_dim=32,
                             shared_expert_intermediate_dim=32, num_experts=4, top_k=2)),
    ("MixtralBackbone", dict(num_query_heads=4, num_key_value_heads=2, num_experts=4, top_k=2)),
    ("Phi3Backbone", dict(num_query_heads=4, num_key_value_heads=2)),
    ("GPT2Backbone", dict(num_heads=4, max_sequence_length=32)),
    ("FalconBackbone", dict(num_attention_heads=4)),
    ("OPTBackbone", dict(num_heads=4, max_sequence_length=32)),
    # encoders (bidirectional attention; BERT and ALBERT take segment ids, and return a
    # pooled output besides the sequence's)
    ("BertBackbone", dict(num_heads=4, max_sequence_length=32)),
    ("RobertaBackbone", dict(num_heads=4, max_sequence_length=32)),
    ("XLMRobertaBackbone", dict(num_heads=4, max_sequence_length=32)),
    ("DistilBertBackbone", dict(num_heads=4, max_sequence_length=32)),
    ("AlbertBackbone", dict(num_heads=4, embedding_dim=16, max_sequence_length=32)),
    ("DebertaV3Backbone", dict(num_heads=4, max_sequence_length=32))])
def test_other_keras_hub_backbones(backbone, config):
    """Decoders and encoders a keras-hub user switches to: those with a layout map under
    it, the others data parallel (their variables replicated, the batch split)."""
    lowered = check_backbone(getattr(keras_hub_models(), backbone), batch=4, vocabulary_size=128, num_layers=2,
                             hidden_dim=32, intermediate_dim=64, **config)
    assert BATCH_GROUPS in collective_groups(lowered, "all-reduce")


def test_keras_model_stepped_by_its_optimizer():
    """What Keras's own JAX trainer does: stateless_call, grads, optimizer.stateless_apply
    (AdamW: its moments and iteration count are state), inputs split over "batch" and the
    hidden layer over "model" by gspmd annotations."""
    mesh = device_mesh().backend_mesh
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, activation="gelu"),
                              keras.layers.LayerNormalization(), keras.layers.Dense(8)])
    optimizer = keras.optimizers.AdamW(learning_rate=1e-2)
    optimizer.build(model.trainable_variables)
    state = ([v.value for v in model.trainable_variables], [v.value for v in model.non_trainable_variables],
             [v.value for v in optimizer.variables])

    def step(state, x, y):
        trainable, non_trainable, optimizer_state = state

        def loss(trainable):
            x_split = gspmd.mesh_split(x, mesh, ("batch", None))
            out, _ = model.stateless_call(trainable, non_trainable, x_split)
            return jnp.mean(jnp.square(out - y))
        value, grads = jax.value_and_grad(loss)(trainable)
        grads[0] = gspmd.mesh_split(grads[0], mesh, (None, "model"))   # the hidden layer's kernel
        trainable, optimizer_state = optimizer.stateless_apply(optimizer_state, grads, trainable)
        return value, (trainable, non_trainable, optimizer_state)

    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(10, 16)).astype(np.float32), rng.normal(size=(10, 8)).astype(np.float32)
    with unpartitioned():
        expected = jax.jit(step)(state, x, y)
    for backend in ("jax", "sim"):
        partitioned = gspmd.jit(step, mesh=mesh, backend=backend)
        assert_close(partitioned(state, x, y), expected)
    assert BATCH_GROUPS in collective_groups(partitioned.lower(state, x, y), "all-reduce")
