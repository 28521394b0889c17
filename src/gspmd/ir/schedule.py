"""What a pipeline's loops do, recorded on the program for reports: how many steps each
stage runs and how many of its slots hold a microbatch."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PipelineSchedule:
    name: str             # gpipe, circular, 1f1b
    stages: int           # L
    microbatches: int     # M
    repeats: int          # R: times a microbatch goes around the ring
    steps: int            # steps with forward slots (as many have backward slots)

    @property
    def slots(self) -> int:
        """Stage-steps of forward work (the backward pass has as many)."""
        return self.stages * self.steps

    @property
    def busy_slots(self) -> int:
        return self.stages * self.microbatches * self.repeats

    @property
    def bubble_fraction(self) -> float:
        """Share of the stages' slots that compute on padding: (L-1)/(M*R + L-1) when L
        divides M (or R = 1)."""
        return 1 - self.busy_slots / self.slots
