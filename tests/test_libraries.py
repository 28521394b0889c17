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
- diffrax 0.7.2: a 1-D heat equation (method of lines) solved by diffeqsolve (Tsit5, PID
  step sizes), its diffusivity and initial condition fitted by jax.grad through the solve
  (diffrax's checkpointed adjoint) and optax.adam, the grid over both mesh axes.
- keras-hub 0.32.0 (Keras 3.15): a LlamaBackbone built under its own `get_layout_map`
  (keras.distribution.ModelParallel) and one SGD step of it; tests/test_keras.py tests it,
  and other backbones, from `keras_backbone_step`.

Not here, because they do not install beside jax 0.10.2 (benchmarks/RESULTS.md, "First
calls on real libraries"): Levanter 1.1 (its haliax imports `jax._src.tree_util.
BuiltInKeyEntry`, gone from jax), EasyDeL 0.3.0 (pins flax 0.12.3 and transformers 5.5,
and its import needs PyTorch), recurrentgemma 1.0.1 (numpy < 2.4, absl-py < 2)."""
from __future__ import annotations

import dataclasses
import os
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
os.environ.setdefault("KERAS_BACKEND", "jax")      # for keras_backbone_step, before keras is imported


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
    grid: int = 32             # diffrax: points of the heat equation's grid


SMALL = Size()
# Levanter's configuration in issue 46: 4 layers, d=256, seq 128, batch 16.
BENCHMARK = Size(layers=4, d_model=256, hidden=1024, vocab=1024, batch=16, seq=128,
                 nodes=2000, edges=16000, classes=16, grid=128)


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


# -- diffrax --------------------------------------------------------------------------------
def heat_solve(kappa, u0, adaptive: bool = True):
    """u at t=0.01 of the 1-D heat equation u_t = kappa u_xx on u0's grid over [0, 1]
    (method of lines, reflecting ends), solved by diffrax: Tsit5 with a PID controller
    (adaptive) or Euler's fixed steps."""
    import diffrax

    def rhs(t, u, kappa):
        u_xx = jnp.concatenate([u[1:2] - u[:1], u[2:] - 2 * u[1:-1] + u[:-2], u[-2:-1] - u[-1:]])
        return kappa * u_xx * (u.shape[0] - 1) ** 2
    if adaptive:
        solver, dt0, controller = diffrax.Tsit5(), 1e-3, diffrax.PIDController(rtol=1e-4, atol=1e-6)
    else:
        solver, dt0, controller = diffrax.Euler(), 5e-4, diffrax.ConstantStepSize()
    solution = diffrax.diffeqsolve(diffrax.ODETerm(rhs), solver, 0.0, 0.01, dt0, u0, args=kappa,
                                   saveat=diffrax.SaveAt(t1=True), stepsize_controller=controller)
    return solution.ys[-1]


def heat_initial(grid: int) -> np.ndarray:
    return (np.sin(np.linspace(0, 3, grid)) + 0.1 * np.cos(np.linspace(0, 17, grid))).astype(np.float32)


def diffrax_step(size: Size = SMALL) -> tuple[Callable, tuple]:
    """One adam step fitting the diffusivity and the initial condition of heat_solve to an
    observed end state; the grid over both mesh axes."""
    optimizer = optax.adam(1e-2)

    def step(params, opt_state, observed):
        def loss(params):
            return jnp.mean((heat_solve(params["kappa"], params["u0"]) - observed) ** 2)
        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return value, optax.apply_updates(params, updates), opt_state

    grid = NamedSharding(jax_mesh(), P(MESH_AXES))
    observed = jax.device_put(0.8 * np.sin(np.linspace(0, 3, size.grid, dtype=np.float32)), grid)
    params = {"kappa": jax.device_put(np.float32(0.5), NamedSharding(jax_mesh(), P())),
              "u0": jax.device_put(heat_initial(size.grid) * 0.9, grid)}
    opt_state = jax.jit(optimizer.init)(params)
    return step, (params, opt_state, observed)


# -- keras ---------------------------------------------------------------------------------
def keras_backbone_step(backbone_class, batch: int, seq: int = 16, **config) -> tuple[Callable, tuple]:
    """A keras-hub backbone built under its own layout map (variables committed to their
    layouts on a batch 2 x model 4 keras mesh; replicated where it has none, inputs then
    committed over "batch", as keras's distribution splits a dataset's batches) and one
    SGD step on its mean squared output, on the inputs it names: token ids, segment ids,
    padding masks of seq/2 to seq tokens."""
    import keras

    mesh = keras.distribution.DeviceMesh(MESH_SHAPE, ["batch", "model"], keras.distribution.list_devices())
    layout_map = backbone_class.get_layout_map(mesh) if hasattr(backbone_class, "get_layout_map") else None
    distribution = keras.distribution.ModelParallel(layout_map=layout_map or keras.distribution.LayoutMap(mesh),
                                                    batch_dim_name="batch")
    with distribution.scope():
        model = backbone_class(**config)
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    rng = np.random.default_rng(0)
    bounds = {"token_ids": config["vocabulary_size"], "segment_ids": 2, "padding_mask": 1}
    lengths = rng.integers(seq // 2, seq + 1, (batch, 1))     # padded sequences
    inputs = {name: (rng.integers(0, bounds[name], (batch, seq)) if name != "padding_mask"
                     else np.arange(seq) < lengths).astype(np.int32) for name in model.input}
    if layout_map is None:
        inputs = jax.device_put(inputs, NamedSharding(mesh.backend_mesh, P("batch")))

    def loss(trainable, non_trainable, inputs):
        outputs, _ = model.stateless_call(trainable, non_trainable, inputs)   # an encoder's: a dict
        return sum(jnp.mean(jnp.square(o.astype(jnp.float32))) for o in jax.tree.leaves(outputs))

    def step(trainable, non_trainable, inputs):
        value, grads = jax.value_and_grad(loss)(trainable, non_trainable, inputs)
        return value, [w - 0.1 * g for w, g in zip(trainable, grads)]
    return step, (trainable, non_trainable, inputs)


def keras_step(size: Size = SMALL) -> tuple[Callable, tuple]:
    """keras-hub's LlamaBackbone (grouped queries: half as many key/value heads) under its
    layout map, one SGD step."""
    from keras_hub.models import LlamaBackbone
    return keras_backbone_step(LlamaBackbone, size.batch, size.seq, vocabulary_size=size.vocab,
                               num_layers=size.layers, num_query_heads=size.heads,
                               num_key_value_heads=size.heads // 2, hidden_dim=size.d_model,
                               intermediate_dim=size.hidden)


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


def test_diffrax_heat_equation_train_step():
    pytest.importorskip("diffrax", reason="diffrax is not installed")
    lowered = check_like_jax_jit(*diffrax_step())
    # The grid stays split: its halos move, the error norms and the loss are sums.
    assert "all-gather" not in Counter(c.kind for c in lowered.report().collectives)
