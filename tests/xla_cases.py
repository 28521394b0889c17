"""Cases ported from XLA's SPMD partitioner tests (openxla/xla,
xla/service/spmd/spmd_partitioner_test.cc), each named after the test it mirrors: the
same shardings, written as XLA sharding strings, on gspmd programs of the same ops
(shapes scaled down where large, meshes of more than 8 devices scaled to 8), with the
communication a good partitioner must achieve — at most what XLA's expected HLO has.

Used by tests/test_xla_cases.py (each case equals one device on both backends and
communicates as asserted) and benchmarks/vs_xla.py (bytes ours / XLA's per case)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Optional

import jax.numpy as jnp
import numpy as np
from jax import lax

import gspmd

F32 = np.float32


def _mesh(spec: str) -> gspmd.Mesh:
    """The mesh of an XLA sharding, "devices=[2,1,2]0,1,2,3 last_tile_dim_replicate": one
    axis per tile dim (a0, a1, ...), its devices in the order listed."""
    m = re.fullmatch(r"devices=\[([\d,]+)\]([\d,]+)( last_tile_dim_replicate)?", spec.strip())
    dims = [int(d) for d in m.group(1).split(",")]
    devices = np.asarray([int(d) for d in m.group(2).split(",")]).reshape(dims)
    return gspmd.Mesh(devices, tuple(f"a{i}" for i in range(len(dims))))


def split(x, spec: str):
    """mesh_split by an XLA sharding, tensor dim i over mesh axis i of its _mesh."""
    mesh = _mesh(spec)
    return gspmd.mesh_split(x, mesh, list(mesh.axis_names[:np.ndim(x)]))


def layout(spec: str) -> gspmd.Sharding:
    """The Sharding an XLA sharding string names (its last tile dim replicated or not)."""
    mesh = _mesh(spec)
    rank = mesh.ndim - spec.strip().endswith("last_tile_dim_replicate")
    return gspmd.Sharding.from_mesh(mesh, list(mesh.axis_names[:rank]), (1,) * rank)


def replicated(rank: int, n: int) -> str:
    """XLA's {replicated} over n devices, as a sharding string split() reads."""
    return f"devices=[{','.join(['1'] * rank + [str(n)])}]{','.join(map(str, range(n)))} last_tile_dim_replicate"


@dataclass(frozen=True)
class Case:
    """One ported test. Expectations (all optional): `kinds` exactly these collectives
    (kind -> count); at most `most` collectives; none of `forbid` kinds; no collective
    of `below` bytes or more; at most `total` bytes in all. Fallback gathers only where
    `fallback` says that nothing cheaper exists."""
    name: str
    fn: Callable
    shapes: tuple                      # argument shapes (float32), or arrays
    kinds: Optional[dict] = None
    most: Optional[int] = None
    forbid: tuple = ()
    below: Optional[int] = None
    total: Optional[int] = None
    fallback: bool = False             # a fallback gather is allowed: nothing cheaper exists

    def arguments(self) -> tuple:
        rng = np.random.RandomState(0)
        return tuple(a if isinstance(a, np.ndarray) else rng.standard_normal(a).astype(F32) for a in self.shapes)


def nbytes(*shape, itemsize=4) -> int:
    return int(np.prod(shape)) * itemsize


CASES: list[Case] = []


def case(name, fn, shapes, **expect) -> None:
    CASES.append(Case(name, fn, tuple(shapes), **expect))


def reshard(name, shape, src, dst, **expect) -> None:
    """XLA's `copy` from one sharding to another."""
    case(name, lambda x: split(split(x, src) * 1, dst), [shape], **expect)


def indices(high: int, *shape) -> np.ndarray:
    return np.random.RandomState(1).randint(0, high, shape).astype(np.int32)


D2, D4, D8 = "devices=[2]0,1", "devices=[4]0,1,2,3", "devices=[8]0,1,2,3,4,5,6,7"
ALL8 = "0,1,2,3,4,5,6,7"
NO_GATHER = ("all-gather", "all-reduce")

# -- resharding ---------------------------------------------------------------------------
reshard("TiledToReplicated", (2, 3), "devices=[2,1]0,1", replicated(2, 2), most=1, total=nbytes(2, 3))
reshard("TiledToTiledEven", (8, 2), "devices=[2,1]0,1", "devices=[1,2]0,1", most=1, forbid=NO_GATHER)
reshard("TiledToTiledUneven", (7, 31, 16), "devices=[1,2,1]0,1", "devices=[2,1,1]0,1", most=1, forbid=NO_GATHER)
reshard("SubgroupAllToAllReshard", (8, 8, 8, 8), f"devices=[2,2,1,2]{ALL8}", "devices=[1,2,2,2]0,1,4,5,2,3,6,7",
        kinds={"all-to-all": 1}, total=nbytes(4, 4, 2, 4, 4))
reshard("SubgroupAllToAllReshard2", (8, 8), f"devices=[2,4]{ALL8}", "devices=[4,2]0,1,4,5,2,3,6,7", most=2,
        forbid=NO_GATHER, total=2 * nbytes(2, 4))
reshard("SubgroupAllToAllReshard3", (8, 8, 8), f"devices=[2,4,1]{ALL8}", "devices=[1,2,4]0,1,4,5,2,3,6,7", most=3,
        forbid=NO_GATHER, total=3 * nbytes(4, 8, 2))
reshard("TileToPartialReplicateReshard", (8, 8), "devices=[2,2]0,1,2,3", "devices=[2,1,2]0,1,2,3 last_tile_dim_replicate",
        kinds={"all-gather": 1}, total=nbytes(4, 8))
reshard("TileToPartialReplicateReshardUnevenPartition", (8, 8), "devices=[2,3]0,1,2,3,4,5",
        "devices=[1,2,3]0,1,2,3,4,5 last_tile_dim_replicate", most=2, fallback=True)
reshard("PartialReplicateToTileReshardUnevenPartition", (8, 8), "devices=[1,2,3]0,1,2,3,4,5 last_tile_dim_replicate",
        "devices=[2,3]0,1,2,3,4,5", most=1, forbid=NO_GATHER, total=nbytes(8, 4))
