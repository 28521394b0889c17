"""Typed PRNG keys (jax.random.key) in and around a Program, which has no key dtype: a
key array of shape K is its uint32 key data, shape K + (2,) (threefry2x32; ops/random.py)
or K + (4,) (rbg, unsafe_rbg).

- The random primitives' converters (their records' `converts_keys`) take and make key
  data, and so do layout annotations (a key's layout is its key data's, words whole);
  control flow carries it like any value.
- Every other primitive on keys only moves them around (slice, squeeze, concatenate,
  select, gather, ...): it moves each key word the same way, so it is converted once per
  word, on uint32 arrays of the keys' own shape, and the words are stacked again.
- At gspmd.jit's boundary, key arguments enter as their key data and key results leave
  as key arrays again (KeyData).
"""
from __future__ import annotations

from typing import Callable, Sequence

import jax
import numpy as np
from jax.extend import core as jcore

from gspmd.errors import ShardingError
from gspmd.ir import Value
from gspmd.ops import KEY_PRIMITIVES
from gspmd.ops.convert import Conversion, Converter, is_key
from gspmd.ops.random import key_impl, key_words, stack_words


def moves_keys(eqn) -> bool:
    """Whether `eqn` is a primitive that moves typed keys around without knowing them."""
    return (any(is_key(v.aval.dtype) for v in (*eqn.invars, *eqn.outvars)) and eqn.primitive.name not in KEY_PRIMITIVES
            and not list(jcore.jaxprs_in_params(eqn.params)))


def convert_per_word(b: Conversion, eqn, args: list[Value], convert: Converter) -> list[Value]:
    """Convert `eqn` once per key word, on the words of its key operands, and stack the
    words of its results."""
    words = [key_words(b, a) if is_key(v.aval.dtype) else None for v, a in zip(eqn.invars, args)]
    if not any(words) or not all(is_key(v.aval.dtype) for v in eqn.outvars):
        raise ShardingError(f"`{eqn}` makes PRNG keys from other values or other values from keys; gspmd knows "
                            "no rule for that. Use jax.random.key_data / wrap_key_data around it.")
    on_words = eqn.replace(invars=[_word_var(v) for v in eqn.invars], outvars=[_word_var(v) for v in eqn.outvars])
    per_word = [convert(b, on_words, [a if w is None else w[i] for a, w in zip(args, words)])
                for i in range(len(next(w for w in words if w)))]
    return [stack_words(b, [outs[j] for outs in per_word]) for j in range(len(eqn.outvars))]


def _word_var(v):
    """A variable for one word of key variable `v` (other atoms as they are)."""
    if not is_key(v.aval.dtype):
        return v
    return jcore.Var(v.aval.update(dtype=np.dtype(np.uint32)))


def constant(value) -> np.ndarray:
    """A constant of the program (a closed-over array): key arrays as their key data."""
    if is_key(getattr(value, "dtype", None)):
        return np.asarray(jax.random.key_data(value))
    return np.asarray(value)


class KeyData:
    """gspmd.jit's boundary for typed keys: `fn` (flat arguments, as traced) takes and
    returns key data where the user's function takes and returns key arrays; `args` and
    `results` convert the values of one call."""

    def __init__(self, fn: Callable, avals: Sequence[jax.ShapeDtypeStruct]):
        self.key_args = [_impl_of(a) for a in avals]   # each argument's PRNG, None: not a key
        self.avals = [a if k is None else jax.eval_shape(jax.random.key_data, a) for a, k in zip(avals, self.key_args)]
        self.key_results: list = []

        def on_key_data(*flat):
            outs = fn(*[_wrap(x, k) for x, k in zip(flat, self.key_args)])
            leaves, tree = jax.tree_util.tree_flatten(outs)
            self.key_results = [_impl_of(x) for x in leaves]
            return jax.tree_util.tree_unflatten(tree, [x if k is None else jax.random.key_data(x)
                                                       for x, k in zip(leaves, self.key_results)])
        self.fn = on_key_data

    def args(self, flat: Sequence) -> list:
        return [x if _impl_of(x) is None else jax.random.key_data(x) for x in flat]

    def results(self, flat: Sequence) -> list:
        return [_wrap(x, k) for x, k in zip(flat, self.key_results)]


def _impl_of(x):
    """The PRNG implementation of a key array (or its aval); None for other values."""
    dtype = getattr(x, "dtype", None)
    return key_impl(dtype) if is_key(dtype) else None


def _wrap(x, impl):
    return x if impl is None else jax.random.wrap_key_data(x, impl=impl)
