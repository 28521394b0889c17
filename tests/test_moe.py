"""The MoE case study: expert dispatch and combine are all-to-alls, nothing else moves
in the forward pass; the train step equals one device."""
import jax
import numpy as np

import gspmd
from gspmd.models import moe
from util import check

MESH = gspmd.Mesh(np.arange(8), ("x",))


def test_moe_forward_dispatches_with_all_to_all():
    cfg = moe.Config()
    params, x, _ = moe.example_inputs(cfg)
    low = check(lambda p, v: moe.moe_layer(p, v, MESH, "x", cfg), params, x, mesh=MESH)
    kinds = [c.kind for c in low.report().collectives]
    assert kinds.count("all-to-all") == 2, low.report()
    assert "all-gather" not in kinds, low.report()   # tokens never gathered


def test_moe_train_step_and_cumsum_capacity():
    cfg = moe.Config(groups=8, group_size=6, capacity=2)   # capacity drops some tokens
    check(moe.make_train_step(MESH, "x", cfg), *moe.example_inputs(cfg, seed=1), mesh=MESH)


def test_cumsum_along_split_and_whole_dims():
    mesh = gspmd.Mesh(np.arange(8).reshape(2, 4), ("x", "y"))
    x = np.random.RandomState(2).standard_normal((6, 7)).astype(np.float32)
    check(lambda a: (jax.numpy.cumsum(gspmd.mesh_split(a, mesh, ["x", "y"]), axis=1),
                     jax.lax.cumsum(a, axis=0, reverse=True)), x, mesh=mesh)


def test_hybrid_moe_splits_each_expert_over_the_second_axis():
    mesh = gspmd.Mesh(np.arange(8).reshape(2, 4), ("x", "y"))
    cfg = moe.Config(groups=4, experts=2, hidden=16)
    params, x, target = moe.example_inputs(cfg)
    low = check(lambda p, v: moe.moe_layer(p, v, mesh, "x", cfg, expert_axis="y"), params, x, mesh=mesh)
    report = low.report()
    assert report.counts()["all-to-all"] == 2, report
    # Tokens keep M split over "y" (as the dense layers' activations): the all-to-alls
    # over "x" move a quarter of them, the experts' einsum gathers M on demand, and the
    # expert output's partial sums over the split hidden dim are reduce-scattered onto M.
    y_groups = {(0, 1, 2, 3), (4, 5, 6, 7)}
    tokens = cfg.experts // 2 * cfg.groups * cfg.capacity * cfg.model * 4   # [E, G, C, M] per x-shard, float32
    assert all(c.bytes == tokens // 4 for c in report.collectives if c.kind == "all-to-all"), report
    assert any(c.kind == "reduce-scatter" and set(c.groups) == y_groups for c in report.collectives), report
    assert low.program.params[1].sharding == gspmd.Sharding.from_mesh(mesh, ["x", -1, "y"], params["w_in"].shape)
    check(moe.make_train_step(mesh, "x", cfg, expert_axis="y"), params, x, target, mesh=mesh)


def test_dropless_moe_with_ragged_dot():
    """Tokens sorted by expert per group and multiplied by lax.ragged_dot (no capacity, no
    token dropped): groups over x, the experts' weights over y (3 experts over 4 devices:
    uneven). Nothing is gathered; the experts' partial sums are all-reduced over y, their
    weights' gradients over x."""
    mesh = gspmd.Mesh(np.arange(8).reshape(2, 4), ("x", "y"))
    cfg = moe.Config(groups=6, group_size=16, model=8, hidden=16, experts=3)
    low = check(moe.make_train_step(mesh, "x", cfg, expert_axis="y", dropless=True), *moe.example_inputs(cfg),
                mesh=mesh)
    kinds = {c.kind for c in low.report().collectives}
    assert kinds == {"all-reduce"}, low.report()
