"""Uneven partitions: shards are ceil(D/P) long and the last ones hold padding. Before
anything reads across the padding (a reduction), it is masked with the identity."""
from __future__ import annotations

from gspmd.ir import emit
from gspmd.spmd.context import DeviceContext
from gspmd.spmd.partitioned import PartitionedValue


def is_padded(pv: PartitionedValue, dim: int) -> bool:
    return pv.shape[dim] % pv.sharding.tiles[dim] != 0


def mask_padding(ctx: DeviceContext, pv: PartitionedValue, dim: int, fill) -> PartitionedValue:
    """Replace the padding along `dim` by `fill` (positions >= the global size): a
    constant, or a scalar Value of the program (a reduction's init value)."""
    if not is_padded(pv, dim):
        return pv
    shard = pv.local.shape[dim]
    start = ctx.table_lookup(pv.sharding.coords()[:, dim] * shard)
    masked = emit.mask_range(ctx.b, pv.local, dim, None, pv.shape[dim], fill, offset=start)
    return PartitionedValue(masked, pv.sharding, pv.shape)
