"""DeviceContext: emits the per-device program's partition-dependent values and
collectives. Every collective records the instruction and the rule that made it."""
from __future__ import annotations

import enum
from typing import Callable, Optional, Sequence

import numpy as np

from gspmd.ir import Builder, Instr, Program, Value, emit
from gspmd.ir.emit import INDEX_DTYPE
from gspmd.ir.reducer import Reducer
from gspmd.spmd.cost import DEFAULT, Hardware


class Why(enum.Enum):
    """Why a partition rule moved data (reports group collectives by it)."""
    RESHARD = "reshard"
    FALLBACK = "reshard fallback"            # gathered only to be split again: reports warn
    PARTIAL_RESULTS = "partial results"      # combining partial sums of a split reduction
    HALO = "halo exchange"                   # windows reaching into neighbours' shards
    DATA_FORMATTING = "data formatting"      # rotations, mirrored reverses
    MANUAL = "manual"                        # written by the user in a manual region


# partition_subprogram(program, in_layouts, out_layouts, subgroups=None) -> the per-device program
PartitionSubprogram = Callable[..., Program]


class DeviceContext:
    """The devices one partitioning step sees as partitions: 0..num_devices-1, which are
    the devices themselves, or inside a manual region (`subgroups` [G, K]: real device
    of subgroup g's virtual device v) the virtual devices of every subgroup at once.
    Tables and collective groups are written over virtual devices and emitted over real
    ones; collectives run within each subgroup."""

    def __init__(self, builder: Builder, num_devices: int,
                 partition_subprogram: Optional[PartitionSubprogram] = None,
                 partitioned: Optional[Callable[[Value], object]] = None,
                 subgroups: Optional[np.ndarray] = None, hardware: Hardware = DEFAULT,
                 tidy: Callable[[Program], Program] = lambda program: program,
                 sharers: Callable[[Instr], tuple[int, ...]] = lambda instr: (1,) * len(instr.operands)):
        """The driver's hooks: partition_subprogram partitions loop bodies and conditions;
        partitioned(value) is the PartitionedValue of any value already partitioned (for
        rules that look through their operands' producers); tidy runs the passes every
        per-device program gets again, on one a rule rewrote after it was made. `hardware`
        is what the rules' choices (reshard plans, layouts) are priced on; sharers(instr),
        per operand, how many ops alike (instr itself among them) reshard that operand alike
        and so share what it costs (see partitioner._sharers)."""
        self.b = builder
        self.hardware = hardware
        self.num_devices = num_devices
        self.subgroups = np.arange(num_devices)[None] if subgroups is None else np.asarray(subgroups)
        self.virtual = np.empty(self.subgroups.size, np.int64)   # real device -> its virtual device
        self.virtual[self.subgroups] = np.arange(num_devices)
        self._pid: Value | None = None
        self._tables: dict[bytes, Value] = {}
        self.partition_subprogram = partition_subprogram
        self.partitioned = partitioned
        self.tidy = tidy
        self.sharers = sharers

    def real_groups(self, groups) -> np.ndarray:
        """Groups of virtual devices as groups of real devices, in every subgroup."""
        groups = _groups(groups)
        return self.subgroups[:, groups].reshape(-1, groups.shape[1])

    def virtual_groups(self, groups) -> np.ndarray:
        """Inverse of real_groups: the virtual groups of real device groups."""
        virtual = self.virtual[_groups(groups)]
        return np.unique(virtual, axis=0) if virtual.size else virtual

    # -- partition-dependent scalars ---------------------------------------------
    def partition_id(self) -> Value:
        """The real device's id (the virtual one is a table lookup)."""
        if self._pid is None:
            self._pid = emit.partition_id(self.b)
        return self._pid

    def table_lookup(self, table: Sequence[int]) -> Value:
        """Scalar `table[virtual device]`, as XLA does it: constant + dynamic-slice."""
        table = np.asarray(table, INDEX_DTYPE)
        if np.all(table == table[0]):
            return self.constant(table[0])
        table = table[self.virtual]
        key = table.tobytes()
        if key not in self._tables:
            t = self.constant(table)
            one = emit.dynamic_slice(self.b, t, [self.partition_id()], (1,))
            self._tables[key] = emit.reshape(self.b, one, ())
        return self._tables[key]

    def constant(self, value, dtype=None) -> Value:
        return emit.constant(self.b, value, dtype)

    def dynamic_slice(self, x: Value, starts: Sequence[Value], sizes: Sequence[int]) -> Value:
        """emit.dynamic_slice on this context's program (the op rules' shorthand)."""
        return emit.dynamic_slice(self.b, x, starts, sizes)

    # -- collectives -------------------------------------------------------------
    def _made_by(self, out: Value, why: Why, detail: str) -> Value:
        """`out`'s collective, recorded as made by the rule being run, for `why`."""
        rule = f"{why.value}: {detail}" if detail else why.value
        out.producer.origin = f"{self.b.origin} [{rule}]" if self.b.origin else rule
        out.producer.why = why
        return out

    def all_reduce(self, x: Value, groups: np.ndarray, reducer: Reducer, why: Why, detail: str = "") -> Value:
        return self._made_by(emit.all_reduce(self.b, x, self.real_groups(groups), reducer), why, detail)

    def all_gather(self, x: Value, dim: int, groups: np.ndarray, why: Why, detail: str = "") -> Value:
        return self._made_by(emit.all_gather(self.b, x, dim, self.real_groups(groups)), why, detail)

    def reduce_scatter(self, x: Value, dim: int, groups: np.ndarray, reducer: Reducer, why: Why,
                       detail: str = "") -> Value:
        return self._made_by(emit.reduce_scatter(self.b, x, dim, self.real_groups(groups), reducer), why, detail)

    def all_to_all(self, x: Value, split_dim: int, concat_dim: int, groups: np.ndarray, why: Why,
                   detail: str = "") -> Value:
        return self._made_by(emit.all_to_all(self.b, x, split_dim, concat_dim, self.real_groups(groups)), why,
                             detail)

    def collective_permute(self, x: Value, pairs: np.ndarray, why: Why, detail: str = "") -> Value:
        pairs = self.real_groups(np.asarray(pairs, np.int64).reshape(-1, 2))
        return self._made_by(emit.collective_permute(self.b, x, pairs), why, detail)


def _groups(groups) -> np.ndarray:
    g = np.asarray(groups, np.int64)
    return g.reshape(-1, g.shape[-1])
