"""Windowed ops besides convolution — reduce-window (pooling), select-and-scatter-add (its
max/min gradient), select-and-gather-add (its max/min forward-mode derivative), reverse —
and the helpers they share with it: reference padding with base dilation, HLO window
attrs as `Window`s.

reduce-window attrs: reducer, window_dimensions, window_strides, padding, base_dilation,
window_dilation. variadic-reduce-window (lax.reduce_window with a computation of its own,
as max pooling that carries argmax indices): operands (*xs, *inits), attrs computation
(as variadic-reduce's) and the window attrs. As XLA does, windows skip padding (it is
not the init value); partitioned, the local op gets a last bool operand saying which
elements of its halo-exchanged windows are real. select-and-scatter-add(source, operand)
attrs: select ("ge": first max, "le": first min), window_dimensions, window_strides,
padding; it adds each source element to the position its window selects in operand. select-and-gather-add(tangents, operand)
attrs: select and reduce-window's window attrs; each window's result is the tangent at
the position its window selects in operand.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable, Optional, Sequence

import jax
import numpy as np
from jax import lax
from jax.extend import core as jcore

from gspmd.errors import ShardingError
from gspmd.ir import Value
from gspmd.ir.emit import broadcast, pad_dim, reshape, scalar
from gspmd.ir.reducer import ADD, MAX, MIN, MUL, Reducer
from gspmd.ops.formatting import partition_in_one_step
from gspmd.ops.reduce import Computation, vectorized
from gspmd.ops.registry import Facets, Frontend, LAYOUT, Memory, Rule, SegmentRule, Semantics, Storage, Timing, register
from gspmd.sharding import Sharding
from gspmd.spmd import factors as fx
from gspmd.spmd import reshard as rs
from gspmd.spmd.context import Why
from gspmd.spmd.halo import (Window, dynamic_slice_dim, local_base, partition_pinned, plan_dim, plan_layout,
                             slice_outputs, windowed, windowed_ranges)
from gspmd.spmd.partitioned import PartitionedValue


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


CONV_DILATIONS = ("lhs_dilation", "rhs_dilation")        # convolution's names
WINDOW_DILATIONS = ("base_dilation", "window_dilation")   # reduce-window's names


def windows_of(attrs: dict, sizes: Sequence[int], dilations=CONV_DILATIONS) -> list[Window]:
    """Per-dim Windows from HLO-style attrs and window sizes."""
    rank = len(sizes)
    base, win = (attrs.get(name, (1,) * rank) for name in dilations)
    return [Window(int(k), int(s), int(lo), int(hi), int(bd), int(wd)) for k, s, (lo, hi), bd, wd in
            zip(sizes, attrs["window_strides"], attrs["padding"], base, win)]


def window_attrs(windows: Sequence[Window], dilations=CONV_DILATIONS) -> dict:
    """The inverse of windows_of (without the sizes)."""
    return {"window_strides": tuple(w.stride for w in windows), "padding": tuple((w.low, w.high) for w in windows),
            dilations[0]: tuple(w.base_dilation for w in windows),
            dilations[1]: tuple(w.window_dilation for w in windows)}


def _window_slices(windows: Sequence[Window], out_shape: Sequence[int]):
    """For each window position: the strided slice of the padded base it reads."""
    for pos in np.ndindex(*(w.size for w in windows)):
        yield pos, tuple(slice(p * w.window_dilation, p * w.window_dilation + (n - 1) * w.stride + 1, w.stride)
                         for p, w, n in zip(pos, windows, out_shape))


def _pad_base(x: np.ndarray, fill, windows: Sequence[Window]) -> np.ndarray:
    return pad_array(x, fill, [w.low for w in windows], [w.high for w in windows],
                     [w.base_dilation - 1 for w in windows])


# -- reduce-window ----------------------------------------------------------------------
def _rw_windows(instr) -> list[Window]:
    return windows_of(instr.attrs, instr.attrs["window_dimensions"], WINDOW_DILATIONS)


def _window_flops(instr) -> int:
    """One operation per result element per window element."""
    return math.prod(instr.outputs[0].shape) * math.prod(instr.attrs["window_dimensions"])


def _evaluate_reduce_window(instr, args, device):
    out, reducer = instr.outputs[0], instr.attrs["reducer"]
    windows = _rw_windows(instr)
    init = reducer.identity(out.dtype)
    base = _pad_base(args[0], init, windows)
    acc = np.full(out.shape, init, out.dtype)
    if all(out.shape):
        for _, sl in _window_slices(windows, out.shape):
            acc = reducer.combine(acc, base[sl])
    return [acc]


def _dim_factors(instr, plans=None) -> list[fx.Factor]:
    """Every tensor shares every dim (but the scalar init values of the variadic form).
    For propagation (plans None) all pass through; when partitioning, trivial-window and
    planned dims do and other windowed dims stay whole."""
    tensors = [o.rank > 0 for o in instr.operands] + [True] * len(instr.outputs)
    return [fx.Factor(n, tuple(d if t else None for t in tensors),
                      fx.PASS if plans is None or w.trivial or d in plans else fx.REPLICATE)
            for d, (n, w) in enumerate(zip(instr.outputs[0].shape, _rw_windows(instr)))]


def _planned(instr, operand, target, planner):
    """The op's windows, the dims to split by halo exchange with each one's plan
    (`planner(size, window, parts)`), their layout, and the factors around them."""
    windows = _rw_windows(instr)
    plans, layout = plan_layout(windows, operand, target,
                                lambda d, parts: planner(operand.shape[d], windows[d], parts))
    return windows, plans, layout, _dim_factors(instr, plans)


def _local_windows(instr, plans, layout, windows, real: Optional[Value] = None):
    """The local emitter of a reduce-window-like op once its operands hold each
    partition's windows along the planned dims. `real` (see _real_elements), when given,
    becomes the local op's last operand: which elements it skips."""
    def emit_local(ctx, _instr, locals_, shapes):
        local = [plans[d].local if d in plans else w for d, w in enumerate(windows)]
        shape = [plans[d].local.out_size(local_base(plans[d])) if d in plans else n for d, n in enumerate(shapes[0])]
        operands = list(locals_)
        if real is not None:
            planned = sorted(plans)
            flat = reshape(ctx.b, real, [real.shape[d] for d in planned])
            operands.append(broadcast(ctx.b, flat, locals_[0].shape, planned))
        ys = ctx.b.add(instr.opcode, operands, [(shape, out.dtype) for out in instr.outputs],
                       **dict(instr.attrs, **window_attrs(local, WINDOW_DILATIONS)))
        return [slice_outputs(ctx, y, plans, layout, {d: d for d in plans}) for y in ys]
    return emit_local


