"""Up-front checks of public arguments, one per family of mistake (an array that is not
one, a count, a function, a flag). Each raises a ShardingError that says what was given
and what to pass instead, before the value can fail deep inside."""
from __future__ import annotations

import inspect
import math
from typing import Callable, Optional

import numpy as np

from gspmd.errors import ShardingError

_SCALARS = (bool, int, float, complex)


def array_shape(x, what: str) -> tuple[int, ...]:
    """The shape of an array argument (a NumPy or jax array, a tracer, a
    jax.ShapeDtypeStruct, or a Python or NumPy scalar)."""
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return tuple(x.shape)
    if isinstance(x, _SCALARS):
        return ()
    raise ShardingError(f"{what} is {describe(x)}, not an array; pass a NumPy or jax array "
                        "(np.asarray(...) of a rectangular nested list) or a jax.ShapeDtypeStruct.")


def describe(x) -> str:
    """A value as a message names it: its type and a short repr; a nested list that
    is not rectangular says so."""
    if x is None:
        return "None"
    if isinstance(x, (str, bytes)):
        return f"the string {x!r:.60}"
    if isinstance(x, (list, tuple)):
        ragged = " whose rows differ in length (not a rectangular array)" if _is_ragged(x) else ""
        return f"a {type(x).__name__} {x!r:.60}{ragged}"
    text = f"{x!r:.60}"
    return text if text.startswith(type(x).__name__) else f"{type(x).__name__} {text}"


def is_number_list(x) -> bool:
    """A (nested) list or tuple of Python numbers only: an array written as lists."""
    return isinstance(x, (list, tuple)) and bool(x) and all(
        isinstance(e, (bool, int, float, complex)) or is_number_list(e) for e in x)


def _is_ragged(x) -> bool:
    rows = [r for r in x if isinstance(r, (list, tuple))]
    if not rows:
        return False
    return len(rows) != len(x) or len({len(r) for r in rows}) > 1 or any(_is_ragged(r) for r in rows)


def count(value, what: str, minimum: int = 1, example: str = "") -> int:
    """A whole number of at least `minimum` (not a bool, not a float)."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)) and value >= minimum:
        return int(value)
    raise ShardingError(f"{what} needs a whole number >= {minimum}, got {describe(value)}; pass e.g. "
                        f"{example or max(minimum, 2)}.")


def number(value, what: str, positive: bool = True, at_most: float = math.inf) -> float:
    """A real number (not a bool): > 0 (or >= 0 where not `positive`), at most `at_most`."""
    if (isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))
            and (value > 0 if positive else value >= 0) and value <= at_most):
        return float(value)
    bounds = f"{'> 0' if positive else '>= 0'}{f' and <= {at_most:g}' if at_most < math.inf else ''}"
    raise ShardingError(f"{what} needs a number {bounds}, got {describe(value)}.")


def function(fn, what: str, arity: Optional[int] = None) -> Callable:
    """A callable that (where its signature says) takes `arity` positional arguments."""
    if not callable(fn):
        raise ShardingError(f"{what} needs a function, got {describe(fn)}; pass a function (def or lambda).")
    if arity is None:
        return fn
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):   # builtins and some callables have none
        return fn
    try:
        signature.bind(*range(arity))
    except TypeError as e:
        raise ShardingError(f"{what} is called with {arity} positional argument{'s' * (arity != 1)}, but "
                            f"{getattr(fn, '__name__', type(fn).__name__)}{signature} cannot take them ({e}); "
                            f"give it {arity} parameters.") from None
    return fn


def flag(value, what: str) -> bool:
    """True or False (a NumPy bool too)."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise ShardingError(f"{what} needs True or False, got {describe(value)}.")
