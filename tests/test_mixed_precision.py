"""Mixed precision (float32 parameters, bfloat16 activations) and the optimizers of the
case studies' train steps (models/optimizers.py): partitioned equals one device."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gspmd
from gspmd.models import moe, pipelined, transformer as T
from gspmd.models.optimizers import SGD, AdamW, Adafactor
from util import check

MESH = gspmd.Mesh(np.arange(8).reshape(2, 4), ("x", "y"))
BF16 = dict(rtol=2e-2, atol=2e-2)   # partial sums combine in another order, rounded to 8 bits


def _with_state(optimizer, params, *batch):
    return (params, *batch) if optimizer is None else (params, optimizer.init(params), *batch)


@pytest.mark.parametrize("optimizer", [None, AdamW(), Adafactor()], ids=["sgd", "adamw", "adafactor"])
def test_transformer_bf16_activations_fp32_parameters(optimizer):
    cfg = T.Config(dtype=jnp.bfloat16)
    params, x, target = T.example_inputs(cfg)
    step = T.make_train_step(T.gspmd_annotate(MESH), cfg, optimizer=optimizer)
    low = check(step, *_with_state(optimizer, params, x, target), mesh=MESH, **BF16)
    assert not any(p.dtype == jnp.bfloat16 for p in low.program.params)   # parameters stay float32
    assert any(v.dtype == jnp.bfloat16 for v in low.program.all_values())
    assert any(v.dtype == jnp.bfloat16 for v in low.spmd.all_values())
    # the annotations still decide the layouts: weights all-gathered, gradients reduce-scattered
    assert {"all-gather", "reduce-scatter"} <= set(low.report().counts())


@pytest.mark.parametrize("dtype, optimizer", [(jnp.bfloat16, Adafactor()), (np.float32, AdamW())],
                         ids=["bf16-adafactor", "fp32-adamw"])
def test_moe_mixed_precision_and_optimizers(dtype, optimizer):
    mesh = gspmd.Mesh(np.arange(8), ("x",))
    cfg = moe.Config(dtype=dtype)
    params, x, target = moe.example_inputs(cfg)
    low = check(moe.make_train_step(mesh, cfg=cfg, optimizer=optimizer), params, optimizer.init(params), x,
                target, mesh=mesh, **(BF16 if dtype == jnp.bfloat16 else {}))
    assert low.report().counts()["all-to-all"] >= 2


@pytest.mark.slow
def test_pipeline_bf16_adamw():
    mesh = gspmd.Mesh(np.arange(8).reshape(2, 4), ("p", "x"))
    cfg = T.Config(layers=2, dtype=jnp.bfloat16)
    stacked, xs, targets = pipelined.example_inputs(cfg, microbatches=4)
    opt = AdamW()
    check(pipelined.make_train_step(mesh, cfg, optimizer=opt), stacked, opt.init(stacked), xs, targets, mesh=mesh,
          **BF16)


def test_adafactor_keeps_factored_second_moments():
    params = {"w": np.ones((6, 4, 5), np.float32), "b": np.ones(5, np.float32)}
    state = Adafactor().init(params)
    assert [{k: v.shape for k, v in m.items()} for m in state["v"]] == [{"v": (5,)}, {"row": (6, 4), "col": (6, 5)}]


def test_adafactor_first_step_of_a_rank_one_gradient_moves_each_weight_by_lr():
    """g = a b^T: the factored moments reconstruct g^2 exactly, so the first update is
    lr * sign(g) (decay 0 at step one, RMS of the update 1: no clipping)."""
    a, b = np.array([1.0, -2.0, 3.0], np.float32), np.array([0.5, -1.0], np.float32)
    w = np.zeros((3, 2), np.float32)
    opt = Adafactor(lr=0.1)
    new, state = opt.update({"w": np.outer(a, b)}, opt.init({"w": w}), {"w": w})
    np.testing.assert_allclose(new["w"], -0.1 * np.sign(np.outer(a, b)), rtol=1e-6)
    assert int(state["count"]) == 1


def test_adamw_matches_optax():
    optax = pytest.importorskip("optax")
    rng = np.random.RandomState(0)
    params = {"w": rng.standard_normal((4, 3)).astype(np.float32), "b": rng.standard_normal(3).astype(np.float32)}
    ours, theirs = AdamW(lr=0.01, weight_decay=0.1), optax.adamw(0.01, weight_decay=0.1)
    state, reference = ours.init(params), theirs.init(params)
    p, q = params, params
    for _ in range(3):
        grads = jax.tree_util.tree_map(lambda x: np.sin(x) + 0.1, p)
        p, state = ours.update(grads, state, p)
        updates, reference = theirs.update(jax.tree_util.tree_map(lambda x: np.sin(x) + 0.1, q), reference, q)
        q = optax.apply_updates(q, updates)
    for x, y in zip(jax.tree_util.tree_leaves(p), jax.tree_util.tree_leaves(q)):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def test_sgd_is_the_default_step():
    cfg = T.Config()
    params, x, target = T.example_inputs(cfg)
    plain = jax.jit(T.make_train_step(T.gspmd_annotate(MESH), cfg))(params, x, target)
    explicit = jax.jit(T.make_train_step(T.gspmd_annotate(MESH), cfg, optimizer=SGD(cfg.lr)))(params, (), x, target)
    for a, b in zip(jax.tree_util.tree_leaves(plain), jax.tree_util.tree_leaves((explicit[0], explicit[2]))):
        np.testing.assert_allclose(a, b)