reshard("PartialReplicateToTileReshard", (8, 8), "devices=[2,1,2]0,1,2,3 last_tile_dim_replicate",
        "devices=[2,2]0,1,2,3", kinds={})
reshard("ComplexReshardFromPartialReplicate", (4, 15, 4, 16),
        "devices=[1,1,1,2,4]0,2,4,6,1,3,5,7 last_tile_dim_replicate", f"devices=[1,8,1,1]{ALL8}", most=1,
        forbid=NO_GATHER)
reshard("ComplexReshardToPartialReplicate", (4, 15, 4, 16), f"devices=[1,4,2,1]{ALL8}",
        "devices=[1,1,1,2,4]0,2,4,6,1,3,5,7 last_tile_dim_replicate", most=2, total=nbytes(4, 16, 4, 8) + nbytes(4, 4, 4, 8))
reshard("ComplexReshardMoveMergeDimensionRight", (4, 15, 4, 15), f"devices=[1,4,1,2]{ALL8}",
        "devices=[1,1,1,8]0,2,4,6,1,3,5,7", kinds={"all-to-all": 1})
reshard("ComplexReshardMoveMergeDimensionLeft", (2, 15, 1, 2), f"devices=[1,4,1,2]{ALL8}", f"devices=[1,8,1,1]{ALL8}",
        kinds={"all-to-all": 1})
reshard("ComplexReshardMoveMergeDimensionLeftReorder", (4, 15, 4, 16), f"devices=[1,4,1,2]{ALL8}",
        "devices=[1,8,1,1]0,2,4,6,1,3,5,7", most=2, forbid=NO_GATHER, total=2 * nbytes(4, 4, 4, 8))
reshard("ComplexReshardPartialMerging", (16, 16, 16), f"devices=[2,1,2,2]{ALL8} last_tile_dim_replicate",
        f"devices=[1,2,1,4]{ALL8} last_tile_dim_replicate", most=2, total=nbytes(8, 8, 16) + nbytes(16, 8, 16))
reshard("ComplexReshardUnmergeToRight", (8, 32), "devices=[8,1]0,2,4,6,1,3,5,7", "devices=[2,4]0,2,4,6,1,3,5,7",
        kinds={"all-to-all": 1})
reshard("ComplexReshardUnmergeToLeft", (8, 32), "devices=[1,8]0,2,4,6,1,3,5,7", "devices=[2,4]0,2,4,6,1,3,5,7",
        most=2, forbid=NO_GATHER)
reshard("NoComplexReshardUnmergeToLeft", (8, 33), "devices=[1,8]0,2,4,6,1,3,5,7", "devices=[2,4]0,2,4,6,1,3,5,7",
        most=2, forbid=NO_GATHER)
reshard("PartialReshardingInfiniteLoops", (16, 16, 16), f"devices=[4,1,1,2]{ALL8} last_tile_dim_replicate",
        f"devices=[2,2,1,2]{ALL8} last_tile_dim_replicate", kinds={"all-to-all": 1})
reshard("PartialDusReplicate", (3, 2), f"devices=[4,2]{ALL8}", replicated(2, 8), most=2, total=2 * nbytes(3, 2))


def _uneven_pad_all_to_all(x):
    y = split(x, f"devices=[4,2]{ALL8}") * 2
    return split(y + split(y.T, "devices=[2,4]0,2,4,6,1,3,5,7"), f"devices=[4,2]{ALL8}")


case("UnevenPadAllToAllReshard", _uneven_pad_all_to_all, [(19, 19)], most=2, forbid=NO_GATHER,
     total=2 * nbytes(5, 10))
case("UnevenPadAllToAllReshard2", _uneven_pad_all_to_all, [(5, 5)], most=3, forbid=NO_GATHER)
case("TileToPartialReplicateHaloExchangeWithPadding",
     lambda x: split(split(x, f"devices=[8,1]{ALL8}").reshape(2, 1, 123),
                     f"devices=[2,1,1,4]{ALL8} last_tile_dim_replicate"), [(2, 123)], most=5, below=nbytes(2, 123))

# -- elementwise, broadcast, reduce, transpose, reshape --------------------------------------
case("TiledElementwise", lambda x, y: split(split(x, "devices=[2,1]0,1") * y + y, "devices=[2,1]0,1"),
     [(3, 3), (3, 3)], kinds={})
case("BroadcastOnlyNewDimsSharded", lambda x: split(jnp.broadcast_to(x, (3, 4, 3)), "devices=[2,1,1]0,1"), [(4, 3)],
     kinds={})
case("BroadcastOnlyOldDimsSharded", lambda x: split(jnp.broadcast_to(x, (4, 4, 3)), "devices=[1,2,1]0,1"), [(4, 3)],
     kinds={})
case("BroadcastBothOldAndNewDimsSharded", lambda x: split(jnp.broadcast_to(x, (4, 4, 3)), "devices=[2,2,1]0,1,2,3"),
     [(4, 3)], kinds={})
case("TiledToReplicatedReduce", lambda x: split(x, "devices=[2,1]0,1").sum(), [(3, 3)], kinds={"all-reduce": 1},
     total=4)
case("TiledToTiledReduce", lambda x: split(split(x, "devices=[1,1,1,2]0,1").sum((0, 1, 2)), D2),
     [(4, 8, 8, 16)], kinds={})
case("PartialTiledToPartialTiledReduce",
     lambda x: split(split(x, f"devices=[2,2,2]{ALL8} last_tile_dim_replicate").sum(0),
                     "devices=[2,4]0,1,4,5,2,3,6,7 last_tile_dim_replicate"), [(4, 4)],
     kinds={"all-reduce": 1}, total=nbytes(2))
case("IotaAlongTileDimension", lambda x: split(x + lax.broadcasted_iota(np.float32, (16, 8, 91), 2),
                                               "devices=[1,1,2]0,1"), [(16, 8, 91)], kinds={})
case("ShardableTranspose", lambda x: split(split(x, "devices=[1,2,1,1]0,1").transpose(0, 3, 1, 2),
                                           "devices=[1,1,2,1]0,1"), [(16, 38, 38, 4)], kinds={})