def _partition_windows(ctx, instr, operands, targets, fills, skip_fills: bool = False):
    """A reduce-window of n operands (then n scalar init values): each operand's windows
    are cut out by halo exchange, with fills[j] where they reach outside the tensor, and
    reduced locally. When a fill may not be the reduction's identity (skip_fills), the
    local op is told which elements are real, to skip the rest as XLA skips padding."""
    n = len(instr.outputs)
    windows, plans, layout, factors = _planned(instr, operands[0], targets[0], plan_dim)
    if not plans:
        return fx.partition(ctx, instr, factors, operands, targets)
    cut = [windowed(ctx, x, plans, layout, fill) for x, fill in zip(operands[:n], fills)]
    real = None
    if skip_fills and any(p.mask or p.predilate is not None for p in plans.values()):
        real = _real_elements(ctx, operands[0], plans, layout)
    others = [d for d in range(operands[0].rank) if d not in plans]
    return partition_pinned(ctx, instr, cut + list(operands[n:]), targets, factors, 0, list(plans), layout,
                            {d: d for d in plans}, others, _local_windows(instr, plans, layout, windows, real))


def _real_elements(ctx, x: PartitionedValue, plans, layout) -> Value:
    """Which elements of each partition's windows (as `windowed` cuts them out of x) are
    x's own rather than padding or base-dilation holes: a bool, 1 long along the
    unplanned dims, made locally (no communication)."""
    shape = tuple(n if d in plans else 1 for d, n in enumerate(x.shape))
    every = PartitionedValue(broadcast(ctx.b, scalar(ctx.b, True, np.bool_), shape),
                             Sharding.replicated(x.rank, x.sharding.num_devices), shape)
    return windowed(ctx, every, plans, layout, np.zeros((), np.bool_)).local


