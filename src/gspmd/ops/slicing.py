"""Data-formatting ops: pad, slice, dynamic-slice, dynamic-update-slice, concatenate.
Dims an op leaves untouched partition as factors; a rotation (concatenate(x[k:], x[:k]),
as jnp.roll traces) along a split dim is collective-permutes between neighbours; other
splits of a dim the op moves data along are still gathered."""
from __future__ import annotations

from typing import Optional

import numpy as np

from gspmd.ir import Value
from gspmd.ops.registry import LAYOUT, register
from gspmd.spmd import factors as fx
from gspmd.spmd import reshard as rs
from gspmd.spmd.factors import PASS, REPLICATE, Factor
from gspmd.spmd.partitioned import PartitionedValue


def _clamped_starts(x_shape, starts, sizes):
    # HLO clamps start indices so the slice stays in bounds.
    return [int(min(max(int(s), 0), d - k)) for s, d, k in zip(starts, x_shape, sizes)]


def _evaluate_dynamic_slice(instr, args, device):
    x, *starts = args
    sizes = instr.outputs[0].shape   # local sizes once partitioned
    starts = _clamped_starts(x.shape, starts, sizes)
    return [x[tuple(slice(s, s + k) for s, k in zip(starts, sizes))]]


def _evaluate_dynamic_update_slice(instr, args, device):
    x, update, *starts = args
    starts = _clamped_starts(x.shape, starts, update.shape)
    y = x.copy()
    y[tuple(slice(s, s + k) for s, k in zip(starts, update.shape))] = update
    return [y]


def _evaluate_slice(instr, args, device):
    a = instr.attrs
    return [args[0][tuple(slice(s, e, st) for s, e, st in zip(a["start"], a["limit"], a["strides"]))]]


def _evaluate_pad(instr, args, device):
    x, fill = args
    a = instr.attrs
    out = instr.outputs[0]
    y = np.full(out.shape, fill, out.dtype)
    # Interior padding spreads elements apart; negative low/high padding crops.
    spread_shape = [d + (d - 1) * i if d else 0 for d, i in zip(x.shape, a["interior"])]
    spread = np.full(spread_shape, fill, out.dtype)
    spread[tuple(slice(None, None, i + 1) for i in a["interior"])] = x
    src, dst = [], []
    for n, lo, size in zip(spread_shape, a["low"], out.shape):
        s0 = max(0, -lo)
        d0 = max(0, lo)
        length = min(n - s0, size - d0)
        src.append(slice(s0, s0 + max(length, 0)))
        dst.append(slice(d0, d0 + max(length, 0)))
    y[tuple(dst)] = spread[tuple(src)]
    return [y]


def _evaluate_concatenate(instr, args, device):
    return [np.concatenate(args, axis=instr.attrs["dimension"])]


def _dynamic_slice_factors(instr):
    """Dims taken whole pass through (their start clamps to 0 on every shard); dims
    cut at a runtime offset must stay whole here (halo-free cases come later)."""
    x, out = instr.operands[0], instr.outputs[0]
    starts = (None,) * (len(instr.operands) - 1)
    factors = []
    for d, (n, k) in enumerate(zip(x.shape, out.shape)):
        if n == k:
            factors.append(Factor(n, (d, *starts, d)))
        else:
            factors += [Factor(n, (d, *starts, None), REPLICATE), Factor(k, (None, *starts, d), REPLICATE)]
    return factors


def _dynamic_update_slice_factors(instr):
    x, update = instr.operands[:2]
    starts = (None,) * (len(instr.operands) - 2)
    factors = []
    for d, (n, k) in enumerate(zip(x.shape, update.shape)):
        if n == k:
            factors.append(Factor(n, (d, d, *starts, d)))
        else:
            factors += [Factor(n, (d, None, *starts, d), REPLICATE), Factor(k, (None, d, *starts, None), REPLICATE)]
    return factors


register("dynamic-slice", evaluate=_evaluate_dynamic_slice, factors=_dynamic_slice_factors, priority=LAYOUT)
register("dynamic-update-slice", evaluate=_evaluate_dynamic_update_slice, factors=_dynamic_update_slice_factors,
         priority=LAYOUT)