case("MultiDimensionShardedTranspose",
     lambda x: split(split(x, f"devices=[4,2,1,1]{ALL8}").transpose(1, 3, 0, 2), "devices=[2,1,4,1]0,2,4,6,1,3,5,7"),
     [(16, 38, 38, 4)], kinds={})
case("NonShardableTranspose", lambda x: split(split(x, "devices=[1,2,1,1]0,1").transpose(0, 3, 1, 2),
                                              "devices=[1,2,1,1]0,1"), [(16, 38, 38, 4)], kinds={"all-to-all": 1})
case("PartialReplicateShardableTranspose",
     lambda x: split(split(x, "devices=[1,2,1,1,2]0,1,2,3 last_tile_dim_replicate").transpose(0, 3, 1, 2),
                     "devices=[1,1,2,1,2]0,1,2,3 last_tile_dim_replicate"), [(16, 38, 38, 4)], kinds={})
case("PartialReplicateNonShardableTranspose",
     lambda x: split(split(x, "devices=[1,2,1,1,2]0,1,2,3 last_tile_dim_replicate").transpose(0, 3, 1, 2),
                     "devices=[1,2,1,1,2]0,1,2,3 last_tile_dim_replicate"), [(16, 38, 38, 4)],
     kinds={"all-to-all": 1})
case("PartialReplicateMultiDimensionShardedTranspose",
     lambda x: split(split(x, f"devices=[2,2,1,1,2]{ALL8} last_tile_dim_replicate").transpose(1, 3, 0, 2),
                     "devices=[2,1,2,1,2]0,1,4,5,2,3,6,7 last_tile_dim_replicate"), [(16, 38, 38, 4)], kinds={})
case("ShardableReshape", lambda x: split(split(x, "devices=[2,1,1]0,1").reshape(38, 10, 4, 81),
                                         "devices=[2,1,1,1]0,1"), [(38, 10, 324)], kinds={})
case("ReshapeWithReshard", lambda x: split(split(x, "devices=[2,1,1]0,1").reshape(38, 38, 4, 81),
                                           "devices=[1,2,1,1]0,1"), [(38, 38, 324)], kinds={"all-to-all": 1})
case("ReshapeWithReshard2", lambda x: split(split(x, "devices=[2,1,1]0,1").reshape(38, 38, 2, 162),
                                            "devices=[1,1,1,2]0,1"), [(38, 38, 324)], kinds={"all-to-all": 1})
case("PartialReplicateShardableReshape",
     lambda x: split(split(x, "devices=[2,1,1,2]0,1,2,3 last_tile_dim_replicate").reshape(38, 10, 4, 81),
                     "devices=[2,1,1,1,2]0,1,2,3 last_tile_dim_replicate"), [(38, 10, 324)], kinds={})
case("ReshapeMergeDimsWithHaloExchange",
     lambda x: split(split(x, "devices=[1,1,2,1]0,1").reshape(3, 2, 1, 14, 5), "devices=[1,1,1,2,1]0,1"),
     [(2, 3, 7, 10)], kinds={"collective-permute": 1})
case("PartialReplicateReshapeMergeDimsWithHaloExchange",
     lambda x: split(split(x, "devices=[1,1,2,1,2]0,1,2,3 last_tile_dim_replicate").reshape(3, 2, 1, 14, 5),
                     "devices=[1,1,1,2,1,2]0,1,2,3 last_tile_dim_replicate"), [(2, 3, 7, 10)],
     kinds={"collective-permute": 1})

# -- data formatting: pad, slice, concatenate, reverse -----------------------------------------
def _pad(x, value, config):
    return lax.pad(x, np.float32(value), config)


def _shift_right(value):
    def fn(x):
        padded = split(split(_pad(split(x, D4), value, [(1, 0, 0)]), D4), D4)   # XLA's copies between
        return split(lax.slice(padded, [0], [4]), D4)
    return fn


case("MergedPadThenSliceShiftRight", _shift_right(2.0), [(4,)], kinds={"collective-permute": 1}, total=nbytes(1))
case("MergedPadThenSliceShiftRightNoMasking", _shift_right(0.0), [(4,)], kinds={"collective-permute": 1},
     total=nbytes(1))


def _rotate_right(size, k):
    def fn(x):
        x = split(x, D4)
        return split(jnp.concatenate([split(x[size - k:], D4), split(x[:size - k], D4)]), D4)
    return fn


case("MergedSliceThenConcatRotateRight", _rotate_right(12, 2), [(12,)], kinds={"collective-permute": 1},
     total=nbytes(2))
case("MergedSliceThenConcatRotateRightWithAlignedPadding", _rotate_right(6, 2), [(6,)],
     kinds={"collective-permute": 1}, total=nbytes(2))
case("MergedSliceThenConcatRotateRightWithUnalignedPadding", _rotate_right(10, 6), [(10,)], most=3,
     forbid=NO_GATHER, total=3 * nbytes(3))


def _wrap(modify_left, modify_right):
    def fn(x):
        x = split(x, "devices=[1,2]0,1")
        left = split(modify_left(split(x[:, -2:], "devices=[1,2]0,1")), "devices=[1,2]0,1")
        right = split(modify_right(split(x[:, :2], "devices=[1,2]0,1")), "devices=[1,2]0,1")
        return split(jnp.concatenate([left, x, right], axis=1), "devices=[1,2]0,1")
    return fn


case("PadWithWrapPattern",
     lambda x: split(jnp.concatenate([split(x[:, 15:16], "devices=[1,2,1]0,1"), split(x, "devices=[1,2,1]0,1"),
                                      split(x[:, :1], "devices=[1,2,1]0,1")], axis=1), "devices=[1,2,1]0,1"),
     [(3, 16, 4 * 16)], kinds={"collective-permute": 1}, total=nbytes(3, 1, 64))
case("PadWrapWithNegatePattern", _wrap(jnp.negative, jnp.negative), [(1, 18)], most=4, forbid=NO_GATHER,
     below=nbytes(1, 3))
case("PadWrapWithMultipleModifiersPattern",
     _wrap(lambda v: jnp.sin(lax.rsqrt(jnp.abs(v) + 1)),
           lambda v: jnp.cos(v.astype(jnp.float16)).astype(jnp.float32)), [(1, 18)], most=4, forbid=NO_GATHER,
     below=nbytes(1, 3))
