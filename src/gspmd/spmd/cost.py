"""ONE cost model, shared by the partitioner's choices (reshard plans, factor layouts)
and by reports (step time, utilization).

Hardware = per-device compute (peak matmul FLOP/s at a calibrated efficiency; HBM
bandwidth for memory-bound ops) + a physical network onto which device ids map in order
(device d sits at position d of the network, row-major, as the paper lays a 2D mesh
onto the TPU torus):

- `Torus`: TPU pods, a 2D (or 3D) torus with wraparound; each device has a link per
  direction per dim (bandwidth per direction, latency per hop). Messages follow
  dimension-order routing along the shorter way round.
- `Hosts`: GPU clusters, hosts of `per_host` devices on a switch (NVLink), hosts on a
  network (one NIC per device). Each level is a crossbar: a device's port is the only
  shared resource.

Collectives over explicit device groups are priced from where the members sit:
- all-gather / reduce-scatter / all-reduce: bidirectional rings, one phase per physical
  dim the groups span (a sub-grid group runs dimension by dimension, as 2D torus
  algorithms do, in the cheapest order; other groups run one ring in the listed order). A ring step costs
  the latency of its longest hop plus its chunk times the most ring edges sharing one
  link (all groups run at once, so strided groups share links), over the link bandwidth.
- all-to-all: every member sends 1/k of its data to every other; the bytes x hops along
  each dim spread over the links of that dim (bisection-bound: O(sqrt N) on a 2D torus).
- collective-permute: each pair's data routed (split both ways round where both ways
  are as short); time of the most loaded link.
Latencies and per-byte rates depend only on the groups, so each is computed once.
"""
from __future__ import annotations

import enum
import functools
import itertools
import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import numpy as np

from gspmd.checks import count, describe, flag, number
from gspmd.errors import ShardingError
from gspmd.sharding import Sharding

GiB = 1 << 30
MiB = 1 << 20


class Pattern(enum.Enum):
    """A collective's communication pattern (the value is its opcode)."""
    ALL_REDUCE = "all-reduce"
    ALL_GATHER = "all-gather"
    REDUCE_SCATTER = "reduce-scatter"
    ALL_TO_ALL = "all-to-all"
    PERMUTE = "collective-permute"


class ComputeKind(enum.Enum):
    """How an op's time is estimated."""
    MATMUL = "matmul"    # dots, convolutions: FLOPs at the matmul efficiency (roofline with HBM)
    MEMORY = "memory"    # element-wise, reductions, data movement: bytes over HBM bandwidth
    FREE = "free"        # constants, ids, bitcasts: no time


# -- the physical network --------------------------------------------------------------
class Link(enum.Enum):
    RING = "ring"        # a torus dim: neighbours linked, with wraparound
    SWITCH = "switch"    # a crossbar: every device one port


@dataclass(frozen=True)
class NetDim:
    size: int
    link: Link
    bandwidth: float     # bytes/s per device per direction
    latency: float       # seconds per hop (ring) or per message (switch)


@dataclass(frozen=True)
class Network:
    dims: tuple[NetDim, ...]   # major to minor: device id = row-major position

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(d.size for d in self.dims)


