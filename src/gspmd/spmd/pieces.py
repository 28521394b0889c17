"""Point-to-point data movement: each device assembles its tile from pieces that their
holders cut out of their local values, in rounds of collective-permutes in which
nobody sends or receives twice. Resharding (exchange steps) and data formatting (pad,
slice, concatenate, reverse along a split dim) are both described as such pieces."""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from gspmd.ir import Value, emit
from gspmd.sharding import Sharding
from gspmd.spmd import cost as cm
from gspmd.spmd.context import INDEX_DTYPE, DeviceContext, Why


@dataclass(frozen=True)
class Transfers:
    """Pieces ([P] and [P, rank] arrays): who sends, who receives (the same device for
    what it keeps), where the sender cuts (in its local value), where the receiver puts
    it (in its tile), how long it is, and per dim whether it spans all the data of the
    receiver's tile."""
    sender: np.ndarray
    receiver: np.ndarray
    send_at: np.ndarray
    recv_at: np.ndarray
    length: np.ndarray
    whole: np.ndarray

    @property
    def remote(self) -> np.ndarray:
        return self.sender != self.receiver

    def rounds(self) -> int:
        """Collective-permutes needed: the most pieces one device sends or receives."""
        return self._rounds

    @functools.cached_property
    def _rounds(self) -> int:    # asked three times of each exchange a reshard search weighs
        remote = self.remote
        if not remote.any():
            return 0
        return int(max(np.bincount(self.sender[remote]).max(), np.bincount(self.receiver[remote]).max()))

    @functools.cached_property
    def colors(self) -> np.ndarray:
        """The round of each piece that travels: the n-th piece each device receives
        (or sends) in round n where that has nobody send (or receive) twice in a round
        and takes no more rounds than needed, else by edge_colors."""
        sender, receiver = self.sender[self.remote], self.receiver[self.remote]
        for by, other in ((receiver, sender), (sender, receiver)):
            nth = _nth(by)
            if len(np.unique(nth * (other.max(initial=0) + 1) + other)) == len(nth) and \
                    nth.max(initial=-1) + 1 == self.rounds():
                return nth
        return np.asarray(edge_colors(list(zip(sender.tolist(), receiver.tolist()))), np.int64)

    def bound(self, itemsize: int, num_devices: int, hw: cm.Hardware) -> float:
        """cost() bounded above without colouring: every round's buffer as large as the
        box holding every piece (a round's buffer holds its pieces' largest length along
        each dim, which the largest piece alone may not reach), and its links as loaded
        as by all pieces at once."""
        remote = self.remote
        box = int(np.prod(self.length[remote].max(axis=0, initial=0)))
        pairs = np.stack([self.sender[remote], self.receiver[remote]], axis=1)
        return self.rounds() * cm.collective_seconds(cm.Pattern.PERMUTE, box * itemsize, pairs, num_devices, hw)

    def cost(self, itemsize: int, num_devices: int, hw: cm.Hardware) -> float:
        """Seconds on `hw`: one collective-permute per round, as large as its largest
        piece."""
        remote, colors = np.flatnonzero(self.remote), self.colors
        total = 0.0
        for r in range(colors.max(initial=-1) + 1):
            which = remote[colors == r]
            nbytes = int(np.prod(self.length[which].max(axis=0))) * itemsize
            pairs = np.stack([self.sender[which], self.receiver[which]], axis=1)
            total += cm.collective_seconds(cm.Pattern.PERMUTE, nbytes, pairs, num_devices, hw)
        return total


def _nth(values: np.ndarray) -> np.ndarray:
    """For each entry, how many equal values come before it."""
    order = np.argsort(values, kind="stable")
    in_order = values[order]
    nth = np.empty(len(values), np.int64)
    nth[order] = np.arange(len(values)) - np.searchsorted(in_order, in_order)
    return nth


def concat_transfers(parts: Sequence[Transfers]) -> Transfers:
    return Transfers(*(np.concatenate([getattr(p, f) for p in parts]) for f in
                       ("sender", "receiver", "send_at", "recv_at", "length", "whole")))


def holders_in_turn(s: Sharding, tile: np.ndarray) -> np.ndarray:
    """For each piece that travels, one of the devices holding its tile in s: the pieces
    of one tile take its holders in turn."""
    tile_id = np.ravel_multi_index(tuple(tile.T), s.tiles) if s.rank else np.zeros(len(tile), np.int64)
    return s.tile_assignment.reshape(-1, s.num_replicas)[tile_id, _nth(tile_id) % s.num_replicas]


@dataclass(frozen=True)
class _Round:
    """One collective-permute (pairs None: the pieces devices keep), per device."""
    pairs: Optional[np.ndarray]   # (sender, receiver)
    piece: tuple[int, ...]        # the static shape that travels
    send_at: np.ndarray           # [N, rank]
    recv_at: np.ndarray           # [N, rank]
    recv_len: np.ndarray          # [N, rank]: 0 where nothing arrives
    whole: tuple[bool, ...]


def _rounds(t: Transfers, num_devices: int) -> list[_Round]:
    remote, kept, colors = np.flatnonzero(t.remote), np.flatnonzero(~t.remote), t.colors
    if len(remote) and len(kept) and _one_each(t):
        # Devices relabelled, some in place: what they keep rides along in the permute
        # (a device sending to itself), rather than being merged in after it by selects
        # that hold the kept, the received and the merged value at once.
        return [_round(t, np.arange(len(t.sender)), num_devices, local=False)]
    nth = _nth(t.receiver[kept])   # a device may keep several pieces (of several segments)
    local = [_round(t, kept[nth == k], num_devices, local=True) for k in range(nth.max(initial=-1) + 1)]
    return local + [_round(t, remote[colors == c], num_devices, local=False) for c in range(colors.max(initial=-1) + 1)]


