"""The dense Transformer train step of the paper's Section 5.1, annotated only on its six
weights and its input activation with Table 1's 2D-finalized strategy: completion must
give every tensor, forward and backward, the layout the paper intends; the result must
match one device and communicate no more than XLA's own partitioner does."""
import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import Mesh as JaxMesh

import gspmd
from gspmd.models import transformer as T
from gspmd.analysis.xla import hlo_collective_bytes
from util import check

MESH = gspmd.Mesh(np.arange(8).reshape(2, 4), ("x", "y"))
CFG = T.Config()
def _lower(strategy=T.FINALIZED_2D, cfg=CFG) -> gspmd.Lowered:
    step = T.make_train_step(T.gspmd_annotate(MESH), cfg, strategy)
    return gspmd.jit(step, mesh=MESH).lower(*T.example_inputs(cfg, abstract=True))


def _xla_bytes(strategy=T.FINALIZED_2D) -> dict[str, int]:
    mesh = JaxMesh(np.array(jax.devices()[:8]).reshape(2, 4), ("x", "y"))
    step = T.make_train_step(T.xla_annotate(mesh), CFG, strategy)
    text = jax.jit(step).lower(*T.example_inputs(CFG)).compile().as_text()
    return hlo_collective_bytes(text)


def _live_values(program):
    used = {o for i in program.instrs for o in i.operands} | set(program.outputs)
    return [v for v in program.values() if v in used or v in program.params]


def test_completion_matches_the_papers_intent_forward_and_backward():
    low = _lower()
    intended = T.intended_2d(CFG)
    checked = {}
    for v in _live_values(low.program):
        if v.shape in intended:
            want = gspmd.Sharding.from_mesh(MESH, intended[v.shape], v.shape)
            assert v.sharding == want, f"%{v.name} {v.shape}: {v.sharding} != {want}\n{low.explain(v)}"
            checked[v.shape] = checked.get(v.shape, 0) + 1
        elif v.rank == 0:
            assert v.sharding.is_replicated
    # Every kind of tensor is covered, many times over (forward, backward, update).
    assert set(checked) == set(intended) and sum(checked.values()) > 150, checked


def test_every_annotation_receives_its_own_layout():
    """Backward tensors by name: each annotation's operand (the parameters going in, and
    the weight gradients coming out of their dots and transposes) already has the
    annotated layout, so no annotation costs a reshard."""
    low = _lower()
    annotations = [i for i in low.program.instrs if i.opcode == "sharding"]
    assert len(annotations) == 13    # 7, and 6 transposed for the weight gradients
    for instr in annotations:
        assert instr.operands[0].sharding == instr.attrs["sharding"], low.explain(instr.operands[0])


def test_matches_one_device_and_communicates_no_more_than_xla():
    low = check(T.make_train_step(T.gspmd_annotate(MESH), CFG), *T.example_inputs(CFG), mesh=MESH)
    report = low.report()
    ours, xla = report.collective_bytes, sum(_xla_bytes().values())
    assert ours <= xla, (ours, xla, str(report))
    # Figure 7, 2D finalized: weights all-gathered over X before use and their gradients
    # reduce-scattered back over X; activations gathered over Y on demand; the scalar
    # loss all-reduced over everyone. Nothing else.
    x_groups = {tuple(int(d) for d in col) for col in MESH.devices.T}
    over_x = [c for c in report.collectives if set(c.groups) == x_groups]
    assert sorted(c.kind for c in over_x) == ["all-gather"] * 6 + ["reduce-scatter"] * 6
    assert {c.kind for c in report.collectives} == {"all-gather", "reduce-scatter", "all-reduce"}
    assert not any("fallback" in c.origin for c in report.collectives)


def _unannotated(low: gspmd.Lowered) -> list:
    """Layouts of the values that are not annotation outputs, in program order."""
    return [v.sharding for v in low.program.values() if v.producer is None or v.producer.opcode != "sharding"]


def test_equivalent_annotation_places_give_the_same_completion():
    """The activation annotated at the layer's output instead of its input, or every
    einsum output annotated too (as completion infers them): the same layouts."""
    base = _unannotated(_lower())
    moved = {k: v for k, v in T.FINALIZED_2D.items() if k != "x"} | {"out": T.ACTIVATIONS_2D["out"]}
    redundant = T.FINALIZED_2D | T.ACTIVATIONS_2D
    for strategy in (moved, redundant):
        assert _unannotated(_lower(strategy)) == base


def test_activations_instead_of_weights_cannot_express_weight_update_sharding():
    """Annotating the einsum outputs instead of the weights gives every activation the
    same layout, but the weights' X split on M is weight-update sharding, a choice no
    activation implies (propagation invents no splits): the weights come out split only
    over Y, on the heads (Megatron's layout, replicated over X), as their gradients are."""
    strategy = {"x": T.FINALIZED_2D["x"]} | T.ACTIVATIONS_2D
    low = _lower(strategy)
    intended = T.intended_2d(CFG)
    for v in _live_values(low.program):
        if v.rank == 4 or v.shape in ((CFG.batch, CFG.seq, CFG.hidden),):
            assert v.sharding == gspmd.Sharding.from_mesh(MESH, intended[v.shape], v.shape), v.name
    wq = low.program.params[2]
    assert wq.shape == (CFG.model, CFG.heads, CFG.head_dim)
    assert wq.sharding == gspmd.Sharding.from_mesh(MESH, [-1, "y", -1], wq.shape)


