"""A top-2 mixture-of-experts layer: softmax gate over experts, lax.top_k(k=2), one-hot
dispatch, annotated for data parallelism (token groups) and expert parallelism; the
forward pass and the gradient equal one device."""
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import gspmd
from util import check, rand

MESH = gspmd.Mesh(np.arange(8).reshape(2, 4), ("data", "expert"))
GROUPS, TOKENS, MODEL, HIDDEN, EXPERTS = 4, 6, 8, 12, 4


def split(x, *dims):
    return gspmd.mesh_split(x, MESH, list(dims))


def top2_moe(params, x, gates_from_top_k=False):
    """x: [groups, tokens, model]. Each token goes to its two best experts, weighted by
    their renormalised gate probabilities."""
    x = split(x, "data", -1, -1)
    w_gate = split(params["gate"], -1, -1)
    w_in, w_out = split(params["w_in"], "expert", -1, -1), split(params["w_out"], "expert", -1, -1)
    logits = split(jnp.einsum("gsm,me->gse", x, w_gate), "data", -1, "expert")
    probs = jax.nn.softmax(logits, axis=-1)
    top_probs, experts = lax.top_k(probs, 2)                                # [g, s, 2]
    dispatch = jax.nn.one_hot(experts, EXPERTS, dtype=x.dtype)              # [g, s, 2, e]
    # The chosen experts' probabilities, read through the one-hot masks (GShard's way)
    # or straight from top_k's values.
    gates = top_probs if gates_from_top_k else jnp.einsum("gse,gske->gsk", probs, dispatch)
    gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    routed = split(jnp.einsum("gske,gsm->egsm", dispatch, x), "expert", "data", -1, -1)
    h = jax.nn.relu(jnp.einsum("egsm,emh->egsh", routed, w_in))
    out = split(jnp.einsum("egsh,ehm->egsm", h, w_out), "expert", "data", -1, -1)
    return jnp.einsum("gsk,gske,egsm->gsm", gates, dispatch, out)


def inputs(seed=0):
    rng = np.random.RandomState(seed)
    params = {"gate": rand(rng, MODEL, EXPERTS), "w_in": rand(rng, EXPERTS, MODEL, HIDDEN) / 3,
              "w_out": rand(rng, EXPERTS, HIDDEN, MODEL) / 3}
    return params, rand(rng, GROUPS, TOKENS, MODEL), rand(rng, GROUPS, TOKENS, MODEL)


def loss(params, x, target, gates_from_top_k=False):
    return jnp.mean((top2_moe(params, x, gates_from_top_k) - target) ** 2)


def test_top2_forward_equals_one_device():
    params, x, _ = inputs()
    low = check(top2_moe, params, x, mesh=MESH)
    gating = [c for c in low.report().collectives if "top-k" in c.origin]
    assert all(c.bytes <= GROUPS * TOKENS * EXPERTS * 4 for c in gating), low.report()   # no more than the gate
    assert low.program.params[1].sharding == gspmd.Sharding.from_mesh(MESH, ["expert", -1, -1], (4, 8, 12))


def test_top2_gradient_equals_one_device():
    params, x, target = inputs(1)
    low = check(jax.grad(loss), params, x, target, mesh=MESH)
    w_in = gspmd.Sharding.from_mesh(MESH, ["expert", -1, -1], params["w_in"].shape)
    assert low.sharding_of(1) == w_in   # the expert weights' gradient stays split by expert


def test_top2_gradient_through_top_k_values():
    params, x, target = inputs(2)
    check(jax.grad(lambda p, v, t: loss(p, v, t, gates_from_top_k=True)), params, x, target, mesh=MESH)