case("SliceTo1", lambda x: split(split(x, D4)[0:1], D4), [(512,)], kinds={})
case("SliceTo1_8Shards", lambda x: split(split(x, f"devices=[4,2]{ALL8}")[0:1], f"devices=[4,2]{ALL8}"), [(4, 4)],
     kinds={})
case("SliceTo1PartialReplicate",
     lambda x: split(split(x, "devices=[2,2]0,1,2,3 last_tile_dim_replicate")[0:1],
                     "devices=[2,2]0,1,2,3 last_tile_dim_replicate"), [(16,)], kinds={})
case("SliceTo2", lambda x: split(split(x, D4)[0:2], D4), [(512,)], kinds={"collective-permute": 1}, total=nbytes(1))
case("SliceToMiddle2", lambda x: split(split(x, D8)[300:302], D8), [(512,)], most=2, total=2 * nbytes(1))
case("SliceToMiddle2PartiallyReplicated",
     lambda x: split(split(x, f"devices=[4,2]{ALL8} last_tile_dim_replicate")[300:302],
                     f"devices=[4,2]{ALL8} last_tile_dim_replicate"), [(512,)], most=2, total=2 * nbytes(1))
case("SliceAlongNonPartitionedDimension",
     lambda x: split(split(x, "devices=[1,1,2]0,1")[:, 2:13, :], "devices=[1,1,2]0,1"), [(16, 14, 257)], kinds={})
case("SliceAlongPartitionedDimension",
     lambda x: split(split(x, "devices=[1,1,2]0,1")[2:128:2, :, 5:256], "devices=[1,1,2]0,1"), [(128, 4, 257)],
     kinds={"collective-permute": 1}, below=nbytes(63, 4, 126))
case("SliceAlongPartitionedDimension2", lambda x: split(split(x, D4)[3:4], D4), [(4,)],
     kinds={"collective-permute": 1}, total=nbytes(1))
case("PartialReplicateSliceAlongNonPartitionedDimension",
     lambda x: split(split(x, "devices=[1,1,2,2]0,1,2,3 last_tile_dim_replicate")[:, 2:13, :],
                     "devices=[1,1,2,2]0,1,2,3 last_tile_dim_replicate"), [(16, 14, 257)], kinds={})
case("PartialReplicateSliceAlongPartitionedDimension",
     lambda x: split(split(x, "devices=[1,1,2,2]0,1,2,3 last_tile_dim_replicate")[2:128:2, :, 5:256],
                     "devices=[1,1,2,2]0,1,2,3 last_tile_dim_replicate"), [(128, 4, 257)],
     kinds={"collective-permute": 1}, below=nbytes(63, 4, 126))
case("PadAlongNonPartitionedDimension",
     lambda x: split(_pad(split(x, "devices=[1,1,2]0,1"), 0, [(0, 0, 0), (1, 2, 0), (0, 0, 0)]),
                     "devices=[1,1,2]0,1"), [(16, 14, 257)], kinds={})
case("PadAlongNonPartitionedDimensionReshard",
     lambda x: split(_pad(split(x, replicated(3, 2)), 0, [(0, 0, 0), (1, 2, 0), (0, 0, 0)]), "devices=[1,1,2]0,1"),
     [(16, 14, 257)], kinds={})
case("PadAlongPartitionedDimension",
     lambda x: split(_pad(split(x, "devices=[1,2]0,1"), 0, [(0, 0, 0), (0, 2, 0)]), "devices=[1,2]0,1"),
     [(14, 257)], kinds={"collective-permute": 1}, total=nbytes(14, 1))
case("PadAlongPartitionedDimensionWithInteriorPadding",
     lambda x, v: split(lax.pad(split(x, D2), v, [(2, 1, 2)]), D2), [(7,), np.asarray(1.5, F32)],
     kinds={"collective-permute": 1}, total=nbytes(1))
case("PartialReplicatePad",
     lambda x, v: split(lax.pad(split(x, "devices=[1,2,2]0,1,2,3 last_tile_dim_replicate"), v, [(2, 4, 1), (2, 1, 2)]),
                        "devices=[1,2,2]0,1,2,3 last_tile_dim_replicate"), [(11, 7), np.asarray(1.5, F32)],
     kinds={"collective-permute": 1}, total=nbytes(11, 1))
case("ConcatenateAlongNonPartitionedDimension",
     lambda x, y: split(jnp.concatenate([split(x, "devices=[2,1]0,1"), split(y, "devices=[2,1]0,1")], axis=1),
                        "devices=[2,1]0,1"), [(14, 257), (14, 116)], kinds={})
case("ConcatenateAlongPartitionedDimension",
     lambda x, y: split(jnp.concatenate([split(x, "devices=[1,2]0,1"), split(y, "devices=[1,2]0,1")], axis=1),
                        "devices=[1,2]0,1"), [(14, 257), (14, 116)], most=2, below=nbytes(14, 187),
     forbid=NO_GATHER)
case("ConcatenateAlongBothDimensions",
     lambda x, y: split(jnp.concatenate([split(x, "devices=[2,2]0,1,2,3"), split(y, "devices=[2,2]0,1,2,3")], axis=1),
                        "devices=[2,2]0,1,2,3"), [(14, 257), (14, 116)], most=2, below=nbytes(7, 187),
     forbid=NO_GATHER)
case("TiledReversePassthrough", lambda x: split(lax.rev(split(x, "devices=[2,1]0,1"), (1,)), "devices=[2,1]0,1"),
     [(3, 3)], kinds={})
case("TiledReversePassthroughViaReversedSharding", lambda x: split(lax.rev(split(x, D2), (0,)), "devices=[2]1,0"),
     [(4,)], kinds={})
case("TiledReverseSwapShards", lambda x: split(lax.rev(split(x, D2), (0,)), D2), [(4,)],
     kinds={"collective-permute": 1})
case("TiledReverseHaloExchange", lambda x: split(lax.rev(split(x, D2), (0,)), "devices=[2]1,0"), [(3,)],
     kinds={"collective-permute": 1}, total=nbytes(1))

