"""Sharding completion (paper 3.5): merging (Figure 3), priorities (Figure 4), direction-
dependent priority of layout ops, UNSPECIFIED dims, no invented splits, explain, as_text,
and a worklist that looks at each instruction a bounded number of times."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gspmd
from gspmd import ops, propagation
from gspmd.models import transformer as T
from gspmd.ops.registry import CONTRACTION, ELEMENTWISE, EXPAND, LAYOUT, priority
from util import check, rand

MESH = gspmd.Mesh(np.arange(8).reshape(2, 4), ("x", "y"))
RNG = np.random.RandomState(0)


def _layout(mapping, shape, mesh=MESH):
    return gspmd.Sharding.from_mesh(mesh, mapping, shape)


# -- Figure 3: AyB, BCx -> AyCx ------------------------------------------------------------
def _figure3(lhs_mesh, rhs_mesh):
    def f(a, b):
        a = gspmd.mesh_split(a, lhs_mesh, ["y", -1])    # A over y, replicated over x
        b = gspmd.mesh_split(b, rhs_mesh, [-1, "x"])    # C over x, replicated over y
        return jnp.tanh(a @ b)
    return check(f, rand(RNG, 8, 16), rand(RNG, 16, 4), mesh=MESH)


def test_figure3_merges_partially_tiled_operands():
    low = _figure3(MESH, MESH)
    assert low.sharding_of(0) == _layout(["y", "x"], (8, 4))
    assert low.report().collectives == []        # each device has what its tile needs


def test_figure3_merges_across_meshes_with_other_device_orders():
    transposed = gspmd.Mesh(MESH.devices.T, ("y", "x"))   # same devices, other mesh order
    low = _figure3(MESH, transposed)
    assert low.sharding_of(0) == _layout(["y", "x"], (8, 4))
    assert len(low.completion.origins(low.value(0))) == 2


def test_figure3_incompatible_orders_keep_the_first_and_reshard():
    """If x's groups cut across y's (x = device % 2 while y = device % 4), no layout
    agrees with both: the output keeps the lhs's, and the partitioner reshards."""
    interleaved = gspmd.Mesh(np.arange(8).reshape(4, 2).T, ("x", "y"))
    low = _figure3(MESH, interleaved)
    assert low.sharding_of(0) == _layout(["y", -1], (8, 4))
    assert low.report().collectives


# -- Figure 4: elementwise first --------------------------------------------------------------
def _figure4(a, w, bias, c):
    a = gspmd.mesh_split(a, MESH, ["x", -1])    # [B, K]: the dot alone would split B
    c = gspmd.mesh_split(c, MESH, [-1, "x"])    # [B, D]: the elementwise chain splits D
    y = a @ w
    z = y + jnp.broadcast_to(bias, y.shape)
    return z * c


def test_figure4_all_bd_tensors_share_one_layout():
    low = check(_figure4, rand(RNG, 8, 16), rand(RNG, 16, 8), rand(RNG, 8), rand(RNG, 8, 8), mesh=MESH)
    bd = [v for v in low.program.values() if v.shape == (8, 8) and v.producer is not None]
    assert len(bd) >= 5 and all(v.sharding == _layout([-1, "x"], (8, 8)) for v in bd)
    assert low.program.params[2].sharding == _layout(["x"], (8,))          # bias, backward
    assert low.program.params[1].sharding == _layout([-1, "x"], (16, 8))   # w, by the dot
    # The only communication: the dot's lhs gathered along its batch split.
    assert [c.kind for c in low.report().collectives] == ["all-gather"]


def test_broadcast_backward_before_forward():
    """A broadcast result takes its layout from its user (the larger tensor) before the
    broadcast operand can dictate it: the small bias is resharded, not the activation."""
    def f(bias, u):
        bias = gspmd.mesh_split(bias, MESH, ["x"])          # [D]
        u = gspmd.mesh_split(u, MESH, [-1, "x"])            # [D, B]
        return jnp.broadcast_to(bias, (16, 8)) + u.T        # [B, D]

    low = check(f, rand(RNG, 8), rand(RNG, 8, 16), mesh=MESH)
    assert low.sharding_of(0) == _layout(["x", -1], (16, 8))
    assert low.report().collective_bytes <= 8 * 4            # at most the bias moves


def test_priority_table():
    assert priority("add", True) == priority("add", False) == ELEMENTWISE
    assert priority("broadcast", False) == LAYOUT < priority("broadcast", True) == EXPAND
    assert priority("reduce", True) == LAYOUT < priority("reduce", False) == EXPAND
    assert priority("dot", True) == priority("dot", False) == CONTRACTION


# -- partial specification, no invented patterns, monotonicity ---------------------------------
def test_unspecified_dims_are_refined_and_unsplit_dims_are_not():
    def f(x, w, spec):
        x = gspmd.mesh_split(x, MESH, spec)
        w = gspmd.mesh_split(w, MESH, ["y", -1])           # K over y
        return x @ w

    args = rand(RNG, 8, 16), rand(RNG, 16, 4)
    open_ = check(lambda x, w: f(x, w, ["x", gspmd.UNSPECIFIED]), *args, mesh=MESH)
    annotated = [i for i in open_.program.instrs if i.opcode == "sharding"][0].output
    assert annotated.sharding == _layout(["x", "y"], (8, 16))
    closed = check(lambda x, w: f(x, w, ["x", -1]), *args, mesh=MESH)
    annotated = [i for i in closed.program.instrs if i.opcode == "sharding"][0].output
    assert annotated.sharding == _layout(["x", -1], (8, 16))


