"""Numbers as the audit writes them for people: shares, counts, durations and GPU time, in one place, so the
report, its review pages and the gate's question read alike. Plain Python: the DAG file parsing the review
task imports these, and must not load pandas."""

from __future__ import annotations

import math
from typing import Any

MISSING = "–"


def _missing(x: Any) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def pct(x: float | None, digits: int = 1) -> str:
    """A share as a percentage: 0.0187 -> '1.9%'."""
    return MISSING if _missing(x) else f"{100 * x:.{digits}f}%"


def num(x: Any, digits: int = 0) -> str:
    """A count or an amount with thousands separators: 3000 -> '3,000', 2.25 at one digit -> '2.2'."""
    if _missing(x):
        return MISSING
    return f"{x:,.{digits}f}" if isinstance(x, float) else f"{x:,}"


def sig(x: float, digits: int = 3) -> str:
    """`digits` significant digits: costs that differ by a few percent still read differently."""
    if x == 0:
        return "0"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(x))))
    return f"{x:,.{decimals}f}"


def duration_fine(hours: Any) -> str:
    """A cost in time to three significant digits, in seconds, minutes or hours (the cap table's ETA)."""
    if _missing(hours):
        return MISSING
    seconds = hours * 3600
    if seconds < 90:
        return f"{sig(seconds)} s"
    if seconds < 5400:
        return f"{sig(seconds / 60)} min"
    return f"{sig(hours)} h"


def gpu_hours(x: Any) -> str:
    return MISSING if _missing(x) else f"{sig(x)} GPU-h"