# -- dynamic-slice and dynamic-update-slice -------------------------------------------------
I5 = np.asarray(5, np.int32)
case("DynamicSliceAlongNonPartitionedDimension",
     lambda x, i, j: split(lax.dynamic_slice(split(x, "devices=[2,1]0,1"), (j, i), (128, 2)), "devices=[2,1]0,1"),
     [(128, 64), I5, np.asarray(3, np.int32)], kinds={})
case("DynamicUpdateSliceAlongNonPartitionedDimension",
     lambda x, u, i, j: split(lax.dynamic_update_slice(split(x, "devices=[2,1]0,1"), split(u, "devices=[2,1]0,1"),
                                                       (j, i)), "devices=[2,1]0,1"),
     [(128, 64), (128, 2), I5, np.asarray(3, np.int32)], kinds={})
case("DynamicUpdateSliceAlongPartitionedDimension",
     lambda x, u, i: split(lax.dynamic_update_slice(split(x, "devices=[1,2]0,1"), split(u, "devices=[1,2]0,1"),
                                                    (i, 60)), "devices=[1,2]0,1"),
     [(128, 64), (128, 2), I5], most=1, total=nbytes(128, 2))
case("DynamicUpdateSliceAlongPartitionedDimension2",
     lambda x, u, i: split(lax.dynamic_update_slice(split(x, f"devices=[8,1,1]{ALL8}"), split(u, f"devices=[8,1,1]{ALL8}"),
                                                    (i, 0, 0)), f"devices=[8,1,1]{ALL8}"),
     [(8, 790, 2), (1, 790, 2), I5], most=1, total=nbytes(1, 790, 2))
case("DynamicUpdateSlicePartitionSliceAndNonSliceDims",
     lambda x, u: split(lax.dynamic_update_slice(split(x, "devices=[2,2]0,1,2,3"), split(u, "devices=[2,2]0,1,2,3"),
                                                 (0, 60)), "devices=[2,2]0,1,2,3"),
     [(128, 64), (128, 2)], most=1, total=nbytes(64, 2))
case("KeepPartitionedNonSlicedDimension",
     lambda x: split(lax.dynamic_update_slice(split(jnp.zeros((4, 32, 32, 8), F32), "devices=[2,2,1,1]0,1,2,3"),
                                              split(x, "devices=[2,2,1,1]0,1,2,3") * 2, (0, 12, 12, 0)),
                     "devices=[2,2,1,1]0,1,2,3"), [(4, 8, 8, 8)], most=1, total=nbytes(2, 8, 8, 8))

# -- grouped convolutions ---------------------------------------------------------------------
def _conv(lhs_spec, rhs_spec, out_spec, padding, feature_groups=1, batch_groups=1):
    def conv(lhs, rhs):
        dn = lax.ConvDimensionNumbers(lhs_spec, rhs_spec, out_spec)
        return lax.conv_general_dilated(lhs, rhs, (1,) * len(padding), padding, dimension_numbers=dn,
                                        feature_group_count=feature_groups, batch_group_count=batch_groups)
    return conv


# f01b_i01o->01bf with batch_group_count = batch (depthwise weight gradients), [16,801,1,1024] scaled to [4,33,1,8];
# b01f_01io->b01f with feature_group_count = features (depthwise), [16,801,1,1024] scaled to [4,33,1,8];
# f0b_i0o->0bf, batch_group_count = 64 (scaled to 16) and b0f_i0o->0bf, feature_group_count = 16, [4,275,64]
# scaled to [4,35,16].
BATCH_GROUPED = (_conv((3, 0, 1, 2), (3, 0, 1, 2), (2, 3, 0, 1), [(2, 2), (0, 0)], batch_groups=8),
                 (4, 33, 1, 8), (4, 33, 1, 8))
FEATURE_GROUPED = (_conv((0, 3, 1, 2), (3, 2, 0, 1), (0, 3, 1, 2), [(2, 2), (0, 0)], feature_groups=8),
                   (4, 33, 1, 8), (5, 1, 1, 8))
FEATURE_GROUPED_2 = (FEATURE_GROUPED[0], (4, 33, 1, 8), (5, 1, 1, 16))   # two output features per group
BATCH_GROUPED_1D = (_conv((2, 0, 1), (2, 0, 1), (1, 2, 0), [(2, 2)], batch_groups=16), (4, 35, 16), (4, 35, 16))
FEATURE_GROUPED_1D = (_conv((0, 2, 1), (2, 0, 1), (1, 2, 0), [(2, 2)], feature_groups=16), (4, 35, 16), (1, 35, 16))
S2 = {name: f"devices={spec}0,1" for name, spec in
      [("f", "[1,1,1,2]"), ("s", "[1,2,1,1]"), ("b", "[2,1,1,1]"), ("r", "[1,1,2,1]")]}
P8 = "0,4,1,5,2,6,3,7 last_tile_dim_replicate"


def _aligned(names, conv, conv_whole, rhs_split, rhs_bytes, out_bytes):
    """XLA's five alignment tests of a grouped convolution: everything split on the
    groups (no communication); then the rhs, the lhs or the result split otherwise, each
    moving just that tensor (the lhs and the result of the last test both)."""
    lhs_bytes = nbytes(4, 34, 1, 4)
    f, s, b = S2["f"], S2["s"], S2["b"]
    return list(zip(names, [conv_whole] + [conv] * 4, [f, f, s, f, s], [f, rhs_split, f, f, f], [f, f, f, b, b],
                    [dict(kinds={}), dict(most=1, total=rhs_bytes), dict(most=1, total=lhs_bytes),
                     dict(most=1, total=out_bytes), dict(most=2, total=lhs_bytes + out_bytes)]))


BATCH_ALIGNED = _aligned([f"PartitionConvWithBathGroupCount{n}" for n in
                          ["", "RHSAlignWithLHS", "LHSAlignWithRHS", "OutputAlignWithLHS", "OutputAlignWithRHS"]],
                         BATCH_GROUPED, BATCH_GROUPED, S2["s"], nbytes(4, 34, 1, 4), nbytes(6, 1, 1, 4))
