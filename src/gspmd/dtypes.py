"""Dtype questions numpy alone answers wrongly for ML types (bfloat16 has kind 'V')."""
from __future__ import annotations

import jax
import numpy as np


def is_floating(dtype) -> bool:
    return bool(jax.dtypes.issubdtype(np.dtype(dtype), np.inexact))
