"""The corpus of real programs (tests/corpus/): each train step runs under gspmd.jit with
its data- and model-parallel annotations on the sim and jax backends and equals the step
on one device (floats to a tolerance, since partial sums add up in another order;
dropout masks, integers and keys bit for bit), and its collectives are the ones its
annotations call for: a split dropout mask adds none, the integer-label loss at most
one small all-reduce, an embedding table split on the vocabulary is never gathered."""
import contextlib
import functools
from collections import Counter

import jax
import numpy as np
import pytest

import gspmd
from corpus import (cond_mlp, equinox_block, linen_cnn, linen_lstm, lm, moe, nnx_mlp, shard_map_ring,
                    sharding_constraints)
from gspmd.frontend.annotation import unpartitioned
from gspmd.spmd.context import Why
from util import BACKENDS, assert_same

PROGRAMS = [linen_cnn, nnx_mlp, equinox_block, lm, moe, cond_mlp, sharding_constraints, shard_map_ring, linen_lstm]
RTOL, ATOL = 1e-4, 1e-5


def meshes(program):
    """(the mesh for gspmd.jit, the context to run in): programs written for jax.jit name
    their jax Mesh by jax.set_mesh; the others pass their gspmd.Mesh to gspmd.jit."""
    if isinstance(program.MESH, jax.sharding.Mesh):
        return None, jax.set_mesh(program.MESH)
    return program.MESH, contextlib.nullcontext()


@functools.cache
def checked(program) -> gspmd.Lowered:
    """The program's train step on its example inputs, partitioned on each backend,
    equals jax.jit's on one device (run once per program); returns the Lowered."""
    args = program.example_inputs()
    mesh, context = meshes(program)
    with context:
        with unpartitioned():
            expected = jax.jit(program.train_step)(*args)
        for backend in BACKENDS:
            assert_same(gspmd.jit(program.train_step, mesh=mesh, backend=backend)(*args), expected, RTOL, ATOL)
        return gspmd.jit(program.train_step, mesh=mesh).lower(*args)


def lower(program, step) -> gspmd.Lowered:
    """`step` (a variant of the program's train step) lowered on its example inputs."""
    mesh, context = meshes(program)
    with context:
        return gspmd.jit(step, mesh=mesh).lower(*program.example_inputs())


def collectives(low: gspmd.Lowered) -> Counter:
    """How many collectives of each (kind, bytes, groups, executions)."""
    return Counter((c.kind, c.bytes, tuple(map(tuple, np.asarray(c.groups).tolist())), c.executions)
                   for c in low.report().collectives)


def counts(low: gspmd.Lowered) -> dict:
    return dict(low.report().counts())


def name(program) -> str:
    return program.__name__.split(".")[-1]


@pytest.mark.parametrize("program", PROGRAMS, ids=name)
def test_every_program_equals_one_device(program):
    assert checked(program).report().fallbacks == [], checked(program).report()


# -- dropout: the mask of a split activation is drawn where it lives -------------------------
@pytest.mark.parametrize("program", [linen_cnn, nnx_mlp, equinox_block], ids=name)
def test_split_dropout_mask_adds_no_collective(program):
    low = checked(program)
    assert collectives(low) == collectives(lower(program, program.make_train_step(0.0)))
    mask = low.value(-1)      # each step returns its keep mask last: split over both axes
    shard = mask.sharding.shard_shape(mask.shape)
    assert shard[0] < mask.shape[0] and shard[-1] < mask.shape[-1], mask.sharding


def test_linen_cnn_collectives():
    low = checked(linen_cnn)
    # The only gather: the conv features (split over "model") flattened for the dense layer.
    assert counts(low) == {"all-reduce": 9, "all-gather": 1}, low.report()


# -- the language model -----------------------------------------------------------------------
def test_lm_integer_label_loss_adds_at_most_one_small_all_reduce():
    integer = collectives(checked(lm))
    one_hot = collectives(lower(lm, lm.make_train_step(lm.one_hot_loss)))
    extra = list((integer - one_hot).elements())
    tokens_per_device = lm.BATCH // 2 * lm.SEQ
    assert integer.total() <= one_hot.total() + 1, (integer, one_hot)
    assert all(kind == "all-reduce" and size <= tokens_per_device * 4 for kind, size, _, _ in extra), extra