FEATURE_ALIGNED = _aligned([f"PartitionConvWithFeatureGroupCount{n}" for n in
                            ["", "RHSAlignWithLHS", "LHSAlignWithRHS", "AlignOuputWithLHS", "AlignOuputWithRHS"]],
                           FEATURE_GROUPED, FEATURE_GROUPED_2, S2["b"], nbytes(5, 1, 1, 8), nbytes(4, 33, 1, 4))
for _name, (_conv_fn, _lhs_shape, _rhs_shape), _lhs, _rhs, _out, _expect in [
        *BATCH_ALIGNED,
        ("PartitionConvGroupOnBatchGroupCount", BATCH_GROUPED, "devices=[1,2,1,2]0,1,2,3", "devices=[1,2,1,2]0,1,2,3",
         "devices=[1,1,1,2,2]0,1,2,3 last_tile_dim_replicate", dict(most=5, below=nbytes(4, 17, 1, 4))),
        ("PartitionConvWithBathGroupAlignWithLHSPartial", BATCH_GROUPED_1D, f"devices=[2,1,4]{ALL8}",
         f"devices=[4,1,2]{ALL8}", f"devices=[1,4,1,2]{P8}", dict(most=4, below=nbytes(4, 35, 16))),
        ("PartitionConvWithBathGroupCountAlignWithRHSPartial", BATCH_GROUPED_1D, f"devices=[4,1,2]{ALL8}",
         f"devices=[2,1,4]{ALL8}", f"devices=[1,4,1,2]{P8}", dict(most=4, below=nbytes(4, 35, 16))),
        ("PartitionConvWithBathGroupCountAlignWithOutputPartial", BATCH_GROUPED_1D, f"devices=[4,1,2]{ALL8}",
         f"devices=[4,1,2]{ALL8}", f"devices=[1,1,4,2]{P8}", dict(most=4, below=nbytes(4, 35, 16))),
        *FEATURE_ALIGNED,
        ("PartitionConvWithFeatureGroupCountAlignWithLHSPartial", FEATURE_GROUPED_1D,
         f"devices=[1,1,4,2]{ALL8} last_tile_dim_replicate", f"devices=[1,1,2,4]{ALL8} last_tile_dim_replicate",
         f"devices=[1,1,2,4]{P8}", dict(most=2, below=nbytes(4, 35, 16))),
        ("PartitionConvWithFeatureGroupCountAlignWithRHSPartial", FEATURE_GROUPED_1D,
         f"devices=[1,1,2,4]{ALL8} last_tile_dim_replicate", f"devices=[1,1,4,2]{ALL8} last_tile_dim_replicate",
         f"devices=[1,1,2,4]{P8}", dict(most=2, below=nbytes(4, 35, 16))),
        ("PartitionConvWithFeatureGroupCountAlignWithOutputPartial", FEATURE_GROUPED_1D,
         f"devices=[1,1,2,4]{ALL8} last_tile_dim_replicate", f"devices=[1,1,2,4]{ALL8} last_tile_dim_replicate",
         f"devices=[1,1,4,2]{P8}", dict(most=2, below=nbytes(4, 35, 16)))]:
    case(_name, lambda a, b, conv=_conv_fn, lhs=_lhs, rhs=_rhs, out=_out: split(conv(split(a, lhs), split(b, rhs)), out),
         [_lhs_shape, _rhs_shape], **_expect)
case("PartitionConvWithFeatureGroupCountBackProp",
     lambda a, b: split(_conv((0, 3, 1, 2), (2, 3, 0, 1), (0, 3, 1, 2), [(2, 2), (0, 0)], feature_groups=8)(
         split(a, S2["f"]), lax.rev(split(b, S2["r"]), (0, 1))), S2["f"]), [(4, 33, 1, 8), (5, 1, 8, 1)], kinds={})
case("PartitionConvWithFeatureGroupCount2",
     lambda a, b: split(_conv((0, 3, 1, 2), (3, 2, 0, 1), (0, 3, 1, 2), [(0, 0), (0, 0)], feature_groups=32)(
         split(a, f"devices=[1,1,1,4,2]{ALL8} last_tile_dim_replicate"),
         split(b, f"devices=[1,1,1,4,2]{ALL8} last_tile_dim_replicate")), "devices=[2,1,1,4]0,4,2,6,1,5,3,7"),
     [(8, 3, 1, 32), (3, 1, 1, 32)], most=1, below=nbytes(8, 1, 1, 8) + 1)

# -- gather and scatter with passthrough dims --------------------------------------------------
def _gather(offset_dims, collapsed, start_map, sizes):
    dn = lax.GatherDimensionNumbers(offset_dims=offset_dims, collapsed_slice_dims=collapsed, start_index_map=start_map)
    return lambda x, i: lax.gather(x, i, dn, sizes, mode=lax.GatherScatterMode.CLIP)


ROWS = _gather((1,), (0,), (0,), (1, 9))
case("UnpartitionedGather", lambda x, i: split(ROWS(x, i), "devices=[1,2]0,1"), [(2, 9), indices(2, 3, 1)], kinds={})
case("PassthroughGather", lambda x, i: split(ROWS(split(x, "devices=[1,2]0,1"), i), "devices=[1,2]0,1"),
     [(2, 9), indices(2, 3, 1)], kinds={})
case("PassthroughGather_PartialReplicate",
     lambda x, i: split(ROWS(split(x, "devices=[1,2,2]0,1,2,3 last_tile_dim_replicate"), i),
                        "devices=[1,2,2]0,1,2,3 last_tile_dim_replicate"), [(2, 9), indices(2, 3, 1)], kinds={})
# XLA's index_vector_dim=1 of s32[4,2,4] is the last dim of [4,4,2] here.
POINTS = _gather((0,), (0, 1), (0, 1), (1, 1, 8))
case("IndexPassthroughGather",
     lambda x, i: split(POINTS(x, split(i, "devices=[2,2,1]0,1,2,3")), "devices=[1,2,2]0,1,2,3"),
     [(2, 9, 8), indices(2, 4, 4, 2)], kinds={})
