"""convolution (HLO Convolution; jax.lax.conv_general_dilated).

Attrs: lhs_spec (batch, feature, spatial...), rhs_spec (out feature, in feature,
spatial...), out_spec (batch, feature, spatial...), window_strides, padding, lhs_dilation,
rhs_dilation, feature_group_count, batch_group_count.

Batch, feature and contracted-feature dims are dimension factors; with feature or batch
groups, the groups are one factor (each device convolves whole groups). A split spatial dim is
partitioned either by outputs (each partition computes its outputs from its input shard
plus halos) or, when the window itself is split (weight gradients, whose window is the
output gradient), by window (each partition convolves its part of the window with the
input range it touches and the partial results are summed). The spatial dims are
matched first and the halo exchange turns them into independent local windows; the
factor partitioner then handles batch and feature dims around them (paper 4.4).
"""
from __future__ import annotations

import enum
import itertools
import math
from typing import Optional

import numpy as np
from jax import lax

from gspmd.dtypes import accumulator
from gspmd.ops.registry import CONTRACTION, Frontend, Kernel, KernelOrders, Rule, Semantics, Timing, register
from gspmd.ops.window import pad_array, window_attrs, windows_of
from gspmd.sharding import Sharding
from gspmd.spmd import cost as cm
from gspmd.spmd import factors as fx
from gspmd.spmd.cost import ComputeKind
from gspmd.spmd.halo import DimPlan, local_base, partition_windowed, pinned_space, plan_dim, slice_outputs
from gspmd.spmd.layout import groups_along
from gspmd.spmd.partitioned import PartitionedValue

class SpatialSplit(enum.Enum):
    """How a split spatial dim is partitioned."""
    OUT = "out"          # input and output split alike; each device's windows by halo exchange
    WINDOW = "window"    # input and window split alike (a window larger than the output:
                         # weight gradients); partial sums over the split


OUT, WINDOW = SpatialSplit.OUT, SpatialSplit.WINDOW


