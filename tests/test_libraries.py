"""Train steps of libraries nobody here wrote, as their users write them (issue 46): each
through gspmd.jit on both backends, equal to jax.jit in values and result layouts, over a
data 2 x tensor 4 mesh whose layouts come from the arguments' committed shardings (as a
user places them with the library's own helpers). benchmarks/bench_first_call.py times
their first calls (cases `lib:penzai`, `lib:jraph`, `:small` for this size) from the builders here.

- penzai 0.2.5: its Llama-like transformer with its layer stack (`use_layer_stack`: the
  blocks under one scan), named axes placed by penzai's `name_to_name_device_put`,
  trained by its trainer's recipe (unbound model, frozen parameter values, optax.adamw).
- jraph 0.0.6.dev0: a two-layer GCN (`jraph.GraphConvolution`, symmetric normalisation,
  self edges) on one graph, nodes over "data" and features over "tensor", node
  classification by softmax cross-entropy, optax.adam.

Not here, because they do not install beside jax 0.10.2 (benchmarks/RESULTS.md, "First
calls on real libraries"): Levanter 1.1 (its haliax imports `jax._src.tree_util.
BuiltInKeyEntry`, gone from jax), EasyDeL 0.3.0 (pins flax 0.12.3 and transformers 5.5,
and its import needs PyTorch), recurrentgemma 1.0.1 (numpy < 2.4, absl-py < 2)."""
from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import gspmd
from util import assert_close

MESH_SHAPE, MESH_AXES = (2, 4), ("data", "tensor")


def jax_mesh() -> jax.sharding.Mesh:
    return jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(MESH_SHAPE), MESH_AXES)


@dataclasses.dataclass(frozen=True)
class Size:
    """One size of every library's step: the tests' small one, the benchmark's larger."""
    layers: int = 2
    d_model: int = 64
    heads: int = 4
    hidden: int = 128
    vocab: int = 128
    batch: int = 8
    seq: int = 16
    nodes: int = 60            # jraph: a graph whose nodes do not divide the mesh
    edges: int = 240
    classes: int = 8


SMALL = Size()
# Levanter's configuration in issue 46: 4 layers, d=256, seq 128, batch 16.
BENCHMARK = Size(layers=4, d_model=256, hidden=1024, vocab=1024, batch=16, seq=128,
                 nodes=2000, edges=16000, classes=16)


# -- penzai --------------------------------------------------------------------------------
def penzai_step(size: Size = SMALL) -> tuple[Callable, tuple]:
    """A penzai Llama-like transformer (blocks in its LayerStack) and one adamw step of it:
    the step and its arguments, placed by penzai's axis-name helper."""
    from penzai import pz
    from penzai.models.transformer.variants import llamalike_common as llamalike
    from penzai.toolshed import sharding_util

    config = llamalike.LlamalikeTransformerConfig(
        num_kv_heads=size.heads, query_head_multiplier=1, embedding_dim=size.d_model,
        projection_dim=size.d_model // size.heads, mlp_hidden_dim=size.hidden,
        num_decoder_blocks=size.layers, vocab_size=size.vocab, mlp_variant="swiglu",
        tie_embedder_and_logits=False, use_layer_stack=True)
    model = llamalike.build_llamalike_transformer(config, init_base_rng=jax.random.key(0), name="llama")
    unbound, params = pz.unbind_params(model, freeze=True)
    optimizer = optax.adamw(1e-3, weight_decay=0.1)

    def step(params, opt_state, tokens):
        def loss(params):
            logits = pz.bind_variables(unbound, params)(tokens)
            log_probs = pz.nx.nmap(jax.nn.log_softmax)(logits.untag("vocabulary")).tag("vocabulary")
            targets = pz.nx.nmap(jnp.roll)(tokens.untag("seq"), -1).tag("seq")
            picked = pz.nx.nmap(lambda lp, t: lp[t])(log_probs.untag("vocabulary"), targets)
            return -jnp.mean(picked.untag("batch", "seq").unwrap())
        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return value, optax.apply_updates(params, updates), opt_state

    names = {"batch": "data", "heads": "tensor", "neurons": "tensor"}
    tokens = np.random.default_rng(0).integers(0, size.vocab, (size.batch, size.seq)).astype(np.int32)
    tokens = sharding_util.name_to_name_device_put(pz.nx.wrap(tokens).tag("batch", "seq"), jax_mesh(), names)
    params = sharding_util.name_to_name_device_put(params, jax_mesh(), names)
    opt_state = jax.jit(optimizer.init)(params)        # the moments as their parameters
    return step, (params, opt_state, tokens)


