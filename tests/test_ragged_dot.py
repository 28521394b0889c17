"""lax.ragged_dot (grouped matmuls: a MoE's tokens sorted by expert times each expert's
weights) and its gradients: equal to one device on both backends. The ragged (token) dim
and the groups (experts) split as well as the other dims: each device multiplies its own
tokens with its own experts, the group sizes within them computed from all the sizes. Tokens split: no communication forward, one all-reduce
of the weights' gradient; experts split: no gather of their weights, each device's
experts' products summed."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax import lax

import gspmd
from strategies import dims_mappings, meshes
from util import check

MESH = gspmd.Mesh(np.arange(8).reshape(2, 4), ("x", "y"))
RNG = np.random.RandomState(0)
TOKENS = RNG.standard_normal((10, 6)).astype(np.float32)     # 10 tokens: uneven over 4 (3, 3, 3, 1)
WEIGHTS = RNG.standard_normal((3, 6, 5)).astype(np.float32)  # 3 experts
SIZES = np.array([3, 5, 1], np.int32)                         # the last token in no group


def split(x, *dims, mesh=MESH):
    return gspmd.mesh_split(x, mesh, list(dims))


def collectives(low) -> list[str]:
    return sorted(c.kind for c in low.report().collectives)


@pytest.mark.parametrize("tokens,weights,expected", [
    ((-1, -1), (-1, -1, -1), []),
    (("y", -1), (-1, -1, -1), []),                    # tokens split: each device its own
    (("x", "y"), (-1, "y", -1), ["all-reduce"]),      # contracting dim split: partial sums
    ((-1, -1), (-1, -1, "y"), []),                    # the weights' output dim split
    ((-1, "y"), ("x", -1, -1), ["all-reduce"]),       # experts split too: each device its experts'
    (("x", -1), ("y", -1, -1), ["all-reduce"]),       # 3 experts over 4 devices, tokens over 2
])
def test_grouped_matmul_equals_one_device(tokens, weights, expected):
    def f(x, w, sizes):
        return lax.ragged_dot(split(x, *tokens), split(w, *weights), sizes)
    assert collectives(check(f, TOKENS, WEIGHTS, SIZES, mesh=MESH)) == expected


def test_gradients_with_tokens_split_reduce_only_the_weights_gradient():
    """d/dw is a ragged dot whose ragged dim contracts: split, it leaves partial sums per
    expert, all-reduced once; d/dx is a grouped matmul of each device's own tokens."""
    def loss(x, w, sizes):
        return jnp.sum(jnp.tanh(lax.ragged_dot(split(x, "y", -1), w, sizes)) ** 2)

    low = check(jax.grad(loss, (0, 1)), TOKENS, WEIGHTS, SIZES, mesh=MESH)
    assert collectives(low) == ["all-reduce"]
    assert low.report().collectives[0].bytes == WEIGHTS.nbytes


def test_experts_split_are_never_gathered():
    """Expert parallelism with the tokens on another axis: forward, partial sums over the
    experts' axis; the weights' gradient, each device its own experts', reduced over the
    tokens' axis only."""
    def loss(x, w, sizes):
        return jnp.sum(jnp.tanh(lax.ragged_dot(split(x, "x", -1), split(w, "y", -1, -1), sizes)) ** 2)

    low = check(jax.value_and_grad(loss, (0, 1)), TOKENS, WEIGHTS, SIZES, mesh=MESH)
    assert "all-gather" not in collectives(low)
    weight_bytes = WEIGHTS.nbytes // 3   # one expert's, per device
    assert all(c.bytes <= max(weight_bytes, 5 * 10 * 4) for c in low.report().collectives), low.report()


def test_gradients_with_2d_sharding():
    def loss(x, w, sizes):
        y = lax.ragged_dot(split(x, "x", "y"), split(w, -1, "y", -1), sizes)
        return jnp.sum(split(y, "x", -1) ** 2)

    check(jax.grad(loss, (0, 1)), TOKENS, WEIGHTS, SIZES, mesh=MESH)


def test_vmapped_over_a_batch_with_sizes_per_batch_element():
    """vmap gives batch dims and group sizes [batch, groups]; batch and tokens split."""
    x = RNG.standard_normal((4, 10, 6)).astype(np.float32)
    w = RNG.standard_normal((4, 3, 6, 5)).astype(np.float32)
    sizes = np.array([[3, 5, 1], [0, 10, 0], [2, 2, 2], [9, 0, 1]], np.int32)

    def loss(x, w, sizes):
        y = jax.vmap(lax.ragged_dot)(split(x, "x", "y", -1), split(w, "x", -1, -1, -1), sizes)
        return jnp.sum(y ** 2)

    low = check(jax.value_and_grad(loss, (0, 1)), x, w, sizes, mesh=MESH)
    assert "all-gather" not in collectives(low)


