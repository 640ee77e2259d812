"""The two truncation figures a reviewer reads, each under one name wherever it is shown: the report, the
review pages (progress, run list), the gate's question and `python -m tracegen status`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tracegen.audit.formats import pct

AT_CAP = "truncated at the cap"
AT_CAP_MEANS = ("of the rows judged at the run's cap, those it cuts: rows since continued past the cap count, "
                "rows cut under a lower cap do not (the gate's figure)")
STILL = "still truncated"
STILL_MEANS = "of all completed rows (each index's current row), those that end cut by a cap: the export leaves them out"


def figure(count: int, of: int) -> str:
    """One figure as every place writes it: '56 of 3,000 (1.9%)'."""
    return f"{count:,} of {of:,} ({pct(count / of if of else None)})"


def figures_from_report(report: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    """{name: (count, of)} of a report.json: the gate's counts and the audit's current truncated rows."""
    out = {}
    v, t = report.get("verdict") or {}, ((report.get("audit") or {}).get("truncation") or {})
    if isinstance(v.get("truncated"), int) and isinstance(v.get("total"), int):
        out[AT_CAP] = (v["truncated"], v["total"])
    if isinstance(t.get("truncated"), int) and isinstance(t.get("ok_rows"), int):
        out[STILL] = (t["truncated"], t["ok_rows"])
    return out


def figures_from_ledger(frame: Any, max_tokens: int) -> dict[str, tuple[int, int]]:
    """The same figures counted from a ledger frame at a cap, as the report's audit counts them."""
    # Imported here: the pages and the gate's question read the names above without loading pandas.
    from tracegen.audit.stats import gate_counts
    from tracegen.store.current import current_mask
    from tracegen.store.records import OK

    if not len(frame):
        return {AT_CAP: (0, 0), STILL: (0, 0)}
    ok = current_mask(frame) & (frame["status"] == OK).to_numpy()
    cut = ok & (frame["finish_reason"] == "length").to_numpy()
    return {AT_CAP: gate_counts(frame, max_tokens), STILL: (int(cut.sum()), int(ok.sum()))}


def figures_text(figures: Mapping[str, tuple[int, int]], sep: str = " · ") -> str:
    """'truncated at the cap: 56 of 3,000 (1.9%) · still truncated: 48 of 2,950 (1.6%)'."""
    return sep.join(f"{name}: {figure(*figures[name])}" for name in (AT_CAP, STILL) if name in figures)
