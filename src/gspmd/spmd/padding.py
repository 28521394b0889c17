"""Uneven partitions: shards are ceil(D/P) long and the last ones hold padding. Before
anything reads across the padding (a reduction), it is masked with the identity."""
from __future__ import annotations

import numpy as np

from gspmd.ir import Value
from gspmd.spmd.context import INDEX_DTYPE, DeviceContext
from gspmd.spmd.partitioned import PartitionedValue


def is_padded(pv: PartitionedValue, dim: int) -> bool:
    return pv.shape[dim] % pv.sharding.tiles[dim] != 0


def mask_padding(ctx: DeviceContext, pv: PartitionedValue, dim: int, fill) -> PartitionedValue:
    """Replace the padding along `dim` by `fill` (positions >= the global size): a
    constant, or a scalar Value of the program (a reduction's init value)."""
    if not is_padded(pv, dim):
        return pv
    b, x = ctx.b, pv.local
    shard = x.shape[dim]
    start = ctx.table_lookup(pv.sharding.coords()[:, dim] * shard)
    iota = b.add1("iota", [], x.shape, INDEX_DTYPE, dimension=dim)
    start_b = b.add1("broadcast", [start], x.shape, INDEX_DTYPE, dims=())
    pos = b.add1("add", [iota, start_b], x.shape, INDEX_DTYPE)
    limit = b.add1("broadcast", [ctx.constant(pv.shape[dim], INDEX_DTYPE)], x.shape, INDEX_DTYPE, dims=())
    inside = b.add1("compare", [pos, limit], x.shape, np.bool_, direction="LT")
    fill = fill if isinstance(fill, Value) else ctx.constant(np.asarray(fill, x.dtype))
    fill_b = b.add1("broadcast", [fill], x.shape, x.dtype, dims=())
    masked = b.add1("select", [inside, x, fill_b], x.shape, x.dtype)
    return PartitionedValue(masked, pv.sharding, pv.shape)