def test_sizes_shared_by_every_batch_element():
    """A rank-1 group_sizes with a batch dim: the same sizes for each element."""
    x = RNG.standard_normal((4, 10, 6)).astype(np.float32)
    w = RNG.standard_normal((4, 3, 6, 5)).astype(np.float32)
    numbers = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((2,), (2,)), ((0,), (0,))),
                                            lhs_ragged_dimensions=(1,), rhs_group_dimensions=(1,))

    def f(x, w, sizes):
        return lax.ragged_dot_general(split(x, "x", "y", -1), w, sizes, numbers)
    check(f, x, w, SIZES, mesh=MESH)


def test_ragged_contracting_dim_split_unevenly():
    """lax.ragged_dot_general with the ragged dim contracting, as a user writes it."""
    numbers = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((0,), (0,)), ((), ())),
                                            lhs_ragged_dimensions=(0,), rhs_group_dimensions=())
    g = RNG.standard_normal((10, 5)).astype(np.float32)

    def f(x, g, sizes):
        return lax.ragged_dot_general(split(x, "y", "x"), split(g, "y", -1), sizes, numbers)
    low = check(f, TOKENS, g, SIZES, mesh=MESH)
    assert collectives(low) == ["all-reduce"]


def test_ragged_batch_dim_is_a_dot():
    numbers = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((2,), (1,)), ((0,), (0,))),
                                            lhs_ragged_dimensions=(0,), rhs_group_dimensions=())
    x, w = TOKENS.reshape(2, 5, 6), RNG.standard_normal((2, 6, 3)).astype(np.float32)

    def f(x, w):
        return lax.ragged_dot_general(split(x, "x", -1, "y"), w, jnp.array([1, 1], jnp.int32), numbers)
    check(f, x, w, mesh=MESH)


def test_bfloat16_with_float32_results():
    def f(x, w, sizes):
        return lax.ragged_dot(split(x, "y", -1), w, sizes, preferred_element_type=jnp.float32)
    check(f, TOKENS.astype(jnp.bfloat16), WEIGHTS.astype(jnp.bfloat16), SIZES, mesh=MESH, rtol=1e-2, atol=1e-2)


def test_flops_count_each_token_once():
    """Per device: its 3 tokens, each times one expert's [6, 5] weights."""
    low = gspmd.jit(lambda x, w, s: lax.ragged_dot(split(x, "y", -1), w, s), mesh=MESH).lower(TOKENS, WEIGHTS, SIZES)
    assert low.report().flops == 2 * 3 * 6 * 5


@st.composite
def ragged_cases(draw):
    mesh = draw(meshes([(2,), (4,), (3,), (2, 2), (2, 4)]))
    tokens, groups = draw(st.integers(1, 13)), draw(st.integers(1, 4))
    sizes = draw(st.lists(st.integers(0, tokens), min_size=groups, max_size=groups))
    return (mesh, tokens, np.asarray(sizes, np.int32), draw(dims_mappings(mesh, 2)), draw(dims_mappings(mesh, 3)),
            draw(st.integers(0, 2 ** 16)))


def _check_ragged(case):
    mesh, tokens, sizes, x_dims, w_dims, seed = case
    rng = np.random.RandomState(seed)
    x = rng.standard_normal((tokens, 6)).astype(np.float32)
    w = rng.standard_normal((len(sizes), 6, 3)).astype(np.float32)

    def step(x, w, sizes):
        def loss(x, w):
            return jnp.sum(lax.ragged_dot(split(x, *x_dims, mesh=mesh), split(w, *w_dims, mesh=mesh), sizes) ** 2)
        return jax.value_and_grad(loss, (0, 1))(x, w)
    check(step, x, w, sizes, mesh=mesh)


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(ragged_cases())
def test_random_grouped_matmuls(case):
    """Group sizes that overrun the tokens or leave some in no group, on random layouts."""
    _check_ragged(case)


@pytest.mark.slow
@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(ragged_cases())
def test_random_grouped_matmuls_slow(case):
    _check_ragged(case)