case("IndexPassthroughGather_PartialReplicate",
     lambda x, i: split(POINTS(x, split(i, f"devices=[2,2,1,2]{ALL8} last_tile_dim_replicate")),
                        f"devices=[1,2,2,2]{ALL8} last_tile_dim_replicate"), [(2, 9, 8), indices(2, 4, 4, 2)],
     kinds={})
case("IndexAndOperandPassthroughGather",
     lambda x, i: split(_gather((1, 2), (), (0, 1), (1, 12))(split(x, "devices=[1,2,2]0,1,2,3 last_tile_dim_replicate"),
                                                             split(i, "devices=[2,1,2]0,2,1,3 last_tile_dim_replicate")),
                        "devices=[2,1,2]0,2,1,3"), [(7, 12), indices(7, 16, 2)], kinds={})
case("GatherOperandPassthroughIndexPassthrough",
     lambda x, i: split(ROWS(split(x, "devices=[1,2,2]1,0,3,2 last_tile_dim_replicate"),
                             split(i, "devices=[2,1,2]1,2,3,0 last_tile_dim_replicate")), "devices=[2,2]0,1,2,3"),
     [(2, 9), indices(2, 7, 1)], most=2, forbid=NO_GATHER)
case("GatherPassthrough",
     lambda x, i: split(_gather((0, 1, 3, 4), (), (0, 1, 2, 3), (4, 16, 8, 8))(split(x, "devices=[1,4,1,1]0,1,2,3"), i),
                        "devices=[1,4,1,1,1]0,1,2,3"),
     [(4, 16, 48, 48), np.stack([np.zeros(6), np.zeros(6), np.arange(6) * 8, np.zeros(6)], 1).astype(np.int32)],
     kinds={})


def _scatter_add(update_window_dims, inserted, to_operand):
    dn = lax.ScatterDimensionNumbers(update_window_dims=update_window_dims, inserted_window_dims=inserted,
                                     scatter_dims_to_operand_dims=to_operand)
    return lambda x, i, u: lax.scatter_add(x, i, u, dn, mode=lax.GatherScatterMode.CLIP)


case("PassthroughScatter",
     lambda x, i, u: split(_scatter_add((1,), (0,), (0,))(split(x, "devices=[1,2]0,1"), i, split(u, "devices=[1,2]0,1")),
                           "devices=[1,2]0,1"), [(2, 9), indices(2, 3, 1), (3, 9)], kinds={})
case("PassthroughScatter_PartialReplicate",
     lambda x, i, u: split(_scatter_add((1,), (0,), (0,))(
         split(x, "devices=[1,2,2]0,1,2,3 last_tile_dim_replicate"), i,
         split(u, "devices=[1,2,2]0,1,2,3 last_tile_dim_replicate")), "devices=[1,2,2]0,1,2,3 last_tile_dim_replicate"),
     [(2, 9), indices(2, 3, 1), (3, 9)], kinds={})
case("IndexPassthroughScatter",
     lambda x, i, u: split(_scatter_add((2,), (0, 1), (0, 1))(x, split(i, "devices=[2,2,1]0,1,2,3"),
                                                              split(u, "devices=[2,2,1]0,1,2,3")), replicated(3, 4)),
     [(2, 9, 8), indices(2, 4, 4, 2), (4, 4, 8)], kinds={"all-reduce": 1}, total=nbytes(2, 9, 8))

# -- dots -----------------------------------------------------------------------------------------
def _dot(name, lhs_shape, rhs_shape, dims, lhs, rhs, out, **expect):
    case(name, lambda a, b: split(lax.dot_general(split(a, lhs), split(b, rhs), dims), out), [lhs_shape, rhs_shape],
         **expect)


NT = (((1,), (1,)), ((), ()))      # [m, k] x [n, k]
_dot("DotPartialDeviceOrder", (4, 8, 16), (16, 8), (((2,), (0,)), ((), ())),
     "devices=[1,1,2,2]1,3,0,2 last_tile_dim_replicate", "devices=[2,2]3,1,2,0",
     "devices=[1,1,2,2]2,3,0,1 last_tile_dim_replicate", most=1, total=nbytes(4, 8, 4))
_dot("DotPartialContracting", (24, 100), (32, 100), NT, "devices=[1,2,2]0,1,2,3 last_tile_dim_replicate",
     "devices=[1,2,2]0,1,2,3 last_tile_dim_replicate", replicated(2, 4), kinds={"all-reduce": 1},
     total=nbytes(24, 32))
_dot("DotPartialContracting2", (24, 100), (32, 100), NT, "devices=[1,2,2]0,1,2,3 last_tile_dim_replicate",
     "devices=[1,2,2]0,1,2,3 last_tile_dim_replicate", "devices=[2,1,2]0,2,1,3 last_tile_dim_replicate", most=1,
     total=nbytes(12, 32))
_dot("DotPartialContracting3", (24, 100), (32, 100), NT, f"devices=[1,2,4]{ALL8} last_tile_dim_replicate",
     f"devices=[1,2,4]{ALL8} last_tile_dim_replicate", f"devices=[1,2,4]{ALL8} last_tile_dim_replicate", most=1,
     total=nbytes(24, 16))
_dot("DotBatchAndPartialContracting", (4, 24, 100), (4, 32, 100), (((2,), (2,)), ((0,), (0,))),
     f"devices=[2,2,2]{ALL8}", "devices=[2,1,2,2]0,2,1,3,4,6,5,7 last_tile_dim_replicate",
     f"devices=[2,2,1,2]{ALL8} last_tile_dim_replicate", kinds={"all-reduce": 1}, total=nbytes(2, 12, 32))
_dot("DotPartialNonContracting", (24, 8, 100), (32, 100), (((2,), (1,)), ((), ())),
     "devices=[2,1,1,2]0,1,2,3 last_tile_dim_replicate", "devices=[2,2]0,2,1,3", "devices=[2,1,2]0,1,2,3",
     most=1, total=nbytes(16, 100))
_dot("DotPartialNonContractingPartialMatch", (24, 8, 100), (32, 100), (((2,), (1,)), ((), ())),
     "devices=[2,2,1]0,1,2,3", "devices=[2,1,2]0,2,1,3 last_tile_dim_replicate", "devices=[2,1,2]0,1,2,3",
     most=2, total=nbytes(12, 8, 100))