# -- jraph ---------------------------------------------------------------------------------
def jraph_step(size: Size = SMALL) -> tuple[Callable, tuple]:
    """A two-layer GCN on one random graph and one adam step of it."""
    import jraph

    rng = np.random.default_rng(0)
    features = size.d_model
    graph = jraph.GraphsTuple(
        nodes=rng.standard_normal((size.nodes, features)).astype(np.float32),
        edges=None, globals=None, n_node=np.array([size.nodes]), n_edge=np.array([size.edges]),
        senders=rng.integers(0, size.nodes, size.edges).astype(np.int32),
        receivers=rng.integers(0, size.nodes, size.edges).astype(np.int32))
    labels = rng.integers(0, size.classes, size.nodes).astype(np.int32)
    w = lambda *shape: (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)
    params = {"w1": w(features, size.hidden), "b1": np.zeros(size.hidden, np.float32),
              "w2": w(size.hidden, size.classes), "b2": np.zeros(size.classes, np.float32)}
    optimizer = optax.adam(1e-2)

    def gcn(params, graph):
        layer = lambda w, b: jraph.GraphConvolution(lambda n: n @ w + b, add_self_edges=True)
        graph = layer(params["w1"], params["b1"])(graph)
        graph = graph._replace(nodes=jax.nn.relu(graph.nodes))
        return layer(params["w2"], params["b2"])(graph).nodes

    def step(params, opt_state, graph, labels):
        def loss(params):
            logits = gcn(params, graph)
            return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))
        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return value, optax.apply_updates(params, updates), opt_state

    mesh = jax_mesh()
    place = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))
    params = {"w1": place(params["w1"], None, "tensor"), "b1": place(params["b1"], "tensor"),
              "w2": place(params["w2"], "tensor", None), "b2": place(params["b2"])}
    graph = graph._replace(nodes=place(graph.nodes, "data", "tensor"))
    opt_state = jax.jit(optimizer.init)(params)
    return step, (params, opt_state, graph, place(labels, "data"))


# -- the checks ----------------------------------------------------------------------------
def check_like_jax_jit(step: Callable, args: tuple) -> gspmd.Lowered:
    """gspmd.jit's step equals jax.jit's on both backends; on the jax backend its results
    lie as jax.jit's do."""
    expected = jax.jit(step)(*args)
    for backend in ("jax", "sim"):
        ours = gspmd.jit(step, backend=backend)(*args)
        assert_close(ours, expected, rtol=2e-4, atol=2e-5)
        if backend == "jax":
            for mine, theirs in zip(jax.tree.leaves(ours), jax.tree.leaves(expected)):
                assert mine.sharding.is_equivalent_to(theirs.sharding, mine.ndim), (mine.sharding, theirs.sharding)
    return gspmd.jit(step, backend="jax").lower(*args)


def test_penzai_llama_layer_stack_train_step():
    pytest.importorskip("penzai", reason="penzai is not installed (pip install penzai==0.2.5)")
    lowered = check_like_jax_jit(*penzai_step())
    kinds = Counter(c.kind for c in lowered.report().collectives)
    # Megatron over "tensor" (partial sums of the attention and MLP outputs) and the
    # weight gradients summed over "data": all-reduces, and nothing gathers whole weights.
    assert kinds["all-reduce"] >= 2, kinds
    assert "all-gather" not in kinds, kinds


def test_jraph_gcn_train_step():
    pytest.importorskip("jraph", reason="jraph is not installed (pip install jraph==0.0.6.dev0)")
    lowered = check_like_jax_jit(*jraph_step())
    kinds = Counter(c.kind for c in lowered.report().collectives)
    # Messages pass between nodes on other devices: the gathers of sender features and
    # the segment sums over receivers move data across "data"; the weight gradients sum.
    assert kinds["all-reduce"] >= 1, kinds