def test_lm_vocab_split_table_is_never_gathered():
    low = checked(lm)
    assert set(counts(low)) == {"all-reduce"}, low.report()      # Megatron: partial sums only
    embed = gspmd.Sharding.from_mesh(lm.MESH, ["model", -1], (lm.VOCAB, lm.WIDTH))
    assert low.sharding_of("params['embed']") == embed
    lookup = [c for c in low.report().collectives if c.source.startswith("lm.py") and "logits_of" in c.source
              and "gather" in c.origin]
    assert [c.bytes for c in lookup] == [lm.BATCH // 2 * lm.SEQ * lm.WIDTH * 4], low.report()   # the activations


def test_lm_qkv_input_gradients_are_summed_before_one_all_reduce():
    """Each head-split projection's input gradient is partial over the heads' axis; their
    sum is all-reduced once (as XLA's AllReduceReassociate pass does)."""
    activations = lm.BATCH // 2 * lm.SEQ * lm.WIDTH * 4
    report = checked(lm).report()
    through_projections = [c for c in report.collectives if "(project)" in c.source and c.bytes == activations]
    assert len(through_projections) == 1, report


# -- mixture of experts -----------------------------------------------------------------------
def test_moe_expert_weights_stay_split():
    low = checked(moe)
    by_expert = gspmd.Sharding.from_mesh(moe.MESH, ["expert", -1, -1], (moe.EXPERTS, moe.WIDTH, moe.HIDDEN))
    assert low.sharding_of("result[0]['w_in']") == by_expert
    gate_bytes = (moe.GROUPS + 1) // 2 * moe.TOKENS * moe.EXPERTS * 4
    gathered = [c for c in low.report().collectives if c.kind == "all-gather"]
    assert all(c.bytes <= gate_bytes for c in gathered), low.report()   # top_k's candidates, the gate's gradient


# -- control flow -----------------------------------------------------------------------------
def test_cond_takes_both_branches_and_each_activation():
    step = gspmd.jit(cond_mlp.train_step, mesh=cond_mlp.MESH, backend=BACKENDS[0])
    taken = set()
    for seed in range(3):
        args = cond_mlp.example_inputs(seed)
        with unpartitioned():
            expected = jax.jit(cond_mlp.train_step)(*args)
        assert_same(step(*args), expected, RTOL, ATOL)
        taken.add(bool(expected[-1]))
    assert taken == {True, False}


def test_cond_branches_move_no_data():
    """Every collective sums partial results (of the dots and means, in the branches
    too): the predicate from split data costs one scalar all-reduce, as the loss does."""
    report = checked(cond_mlp).report()
    assert {(c.kind, c.why) for c in report.collectives} == {("all-reduce", Why.PARTIAL_RESULTS)}, report
    assert [c.bytes for c in report.collectives].count(4) == 2, report


# -- code written for jax.jit -----------------------------------------------------------------
def test_sharding_constraints_alone_lay_out_the_step():
    assert "gspmd" not in vars(sharding_constraints)
    low = checked(sharding_constraints)
    mesh = gspmd.Mesh.from_jax(sharding_constraints.MESH)
    w1 = low.sharding_of("params['w1']")
    assert w1 == gspmd.Sharding.from_mesh(mesh, [-1, "model"], (sharding_constraints.FEATURES, sharding_constraints.HIDDEN))
    assert set(counts(low)) == {"all-reduce"}, low.report()


def test_shard_map_ring_costs_its_permutes_and_the_parameter_gathers():
    low = checked(shard_map_ring)
    params = 2
    # The ring passes the loss and each gradient once (2 data shards); the region needs
    # the ZeRO-split parameters whole; its replicated gradients are sliced locally.
    assert counts(low) == {"collective-permute": 1 + params, "all-gather": params}, low.report()


# -- a sharded init with Flax's orthogonal initializer ---------------------------------------
def test_linen_lstm_initializes_in_place_and_sums_only_gradients():
    """The QR of the orthogonal recurrent kernels runs whole on each device (its input is
    drawn there), so nothing is gathered: the step's only collectives sum the gradients
    over the split batch."""
    low = checked(linen_lstm)
    assert set(counts(low)) == {"all-reduce"}, low.report()
    assert any(i.opcode == "linalg" for i in low.program.instrs), "the orthogonal initializer's QR"
