"""Reducers: the binary computations that reduce, all-reduce, reduce-scatter, scatter
and reduce-window combine elements with. One small record each holds everything the
passes need: its NumPy and jax forms and its identity (what padding is masked with)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
from jax import lax
from jax import numpy as jnp

from gspmd.dtypes import is_floating


def _extreme(highest: bool) -> Callable:
    def identity(dtype: np.dtype):
        if is_floating(dtype):
            return np.inf if highest else -np.inf
        if dtype == np.bool_:
            return highest
        info = np.iinfo(dtype)
        return info.max if highest else info.min
    return identity


def _all_bits(dtype: np.dtype):
    return True if dtype == np.bool_ else np.asarray(-1).astype(dtype)


@dataclass(frozen=True, eq=False)
class Reducer:
    name: str                 # HLO's name of the computation
    combine: np.ufunc         # NumPy binary form (bitwise on integers, logical on booleans)
    lax_combine: Callable     # jax binary form
    _identity: Callable       # dtype -> the identity element

    def identity(self, dtype) -> np.ndarray:
        """x op identity == x for every x of `dtype`."""
        dtype = np.dtype(dtype)
        return np.asarray(self._identity(dtype), dtype)

    def reduce(self, x: np.ndarray, axis: Sequence[int]) -> np.ndarray:
        """NumPy reduction of x over `axis` (empty reductions give the identity)."""
        return self.combine.reduce(x, axis=tuple(axis), initial=self.identity(x.dtype))

    def lax_reduce(self, x, axes: Sequence[int]):
        """The same reduction in jax (add/max/min/... become XLA's reduce primitives)."""
        return lax.reduce(x, self.identity(x.dtype), self.lax_combine, tuple(axes))

    def __repr__(self):
        return self.name

    def __reduce__(self):   # pickles (and deep-copies) as the module-level singleton
        return self.name.upper()


ADD = Reducer("add", np.add, lax.add, lambda dtype: 0)
MUL = Reducer("mul", np.multiply, lax.mul, lambda dtype: 1)
MAX = Reducer("max", np.maximum, lax.max, _extreme(highest=False))
MIN = Reducer("min", np.minimum, lax.min, _extreme(highest=True))
AND = Reducer("and", np.bitwise_and, lax.bitwise_and, _all_bits)
OR = Reducer("or", np.bitwise_or, lax.bitwise_or, lambda dtype: 0)
XOR = Reducer("xor", np.bitwise_xor, lax.bitwise_xor, lambda dtype: 0)
LOGADDEXP = Reducer("logaddexp", np.logaddexp, jnp.logaddexp, lambda dtype: -np.inf)   # cumlogsumexp
