"""Windowed ops besides convolution (reverse; reduce-window comes next) and the helpers
they share with it: reference padding with base dilation, HLO window attrs as `Window`s."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from gspmd.ops.registry import LAYOUT, register
from gspmd.spmd import factors as fx
from gspmd.spmd.halo import Window


def pad_array(x: np.ndarray, fill, low: Sequence[int], high: Sequence[int], interior: Sequence[int]) -> np.ndarray:
    """HLO pad: `interior` fill elements between neighbours, then low/high padding
    (negative crops)."""
    spread_shape = [d + (d - 1) * i if d else 0 for d, i in zip(x.shape, interior)]
    spread = np.full(spread_shape, fill, x.dtype)
    spread[tuple(slice(None, None, i + 1) for i in interior)] = x
    out_shape = [max(0, lo + n + hi) for lo, n, hi in zip(low, spread_shape, high)]
    y = np.full(out_shape, fill, x.dtype)
    src, dst = [], []
    for n, lo, size in zip(spread_shape, low, out_shape):
        s0, d0 = max(0, -lo), max(0, lo)
        length = max(0, min(n - s0, size - d0))
        src.append(slice(s0, s0 + length))
        dst.append(slice(d0, d0 + length))
    y[tuple(dst)] = spread[tuple(src)]
    return y


def windows_of(attrs: dict, sizes: Sequence[int]) -> list[Window]:
    """Per-dim Windows from HLO-style attrs (window_strides, padding, lhs_dilation,
    rhs_dilation) and window sizes."""
    return [Window(int(k), int(s), int(lo), int(hi), int(bd), int(wd)) for k, s, (lo, hi), bd, wd in
            zip(sizes, attrs["window_strides"], attrs["padding"], attrs["lhs_dilation"], attrs["rhs_dilation"])]


def window_attrs(windows: Sequence[Window]) -> dict:
    """The inverse of windows_of (without the sizes)."""
    return dict(window_strides=tuple(w.stride for w in windows), padding=tuple((w.low, w.high) for w in windows),
                lhs_dilation=tuple(w.base_dilation for w in windows),
                rhs_dilation=tuple(w.window_dilation for w in windows))


# -- reverse --------------------------------------------------------------------------
def _reverse_factors(instr):
    dims = instr.attrs["dims"]
    return [fx.Factor(n, (d, d), fx.REPLICATE if d in dims else fx.PASS)
            for d, n in enumerate(instr.operands[0].shape)]


def _evaluate_reverse(instr, args, device):
    return [np.flip(args[0], instr.attrs["dims"]).copy()]


register("reverse", evaluate=_evaluate_reverse, factors=_reverse_factors, priority=LAYOUT)