def _untouched_dims_factors(instr, untouched):
    """Dims the op leaves as they are pass through (scalar operands aside); the others
    stay whole here."""
    ranks = [v.rank for v in instr.operands]
    return [Factor(n, tuple(d if r else None for r in ranks) + (d,), PASS if untouched[d] else REPLICATE)
            for d, n in enumerate(instr.outputs[0].shape)]


def _slice_factors(instr):
    a, x = instr.attrs, instr.operands[0]
    return _untouched_dims_factors(instr, [s == 0 and e == n and st == 1 for s, e, st, n in
                                           zip(a["start"], a["limit"], a["strides"], x.shape)])


def _concatenate_factors(instr):
    dim = instr.attrs["dimension"]
    return _untouched_dims_factors(instr, [d != dim for d in range(instr.outputs[0].rank)])


def _pad_factors(instr):
    a = instr.attrs
    return _untouched_dims_factors(instr, [lo == hi == i == 0 for lo, hi, i in zip(a["low"], a["high"], a["interior"])])


register("slice", evaluate=_evaluate_slice, factors=_slice_factors, priority=LAYOUT)
register("pad", evaluate=_evaluate_pad, factors=_pad_factors, priority=LAYOUT)
# -- rotation: concatenate(x[k:], x[:k]) -------------------------------------------------
def _rotation(instr) -> Optional[tuple[Value, int]]:
    """(x, k) when instr concatenates x[k:] and x[:k] along its dim (jnp.roll)."""
    dim = instr.attrs["dimension"]
    if len(instr.operands) != 2 or any(o.producer is None or o.producer.opcode != "slice" for o in instr.operands):
        return None
    (tail, head), x = [o.producer for o in instr.operands], instr.operands[0].producer.operands[0]
    if head.operands[0] is not x or any(s.attrs["strides"] != (1,) * x.rank for s in (tail, head)):
        return None
    k = tail.attrs["start"][dim]
    whole = [d for d in range(x.rank) if d != dim]
    for s, (lo, hi) in ((tail, (k, x.shape[dim])), (head, (0, k))):
        if (s.attrs["start"][dim], s.attrs["limit"][dim]) != (lo, hi) or \
                any(s.attrs["start"][d] != 0 or s.attrs["limit"][d] != x.shape[d] for d in whole):
            return None
    return x, k


def _fetch_tiles_ahead(ctx, pv: PartitionedValue, dim: int, ahead: int) -> Value:
    """Each device receives the shard `ahead` tiles further along `dim` (cyclically)."""
    if ahead % pv.sharding.tiles[dim] == 0:
        return pv.local
    layout = pv.sharding.tile_assignment
    pairs = np.stack([np.roll(layout, -ahead, axis=dim).ravel(), layout.ravel()], axis=1)
    return ctx.collective_permute(pv.local, pairs, "rotation: collective-permute")


def _partition_concatenate(ctx, instr, operands, targets):
    """A rotation along an evenly split dim moves whole shards between neighbours (paper
    4.6): one collective-permute, or two and a static slice when k is not a multiple of
    the shard length. Other concatenates partition by their factors."""
    (target,), rotation, dim = targets, _rotation(instr), instr.attrs["dimension"]
    out = instr.outputs[0]
    if rotation is None or target.tiles[dim] == 1 or out.shape[dim] % target.tiles[dim]:
        return fx.partition(ctx, instr, _concatenate_factors(instr), operands, targets)
    x, k = rotation
    pv = rs.reshard(ctx, ctx.partitioned(x), target)
    size = out.shape[dim] // target.tiles[dim]
    ahead, offset = divmod(k, size)
    pieces = [_fetch_tiles_ahead(ctx, pv, dim, ahead)]
    if offset:
        pieces.append(_fetch_tiles_ahead(ctx, pv, dim, ahead + 1))
        shape = list(pv.local.shape)
        shape[dim] *= 2
        joined = ctx.b.add1("concatenate", pieces, shape, out.dtype, dimension=dim)
        start, limit = [0] * out.rank, list(pv.local.shape)
        start[dim], limit[dim] = offset, offset + size
        pieces = [ctx.b.add1("slice", [joined], pv.local.shape, out.dtype, start=tuple(start),
                             limit=tuple(limit), strides=(1,) * out.rank)]
    return [PartitionedValue(pieces[0], target, out.shape)]


register("concatenate", evaluate=_evaluate_concatenate, factors=_concatenate_factors,
         partition=_partition_concatenate, priority=LAYOUT)