def _one_each(t: Transfers) -> bool:
    """Whether every device sends at most one piece and receives at most one."""
    return len(np.unique(t.sender)) == len(t.sender) and len(np.unique(t.receiver)) == len(t.receiver)


def _round(t: Transfers, which: np.ndarray, num_devices: int, local: bool) -> _Round:
    rank = t.send_at.shape[1]
    send_at = np.zeros((num_devices, rank), np.int64)
    recv_at, recv_len = np.zeros_like(send_at), np.zeros_like(send_at)
    sender, receiver = t.sender[which], t.receiver[which]
    send_at[sender], recv_at[receiver], recv_len[receiver] = t.send_at[which], t.recv_at[which], t.length[which]
    piece = tuple(int(v) for v in recv_len.max(axis=0))
    pairs = None if local else np.stack([sender, receiver], axis=1)
    return _Round(pairs, piece, send_at, recv_at, recv_len, tuple(bool(w) for w in t.whole[which].all(axis=0)))


def edge_colors(edges: list[tuple[int, int]]) -> list[int]:
    """A round per (sender, receiver) edge such that nobody sends or receives twice in a
    round, in as many rounds as the busiest device has pieces (Koenig's edge colouring
    of a bipartite graph: where the two free colours differ, swap them along the
    alternating path first)."""
    at: dict[tuple, dict[int, int]] = {}      # node -> colour -> edge
    colors = [-1] * len(edges)
    for e, (u, v) in enumerate(edges):
        nu, nv = at.setdefault(("s", u), {}), at.setdefault(("r", v), {})
        a = next(c for c in itertools.count() if c not in nu)
        b = next(c for c in itertools.count() if c not in nv)
        if a in nv:   # flip a <-> b along the path from v that starts with colour a
            path, node, c = [], ("r", v), a
            while c in at.get(node, {}):
                f = at[node][c]
                path.append(f)
                node = ("s", edges[f][0]) if node[0] == "r" else ("r", edges[f][1])
                c = b if c == a else a
            for f in path:
                del at[("s", edges[f][0])][colors[f]], at[("r", edges[f][1])][colors[f]]
            for f in path:
                colors[f] = b if colors[f] == a else a
                at[("s", edges[f][0])][colors[f]] = at[("r", edges[f][1])][colors[f]] = f
        colors[e] = a
        nu[a] = nv[a] = e
    return colors


def move(ctx: DeviceContext, x: Value, t: Transfers, tile: Sequence[int], why: Why, detail: str,
         out: Optional[Value] = None, reverse_dim: Optional[int] = None) -> Value:
    """Each device's tile (shape `tile`) with the pieces of x that `t` sends it written
    in place over `out` (a value of that shape, or nothing: then positions no piece
    covers hold zeros). With reverse_dim, pieces arrive reversed along that dim (recv_at
    is then where the reversed piece starts)."""
    for r in _rounds(t, ctx.num_devices):
        piece = _cut(ctx, x, r)
        if r.pairs is not None:
            piece = ctx.collective_permute(piece, r.pairs, why, detail)
        out = _place(ctx, piece, r, tile, out, reverse_dim)
    return out


def _cut(ctx: DeviceContext, x: Value, r: _Round) -> Value:
    """Each sender's piece: r.piece elements from r.send_at of its local value."""
    if r.piece == x.shape and not r.send_at.any():
        return x
    for d in range(x.rank):
        x = emit.pad_dim(ctx.b, x, d, 0, max(0, int((r.send_at[:, d] + r.piece[d]).max()) - x.shape[d]), 0)
    return emit.dynamic_slice(ctx.b, x, [ctx.table_lookup(r.send_at[:, d]) for d in range(x.rank)], r.piece)


def _place(ctx: DeviceContext, piece: Value, r: _Round, tile: Sequence[int], out: Optional[Value],
           reverse_dim: Optional[int]) -> Value:
    """`out` with each receiver's piece written at r.recv_at (r.recv_len of it is data;
    past a tile's data is padding, which may hold anything)."""
    b, x = ctx.b, piece
    receivers = r.recv_len.min(axis=1) > 0
    shift = r.recv_at.copy()
    if reverse_dim is not None:   # the data is now at the end of the piece
        x = emit.reverse(b, x, [reverse_dim])
        shift[:, reverse_dim] -= np.where(receivers, r.piece[reverse_dim] - r.recv_len[:, reverse_dim], 0)
    for d in range(x.rank):
        if not shift[:, d].any():
            x = emit.pad_dim(b, x, d, 0, tile[d] - x.shape[d], 0)
        else:   # shift each piece to its place: pad by a tile on each side, cut a tile
            x = emit.pad_dim(b, x, d, tile[d], tile[d], 0)
            zero, start = ctx.constant(0, INDEX_DTYPE), ctx.table_lookup(tile[d] - shift[:, d])
            x = emit.dynamic_slice(b, x, [start if i == d else zero for i in range(x.rank)],
                                   [tile[i] if i == d else x.shape[i] for i in range(x.rank)])
    masked = [d for d in range(x.rank) if not r.whole[d]]
    if not masked and not receivers.all():
        masked = [0]
    if out is None and not masked:
        return x
    inside = None
    for d in masked:
        end = np.where(receivers, r.recv_at[:, d] + (r.recv_len[:, d] if not r.whole[d] else tile[d]), 0)
        test = emit.in_range(b, x.shape, d, ctx.table_lookup(r.recv_at[:, d]), ctx.table_lookup(end))
        inside = test if inside is None else emit.logical_and(b, inside, test)
    if out is None:
        out = emit.broadcast(b, ctx.constant(np.zeros((), x.dtype)), x.shape)
    return emit.select(b, inside, x, out)