_dot("DotPartialContractingPartialMatch", (24, 8, 100), (32, 8, 100), (((1, 2), (1, 2)), ((), ())),
     "devices=[1,2,2]0,1,2,3", "devices=[1,1,2,2]0,2,1,3 last_tile_dim_replicate", replicated(2, 4),
     most=2, total=nbytes(32, 4, 50) + nbytes(24, 32))
_dot("DotNonContractingPartialMatchContractingMatch", (24, 8, 100), (100, 50), (((2,), (0,)), ((), ())),
     "devices=[2,1,2]0,1,2,3", "devices=[2,2]0,2,1,3", "devices=[2,2,1]0,1,2,3", most=2,
     total=nbytes(12, 8, 50) + nbytes(50, 25))
_dot("DotLHSMutiNonContractingRHSNotMatch", (24, 8, 10), (10, 50), (((2,), (0,)), ((), ())),
     "devices=[2,2,1]0,1,2,3", "devices=[2,1,2]0,2,1,3 last_tile_dim_replicate", "devices=[2,2,1]0,1,2,3",
     most=1, total=nbytes(10, 50))
_dot("SimpleDotPartial", (2, 24, 100), (2, 32, 100), (((2,), (2,)), ((0,), (0,))),
     "devices=[2,1,1,2]0,1,2,3 last_tile_dim_replicate", "devices=[2,1,1,2]0,1,2,3 last_tile_dim_replicate",
     "devices=[2,1,1,2]0,1,2,3 last_tile_dim_replicate", kinds={})
_dot("Dot2DPartitionedNonContractingAndContracting0", (48, 12), (32, 12), NT, "devices=[2,2]0,1,2,3",
     "devices=[2,2]0,2,1,3", "devices=[2,2]0,1,2,3", most=2, total=nbytes(24, 12) + nbytes(16, 12))
_dot("Dot2DPartitionedNonContractingAndContracting1", (48, 100), (32, 100), NT, "devices=[2,2]0,1,2,3",
     "devices=[2,2]0,1,2,3", "devices=[2,2]0,1,2,3", most=2, total=nbytes(16, 100) + nbytes(24, 32))
_dot("Dot2DPartitionedNonContractingAndContracting2", (48, 100), (32, 100), NT, replicated(2, 4),
     "devices=[2,2]0,1,2,3", "devices=[2,2]0,1,2,3", most=2, total=nbytes(16, 100) + nbytes(24, 32))
_dot("Dot2DPartitionedNoncontractingAndContracting3", (23, 24), (23, 32), (((0,), (0,)), ((), ())),
     "devices=[2,1,2]0,1,2,3 last_tile_dim_replicate", "devices=[2,2]0,1,2,3", "devices=[2,2]1,0,3,2", most=2,
     total=nbytes(24, 16))
_dot("Dot2DPartitionedBatchAndNonContracting", (4, 24, 100), (4, 32, 100), (((2,), (2,)), ((0,), (0,))),
     "devices=[2,2,1]0,1,2,3", "devices=[2,2,1]0,1,2,3", "devices=[2,2,1]0,1,2,3", most=2, total=nbytes(2, 32, 100))
_dot("Dot2DPartitionedBatchAndContracting", (4, 24, 100), (4, 32, 100), (((2,), (2,)), ((0,), (0,))),
     "devices=[2,1,2]0,1,2,3", "devices=[1,2,2]0,1,2,3", "devices=[2,2,1]0,1,2,3", most=2,
     total=nbytes(2, 32, 50) + nbytes(2, 24, 32))
_dot("Dot2DPartitionedBatchAndContracting2", (4, 24, 100), (4, 32, 100), (((2,), (2,)), ((0,), (0,))),
     "devices=[2,1,2]0,1,2,3", replicated(3, 4), "devices=[2,2,1]0,1,2,3", most=1, total=nbytes(2, 24, 32))
_dot("Dot2DPartitionedBatchNonContractingAndContracting", (4, 24, 100), (4, 32, 100), (((2,), (2,)), ((0,), (0,))),
     "devices=[2,1,2]0,1,2,3", "devices=[2,2,1]0,1,2,3", "devices=[2,1,2]0,1,2,3", most=2,
     total=nbytes(2, 32, 100))
_dot("Dot2DPartitionedBatchAndReshard", (4, 8, 24, 100), (4, 8, 32, 100), (((3,), (3,)), ((0, 1), (0, 1))),
     "devices=[2,1,2,1]0,1,2,3", "devices=[2,1,2,1]0,1,2,3", "devices=[1,2,2,1]0,1,2,3", most=2,
     total=nbytes(2, 8, 32, 100) + nbytes(2, 8, 12, 32))

# -- sort ---------------------------------------------------------------------------------------
S8 = f"devices=[1,8]{ALL8}"
case("SortShardedOnSortDim_OneOperand", lambda x: split(jnp.sort(split(-x, S8), axis=1), S8), [(16, 64)],
     kinds={"all-to-all": 2}, total=2 * nbytes(2, 64))
case("SortShardedOnSortDim_TwoOperands",
     lambda x: tuple(split(v, S8) for v in lax.sort((split(-x, S8), split(lax.broadcasted_iota(np.int32, (16, 64), 1),
                                                                          S8)), dimension=1, num_keys=1)),
     [(16, 64)], kinds={"all-to-all": 4}, total=4 * nbytes(2, 64))
case("SortShardedOnSortDim_RankOne", lambda x: split(jnp.sort(split(-x, D8)), D8), [(64,)], most=1,
     total=nbytes(64))
case("SortShardedOnSortDim_OneFreeDivisibleDim",
     lambda x: split(jnp.sort(split(-x, f"devices=[1,1,8]{ALL8}"), axis=2), f"devices=[1,1,8]{ALL8}"), [(7, 16, 64)],
     kinds={"all-to-all": 2}, total=2 * nbytes(7, 2, 64))
case("SortAlongNonPartitionedDimension",
     lambda x: split(jnp.sort(split(x, "devices=[1,2,1]0,1"), axis=2), "devices=[1,2,1]0,1"), [(8, 14, 17)],
     kinds={})
