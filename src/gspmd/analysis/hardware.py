"""Hardware profiles for estimating step time and checking memory without running.

Numbers are per device, public peak figures rounded; they rank strategies rather than
predict wall-clock time to the percent. Communication uses ring algorithms with no
overlap with compute (an upper bound): a collective over k devices moving B bytes costs
latency * (k - 1) + B * factor / bandwidth.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from gspmd.errors import ShardingError

GiB = 1 << 30


@dataclass(frozen=True)
class Hardware:
    name: str
    flops_per_s: float        # peak dense matmul throughput per device
    memory_bytes: int         # accelerator memory per device
    bandwidth_bytes_per_s: float   # collective bandwidth per device (interconnect)
    latency_s: float          # per step of a ring collective


PROFILES = {h.name: h for h in [
    Hardware("tpu-v3", 61.5e12, 16 * GiB, 100e9, 5e-6),      # per TensorCore, as the paper counts
    Hardware("tpu-v4", 275e12, 32 * GiB, 270e9, 5e-6),
    Hardware("a100", 312e12, 80 * GiB, 300e9, 8e-6),          # NVLink 3, bf16 dense
    Hardware("h100", 989e12, 80 * GiB, 450e9, 8e-6),          # NVLink 4
    Hardware("h200", 989e12, 141 * GiB, 450e9, 8e-6),
    Hardware("cpu", 1e11, 16 * GiB, 10e9, 20e-6),
]}

# Bytes each device sends, as a multiple of the collective's result bytes, for k devices.
_RING_FACTOR = {
    "all-reduce": lambda k: 2 * (k - 1) / k,
    "all-gather": lambda k: (k - 1) / k,
    "reduce-scatter": lambda k: float(k - 1),     # the input is k times the result
    "all-to-all": lambda k: (k - 1) / k,
    "collective-permute": lambda k: 1.0,
}


def profile(hardware: Union[str, Hardware]) -> Hardware:
    if isinstance(hardware, Hardware):
        return hardware
    if hardware not in PROFILES:
        raise ShardingError(f"Unknown hardware {hardware!r}; choose one of {sorted(PROFILES)} "
                            "or pass a gspmd.analysis.Hardware(...).")
    return PROFILES[hardware]


def collective_seconds(kind: str, nbytes: int, group_size: int, hw: Hardware) -> float:
    k = max(group_size, 2) if kind == "collective-permute" else group_size
    if k <= 1:
        return 0.0
    return hw.latency_s * (k - 1) + nbytes * _RING_FACTOR[kind](k) / hw.bandwidth_bytes_per_s
