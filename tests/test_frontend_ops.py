"""Every primitive the frontend knows, traced, partitioned and run on 8 devices."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gspmd
from util import check, rand

MESH = gspmd.Mesh(np.arange(8).reshape(2, 4), ("x", "y"))


def split(x, *dims):
    return gspmd.mesh_split(x, MESH, list(dims))


UNARY = [jnp.negative, jnp.exp, jnp.tanh, jax.nn.sigmoid, jnp.abs, jnp.sign, jnp.floor, jnp.ceil,
         jnp.cos, jnp.sin, jnp.expm1, jnp.log1p, jax.nn.relu, jax.nn.gelu, lambda v: v ** 3,
         lambda v: jnp.sqrt(jnp.abs(v) + 1), lambda v: jax.lax.rsqrt(jnp.abs(v) + 1),
         lambda v: jnp.log(jnp.abs(v) + 1), lambda v: jnp.isfinite(v).astype(jnp.float32),
         lambda v: jnp.round(v), lambda v: jax.lax.stop_gradient(v) * 2]


@pytest.mark.parametrize("fn", UNARY)
def test_unary(fn):
    rng = np.random.RandomState(0)
    check(lambda a: fn(split(a, "x", "y")), rand(rng, 6, 10), mesh=MESH)


BINARY = [jnp.add, jnp.subtract, jnp.multiply, jnp.divide, jnp.maximum, jnp.minimum, jnp.arctan2,
          lambda a, b: jnp.power(jnp.abs(a) + 1, b), lambda a, b: jnp.where(a > b, a, b),
          lambda a, b: (a == b) | (a < b), lambda a, b: (a != b) & (a >= b), lambda a, b: a <= 2 * b,
          lambda a, b: jnp.fmod(a, jnp.abs(b) + 1), lambda a, b: a + 1.5]


@pytest.mark.parametrize("fn", BINARY)
def test_binary(fn):
    rng = np.random.RandomState(1)
    check(lambda a, b: fn(split(a, "y", "x"), b), rand(rng, 6, 10), rand(rng, 6, 10), mesh=MESH)


def test_integer_ops_and_conversions():
    def f(a, b):
        a = split(a, "x", -1)
        q = a // (jnp.abs(b) + 1)
        return q, a.astype(jnp.float32) * 0.5, a % 3, -a, jnp.maximum(a, b)

    rng = np.random.RandomState(2)
    check(f, rng.randint(-50, 50, (6, 4)).astype(np.int32), rng.randint(-5, 5, (6, 4)).astype(np.int32),
          mesh=MESH)


def test_softmax_einsum_mean_and_layout_ops():
    def f(x, w):
        x = split(x, "x", -1, "y")
        h = jnp.einsum("bsd,df->bsf", x, w)
        p = jax.nn.softmax(h, axis=-1)
        t = jnp.transpose(p, (2, 0, 1)).reshape(-1, p.shape[1])
        return p, jnp.mean(t, axis=0), jnp.broadcast_to(t[:, :1], t.shape) + t, jnp.expand_dims(h.sum(-1), 0)

    rng = np.random.RandomState(3)
    check(f, rand(rng, 4, 6, 8), rand(rng, 8, 12), mesh=MESH)


def test_iota_and_select_with_partition_offsets():
    def f(x):
        x = split(x, "y", "x")
        i = jax.lax.broadcasted_iota(jnp.int32, x.shape, 0)
        j = jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)
        return jnp.where(i >= j, x, 0.0), split(i * 10 + j, "y", "x")

    rng = np.random.RandomState(4)
    check(f, rand(rng, 9, 6), mesh=MESH)


def test_custom_jvp_and_jit_are_inlined():
    @jax.jit
    def inner(v):
        return jax.nn.softplus(v) + jax.nn.relu(v)

    def f(x):
        return jax.grad(lambda v: inner(split(v, "x", "y")).sum())(x)

    rng = np.random.RandomState(5)
    check(f, rand(rng, 4, 8), mesh=MESH)


def test_custom_partitioning_runs_its_function_partitioned_by_gspmd():
    """A kernel wrapped in jax.experimental.custom_partitioning (as TransformerEngine's
    and MaxText's are): gspmd partitions the function itself; its partition callback,
    written for XLA's shardings, is not called."""
    from jax.experimental.custom_partitioning import custom_partitioning

    @custom_partitioning
    def scaled_softmax(x):
        return jax.nn.softmax(x * 0.5, axis=-1)

    def never(*_):
        raise AssertionError("the partition callback ran")
    scaled_softmax.def_partition(infer_sharding_from_operands=never, partition=never, sharding_rule="i j -> i j")

    low = check(lambda x: scaled_softmax(split(x, "x", "y")), rand(np.random.RandomState(9), 4, 8), mesh=MESH)
    assert {c.kind for c in low.report().collectives} == {"all-reduce"}   # the softmax's max and sum


def test_pytree_inputs_and_outputs():
    def f(params, x):
        h = split(x, "x", -1) @ params["w"]
        return {"out": h + params["b"], "aux": (h.sum(), [h.max()])}

    rng = np.random.RandomState(6)
    check(f, {"w": rand(rng, 8, 4), "b": rand(rng, 4)}, rand(rng, 6, 8), mesh=MESH)


def test_unknown_primitive_raises_sharding_error():
    with pytest.raises(gspmd.ShardingError, match="rng_uniform"):
        gspmd.jit(lambda x: split(x, "x", -1) + jax.lax.rng_uniform(0.0, 1.0, (4, 4)), mesh=MESH)(
            np.ones((4, 4), np.float32))


def test_data_formatting_ops_run_through_the_replicate_fallback():
    def f(x):
        x = split(x, "x", "y")
        y = jnp.pad(x, ((1, 2), (0, 1)))[1:6:2]
        return jnp.concatenate([y, y * 2], axis=1), jax.lax.dynamic_slice(x, (1, 2), (2, 3))

    rng = np.random.RandomState(7)
    check(f, rand(rng, 8, 8), mesh=MESH)


def test_custom_vjp_is_inlined_forward_and_backward():
    @jax.custom_vjp
    def clip_grad(v):
        return v

    def fwd(v):
        return v, None

    def bwd(_, g):
        return (jnp.clip(g, -0.1, 0.1),)

    clip_grad.defvjp(fwd, bwd)

    def f(x):
        return jax.grad(lambda v: jnp.sum(clip_grad(split(v, "x", "y")) ** 3))(x)

    rng = np.random.RandomState(8)
    check(f, rand(rng, 4, 8), mesh=MESH)


def test_bfloat16_values_partition_and_run():
    def f(x, w):
        x, w = split(x, "x", -1), split(w, -1, "y")
        return jax.nn.relu(x @ w).sum(1), jnp.exp(x).max(0)

    rng = np.random.RandomState(9)
    x, w = jnp.asarray(rand(rng, 8, 16), jnp.bfloat16), jnp.asarray(rand(rng, 16, 8), jnp.bfloat16)
    check(f, x, w, mesh=MESH, rtol=2e-2, atol=2e-2)   # XLA may keep excess precision in fusions


def test_integer_bitwise_ops_follow_hlo():
    def f(a, b):
        a = split(a, "x", "y")
        return a & b, a | b, a ^ b, ~a, (a > 0) & (b > 0), ~(a > b)

    rng = np.random.RandomState(10)
    check(f, rng.randint(-40, 40, (6, 8)).astype(np.int32), rng.randint(-40, 40, (6, 8)).astype(np.int32), mesh=MESH)


def test_every_op_record_has_a_reference_and_a_lowering():
    """One record per op holds all of its knowledge: what runs it on the sim backend and
    on jax devices (manual regions are inlined into the SPMD program by partitioning)."""
    from gspmd.ops import OPS
    for opcode, op in OPS.items():
        semantics = op.semantics
        assert semantics.evaluate or semantics.evaluate_all or semantics.evaluate_programs or opcode == "manual", opcode
        assert semantics.lower is not None or opcode == "manual", opcode


def test_select_n_with_many_cases():
    rng = np.random.RandomState(2)
    which = np.array([[0, 1, 2, 3, 1, 0]] * 4, np.int32)
    cases = [rand(rng, 4, 6) for _ in range(4)]
    check(lambda w, *c: jax.lax.select_n(split(w, "x", "y"), *c), which, *cases, mesh=MESH)


def test_platform_index_is_the_platform_jax_runs_on():
    """lax.platform_dependent's index (its cond comes with the control-flow records)."""
    jaxpr = jax.make_jaxpr(lambda v: jax.lax.platform_dependent(v, tpu=jnp.sin, cpu=jnp.cos, default=jnp.tanh))(1.0)
    index = next(e for e in jaxpr.eqns if e.primitive.name == "platform_index")
    rng = np.random.RandomState(4)
    check(lambda a: split(a, "x", "y") * index.primitive.bind(**index.params), rand(rng, 4, 8), mesh=MESH)


@pytest.mark.parametrize("axis", [0, 1, 2, -1])
def test_stack_keeps_the_operands_splits_and_its_gradient(axis):
    """jnp.stack is a primitive of its own in this JAX: the stacked dim is new, the
    operands' splits (uneven: 6 rows over 2, 10 columns over 4) carry over to the others."""
    rng = np.random.RandomState(1)
    a, b = rand(rng, 6, 10), rand(rng, 6, 10)

    def f(a, b):
        return jnp.stack([split(a, "x", "y"), jnp.tanh(b), a * b], axis=axis)
    low = check(f, a, b, mesh=MESH)
    assert low.report().counts() == {}, low.report()   # the splits carry over: nothing moves
    check(jax.grad(lambda a, b: jnp.sum(f(a, b) ** 2), argnums=(0, 1)), a, b, mesh=MESH)


@pytest.mark.parametrize("reps", [(2, 1), (1, 3), (3, 2), (2, 2, 1)])
def test_tile_and_its_gradient(reps):
    """jnp.tile is a primitive of its own in this JAX; on split operands (uneven: 6 rows
    over 2, 10 columns over 4) it equals one device, forward and backward."""
    rng = np.random.RandomState(2)
    a = rand(rng, 6, 10)

    def f(a):
        return jnp.tile(split(a, "x", "y"), reps) * 1.5
    check(f, a, mesh=MESH)
    check(jax.grad(lambda a: jnp.sum(jnp.sin(f(a)))), a, mesh=MESH)


# Values with no elements wherever jax.jit takes them, split on their empty dim or on
# another: nothing to move, so no collectives.
EMPTY = {
    "element-wise": (lambda a: jnp.sin(split(a, "x", "y")) * 2, [(0, 7)]),
    "broadcast": (lambda a, b: split(a, None, "y") + b, [(0, 7), (7,)]),
    "dot, empty contraction": (lambda a, b: split(a, "x", None) @ b, [(6, 0), (0, 5)]),
    "dot, empty result": (lambda a, b: split(a, "x", "y") @ b, [(0, 3), (3, 5)]),
    "dot, empty batch": (lambda a, b: jnp.einsum("bij,bjk->bik", split(a, "x", "y", None), b), [(0, 3, 4), (0, 4, 2)]),
    "reductions": (lambda a: (split(a, "x", "y").sum(0), a.max(1), a.prod(), jnp.argmax(a, 1)), [(0, 7)]),
    "concatenate": (lambda a, b: jnp.concatenate([split(a, "x", "y"), b], 0), [(0, 5), (6, 5)]),
    "reshape, pad": (lambda a: (split(a, "x", "y").reshape(7, 0, 1).T, jnp.pad(a, ((1, 2), (0, 1)))), [(0, 7)]),
    "slice to nothing": (lambda a: split(a, "x", "y")[2:2, 1:5], [(6, 7)]),
    "cumsum, sort": (lambda a: (jnp.cumsum(split(a, "x", "y"), 0), jnp.sort(a, 0)), [(0, 7)]),
    "convolution": (lambda x, w: jax.lax.conv_general_dilated(split(x, "x", None, "y"), w, (1,), "SAME"),
                    [(0, 3, 9), (2, 3, 3)]),
}


@pytest.mark.parametrize("case", EMPTY)
def test_values_with_no_elements(case):
    fn, shapes = EMPTY[case]
    rng = np.random.RandomState(0)
    report = check(fn, *[rand(rng, *s) for s in shapes], mesh=MESH).report()
    assert not report.collectives, str(report)


def test_gradients_through_values_with_no_elements():
    """A dot over an empty contraction is zeros; its gradients are empty; an empty operand
    of a concatenate gets an empty gradient."""
    rng = np.random.RandomState(1)

    def grads(a, b, c):
        def loss(a, b, c):
            return (split(a, "x", None) @ b).sum() + (jnp.concatenate([split(c, "x", "y"), b.T], 0) ** 2).sum()
        return jax.grad(loss, (0, 1, 2))(a, b, c)
    report = check(grads, rand(rng, 6, 0), rand(rng, 0, 5), rand(rng, 3, 0), mesh=MESH).report()
    assert not report.collectives, str(report)