def _partition_reduce_window(ctx, instr, operands, targets):
    return _partition_windows(ctx, instr, operands, targets, [instr.attrs["reducer"].identity(operands[0].dtype)])


# -- variadic-reduce-window: operands (*xs, *inits[, real]) ---------------------------------
def _evaluate_variadic_reduce_window(instr, args, device):
    """Each window's elements combined into the init values, one window position at a
    time. Like XLA, padding and base-dilation holes are skipped, as are the elements an
    optional last bool operand marks false (partitioned windows' padding)."""
    n, outs, windows = len(instr.outputs), instr.outputs, _rw_windows(instr)
    xs, inits, real = args[:n], args[n:2 * n], args[2 * n:]
    acc = [np.full(out.shape, init, out.dtype) for out, init in zip(outs, inits)]
    if not all(outs[0].shape):
        return acc
    bases = [_pad_base(x, init, windows) for x, init in zip(xs, inits)]
    real = _pad_base(real[0] if real else np.ones(xs[0].shape, np.bool_), np.zeros((), np.bool_), windows)
    combine = vectorized(instr.attrs["computation"])
    for _, sl in _window_slices(windows, outs[0].shape):
        combined = combine(*(a.ravel() for a in acc), *(base[sl].ravel() for base in bases))
        acc = [np.where(real[sl], np.asarray(c).reshape(out.shape), a).astype(out.dtype, copy=False)
               for c, a, out in zip(combined, acc, outs)]
    return acc


def _skipping_unreal(fn: Callable, n: int) -> Callable:
    """fn over (values..., real) pairs: an element that is not real leaves the other side
    as it is (either side may be the accumulator: XLA fixes no order)."""
    def combine(p, q):
        both = fn(*p[:n], *q[:n])
        picked = [lax.select(q[n], lax.select(p[n], c, b), a) for c, a, b in zip(both, p[:n], q[:n])]
        return (*picked, p[n] | q[n])
    return combine


def _lower_variadic_reduce_window(instr, args, lc):
    n, fn, a = len(instr.outputs), instr.attrs["computation"], instr.attrs
    xs, inits, real = args[:n], args[n:2 * n], args[2 * n:]
    combine = _skipping_unreal(fn, n) if real else (lambda p, q: tuple(fn(*p, *q)))
    outs = lax.reduce_window((*xs, *real), (*inits, *(np.bool_(True) for _ in real)), combine,
                             a["window_dimensions"], a["window_strides"], a["padding"], a["base_dilation"],
                             a["window_dilation"])
    return list(outs[:n])


def _partition_variadic_reduce_window(ctx, instr, operands, targets):
    return _partition_windows(ctx, instr, operands, targets, [o.local for o in operands[len(instr.outputs):]],
                              skip_fills=True)


# -- select-and-gather-add ----------------------------------------------------------------
def _selected(instr) -> Reducer:
    return MAX if instr.attrs["select"] == "ge" else MIN


def _padded_operand(instr, operand: np.ndarray, windows) -> np.ndarray:
    """The operand padded with what its windows never select."""
    return _pad_base(operand, _selected(instr).identity(operand.dtype), windows)


