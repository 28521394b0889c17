"""The sim backend: runs an SPMD program for all N devices in one process, with NumPy.

Each instruction runs for every device in turn; collectives see all devices' operands.
Padding of uneven shards is filled with NaN (floats) or a large value (ints) so that a
missing mask shows up in results. Run with one device it is the reference interpreter.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from gspmd import ops
from gspmd.dtypes import is_floating
from gspmd.errors import ShardingError
from gspmd.ir import Program
from gspmd.sharding import Sharding


def run(program: Program, per_device_args: Sequence[Sequence[np.ndarray]], num_devices: int) -> list[list]:
    """Run `program` on devices 0..N-1; per_device_args[d] are device d's inputs.
    Returns per-device outputs."""
    env: dict = {}
    for i, p in enumerate(program.params):
        env[p] = [np.asarray(per_device_args[d][i], p.dtype) for d in range(num_devices)]
    for instr in program.instrs:
        op = ops.lookup(instr.opcode).semantics
        args = [env[o] for o in instr.operands]
        if op.evaluate_programs is not None:
            results = op.evaluate_programs(instr, [[a[d] for a in args] for d in range(num_devices)],
                                           lambda sub, carry: run(sub, carry, num_devices))
        elif op.evaluate_all is not None:
            results = op.evaluate_all(instr, [[a[d] for a in args] for d in range(num_devices)])
        else:
            results = [op.evaluate(instr, [a[d] for a in args], d) for d in range(num_devices)]
        for j, out in enumerate(instr.outputs):
            env[out] = [r[j] for r in results]
    return [[env[o][d] for o in program.outputs] for d in range(num_devices)]


def evaluate(program: Program, args: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Reference semantics of an unpartitioned program."""
    return run(program, [args], 1)[0]


def _garbage(dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    if is_floating(dtype):
        return np.asarray(np.nan, dtype)
    if dtype == np.bool_:
        return np.asarray(True)
    return np.asarray(np.iinfo(dtype).max // 2 + 7, dtype)


def tile_slices(sharding: Sharding, shape: Sequence[int], device: int) -> tuple[slice, ...]:
    """The global index range device `device` holds (without padding)."""
    coords = sharding.coords()[device]
    out = []
    for dim, size in enumerate(shape):
        n = -(-size // sharding.tiles[dim])
        out.append(slice(min(coords[dim] * n, size), min((coords[dim] + 1) * n, size)))
    return tuple(out)


def shard(x: np.ndarray, sharding: Sharding) -> list[np.ndarray]:
    """Per-device shards of a global array, padded with garbage to the shard shape."""
    local_shape = sharding.shard_shape(x.shape)
    shards = []
    for d in range(sharding.num_devices):
        piece = x[tile_slices(sharding, x.shape, d)]
        buf = np.full(local_shape, _garbage(x.dtype), x.dtype)
        buf[tuple(slice(0, n) for n in piece.shape)] = piece
        shards.append(buf)
    return shards


def unshard(shards: Sequence[np.ndarray], sharding: Sharding, shape: Sequence[int]) -> np.ndarray:
    """The global array from per-device shards; replicas must agree exactly."""
    out = np.empty(shape, np.asarray(shards[0]).dtype)
    seen = {}
    for d, s in enumerate(shards):
        idx = tile_slices(sharding, shape, d)
        piece = np.asarray(s)[tuple(slice(0, i.stop - i.start) for i in idx)]
        key = tuple((i.start, i.stop) for i in idx)
        if key in seen:
            if not np.array_equal(seen[key], piece, equal_nan=True):
                raise ShardingError(f"Internal error: replicas of tile {key} disagree across devices "
                                    f"(sharding {sharding}); please report this program.")
            continue
        seen[key] = piece
        out[idx] = piece
    return out
