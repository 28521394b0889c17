"""Dtype questions numpy alone answers wrongly for ML types (bfloat16 has kind 'V')."""
from __future__ import annotations

import jax
import numpy as np


def is_floating(dtype) -> bool:
    return bool(jax.dtypes.issubdtype(np.dtype(dtype), np.inexact))


def accumulator(dtype) -> np.dtype:
    """The dtype NumPy evaluates products and sums of `dtype` in: narrow floats (bfloat16,
    float16) in float32, then rounded, as XLA:CPU does (NumPy's einsum has no bfloat16)."""
    dtype = np.dtype(dtype)
    return np.dtype(np.float32) if is_floating(dtype) and dtype.itemsize < 4 else dtype