def test_two_layers_without_layer_norm():
    cfg = T.Config(layers=2, layer_norm=False)
    low = _lower(cfg=cfg)
    intended = T.intended_2d(cfg)
    for v in _live_values(low.program):
        if v.shape in intended:
            assert v.sharding == gspmd.Sharding.from_mesh(MESH, intended[v.shape], v.shape), v.name


def test_blockwise_attention_equals_one_device_with_the_same_collectives():
    """Queries attended 4 at a time (3 blocks of an uneven 12 x 3 batch over the mesh):
    the same numbers and the same collectives as attending them all at once."""
    cfg = T.Config(batch=3, seq=12, heads=4, hidden=30, layers=2)
    blockwise = dataclasses.replace(cfg, attention_block=4)
    whole = check(T.make_train_step(T.gspmd_annotate(MESH), cfg), *T.example_inputs(cfg), mesh=MESH)
    blocks = check(T.make_train_step(T.gspmd_annotate(MESH), blockwise), *T.example_inputs(blockwise), mesh=MESH)
    assert blocks.report().counts() == whole.report().counts()
    assert any(i.opcode == "while" for i in blocks.spmd.instrs)


def test_an_attention_block_must_divide_the_sequence():
    cfg = T.Config(seq=12, attention_block=5)
    with pytest.raises(gspmd.ShardingError, match="attention_block 5 does not divide the sequence"):
        _lower(cfg=cfg)
    with pytest.raises(gspmd.ShardingError, match="attention_block needs a whole number >= 1"):
        _lower(cfg=T.Config(seq=12, attention_block=0))


def _dropout_loss(cfg: T.Config, strategy=T.MEGATRON):
    """A squared-error loss through cfg.layers layers, each drawing its dropout masks
    from its own key."""
    annotate = T.gspmd_annotate(MESH)

    def loss(params, x, target, key):
        for p, k in zip(params, jax.random.split(key, len(params))):
            x = T.layer(p, x, annotate, strategy, cfg, key=k)
        return jax.numpy.mean((x - target) ** 2)
    return loss


def _dropout_step(cfg: T.Config, strategy=T.MEGATRON):
    return jax.grad(_dropout_loss(cfg, strategy))


@pytest.mark.parametrize("block", [None, 4])
def test_dropout_equals_one_device_with_the_collectives_of_no_dropout(block):
    """Dropout on the attention probabilities and both residual branches (Megatron-LM's
    places), an uneven batch of 3 over X and 4 heads over Y: the gradients equal one
    device's (the same masks: each device hashes its own shard's counters), with the
    collectives of the same step without dropout; the softmax as a kernel of its own
    changes neither."""
    cfg = T.Config(batch=3, seq=12, heads=4, hidden=30, layers=2, attention_block=block)
    params, x, target = T.example_inputs(cfg)
    key = jax.random.key(7)
    plain = check(_dropout_step(dataclasses.replace(cfg, dropout=0.1)), params, x, target, key, mesh=MESH)
    unfused = dataclasses.replace(cfg, dropout=0.1, softmax_kernel=True)
    barriered = check(_dropout_step(unfused), params, x, target, key, mesh=MESH)
    without = gspmd.jit(_dropout_step(cfg), mesh=MESH).lower(params, x, target, key)
    assert plain.report().counts() == barriered.report().counts() == without.report().counts()
    dropped = jax.jit(_dropout_step(unfused))(params, x, target, key)
    kept = jax.jit(_dropout_step(cfg))(params, x, target, key)
    assert not np.allclose(dropped[0]["wq"], kept[0]["wq"])       # the masks do drop


def test_dropout_needs_a_key():
    cfg = T.Config(dropout=0.1)
    params, x, _ = T.example_inputs(cfg)
    with pytest.raises(gspmd.ShardingError, match="draws its masks from a key"):
        T.layer(params[0], x, T.gspmd_annotate(MESH), T.MEGATRON, cfg)


def test_gradient_accumulation_equals_one_device_and_the_whole_batch():
    """make_step(microbatches=3): an AdamW step over 3 microbatches of 3 sequences each,
    split unevenly over X = 2 (with dropout: each microbatch its own folded key), equals one
    device's; without dropout it is the whole batch's step."""
    from gspmd.models.optimizers import AdamW, make_step
    cfg = T.Config(batch=9, seq=12, heads=4, hidden=30, layers=2)
    params, x, target = T.example_inputs(cfg)
    state, key = AdamW().init(params), jax.random.key(3)
    dropped = dataclasses.replace(cfg, dropout=0.1)
    low = check(make_step(_dropout_loss(dropped), AdamW(), 0.01, microbatches=3, batched=2), params, state, x, target,
                key, mesh=MESH)
    assert any(i.opcode == "while" for i in low.spmd.instrs)
    loss = _dropout_loss(cfg)
    accumulated = jax.jit(make_step(loss, AdamW(), 0.01, microbatches=3, batched=2))(params, state, x, target, key)
    whole = jax.jit(make_step(loss, AdamW(), 0.01))(params, state, x, target, key)
    for a, b in zip(jax.tree_util.tree_leaves(accumulated), jax.tree_util.tree_leaves(whole)):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


def test_gradient_accumulation_needs_a_batch_that_divides():
    from gspmd.models.optimizers import make_step
    cfg = T.Config(batch=6)
    params, x, target = T.example_inputs(cfg)
    with pytest.raises(gspmd.ShardingError, match="over 4 microbatches needs a batch that divides"):
        jax.eval_shape(make_step(_dropout_loss(cfg), None, 0.1, microbatches=4), params, x, target, jax.random.key(0))
