"""The "auto" columns of PUBLISHED.md and PAPER.md (issue 47): given a row's model, chip
count and global batch, the configuration `gspmd plan MODEL --auto` finds (mesh,
strategy, stages, schedule, repeats, microbatches, remat; the model's dims, attention
kind, dropout, optimizer and dtypes fixed) and its estimated step against the row's
stated configuration planned by gspmd on the same profile ("ours")."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from gspmd import plan_search, planning

HEAD = ["auto: configuration", "auto step s (fits)", "auto / ours", "search s"]
BUDGET_S = 60.0     # seconds of search a row (issue 47: at most 60)


@dataclass
class Auto:
    configuration: str
    step_s: float
    fits: bool
    ratio: float        # auto's step over the stated configuration's
    search_s: float

    def cells(self) -> list[str]:
        return [self.configuration, f"{self.step_s:.3f} ({'yes' if self.fits else 'NO'})", f"{self.ratio:.3f}",
                f"{self.search_s:.0f}"]


def semantics(sizes: planning.Sizes) -> planning.Sizes:
    """The row's model as given to the search: what it parallelizes and recomputes left open."""
    return dataclasses.replace(sizes, **{k: None for k in plan_search.SEARCHED})


def search(model: str, sizes: planning.Sizes, devices: int, hardware: str, stated_step_s: float,
           budget_s: float = BUDGET_S) -> Auto:
    found = plan_search.search(model, semantics(sizes), devices, hardware, budget_s)
    report = found.chosen.plan.report
    return Auto(" ".join(f"{k} {v}" for k, v in found.configuration().items()), report.step_seconds,
                report.fits_in_memory, report.step_seconds / stated_step_s, found.seconds)


def summary(autos: list[Auto], budget_s: float) -> str:
    """The issue's done-when for a table: auto no slower than the stated configuration,
    fitting, within the budget, on every row."""
    ok = [a for a in autos if a.ratio <= 1.0 + 1e-9 and a.fits and a.search_s <= budget_s]
    worst = max(a.search_s for a in autos)
    return (f"- auto (`gspmd plan MODEL --auto`, {budget_s:.0f} s a row): no slower than the stated configuration "
            f"and fitting on {len(ok)} of {len(autos)} rows (auto / ours {min(a.ratio for a in autos):.3f}-"
            f"{max(a.ratio for a in autos):.3f}), searched in at most {worst:.0f} s a row; "
            f"{'PASS' if len(ok) == len(autos) else 'FAIL'}.")