def test_no_annotation_no_split():
    def f(x, w):
        return jnp.tanh(gspmd.mesh_split(x, MESH, ["x", -1]) @ w)

    low = check(f, rand(RNG, 8, 16), rand(RNG, 16, 4), mesh=MESH)
    assert low.program.params[1].sharding.is_replicated            # nothing reaches w
    assert low.sharding_of(0) == _layout(["x", -1], (8, 4))
    assert low.report().collectives == []


def test_annotations_stay_fixed_against_their_neighbours():
    def f(x):
        x = gspmd.mesh_split(x, MESH, ["x", -1])
        return gspmd.mesh_split(jnp.sin(x), MESH, [-1, "x"])      # conflicts: x twice

    low = check(f, rand(RNG, 8, 8), mesh=MESH)
    assert low.sharding_of(0) == _layout([-1, "x"], (8, 8))
    sin = next(i for i in low.program.instrs if i.opcode == "sine")
    assert sin.output.sharding == _layout(["x", -1], (8, 8))      # first come, never undone


def test_reshape_carries_splits_through_split_and_merged_dims():
    def f(x):
        x = gspmd.mesh_split(x, MESH, ["x", "y"])                # [4, 16]
        return jnp.tanh(x.reshape(4, 4, 4)).reshape(16, 4)

    low = check(f, rand(RNG, 4, 16), mesh=MESH)
    split = next(i for i in low.program.instrs if i.opcode == "reshape").output
    assert split.sharding == _layout(["x", "y", -1], (4, 4, 4))
    # Merging [4 split 2, 4 split 4] into 16: only the major dim's split stays contiguous.
    assert low.sharding_of(0) == _layout(["x", -1], (16, 4))


def test_reshape_spreads_a_split_over_the_dims_it_splits_into():
    def f(x):
        x = gspmd.mesh_split(x, MESH, [-1, ("x", "y")])          # [4, 16] split 8 ways
        return jnp.tanh(x.reshape(4, 2, 8))

    low = check(f, rand(RNG, 4, 16), mesh=MESH)
    assert low.sharding_of(0) == _layout([-1, "x", "y"], (4, 2, 8))   # each device's 2 elements, in place
    assert not low.report().collectives


# -- explain and as_text ---------------------------------------------------------------------
def _figure4_lowered():
    return gspmd.jit(_figure4, mesh=MESH).lower(np.ones((8, 16), np.float32), np.ones((16, 8), np.float32),
                                              np.ones(8, np.float32), np.ones((8, 8), np.float32))


def test_explain_names_the_annotation_and_the_chain_of_ops():
    low = _figure4_lowered()
    text = low.explain(0)
    c_annotation = [i for i in low.program.instrs if i.opcode == "sharding"][1]
    assert f"from annotation %{c_annotation.output.name}" in text and "multiply (forward" in text
    bias = low.explain(low.program.params[2].name)
    assert "broadcast (backward" in bias and "add (backward" in bias
    assert low.explain(f"%{low.program.params[2].name}") == bias


def test_explain_of_unreached_value_and_bad_references():
    low = gspmd.jit(lambda x, w: gspmd.mesh_split(x, MESH, ["x", -1]) @ w, mesh=MESH).lower(
        np.ones((8, 16), np.float32), np.ones((16, 4), np.float32))
    assert "no annotation reaches it" in low.explain(low.program.params[1].name)
    with pytest.raises(gspmd.ShardingError, match="out of range"):
        low.explain(3)
    with pytest.raises(gspmd.ShardingError, match="No value named"):
        low.sharding_of("%nope")


def test_as_text_shows_every_values_sharding():
    low = _figure4_lowered()
    completed = low.as_text().split("// SPMD")[0]
    for v in low.program.values():
        assert f"%{v.name}: {v.type_str()} sharding={v.sharding}" in completed


# -- cost: a worklist ----------------------------------------------------------------------------
def _propose_calls(layers: int, monkeypatch) -> tuple[int, int]:
    calls = []
    original = ops.proposer

    def counted(instr):
        propose = original(instr)
        return lambda *a: calls.append(1) or propose(*a)
    monkeypatch.setattr(ops, "proposer", counted)
    cfg = T.Config(layers=layers)
    step = T.make_train_step(T.gspmd_annotate(MESH), cfg)
    flat, tree = jax.tree_util.tree_flatten(T.example_inputs(cfg, abstract=True))
    program, _ = gspmd.frontend.trace(lambda *a: step(*jax.tree_util.tree_unflatten(tree, a)), flat)
    propagation.complete(program, MESH.size)
    return len(calls), len(program.instrs)


def test_proposals_grow_linearly_with_layers(monkeypatch):
    one, n1 = _propose_calls(1, monkeypatch)
    four, n4 = _propose_calls(4, monkeypatch)
    assert four / n4 < 1.2 * one / n1, (one, n1, four, n4)
    assert one / n1 < 12      # a handful of proposals per instruction, not sweeps x levels
