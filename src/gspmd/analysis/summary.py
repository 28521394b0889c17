"""Lowered.summary(): per-device collective bytes by source line and kind, one table."""
from __future__ import annotations

from gspmd.analysis.report import COLLECTIVES, Report


def collective_table(report: Report) -> str:
    """Rows: the source line (or parameter/result path) that made collectives, most
    bytes first; columns: collective kinds, then the total. Bytes per device, loops
    counted as often as they run."""
    kinds = [k for k in COLLECTIVES if any(c.kind == k for c in report.collectives)]
    rows: dict[str, dict[str, int]] = {}
    for c in report.collectives:
        row = rows.setdefault(c.source or "(no source line)", {})
        row[c.kind] = row.get(c.kind, 0) + c.bytes * c.executions
    if not rows:
        return "no collectives: every device computes on its own data"
    width = max(len("source"), *map(len, rows))
    header = f"{'source':<{width}}" + "".join(f"{k:>20}" for k in kinds) + f"{'total':>14}"
    lines = ["per-device collective bytes by source line and kind", header, "-" * len(header)]
    totals = {k: sum(r.get(k, 0) for r in rows.values()) for k in kinds}
    for source, row in sorted(rows.items(), key=lambda item: -sum(item[1].values())):
        lines.append(f"{source:<{width}}" + "".join(f"{row.get(k, 0):>20,}" for k in kinds)
                     + f"{sum(row.values()):>14,}")
    lines.append("-" * len(header))
    lines.append(f"{'total':<{width}}" + "".join(f"{totals[k]:>20,}" for k in kinds) + f"{sum(totals.values()):>14,}")
    return "\n".join(lines)
