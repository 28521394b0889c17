"""Dimension factors: several factors on one dim (reshape), and permutation factors
(concatenate), on their own and through the ops that use them."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import gspmd
from gspmd.ops.shape import reshape_factors
from gspmd.spmd import factors as fx
from util import check

MESH = gspmd.Mesh(np.arange(8).reshape(2, 4), ("x", "y"))


def test_a_split_falls_on_whole_major_factors_then_one_that_divides():
    assert fx.split_over([2, 8], 4) == [2, 2]
    assert fx.split_over([4, 2], 2) == [2, 1]
    assert fx.split_over([3, 2], 2) is None      # shards would not be runs of whole factors
    assert fx.split_over([1, 10], 4) == [1, 4]   # one factor alone may split unevenly
    assert fx.split_over([2, 5], 4) is None


def test_reshape_factors_refine_both_sides_and_keep_the_rest_of_a_run_whole():
    assert [(f.size, f.dims) for f in reshape_factors((16,), (2, 8))] == [(2, (0, 0)), (8, (0, 1))]
    assert [(f.size, f.dims) for f in reshape_factors((4, 6), (8, 3))] == [(4, (0, 0)), (2, (1, 0)), (3, (1, 1))]
    kinds = {f.kind for f in reshape_factors((2, 3), (3, 2))}
    assert kinds == {fx.REPLICATE}


def test_a_split_is_carried_through_several_factors_exactly_or_not_at_all():
    factors = reshape_factors((16,), (2, 8))
    s = gspmd.Sharding(np.arange(4).reshape(4, 1))
    assert fx.carried(factors, s, 0, 1, 2).tiles == (2, 2)
    back = fx.carried(factors, fx.carried(factors, s, 0, 1, 2), 1, 0, 1)
    assert back == s
    minor_only = gspmd.Sharding(np.arange(2).reshape(1, 2, 1))    # [2, 8] split (1, 2): not contiguous in 16
    assert fx.carried(factors, minor_only, 1, 0, 1) is None


def test_a_concatenated_dim_is_a_permutation_factor_carried_by_propagation():
    def f(a, b):
        a = gspmd.mesh_split(a, MESH, ["y", -1])
        return jnp.concatenate([a, b], axis=0) * 2

    rng = np.random.RandomState(0)
    x, y = rng.standard_normal((8, 6)).astype(np.float32), rng.standard_normal((4, 6)).astype(np.float32)
    low = check(f, x, y, mesh=MESH)
    assert low.sharding_of("b").tiles[0] == 4    # b takes the split of the concatenated dim
