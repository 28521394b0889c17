"""Differential testing: a partitioned program must equal the single-device program."""
from __future__ import annotations

import jax
import numpy as np

import gspmd


def assert_close(actual, expected, rtol=1e-4, atol=1e-4):
    a_leaves, a_tree = jax.tree_util.tree_flatten(actual)
    e_leaves, e_tree = jax.tree_util.tree_flatten(expected)
    assert a_tree == e_tree, (a_tree, e_tree)
    for a, e in zip(a_leaves, e_leaves):
        a, e = np.asarray(a), np.asarray(e)
        assert a.shape == e.shape and a.dtype == e.dtype, (a.shape, a.dtype, e.shape, e.dtype)
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol)


def check(fn, *args, mesh=None, rtol=1e-4, atol=1e-4) -> gspmd.Lowered:
    """Run fn partitioned and on one device; assert equal; return the Lowered."""
    partitioned = gspmd.jit(fn, mesh=mesh)
    assert_close(partitioned(*args), jax.jit(fn)(*args), rtol, atol)
    return partitioned.lower(*args)


def rand(rng: np.random.RandomState, *shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)