def _chosen(instr, base: np.ndarray, slices) -> np.ndarray:
    """Per window of the padded operand `base`, which of its elements (in window order)
    it selects: the first extreme, like XLA."""
    return (np.argmax if instr.attrs["select"] == "ge" else np.argmin)(np.stack([base[sl] for sl in slices]), axis=0)


def _evaluate_select_and_gather_add(instr, args, device):
    tangents, operand = args
    out, windows = instr.outputs[0], _rw_windows(instr)
    if not all(out.shape):
        return [np.zeros(out.shape, out.dtype)]
    slices = [sl for _, sl in _window_slices(windows, out.shape)]
    picked = np.stack([_pad_base(tangents, np.zeros((), tangents.dtype), windows)[sl] for sl in slices])
    chosen = _chosen(instr, _padded_operand(instr, operand, windows), slices)
    return [np.take_along_axis(picked, chosen[None], axis=0)[0].astype(out.dtype)]


def _partition_select_and_gather_add(ctx, instr, operands, targets):
    """As reduce-window: both operands' windows cut out by halo exchange (the operand's
    padding never selected, the tangents' zero)."""
    (tangents, operand), (target,) = operands, targets
    windows, plans, layout, factors = _planned(instr, operand, target, plan_dim)
    if not plans:
        return fx.partition(ctx, instr, factors, operands, targets)
    fills = (np.zeros((), tangents.dtype), _selected(instr).identity(operand.dtype))
    cut = [windowed(ctx, o, plans, layout, fill) for o, fill in zip(operands, fills)]
    others = [d for d in range(operand.rank) if d not in plans]
    return partition_pinned(ctx, instr, cut, targets, factors, 1, list(plans), layout, {d: d for d in plans},
                            others, _local_windows(instr, plans, layout, windows))


# -- select-and-scatter-add ---------------------------------------------------------------
def _evaluate_select_and_scatter_add(instr, args, device):
    source, operand = args
    out = instr.outputs[0]
    windows = _rw_windows(instr)
    slices = [sl for _, sl in _window_slices(windows, source.shape)]
    if not slices or not source.size:
        return [np.zeros(out.shape, out.dtype)]
    base = _padded_operand(instr, operand, windows)
    chosen = _chosen(instr, base, slices)
    acc = np.zeros(base.shape, out.dtype)
    for k, sl in enumerate(slices):
        acc[sl] += np.where(chosen == k, source, 0).astype(out.dtype)
    crop = tuple(slice(w.low, w.low + n) for w, n in zip(windows, out.shape))
    return [acc[crop]]


def _partition_select_and_scatter_add(ctx, instr, operands, targets):
    """Each partition runs the windows that touch its own operand elements (source and
    operand ranges by halo exchange) and keeps what lands on its own elements."""
    (source, operand), (target,) = operands, targets
    windows, spans, layout, factors = _planned(instr, operand, target, _scatter_span)
    if not spans:
        return fx.partition(ctx, instr, factors, operands, targets)
    fill = _selected(instr).identity(operand.dtype)
    src = windowed_ranges(ctx, source, {d: (o, k, True) for d, (o, k, _, _) in spans.items()}, layout, 0)
    opd = windowed_ranges(ctx, operand, {d: (x, k, True) for d, (_, _, x, k) in spans.items()}, layout, fill)

    def emit(ctx, _instr, locals_, shapes):
        local = [replace(w, low=0, high=0) if d in spans else w for d, w in enumerate(windows)]
        y = ctx.b.add1(instr.opcode, locals_, locals_[1].shape, instr.outputs[0].dtype,
                       **dict(instr.attrs, **window_attrs(local, WINDOW_DILATIONS)))
        for d, (_, _, first, _) in spans.items():   # keep what lands on the partition's own elements
            n = shapes[0][d]
            own = np.arange(len(first)) * n - first
            lo, hi = max(0, -int(own.min())), max(0, int((own + n).max()) - y.shape[d])
            y = pad_dim(ctx.b, y, d, lo, hi, np.zeros((), y.dtype))
            y = dynamic_slice_dim(ctx, y, d, (own + lo)[layout.coords()[:, d]], n)
        return [y]
    others = [d for d in range(operand.rank) if d not in spans]
    return partition_pinned(ctx, instr, [src, opd], targets, factors, 1, list(spans), layout,
                            {d: d for d in spans}, others, emit)


