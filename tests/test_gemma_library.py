"""The `gemma` library's transformer (Google DeepMind's Gemma 3 in flax linen: sliding
and global attention layers, QK norm, gated MLP, tied embedding) through gspmd.jit,
Megatron-style over a data x model mesh, equal to jax.jit (issue 24: real libraries a
user brings).

Not in the test extra: `gemma` imports kauldron, whose metric writers import TensorFlow
(clu), so it skips unless a user has installed it (`pip install gemma`; the run recorded
in benchmarks/RESULTS.md used gemma 4.0.1 with jax 0.10.2)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import gspmd
from gspmd.frontend.annotation import unpartitioned
from util import assert_close

try:
    from gemma import gm
    gm.nn.Transformer   # noqa: B018 (gemma's imports are lazy: this runs them)
except ImportError as missing:
    pytest.skip(f"the gemma library is not importable here ({missing}); `pip install gemma` "
                "(it needs TensorFlow through kauldron)", allow_module_level=True)

MESH = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))

# Heads and the MLP's hidden dim over "model" (2 key/value heads over 4: uneven).
SPLITS = {"q_einsum": P("model"), "kv_einsum": P(None, "model"), "attn_vec_einsum": P("model"),
          "gating_einsum": P(None, "model"), "linear": P("model")}


def tiny_gemma3() -> "gm.nn.Transformer":
    layers = (gm.nn.AttentionType.LOCAL_SLIDING, gm.nn.AttentionType.GLOBAL)
    config = dataclasses.replace(gm.nn.Gemma3_270M.config, num_embed=128, embed_dim=32, hidden_dim=64,
                                 num_heads=4, head_dim=8, num_kv_heads=2, sliding_window_size=4,
                                 attention_types=layers)
    return gm.nn.Transformer(config=config)


def layout_of(path, _) -> P:
    return next((spec for name, spec in SPLITS.items() if name in jax.tree_util.keystr(path)), P())


def test_gemma3_train_step_tensor_and_data_parallel():
    model = tiny_gemma3()
    tokens = np.random.default_rng(0).integers(1, 128, (5, 16)).astype(np.int32)   # 5 over data=2
    params = jax.tree.map(lambda a: a.astype(jnp.float32), model.init(jax.random.key(0), tokens)["params"])

    def step(params, tokens):
        def loss(params):
            logits = model.apply({"params": params}, tokens).logits
            return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), tokens[:, 1:, None], -1))
        value, grads = jax.value_and_grad(loss)(params)
        return value, jax.tree.map(lambda w, g: w - 0.1 * g, params, grads)

    in_shardings = (jax.tree_util.tree_map_with_path(layout_of, params), P("data"))
    with unpartitioned():
        expected = jax.jit(step)(params, tokens)
    for backend in ("jax", "sim"):
        partitioned = gspmd.jit(step, mesh=MESH, backend=backend, in_shardings=in_shardings)
        assert_close(partitioned(params, tokens), expected)
    groups = {c.groups for c in partitioned.lower(params, tokens).report().collectives if c.kind == "all-reduce"}
    assert ((0, 4), (1, 5), (2, 6), (3, 7)) in groups   # gradients over "data"
    assert ((0, 1, 2, 3), (4, 5, 6, 7)) in groups       # partial sums over "model"