def _evaluate_conv(instr, args, device):
    a, out = instr.attrs, instr.outputs[0]
    # float32 and float64 sum in float64, the closest to any order XLA sums in.
    acc = np.float64 if out.dtype in (np.float32, np.float64) else accumulator(out.dtype)
    x = np.transpose(args[0], a["lhs_spec"]).astype(acc)        # (B, F, *spatial)
    k = np.transpose(args[1], a["rhs_spec"]).astype(acc)        # (O, I, *window)
    nsp = x.ndim - 2
    x = pad_array(x, 0, (0, 0) + tuple(p[0] for p in a["padding"]), (0, 0) + tuple(p[1] for p in a["padding"]),
                  (0, 0) + tuple(d - 1 for d in a["lhs_dilation"]))
    g, bg = a["feature_group_count"], a["batch_group_count"]
    (b, f), (o, i) = x.shape[:2], k.shape[:2]
    if bg > 1:   # batch group j convolves with output features of group j
        xg = x.reshape((bg, b // bg, f) + x.shape[2:]).swapaxes(0, 1)
    else:
        xg = x.reshape((b, g, f // g) + x.shape[2:])
    kg = k.reshape((g * bg, o // (g * bg), i) + k.shape[2:])
    out_sp = tuple(out.shape[d] for d in a["out_spec"][2:])
    res = np.zeros((xg.shape[0], g * bg, o // (g * bg)) + out_sp, acc)
    if all(out_sp):
        for pos in np.ndindex(*k.shape[2:]):
            window = tuple(slice(p * r, p * r + (n - 1) * s + 1, s)
                           for p, r, n, s in zip(pos, a["rhs_dilation"], out_sp, a["window_strides"]))
            res += np.einsum("bgi...,goi->bgo...", xg[(slice(None),) * 3 + window], kg[(Ellipsis,) + pos])
    res = res.reshape((res.shape[0], o) + out_sp)
    assert res.ndim == nsp + 2
    return [np.transpose(res, np.argsort(a["out_spec"])).astype(out.dtype)]


def _dims(instr):
    a = instr.attrs
    return a["lhs_spec"], a["rhs_spec"], a["out_spec"]


def _default_modes(instr) -> list[SpatialSplit]:
    """For propagation: spatial dims carry between input and output, except when the
    window is larger than the output (weight gradients), where they carry between input
    and window."""
    (_, _, *ls), (_, _, *rsp), (_, _, *osp) = _dims(instr)
    rhs, out = instr.operands[1], instr.outputs[0]
    return [OUT if out.shape[o] >= rhs.shape[r] else WINDOW for r, o in zip(rsp, osp)]


def conv_factors(instr, modes: Optional[list[Optional[SpatialSplit]]] = None) -> list[fx.Factor]:
    """Factors of a convolution; `modes` says per spatial dim whether it is split by
    outputs, by window, or kept whole (None). Grouped convolutions split along the
    groups: feature group j (the j-th part of the lhs features, of the rhs and result
    output features) and batch group j (the j-th part of the lhs batch, of the output
    features) are a group factor, so that each device convolves whole groups."""
    lhs, rhs = instr.operands
    (lb, lf, *ls), (ro, ri, *rsp), (ob, of, *osp) = _dims(instr)
    g, bg = instr.attrs["feature_group_count"], instr.attrs["batch_group_count"]
    b, f, o = lhs.shape[lb], lhs.shape[lf], rhs.shape[ro]
    if bg > 1:
        factors = [fx.Factor(bg, (lb, ro, of), fx.GROUP), fx.Factor(f, (lf, ri, None), fx.REDUCE),
                   fx.Factor(b // bg, (None, None, ob), fx.REPLICATE)]
    elif g > 1:
        factors = [fx.Factor(b, (lb, None, ob)), fx.Factor(g, (lf, ro, of), fx.GROUP),
                   fx.Factor(f // g, (None, ri, None), fx.REPLICATE)]
    else:
        factors = [fx.Factor(b, (lb, None, ob)), fx.Factor(f, (lf, ri, None), fx.REDUCE),
                   fx.Factor(o, (None, ro, of))]
    for mode, l, r, q in zip(modes or _default_modes(instr), ls, rsp, osp):
        size = lhs.shape[l]
        if mode is OUT:
            factors += [fx.Factor(size, (l, None, q)), fx.Factor(rhs.shape[r], (None, r, None), fx.REPLICATE)]
        elif mode is WINDOW:
            factors += [fx.Factor(size, (l, r, None), fx.REDUCE), fx.Factor(1, (None, None, q), fx.REPLICATE)]
        else:
            factors.append(fx.Factor(size, (l, r, q), fx.REPLICATE))
    return factors


def _spatial_layout(instr, lhs: PartitionedValue, rhs: PartitionedValue, target: Sharding):
    """Per spatial dim its mode and, as one lhs-shaped Sharding that splits only spatial
    dims, the partitions: taken from the input, else from the output, else (window mode)
    from the window."""
    (_, _, *ls), (_, _, *rsp), (_, _, *osp) = _dims(instr)
    out = instr.outputs[0]
    layout = Sharding.replicated(lhs.rank, lhs.sharding.num_devices)
    modes: list[Optional[SpatialSplit]] = []
    for l, r, q in zip(ls, rsp, osp):
        t_lhs, t_rhs, t_out = lhs.sharding.tiles[l], rhs.sharding.tiles[r], target.tiles[q]
        if t_rhs > 1 and (out.shape[q] < rhs.shape[r] or t_lhs == t_out == 1):
            mode, piece = WINDOW, rhs.sharding.remap([l if d == r else None for d in range(rhs.rank)], lhs.rank)
        elif t_lhs > 1:
            mode, piece = OUT, lhs.sharding.keep_dims([l])
        elif t_out > 1:
            mode, piece = OUT, target.remap([l if d == q else None for d in range(out.rank)], lhs.rank)
        else:
            mode, piece = None, None
        merged = layout.merge(piece) if piece is not None else None
        if merged is None:
            mode = None
        else:
            layout = merged
        modes.append(mode)
    return modes, layout


def _partition_conv(ctx, instr, operands, targets):
    lhs, rhs = operands
    (target,) = targets
    (_, _, *ls), (_, _, *rsp), (ob, of, *osp) = _dims(instr)
    modes, spatial = min(_spatial_options(instr, lhs, rhs, target),
                         key=lambda option: cm.rounded(_estimate(instr, operands, target, *option, ctx.hardware)))
    plans = _plans(instr, lhs, rhs, modes, spatial)
    factors = conv_factors(instr, modes)
    emit = _local_conv(instr, plans, spatial)
    if not plans:
        return fx.partition(ctx, instr, factors, operands, targets, emit_local=emit)
    out_map = {ls[j]: osp[j] for j, mode in enumerate(modes) if mode is OUT}
    return partition_windowed(ctx, instr, operands, [target], factors, 0, {ls[j]: p for j, p in plans.items()},
                              spatial, out_map, [ob, of], 0, emit)


def _plans(instr, lhs, rhs, modes, spatial: Sharding) -> dict[int, DimPlan]:
    (_, _, *ls), (_, _, *rsp), _ = _dims(instr)
    windows = windows_of(instr.attrs, [rhs.shape[r] for r in rsp])
    return {j: plan_dim(lhs.shape[ls[j]], windows[j], spatial.tiles[ls[j]], window_parts=(m is WINDOW))
            for j, m in enumerate(modes) if m is not None}


def _spatial_options(instr, lhs, rhs, target):
    """The spatial splits the operands and target suggest and, where something splits
    batch, features or groups too, the same with any of them given up (resharding an
    operand to split those may cost less than exchanging halos or summing partial
    windows)."""
    modes, spatial = _spatial_layout(instr, lhs, rhs, target)
    (lb, lf, *ls), (ro, ri, *_), (ob, of, *_) = _dims(instr)
    others = [lhs.sharding.tiles[d] for d in (lb, lf)] + [rhs.sharding.tiles[d] for d in (ro, ri)] + \
        [target.tiles[d] for d in (ob, of)]
    split = [j for j, m in enumerate(modes) if m is not None]
    for keep in itertools.product((True, False), repeat=len(split) if max(others) > 1 else 0):
        kept = [j for j, k in zip(split, keep) if k] if keep else split
        yield ([m if j in kept else None for j, m in enumerate(modes)],
               spatial.keep_dims([ls[j] for j in kept]))


def _estimate(instr, operands, target, modes, spatial: Sharding, hw: cm.Hardware) -> cm.Cost:
    """What partitioning with these spatial splits costs on `hw`: the factor
    partitioner's choice around them, plus the halos of split inputs."""
    lhs, rhs = operands
    (_, _, *ls), _, _ = _dims(instr)
    plans = _plans(instr, lhs, rhs, modes, spatial)
    factors = conv_factors(instr, modes)
    pinned = pinned_space(factors, 0, [ls[j] for j in plans], spatial, lhs.rank)
    cost = fx.cheapest_space(instr, factors, operands, [target], hw, pinned)[1]
    local = lhs.sharding.shard_shape(lhs.shape)
    for j, plan in plans.items():
        if lhs.sharding.tiles[ls[j]] > 1 and plan.count > plan.shard:
            halo = (plan.count - plan.shard) * math.prod(local) // local[ls[j]] * lhs.dtype.itemsize
            line = groups_along(lhs.sharding, [ls[j]])
            neighbours = np.stack([line[:, :-1].ravel(), line[:, 1:].ravel()], axis=1)
            cost = cm.add_costs(cost, cm.collective_seconds(cm.Pattern.PERMUTE, halo, neighbours,
                                                            lhs.sharding.num_devices, hw))
    return cost


def _local_conv(instr, plans: dict[int, DimPlan], spatial: Sharding):
    """Emitter of the per-device convolution: planned spatial dims use their local
    window; group counts follow the local share of the groups."""
    (lb, lf, *ls), (_, _, *rsp), (_, _, *osp) = _dims(instr)
    (lhs, _), out, a = instr.operands, instr.outputs[0], instr.attrs

    def emit(ctx, _instr, locals_, shapes):
        lhs_l, rhs_l = locals_
        windows = windows_of(a, [rhs_l.shape[r] for r in rsp])
        windows = [plans[j].local if j in plans else w for j, w in enumerate(windows)]
        shape = list(shapes[0])
        for j, p in plans.items():
            shape[osp[j]] = p.local.out_size(local_base(p))
        attrs = dict(a, **window_attrs(windows))
        # Each device convolves whole groups: as many as its share of the grouped dims.
        if a["feature_group_count"] > 1:
            attrs["feature_group_count"] = a["feature_group_count"] * lhs_l.shape[lf] // lhs.shape[lf]
        if a["batch_group_count"] > 1:
            attrs["batch_group_count"] = a["batch_group_count"] * lhs_l.shape[lb] // lhs.shape[lb]
        y = ctx.b.add1("convolution", [lhs_l, rhs_l], shape, out.dtype, **attrs)
        y = slice_outputs(ctx, y, {osp[j]: p for j, p in plans.items()}, spatial, {osp[j]: ls[j] for j in plans})
        return [y]
    return emit


def _conv_flops(instr) -> int:
    """2 multiply-adds per output element per kernel input element (grouping included,
    since the kernel's input-feature dim is already per group)."""
    kernel, rhs_spec = instr.operands[1], instr.attrs["rhs_spec"]
    per_output = math.prod(kernel.shape[d] for d in rhs_spec[1:])
    return 2 * math.prod(instr.outputs[0].shape) * per_output // instr.attrs["batch_group_count"]


def _convert_conv(b, eqn, args):
    p = eqn.params
    dn = p["dimension_numbers"]
    return [b.add1("convolution", args, *b.out_aval(eqn), lhs_spec=tuple(dn.lhs_spec), rhs_spec=tuple(dn.rhs_spec),
                   out_spec=tuple(dn.out_spec), window_strides=tuple(p["window_strides"]),
                   padding=tuple((int(lo), int(hi)) for lo, hi in p["padding"]),
                   lhs_dilation=tuple(p["lhs_dilation"]), rhs_dilation=tuple(p["rhs_dilation"]),
                   feature_group_count=int(p["feature_group_count"]),
                   batch_group_count=int(p["batch_group_count"]))]


def _lower_conv(instr, args, lc):
    a, out = instr.attrs, instr.outputs[0]
    dims = lax.ConvDimensionNumbers(a["lhs_spec"], a["rhs_spec"], a["out_spec"])
    padding = _padding_xla_cpu_compiles(a, args[1].shape)
    y = lax.conv_general_dilated(
        *args, a["window_strides"], padding, a["lhs_dilation"], a["rhs_dilation"], dims,
        feature_group_count=a["feature_group_count"], batch_group_count=a["batch_group_count"],
        preferred_element_type=out.dtype)
    if padding != tuple(map(tuple, a["padding"])):   # the outputs the extra padding added
        y = lax.slice(y, (0,) * out.rank, out.shape)
    return [y]


def _padding_xla_cpu_compiles(a, kernel_shape) -> tuple:
    """The padding, with one more element high on each spatial dim where a window reads
    exactly one input element per output (lhs_dilation == window size == stride + 1, no
    padding, no rhs dilation; the extra output, if any, is sliced off). XLA's
    convolution operand swap (its algebraic simplifier, jax 0.10.2) copies such a dim
    unchanged into the swapped convolution, whose kernel is the input: the window no
    longer matches it and XLA aborts the process ("Window dimensions do not match RHS
    shape"). Strided convolutions' input gradients are such convolutions, and XLA swaps
    them where the window outgrows the input (rhs-dilated ones). tests/test_conv.py's
    plain-jax reproducer says when this can go."""
    if a["feature_group_count"] > 1 or a["batch_group_count"] > 1:   # XLA swaps no grouped convolution
        return a["padding"]
    windows = [kernel_shape[d] for d in a["rhs_spec"][2:]]
    return tuple((lo, hi + 1) if (lo, hi) == (0, 0) and r == 1 and b == k == s + 1 else (lo, hi)
                 for (lo, hi), k, s, b, r in zip(a["padding"], windows, a["window_strides"], a["lhs_dilation"],
                                                 a["rhs_dilation"]))


def _layout(instr) -> KernelOrders:
    """XLA's CPU convolutions work on [batch, spatial..., feature] inputs and results and
    [spatial..., in, out] kernels."""
    (lb, lf, *ls), (ro, ri, *rsp), (ob, of, *osp) = _dims(instr)
    return KernelOrders((((lb, *ls, lf),), ((*rsp, ri, ro),)), (ob, *osp, of))


register("convolution",
         frontend=Frontend(converts={"conv_general_dilated": _convert_conv}),
         semantics=Semantics(evaluate=_evaluate_conv, lower=_lower_conv),
         rule=Rule(factors=conv_factors, partition=_partition_conv, priority=CONTRACTION),
         timing=Timing(flops=_conv_flops, compute=ComputeKind.MATMUL),
         kernel=Kernel(orders=_layout))
