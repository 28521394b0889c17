"""A top-2 mixture-of-experts layer (GShard's): a softmax gate over the experts,
lax.top_k picks each token's two experts, one-hot dispatch and combine, the
load-balancing auxiliary loss; trained with optax.adam.

Annotations: the token groups (3, over 2: uneven) over "data"; the experts' weights,
the dispatched tokens and the experts' outputs over "expert" (expert parallelism)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

import gspmd

MESH = gspmd.Mesh(np.arange(8).reshape(2, 4), ("data", "expert"))
GROUPS, TOKENS, WIDTH, HIDDEN, EXPERTS, AUX_WEIGHT = 3, 6, 8, 12, 4, 0.01
ANNOTATIONS = {
    "x": P("data", None, None), "gate": P(), "w_in": P("expert", None, None), "w_out": P("expert", None, None),
    "logits": P("data", None, "expert"), "dispatched": P("expert", "data", None, None),
}
OPTIMIZER = optax.adam(1e-2)


def split(x, name):
    return gspmd.mesh_split(x, MESH, ANNOTATIONS[name])


def top2_moe(params, x):
    """x: [groups, tokens, width] -> (output, auxiliary loss)."""
    x = split(x, "x")
    logits = split(jnp.einsum("gsm,me->gse", x, split(params["gate"], "gate")), "logits")
    probs = jax.nn.softmax(logits, axis=-1)
    top_probs, experts = lax.top_k(probs, 2)                                   # [g, s, 2]
    dispatch = jax.nn.one_hot(experts, EXPERTS, dtype=x.dtype)                 # [g, s, 2, e]
    gates = top_probs / jnp.sum(top_probs, axis=-1, keepdims=True)
    routed = split(jnp.einsum("gske,gsm->egsm", dispatch, x), "dispatched")
    h = jax.nn.relu(jnp.einsum("egsm,emh->egsh", routed, split(params["w_in"], "w_in")))
    out = split(jnp.einsum("egsh,ehm->egsm", h, split(params["w_out"], "w_out")), "dispatched")
    # Load balance: the share of tokens whose first choice is each expert, times the
    # mean gate probability of that expert, summed over experts (1 when balanced).
    first_choice_share = dispatch[:, :, 0].mean(axis=1)                        # [g, e]
    aux = (first_choice_share * probs.mean(axis=1)).sum(-1).mean() * EXPERTS
    return jnp.einsum("gsk,gske,egsm->gsm", gates, dispatch, out), aux


def train_step(params, opt_state, x, target):
    def loss_fn(params):
        y, aux = top2_moe(params, x)
        return jnp.mean((y - target) ** 2) + AUX_WEIGHT * aux, aux

    (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, aux


def example_inputs(seed: int = 0):
    rng = np.random.RandomState(seed)

    def normal(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(np.float32)
    params = {"gate": normal(WIDTH, EXPERTS), "w_in": normal(EXPERTS, WIDTH, HIDDEN, scale=0.3),
              "w_out": normal(EXPERTS, HIDDEN, WIDTH, scale=0.3)}
    return params, OPTIMIZER.init(params), normal(GROUPS, TOKENS, WIDTH), normal(GROUPS, TOKENS, WIDTH)