@dataclass(frozen=True)
class Torus:
    """A torus of `ndim` dims of chips, as square as the chip count allows. With several
    devices per chip (TPU v3: 2 cores; 2048 cores = 32 x 32 chips = 32 x 64 cores),
    consecutive ids share a chip along the minor dim: a ring along it crosses each chip
    link once, while rings along the other dims, one per core, share their chips' links."""
    link_bandwidth: float      # bytes/s per direction of one chip-to-chip link
    hop_latency: float
    ndim: int = 2
    devices_per_chip: int = 1

    def network(self, num_devices: int) -> Network:
        per_chip = self.devices_per_chip if num_devices % self.devices_per_chip == 0 else 1
        shape = _near_square(num_devices // per_chip, self.ndim)
        shape = shape[:-1] + (shape[-1] * per_chip,)
        shared = self.link_bandwidth / self.devices_per_chip
        return Network(tuple(NetDim(s, Link.RING, self.link_bandwidth if d == len(shape) - 1 else shared,
                                    self.hop_latency) for d, s in enumerate(shape)))


@dataclass(frozen=True)
class Hosts:
    """Hosts of `per_host` devices (NVLink switch), connected by a network (a NIC per device)."""
    per_host: int
    local_bandwidth: float
    local_latency: float
    network_bandwidth: float
    network_latency: float

    def network(self, num_devices: int) -> Network:
        local = NetDim(min(num_devices, self.per_host), Link.SWITCH, self.local_bandwidth, self.local_latency)
        if num_devices <= self.per_host:
            return Network((local,))
        hosts = NetDim(-(-num_devices // self.per_host), Link.SWITCH, self.network_bandwidth, self.network_latency)
        return Network((hosts, local))


def _near_square(n: int, ndim: int) -> tuple[int, ...]:
    """n as ndim factors, each as close to n**(1/ndim) as divisibility allows, ascending."""
    if ndim == 1:
        return (n,)
    first = max(f for f in range(1, int(round(n ** (1 / ndim))) + 1) if n % f == 0)
    return (first,) + _near_square(n // first, ndim - 1)


# -- hardware ----------------------------------------------------------------------------
# Share of NVLink's line rate a ring collective moves data at: NCCL's protocol takes about
# a fifth of it (H100: ~370 of 450 GB/s, NCCL's maintainers in nccl-tests issue 212; 8-GPU
# A100 all-reduces measure 200-235 GB/s of bus bandwidth of 300). NICs reach 85-96% of
# their line rate in the same tests, which the GPU profiles leave at 100%.
NVLINK_BY_NCCL = 0.8


@dataclass(frozen=True)
class Hardware:
    """Per-device numbers (public peak figures, rounded) plus the calibrated fractions
    a compiled step reaches. They rank plans and estimate steps to tens of percent."""
    name: str
    flops_per_s: float            # peak dense matmul throughput per device
    memory_bytes: int             # accelerator memory per device
    hbm_bytes_per_s: float        # memory bandwidth per device
    interconnect: Union[Torus, Hosts]
    matmul_efficiency: float = 0.8    # fraction of peak large dots/convolutions reach
    # Fraction of the HBM bandwidth memory-bound kernels reach: a streaming copy gets
    # 85-90% of it on A100 and H100 (BabelStream), kernels of several operand streams
    # and short rows less.
    memory_efficiency: float = 0.8
    collective_overhead_s: float = 5e-6   # fixed cost of launching one collective
    # Share of a collective's time that independent compute can hide; the rest contends
    # with compute for the core (DMA issue, reductions, HBM). 0.4 puts the paper's Tables
    # 2 and 3 within 24% on tpu-v3, all but the communication-bound (8, 32) mesh within 7%,
    # with the plans rematerialized as XLA on TPU does (benchmarks/PAPER.md); it was 0.5
    # while the plans stored element-wise intermediates that TPU fusion does not (1.0:
    # the (8, 32) mesh ~30% fast). Other profiles share it.
    overlap: float = 0.4
    # The compiler expands some kernels into steps that hold scratch memory: XLA:CPU runs
    # select-and-scatter as iotas, a reduce-window and a scatter, an all-to-all through
    # per-destination pieces, and a dot that is not canonical after transposing both
    # operands; and it combines independent all-reduces into one. Accelerators run each
    # as one kernel (the memory model leaves their all-reduces apart).
    kernel_scratch: bool = False
    # The compiler recomputes values to fit a program in memory (XLA's rematerialization
    # pass on accelerators, given the device's memory); XLA:CPU has no memory limit.
    rematerializes: bool = True
    # Memory the runtime keeps for itself, out of a program's reach: XLA:TPU's
    # out-of-memory report lists it as "reserved" (530 MiB of a TPU v3 core's 16 GiB,
    # leaving "15.48G hbm"; 1.25 GiB of a TPU v4 chip's 32 GiB).
    reserved_bytes: int = 0
    # Whether element-wise producers fuse into the matmuls that read them. XLA:TPU fuses
    # a layer norm, a softmax or a cast into the convolution that consumes it; a GPU
    # matmul is a library kernel (cuBLAS) that reads its operands from HBM, so each chain
    # feeding one runs as a kernel of its own and writes its result (operand transposes
    # still fold, as the kernel's transpose flags).
    fuses_into_matmul: bool = True
    # Element-wise arithmetic per second outside the matmul units (integer and float32
    # vector instructions): what a fused kernel whose arithmetic outweighs its bytes, a
    # PRNG's hash rounds, runs at. None: not modelled (kernels timed by their bytes).
    vector_ops_per_s: Optional[float] = None

    def __post_init__(self):
        """A profile given wrong numbers (or its fields out of order) fails here, not in a plan."""
        if not isinstance(self.name, str) or not self.name:
            raise ShardingError(f"Hardware(name=...) needs a non-empty string, got {describe(self.name)}.")
        for name in ("flops_per_s", "hbm_bytes_per_s"):
            number(getattr(self, name), f"Hardware({name}=...)")
        count(self.memory_bytes, "Hardware(memory_bytes=...)", example="memory_bytes=16 * 2**30")
        count(self.reserved_bytes, "Hardware(reserved_bytes=...)", minimum=0, example="reserved_bytes=0")
        if not isinstance(self.interconnect, (Torus, Hosts)):
            raise ShardingError(f"Hardware(interconnect=...) needs a Torus or Hosts of gspmd.spmd.cost, got "
                                f"{describe(self.interconnect)}; e.g. Hosts(8, 450e9, 3e-6, 50e9, 10e-6).")
        for name in ("matmul_efficiency", "memory_efficiency", "overlap"):
            number(getattr(self, name), f"Hardware({name}=...)", positive=name != "overlap", at_most=1)
        number(self.collective_overhead_s, "Hardware(collective_overhead_s=...)", positive=False)
        if self.vector_ops_per_s is not None:
            number(self.vector_ops_per_s, "Hardware(vector_ops_per_s=...)")
        for name in ("kernel_scratch", "rematerializes", "fuses_into_matmul"):
            flag(getattr(self, name), f"Hardware({name}=...)")

    @property
    def usable_bytes(self) -> int:
        """Memory per device a program (its arguments included) may use."""
        return self.memory_bytes - self.reserved_bytes

    def network(self, num_devices: int) -> Network:
        return _network(self.interconnect, num_devices)


@functools.lru_cache(maxsize=1024)
def _network(interconnect, num_devices: int) -> Network:
    # Asked of every layout a reshard search prices: built once per device count.
    return interconnect.network(num_devices)


PROFILES = {h.name: h for h in [
    # TPU v3, per TensorCore as the paper counts (2 per chip, 1024 chips in a 32 x 32
    # torus): 123 TF/s and 900 GB/s HBM per chip; 656 Gb/s ICI links.
    Hardware("tpu-v3", 61.5e12, 16 * GiB, 450e9, Torus(45e9, 1e-6, devices_per_chip=2), reserved_bytes=530 * MiB),
    Hardware("tpu-v4", 275e12, 32 * GiB, 1.2e12, Torus(50e9, 1e-6, ndim=3),      # one device per chip
             reserved_bytes=GiB + 256 * MiB),
    # TPU v5p, one device per chip (megacore) in a 3D torus: 459 TF/s bf16, 96 GiB HBM2e at
    # 2.76 TB/s, of which 95 GiB are what jax may allocate (Cloud TPU's v5p page: the rest
    # is libtpu's); ICI 4800 Gb/s per chip over its 6 links (100 GB/s each, counted per
    # direction as tpu-v4's 2400 Gb/s are).
    Hardware("tpu-v5p", 459e12, 96 * GiB, 2.765e12, Torus(100e9, 1e-6, ndim=3), reserved_bytes=GiB),
    # GPUs' vector rate: 64 int32 lanes per SM (A100: 108 SMs at 1.41 GHz; H100 and H200
    # SXM: 132 at 1.98 GHz), one add, xor or funnel-shift rotation each per clock.
    # NVLink at what NCCL gets of its line rate (NVLINK_BY_NCCL); NICs at theirs.
    Hardware("a100", 312e12, 80 * GiB, 2.0e12, Hosts(8, NVLINK_BY_NCCL * 300e9, 3e-6, 25e9, 10e-6),   # NVLink 3, HDR IB
             fuses_into_matmul=False, vector_ops_per_s=9.7e12),
    Hardware("h100", 989e12, 80 * GiB, 3.35e12, Hosts(8, NVLINK_BY_NCCL * 450e9, 3e-6, 50e9, 10e-6),  # NVLink 4, NDR IB
             fuses_into_matmul=False, vector_ops_per_s=16.7e12),
    Hardware("h200", 989e12, 141 * GiB, 4.8e12, Hosts(8, NVLINK_BY_NCCL * 450e9, 3e-6, 50e9, 10e-6),
             fuses_into_matmul=False, vector_ops_per_s=16.7e12),
    Hardware("cpu", 1e11, 16 * GiB, 20e9, Hosts(1 << 20, 10e9, 20e-6, 10e9, 20e-6), kernel_scratch=True,
             rematerializes=False),
]}

DEFAULT = PROFILES["tpu-v3"]   # what the partitioner prices plans on when given none


def profile(hardware: Union[None, str, Hardware]) -> Hardware:
    if hardware is None:
        return DEFAULT
    if isinstance(hardware, Hardware):
        return hardware
    if not isinstance(hardware, str) or hardware not in PROFILES:
        raise ShardingError(f"Unknown hardware {hardware!r}; choose one of {sorted(PROFILES)} "
                            "or pass a gspmd.Hardware(...).")
    return PROFILES[hardware]


# -- compute -----------------------------------------------------------------------------
def compute_seconds(kind: ComputeKind, flops: float, nbytes: float, hw: Hardware) -> float:
    """One op: MATMUL is a roofline of FLOPs at the matmul efficiency and its operands'
    bytes; MEMORY moves its bytes through HBM at the memory efficiency; FREE costs nothing."""
    if kind is ComputeKind.FREE:
        return 0.0
    memory = nbytes / (hw.hbm_bytes_per_s * hw.memory_efficiency)
    if kind is ComputeKind.MATMUL:
        return max(flops / (hw.flops_per_s * hw.matmul_efficiency), memory)
    return memory


# -- collectives -------------------------------------------------------------------------
@dataclass(frozen=True)
class Rate:
    """A collective's time as latency + bytes x seconds_per_byte (bytes: the per-device
    payload of its result)."""
    latency: float
    per_byte: float

    def seconds(self, nbytes: float) -> float:
        return self.latency + nbytes * self.per_byte


def collective_seconds(pattern: Pattern, nbytes: float, groups: np.ndarray, num_devices: int,
                       hw: Hardware) -> float:
    """Time of one collective over `groups` ([G, k] device ids; [P, 2] (source, target)
    pairs for a permute) whose result holds `nbytes` per device, in a program over
    `num_devices` devices (ids are positions in that many devices' network)."""
    return rate(pattern, groups, num_devices, hw).seconds(nbytes)


def axis_groups(devices: np.ndarray, axes: Sequence[int]) -> np.ndarray:
    """[G, k] device groups of a mesh whose members differ only along `axes` (major to minor)."""
    rest = [d for d in range(devices.ndim) if d not in axes]
    return devices.transpose(rest + list(axes)).reshape(-1, math.prod(devices.shape[a] for a in axes))


def axes_seconds(pattern: Pattern, nbytes: float, devices: np.ndarray, axes: Sequence[int], hw: Hardware) -> float:
    """One collective over the groups mesh `axes` form on `devices` (a permute: each
    device to the next along them, around the ring)."""
    groups = axis_groups(devices, axes)
    if pattern is Pattern.PERMUTE:
        groups = np.stack([groups.ravel(), np.roll(groups, 1, axis=1).ravel()], axis=1)
    return collective_seconds(pattern, nbytes, groups, devices.size, hw)


def rate(pattern: Pattern, groups: np.ndarray, num_devices: int, hw: Hardware) -> Rate:
    groups = np.ascontiguousarray(groups, np.int64)
    groups = groups.reshape(-1, groups.shape[-1]) if groups.size else groups.reshape(0, 2)
    return _rate(pattern, groups.tobytes(), groups.shape, hw, num_devices)


@functools.lru_cache(maxsize=1 << 16)
def _rate(pattern: Pattern, data: bytes, shape: tuple, hw: Hardware, num_devices: int) -> Rate:
    groups = np.frombuffer(data, np.int64).reshape(shape)
    if pattern is Pattern.PERMUTE:
        groups = groups[groups[:, 0] != groups[:, 1]]
    if groups.size == 0 or groups.shape[1] <= 1:
        return Rate(0.0, 0.0)
    net = hw.network(num_devices)
    coords = np.stack(np.unravel_index(groups, net.shape), axis=-1)   # [G, k, ndim]
    fixed = hw.collective_overhead_s
    if pattern is Pattern.PERMUTE:
        # Each pair's data half one way round, half the other, as the ring collectives
        # route theirs: a message halfway round a ring (a swap on a 2-ring) uses both
        # directions, so swapping halves costs what a 2-member all-gather does.
        src, dst = coords[:, 0], coords[:, 1]
        latency, per_byte = _route(net, np.concatenate([src, src]), np.concatenate([dst, dst]),
                                   prefer=np.repeat([1, -1], len(src)))
        return Rate(fixed + latency, per_byte / 2)
    if pattern is Pattern.ALL_TO_ALL:
        latency, per_byte = _all_to_all(net, coords)
        return Rate(fixed + latency, per_byte)
    k = groups.shape[1]
    latency, per_byte = _ring_collective(net, coords)    # all-gather of result bytes
    if pattern is Pattern.ALL_GATHER:
        return Rate(fixed + latency, per_byte)
    if pattern is Pattern.REDUCE_SCATTER:                # the mirror image, on k x the result
        return Rate(fixed + latency, per_byte * k)
    return Rate(2 * fixed + 2 * latency, 2 * per_byte)  # all-reduce = reduce-scatter + all-gather


def _ring_collective(net: Network, coords: np.ndarray) -> tuple[float, float]:
    """(latency, seconds per result byte) of an all-gather over the groups."""
    k = coords.shape[1]
    spans = [d for d in range(len(net.dims)) if np.any(coords[:, :, d] != coords[:, :1, d])]
    extents = [len(np.unique(coords[0, :, d])) for d in spans]
    if math.prod(extents) != k:       # not a sub-grid: one ring in the listed order
        return _ring(net, coords, k, 1.0 / k)
    # The phases may run in any order (their latencies add up the same); the cheapest
    # usually runs the slowest dim while the chunks are smallest.
    return min((_phased(net, coords, order) for order in itertools.permutations(zip(spans, extents))),
               key=lambda rate: rate[1])


def _phased(net: Network, coords: np.ndarray, order) -> tuple[float, float]:
    """(latency, seconds per result byte) of a sub-grid all-gather run one physical dim
    after another in `order`: each phase gathers what the previous ones gathered."""
    latency, per_byte, held = 0.0, 0.0, 1.0 / coords.shape[1]
    for d, e in order:
        lat, pb = _ring(net, _sub_rings(net, coords, d, e), e, held)
        latency, per_byte, held = latency + lat, per_byte + pb, held * e
    return latency, per_byte


def _sub_rings(net: Network, coords: np.ndarray, d: int, e: int) -> np.ndarray:
    """The rings of a sub-grid group's phase along dim d: members sharing every other
    coordinate, ordered along d. [G * k / e, e, ndim]."""
    g, k, nd = coords.shape
    order = [i for i in range(nd) if i != d] + [d]          # d least significant
    keys = np.ravel_multi_index(tuple(coords[..., order].reshape(-1, nd).T), tuple(net.shape[i] for i in order))
    members = np.take_along_axis(coords, np.argsort(keys.reshape(g, k), axis=1)[..., None], axis=1)
    return members.reshape(g * k // e, e, nd)


def _ring(net: Network, rings: np.ndarray, e: int, chunk_fraction: float) -> tuple[float, float]:
    """(latency, seconds per result byte) of e-1 ring steps, each moving chunk_fraction
    of the result per device: half round the ring in its order, half the other way."""
    src = rings.reshape(-1, rings.shape[-1])
    dst = np.roll(rings, -1, axis=1).reshape(-1, rings.shape[-1])
    latency, seconds_per_byte = _route(net, np.concatenate([src, dst]), np.concatenate([dst, src]),
                                       prefer=np.repeat([1, -1], len(src)))
    return (e - 1) * latency, (e - 1) * chunk_fraction * seconds_per_byte / 2


def _route(net: Network, src: np.ndarray, dst: np.ndarray, prefer=1) -> tuple[float, float]:
    """All messages src[i] -> dst[i] (coordinates) at once, routed dimension by
    dimension, the shorter way round (`prefer`: +1 or -1 per message, for ties): (latency
    of the longest route, seconds per byte on the busiest link)."""
    latency = np.zeros(len(src))
    per_byte = 0.0
    for d, dim in enumerate(net.dims):
        a, b = src[:, d], dst[:, d]
        moving = a != b
        if not moving.any():
            continue
        if dim.link is Link.SWITCH:
            latency += moving * dim.latency
            load = max(np.bincount(_others(src, d)[moving] * dim.size + a[moving]).max(),
                       np.bincount(_others(dst, d)[moving] * dim.size + b[moving]).max())
        else:
            forward = (b - a) % dim.size
            step = np.where(forward == dim.size - forward, prefer, np.where(forward < dim.size - forward, 1, -1))
            hops = np.where(step > 0, forward, dim.size - forward) * moving
            latency += hops * dim.latency
            load = _ring_link_load(_others(src, d), a, step, hops, dim.size)
        per_byte = max(per_byte, load / dim.bandwidth)
    return float(latency.max()), float(per_byte)


def _others(coords: np.ndarray, d: int) -> np.ndarray:
    """A line id per row: its coordinates in every dim but d."""
    rest = np.delete(coords, d, axis=1)
    if rest.shape[1] == 0:
        return np.zeros(len(coords), np.int64)
    return np.ravel_multi_index(tuple(rest.T), tuple(rest.max(0) + 1))


def _ring_link_load(line: np.ndarray, start: np.ndarray, step: np.ndarray, hops: np.ndarray, size: int) -> int:
    """The most messages crossing one directed link of a ring dim."""
    load = np.zeros((int(line.max()) + 1, size, 2), np.int64)
    pos = start.copy()
    direction = (step < 0).astype(np.int64)
    for t in range(int(hops.max())):
        active = hops > t
        np.add.at(load, (line[active], pos[active], direction[active]), 1)
        pos = (pos + step) % size
    return int(load.max())


def _all_to_all(net: Network, coords: np.ndarray) -> tuple[float, float]:
    """Each member sends 1/k of its result to each other member. Along a ring dim the
    bytes x hops of all pairs spread over the 2 links per member of that dim; through a
    switch a member's port carries what it sends to members elsewhere on that dim."""
    k = coords.shape[1]
    group = coords[0]
    latency, per_byte = 0.0, 0.0
    for d, dim in enumerate(net.dims):
        c = group[:, d]
        if np.all(c == c[0]):
            continue
        counts = np.bincount(c, minlength=dim.size)
        if dim.link is Link.SWITCH:
            away = k - counts[c]                        # peers at another position of this dim
            seconds = away.max() / k / dim.bandwidth
            latency += dim.latency
        else:
            pos = np.arange(dim.size)
            dist = np.abs(pos[:, None] - pos[None, :])
            dist = np.minimum(dist, dim.size - dist)
            hop_pairs = counts @ dist @ counts          # sum over ordered pairs of hops along d
            seconds = hop_pairs / k / (2 * k) / dim.bandwidth
            latency += dist[np.ix_(np.nonzero(counts)[0], np.nonzero(counts)[0])].max() * dim.latency
        per_byte = max(per_byte, float(seconds))
    return float(latency), per_byte


# -- laying a logical mesh onto the network ---------------------------------------------
def device_mesh(shape: Sequence[int], hardware: Union[None, str, Hardware] = None) -> np.ndarray:
    """Device ids for a logical mesh of `shape` such that each mesh axis runs along whole
    dims (or factors of dims) of the physical network, largest axes first on the minor
    (fastest) dims, as jax's mesh_utils does for TPU slices. Row-major ids when the
    shape does not factor onto the network, and on hosts of GPUs."""
    shape = tuple(int(s) for s in shape)
    n = math.prod(shape)
    hw = profile(hardware)
    if isinstance(hw.interconnect, Hosts):
        # GPU clusters: row-major, the minor axis inside a host (where Megatron-LM puts
        # tensor parallelism), the major ones across hosts (pipeline, data).
        return np.arange(n).reshape(shape)
    phys = list(hw.network(n).shape)
    free = list(phys)
    parts: list[list[tuple[int, int]]] = [[] for _ in shape]    # per axis: (physical dim, factor)
    for axis in sorted(range(len(shape)), key=lambda a: -shape[a]):
        need = shape[axis]
        for d in sorted(range(len(phys)), key=lambda d: (free[d] != need, -d)):
            f = math.gcd(need, free[d])
            if f > 1:
                parts[axis].append((d, f))
                free[d] //= f
                need //= f
            if need == 1:
                break
        if need != 1:
            return np.arange(n).reshape(shape)
    # Split each physical dim into its factors (in assignment order, major first), then
    # gather each axis's factors.
    factors = [(d, f, axis) for axis, ps in enumerate(parts) for d, f in ps]
    if not factors:
        return np.arange(n).reshape(shape)
    factors.sort(key=lambda t: t[0])
    ids = np.arange(n).reshape([f for _, f, _ in factors])
    order = sorted(range(len(factors)), key=lambda i: (factors[i][2], factors[i][0]))
    return ids.transpose(order).reshape(shape)


# -- pricing reshards --------------------------------------------------------------------
Cost = float  # estimated seconds on the hardware being planned for
FREE: Cost = 0.0


def add_costs(*costs: Cost) -> Cost:
    return float(sum(costs))


def rounded(cost: Cost) -> float:
    """A cost to compare: equal plans priced by different sums must tie (so that the
    layout order decides between them)."""
    return round(cost, 12)


def at_least(src: Sharding, dst: Sharding, shape: Sequence[int], itemsize: int, hw: Hardware) -> Cost:
    """A lower bound of what resharding src to dst takes on `hw`, without planning:
    callers comparing alternatives skip the plans that cannot win."""
    return FREE if src == dst else lacking(src, dst, tuple(shape), itemsize, hw)


@functools.lru_cache(maxsize=65536)
def lacking(cur: Sharding, dst: Sharding, shape: tuple[int, ...], itemsize: int, hw: Hardware) -> Cost:
    """A lower bound of what turning cur into dst takes: the most data any device lacks
    (what it needs of its dst tile minus what its cur tile holds), received over all of
    its links at once by one collective. Cached: searches for reshard plans ask it of the
    same layouts again and again."""
    n, m, size = np.asarray(cur.shard_shape(shape)), np.asarray(dst.shard_shape(shape)), np.asarray(shape)
    lo_c, lo_d = cur.coords() * n, dst.coords() * m
    hi_c, hi_d = np.minimum(lo_c + n, size), np.minimum(lo_d + m, size)
    need = np.prod(np.maximum(hi_d - lo_d, 0), axis=1)
    have = np.prod(np.maximum(np.minimum(hi_c, hi_d) - np.maximum(lo_c, lo_d), 0), axis=1)
    missing = int((need - have).max()) * itemsize
    if not missing:
        return FREE
    links = sum(d.bandwidth * (2 if d.link is Link.RING else 1) for d in hw.network(cur.num_devices).dims)
    return hw.collective_overhead_s + missing / links
