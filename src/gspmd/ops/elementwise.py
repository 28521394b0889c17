"""Elementwise ops: every dim is a pass-through factor shared by all operands."""
from __future__ import annotations

import numpy as np

from gspmd.dtypes import is_floating
from gspmd.ops.registry import ELEMENTWISE, elementwise_factors, register
from gspmd.spmd import reshard as rs


def _int_div(a, b):
    # HLO integer division truncates toward zero.
    q = np.abs(a) // np.maximum(np.abs(b), 1)
    return np.where((a < 0) != (b < 0), -q, q)


def _divide(a, b):
    return _int_div(a, b) if np.asarray(a).dtype.kind in "iu" else np.divide(a, b)


def _logistic(x):
    return 1 / (1 + np.exp(-x))


_COMPARE = {"EQ": np.equal, "NE": np.not_equal, "LT": np.less, "LE": np.less_equal,
            "GT": np.greater, "GE": np.greater_equal}

NUMPY_FUNCS = {
    "add": np.add, "subtract": np.subtract, "multiply": np.multiply, "divide": _divide,
    "maximum": np.maximum, "minimum": np.minimum, "power": np.power, "remainder": np.fmod,
    # Bitwise on integers, logical on booleans (HLO semantics).
    "and": np.bitwise_and, "or": np.bitwise_or, "xor": np.bitwise_xor, "not": np.invert,
    "atan2": np.arctan2,
    "negate": np.negative, "exponential": np.exp, "log": np.log, "tanh": np.tanh,
    "logistic": _logistic, "rsqrt": lambda x: 1 / np.sqrt(x), "sqrt": np.sqrt, "abs": np.abs,
    "sign": np.sign, "floor": np.floor, "ceil": np.ceil, "cosine": np.cos, "sine": np.sin,
    "exponential-minus-one": np.expm1, "log-plus-one": np.log1p, "is-finite": np.isfinite,
    "round-nearest-even": np.round, "convert": lambda x: x, "copy": lambda x: x,
    "sharding": lambda x: x,
}


def _widen(x: np.ndarray) -> np.ndarray:
    """Narrow floats (bfloat16, float16) compute in float32 and round after, as XLA does."""
    return x.astype(np.float32) if is_floating(x.dtype) and x.dtype.itemsize < 4 else x


def _evaluate_with(fn):
    def evaluate(instr, args, device):
        out = instr.outputs[0]
        with np.errstate(all="ignore"):
            return [np.asarray(fn(*map(_widen, args))).astype(out.dtype, copy=False).reshape(out.shape)]
    return evaluate


def _evaluate_compare(instr, args, device):
    return [_COMPARE[instr.attrs["direction"]](*args)]


def _evaluate_select(instr, args, device):
    pred, on_true, on_false = args
    return [np.where(pred, on_true, on_false).astype(instr.outputs[0].dtype, copy=False)]


def _reshard_to_target(ctx, instr, operands, targets):
    """Annotations and copies only change layout."""
    return [rs.reshard(ctx, operands[0], targets[0])]


for _opcode, _fn in NUMPY_FUNCS.items():
    register(_opcode, evaluate=_evaluate_with(_fn), factors=elementwise_factors, priority=ELEMENTWISE)
register("compare", evaluate=_evaluate_compare, factors=elementwise_factors, priority=ELEMENTWISE)
register("select", evaluate=_evaluate_select, factors=elementwise_factors, priority=ELEMENTWISE)
for _opcode in ("sharding", "copy"):
    register(_opcode, evaluate=_evaluate_with(NUMPY_FUNCS[_opcode]), factors=elementwise_factors,
             partition=_reshard_to_target, priority=ELEMENTWISE)