def _scatter_span(size: int, w: Window, parts: int):
    """Windows o touching elements [i*n, (i+1)*n) of the operand: the first one and their
    count per partition, then the operand range they read (first element, count)."""
    n, i = -(-size // parts), np.arange(parts)
    first_o = (i * n + w.low - w.size + w.stride) // w.stride
    last_o = ((i + 1) * n - 1 + w.low) // w.stride
    count_o = int(max(1, (last_o - first_o + 1).max()))
    return first_o, count_o, first_o * w.stride - w.low, (count_o - 1) * w.stride + w.size


# -- reverse --------------------------------------------------------------------------
def _reverse_factors(instr):
    dims = instr.attrs["dims"]
    return [fx.Factor(n, (d, d), fx.REPLICATE if d in dims else fx.PASS)
            for d, n in enumerate(instr.operands[0].shape)]


def _propagate_reverse(instr, shardings, target):
    """The other tensor's layout with its device order mirrored along the reversed dims
    (XLA's ReverseSharding): each device then holds the elements it held before,
    reversed, so a split reversed dim stays split and the reverse moves nothing (on an
    uneven dim a halo, the padding having come first)."""
    dims = instr.attrs["dims"]
    return [Sharding(np.flip(s.tile_assignment, dims)) for t, s in enumerate(shardings)
            if t != target and s is not None]


def _reverse_changed_dim(instr) -> Optional[int]:
    dims = instr.attrs["dims"]
    return dims[0] if len(dims) == 1 else None


def _reverse_segments(instr, dim, below, fill):
    return [s.mirrored(instr.outputs[0].shape[dim]) for s in below(instr.operands[0])]


def _evaluate_reverse(instr, args, device):
    return [np.flip(args[0], instr.attrs["dims"]).copy()]


def _partition_reverse(ctx, instr, operands, targets):
    """Along one dim: the pieces each device lacks (none when the layouts mirror each
    other), with the chain below (ops/formatting.py). Along several split dims:
    partition i takes the shard of its mirror t-1-i (one collective-permute) and
    reverses it locally; on an uneven dim the data then sits t*n - D elements early
    (the padding came first), which a halo shift realigns."""
    (x,), (target,) = operands, targets
    merged = partition_in_one_step(ctx, instr, target)
    if merged is not None:
        return [merged]
    dims = instr.attrs["dims"]
    split = [d for d in dims if x.sharding.tiles[d] > 1]
    if not split:
        return fx.partition(ctx, instr, _reverse_factors(instr), operands, targets)
    tiles = x.sharding.tile_assignment
    pairs = np.stack([np.flip(tiles, split).ravel(), tiles.ravel()], axis=1)
    y = ctx.collective_permute(x.local, pairs, Why.DATA_FORMATTING, "reverse: mirrored shards")
    y = ctx.b.add1("reverse", [y], y.shape, y.dtype, dims=dims)
    padded = [n * t for n, t in zip(y.shape, x.sharding.tiles)]
    plans = {d: plan_dim(padded[d], Window(low=x.shape[d] - padded[d]), x.sharding.tiles[d])
             for d in split if padded[d] != x.shape[d]}
    pv = PartitionedValue(y, x.sharding, tuple(padded))
    if plans:
        pv = windowed(ctx, pv, plans, x.sharding.keep_dims(list(plans)), np.zeros((), y.dtype))
    return [rs.reshard(ctx, PartitionedValue(pv.local, x.sharding, x.shape), target)]


# -- conversion and lowering --------------------------------------------------------------
def _convert_rev(b, eqn, args):
    return [b.add1("reverse", args, *b.out_aval(eqn), dims=tuple(int(d) for d in eqn.params["dimensions"]))]


def _padding(p) -> tuple:
    return tuple((int(lo), int(hi)) for lo, hi in p["padding"])


def _reduce_window_attrs(p) -> dict:
    return dict(window_dimensions=tuple(p["window_dimensions"]), window_strides=tuple(p["window_strides"]),
                padding=_padding(p), base_dilation=tuple(p["base_dilation"]),
                window_dilation=tuple(p["window_dilation"]))


def _convert_reduce_window(reducer: Reducer):
    def convert(b, eqn, args):
        return [b.add1("reduce-window", args, *b.out_aval(eqn), reducer=reducer, **_reduce_window_attrs(eqn.params))]
    return convert


# the reducers a reduce_window's computation may be, with their element-wise op
_WINDOW_REDUCERS = {"add": (ADD, "add"), "mul": (MUL, "multiply"), "max": (MAX, "maximum"), "min": (MIN, "minimum")}


def _convert_generic_reduce_window(b, eqn, args):
    """lax.reduce_window with a computation of its own: one add, mul, max or min of its
    two arguments is that reducer's reduce-window from its identity, combined with the
    init value (a traced one too) where that is exact: XLA combines the init value into
    each window once, and once more per padded or base-dilated position, which max and
    min absorb. Anything else (several operands, as max pooling that carries indices, or
    an init value added at padding) is the variadic form."""
    p = eqn.params
    body = getattr(p["jaxpr"], "jaxpr", p["jaxpr"])
    found = None
    if len(args) == 2 and len(body.eqns) == 1 and not p["consts"]:
        (op,) = body.eqns
        if sorted(map(id, op.invars)) == sorted(map(id, body.invars)) and list(op.outvars) == list(body.outvars):
            found = _WINDOW_REDUCERS.get(op.primitive.name)
    if found is not None:
        (reducer, combine), (x, init) = found, args
        identity = init.producer is not None and init.producer.opcode == "constant" and np.array_equal(
            init.producer.attrs["value"], reducer.identity(x.dtype))
        inside = all(lo == hi == 0 for lo, hi in _padding(p)) and all(d == 1 for d in p["base_dilation"])
        if identity or inside or reducer in (MAX, MIN):
            out = _convert_reduce_window(reducer)(b, eqn, [x])[0]
            if identity:
                return [out]
            return [b.add1(combine, [out, broadcast(b, init, out.shape)], out.shape, out.dtype)]
    return b.add("variadic-reduce-window", args, [b.out_aval(eqn, i) for i in range(len(eqn.outvars))],
                 computation=Computation(jcore.ClosedJaxpr(body, p["consts"])), **_reduce_window_attrs(p))


def _select(eqn) -> str:
    """The select_prim of a max (ge) or min (le) pooling derivative."""
    select = eqn.params["select_prim"].name
    if select not in ("ge", "le"):
        raise ShardingError(f"{eqn.primitive.name} with select_prim {select} is not supported (`{eqn}`): gspmd "
                            "partitions the derivatives of max and min pooling (ge, le).")
    return select


def _convert_select_and_scatter_add(b, eqn, args):
    p = eqn.params
    return [b.add1("select-and-scatter-add", args, *b.out_aval(eqn), select=_select(eqn),
                   window_dimensions=tuple(p["window_dimensions"]), window_strides=tuple(p["window_strides"]),
                   padding=_padding(p))]


def _convert_select_and_gather_add(b, eqn, args):
    p = eqn.params
    return [b.add1("select-and-gather-add", args, *b.out_aval(eqn), select=_select(eqn),
                   window_dimensions=tuple(p["window_dimensions"]), window_strides=tuple(p["window_strides"]),
                   padding=_padding(p), base_dilation=tuple(p["base_dilation"]),
                   window_dilation=tuple(p["window_dilation"]))]


def _lower_reverse(instr, args, lc):
    return [lax.rev(args[0], instr.attrs["dims"])]


def _reduce_window_of(x, reducer: Reducer, a: dict):
    # A concrete identity lets jax use its max/min/add pooling primitives (differentiable).
    ones = (1,) * x.ndim
    return lax.reduce_window(x, reducer.identity(x.dtype), reducer.lax_combine, a["window_dimensions"],
                             a["window_strides"], a["padding"], a.get("base_dilation", ones),
                             a.get("window_dilation", ones))


def _lower_reduce_window(instr, args, lc):
    return [_reduce_window_of(args[0], instr.attrs["reducer"], instr.attrs)]


def _lower_select_and_scatter_add(instr, args, lc):
    """The transpose of max (ge) / min (le) pooling: jax's own gradient of reduce-window,
    which is HLO select-and-scatter (first extreme in each window wins)."""
    source, operand = args
    _, pullback = jax.vjp(lambda o: _reduce_window_of(o, _selected(instr), instr.attrs), operand)
    return [pullback(source.astype(operand.dtype))[0].astype(instr.outputs[0].dtype)]


def _lower_select_and_gather_add(instr, args, lc):
    """The forward-mode derivative of max (ge) / min (le) pooling: jax's own."""
    tangents, operand = args
    _, picked = jax.jvp(lambda o: _reduce_window_of(o, _selected(instr), instr.attrs), (operand,),
                        (tangents.astype(operand.dtype),))
    return [picked.astype(instr.outputs[0].dtype)]


register("reverse",
         frontend=Frontend(converts={"rev": _convert_rev}),
         semantics=Semantics(evaluate=_evaluate_reverse, lower=_lower_reverse),
         rule=Rule(factors=_reverse_factors, propagate=_propagate_reverse, partition=_partition_reverse,
                   priority=LAYOUT),
         memory=Memory(storage=Storage.INDEXED),
         facets=Facets(segments=SegmentRule(_reverse_changed_dim, _reverse_segments)))
register("reduce-window",
         frontend=Frontend(converts={"reduce_window_sum": _convert_reduce_window(ADD),
                                     "reduce_window_max": _convert_reduce_window(MAX),
                                     "reduce_window_min": _convert_reduce_window(MIN),
                                     "reduce_window": _convert_generic_reduce_window}),
         semantics=Semantics(evaluate=_evaluate_reduce_window, lower=_lower_reduce_window),
         rule=Rule(factors=_dim_factors, partition=_partition_reduce_window, priority=LAYOUT),
         timing=Timing(flops=_window_flops))
register("variadic-reduce-window",
         semantics=Semantics(evaluate=_evaluate_variadic_reduce_window, lower=_lower_variadic_reduce_window),
         rule=Rule(factors=_dim_factors, partition=_partition_variadic_reduce_window, priority=LAYOUT),
         timing=Timing(flops=_window_flops))


def _expanded_select_and_scatter(instr) -> int:
    """XLA:CPU expands select-and-scatter: an int32 iota per dim of the operand, a
    reduce-window picking each window's value and position, then a scatter."""
    source, operand = instr.operands
    return operand.rank * math.prod(operand.shape) * 4 + (1 + operand.rank) * math.prod(source.shape) * 4


register("select-and-scatter-add",
         frontend=Frontend(converts={"select_and_scatter_add": _convert_select_and_scatter_add}),
         semantics=Semantics(evaluate=_evaluate_select_and_scatter_add, lower=_lower_select_and_scatter_add),
         rule=Rule(factors=_dim_factors, partition=_partition_select_and_scatter_add, priority=LAYOUT),
         memory=Memory(scratch=_expanded_select_and_scatter))
register("select-and-gather-add",
         frontend=Frontend(converts={"select_and_gather_add": _convert_select_and_gather_add}),
         semantics=Semantics(evaluate=_evaluate_select_and_gather_add, lower=_lower_select_and_gather_add),
         rule=Rule(factors=_dim_factors, partition=_partition_select_and_gather_add, priority=LAYOUT),
         timing=Timing(flops=_window_flops))
