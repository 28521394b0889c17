"""Layout arithmetic: how the tiles of a Sharding group, coarsen, nest and move between
dims. Pure functions of layouts and shapes; no code is emitted and nothing is priced.

A dim split into t tiles is coarsened by k (tile c -> c // k) by the k devices that
differ only in c % k. Shards of uneven dims only nest when ceil(D/(t/k)) == k*ceil(D/t)
or the coarse layout is the whole dim. A move (source dim, destination dim, k) takes
the minor factor k of the source's split to become the minor factor of the
destination's (what one all-to-all does)."""
from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

from gspmd.sharding import Sharding

Move = tuple  # (source dim, destination dim, k)


def groups_along(s: Sharding, dims: Sequence[int]) -> np.ndarray:
    """Device groups [G, k] whose members differ only in their tile index along
    `dims` (major to minor), ordered by that index; one group per other tile & replica."""
    dims = list(dims)
    rest = [i for i in range(s.rank + 1) if i not in dims]
    k = math.prod(s.tile_assignment.shape[d] for d in dims)
    return s.tile_assignment.transpose(rest + dims).reshape(-1, k)


def minor_groups(s: Sharding, dim: int, k: int) -> np.ndarray:
    """Groups [G, k] of devices that differ only in (tile index along dim) % k."""
    return move_groups(s, ((dim, None, k),))


def coarsen_to(s: Sharding, tiles: Sequence[int]) -> Sharding:
    """Each dim's split coarsened to `tiles` (tile c -> c // (old / new))."""
    return Sharding.from_coords(s.coords() // (np.asarray(s.tiles) // np.asarray(tiles)), tiles)


def coarsen(s: Sharding, dim: int, k: int) -> Sharding:
    tiles = list(s.tiles)
    tiles[dim] //= k
    return coarsen_to(s, tiles)


def nests(size: int, fine_tiles: int, k: int) -> bool:
    """Do the shards of a (fine_tiles/k)-way split hold exactly k shards of a
    fine_tiles-way split each (or is the coarse split the whole dim)?"""
    coarse = fine_tiles // k
    return coarse == 1 or -(-size // coarse) == k * -(-size // fine_tiles)


def shard_len(shape: Sequence[int], s: Sharding, dim: int) -> int:
    return -(-shape[dim] // s.tiles[dim])


def local_nbytes(shape: Sequence[int], s: Sharding, itemsize: int) -> int:
    return math.prod(s.shard_shape(shape)) * itemsize


def subdivides(dst: Sharding, src: Sharding, shape: Sequence[int]) -> bool:
    """Does every device's dst tile lie inside its src tile?"""
    if any(d % s for d, s in zip(dst.tiles, src.tiles)):
        return False
    if not all(nests(n, d, d // s) for n, d, s in zip(shape, dst.tiles, src.tiles)):
        return False
    return coarsen_to(dst, src.tiles) == src


def moved_layout(s: Sharding, moves: Sequence[Move]) -> Optional[Sharding]:
    """The layout after `moves`, applied in order (None where no layout results)."""
    coords, tiles = s.coords().copy(), list(s.tiles)
    for a, b, k in moves:
        digit = coords[:, a] % k
        coords[:, a] //= k
        coords[:, b] = coords[:, b] * k + digit
        tiles[a] //= k
        tiles[b] *= k
    return Sharding.from_coords(coords, tiles)


def move_factors(moves: Sequence[Move], rank: int, side: int) -> list[int]:
    """Per dim, the product of the factors that leave it (side 0) or arrive (side 1)."""
    out = [1] * rank
    for move in moves:
        out[move[side]] *= move[2]
    return out


def move_groups(s: Sharding, moves: Sequence[Move]) -> np.ndarray:
    """Groups [G, prod k] of devices that differ only in the digits the moves take from
    their source dims, ordered by those digits (first move major). A dim losing several
    factors gives its minor-most to the first move."""
    shape, digit_axis = [], {}
    for d, t in enumerate(s.tile_assignment.shape):
        mine = [i for i, move in enumerate(moves) if move[0] == d]
        shape.append(t // math.prod(moves[i][2] for i in mine))
        for i in reversed(mine):
            digit_axis[i] = len(shape)
            shape.append(moves[i][2])
    digits = [digit_axis[i] for i in range(len(moves))]
    rest = [ax for ax in range(len(shape)) if ax not in digits]
    k = math.prod(move[2] for move in moves)
    return s.tile_assignment.reshape(shape).transpose(rest + digits).reshape(-1, k)


def moves_nest(s: Sharding, moves: Sequence[Move], shape: Sequence[int]) -> bool:
    """Uneven dims take part only where the shards before and after nest."""
    out, into = move_factors(moves, s.rank, 0), move_factors(moves, s.rank, 1)
    return all(nests(shape[d], s.tiles[d], out[d]) and nests(shape[d], s.tiles[d] * into[d], into[d])
               for d in range(s.rank))


def whole_along(s: Sharding, dim: int, shape: Sequence[int]) -> list[Sharding]:
    """Layouts like `s` with `dim` whole: its split gathered, or moved to become the
    minor part of another dim's split (one all-to-all, uneven dims padded to whole
    pieces) where that dim has room for the finer split and its shards nest in the
    coarser ones."""
    layouts = [s.keep_dims([d for d in range(s.rank) if d != dim])]
    t = s.tiles[dim]
    if t == 1:
        return layouts
    for other in range(s.rank):
        move = ((dim, other, t),)
        if other != dim and shape[other] >= s.tiles[other] * t and moves_nest(s, move, shape):
            layouts.append(moved_layout(s, move))
    return layouts
