"""PartitionedValue: one device's piece of a global value, with how it is laid out."""
from __future__ import annotations

from dataclasses import dataclass

from gspmd.ir import Value
from gspmd.sharding import Sharding


@dataclass
class PartitionedValue:
    local: Value              # the per-device value in the SPMD program (shard shape)
    sharding: Sharding
    shape: tuple[int, ...]    # the global shape

    def __post_init__(self):
        if self.local.sharding is None:   # for reports: the layout a per-device value is a shard of
            self.local.sharding = self.sharding

    @property
    def dtype(self):
        return self.local.dtype

    @property
    def rank(self) -> int:
        return len(self.shape)
