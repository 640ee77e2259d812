"""The report's account of the tail measurement and of runaway rows: which part of the cap table is
measured and which modelled, what measuring cost, and the rows no cap finishes.

`section` builds the report JSON's `measurement` value from the run's `measure.json`
(`tracegen.generate.measure`) and the runaways found in the report's scope; `html` (the template
`templates/measurement.html.j2`, autoescaped: model text stays text) and `summary_lines` render it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from tracegen.audit.formats import pct
from tracegen.audit.rendering import render
from tracegen.store.layout import MEASURE_FILE
from tracegen.store.root import OutputRoot
from tracegen.store.storage import StorageKeyError

RUNAWAY_EXAMPLES = 3
# What each runaway_policy does with the runaway rows, as the section says it.
POLICY_EFFECTS = {"drop": "left out of the export (listed in its manifest)",
                  "keep": "exported with the truncated rows when those are exported",
                  "resample": "generated once more from scratch; the fresh sample replaces them"}


def read_measurement(root: OutputRoot, run_id: str) -> dict[str, Any] | None:
    try:
        return json.loads(root.run_files.get(run_id, MEASURE_FILE))
    except StorageKeyError:
        return None


def section(
    measurement: Mapping[str, Any] | None,
    *,
    runaways: Mapping[str, Any] | None = None,
    runaway_examples: list[Mapping[str, Any]] | None = None,
    runaway_policy: str | None = None,
    cap_table: Mapping[str, Any] | None = None,
) -> dict[str, Any] | None:
    """The report JSON's `measurement` value (None: no measurement decided and no runaway judged)."""
    if measurement is None and runaways is None:
        return None
    observed = None
    if cap_table:
        caps = [r["cap"] for r in cap_table.get("rows") or [] if r.get("basis") == "observed"]
        observed = max(caps) if caps else None
    return {
        "tail": dict(measurement) if measurement is not None else None,
        "observed_up_to": observed,
        "runaway": None if runaways is None else {
            **dict(runaways), "policy": runaway_policy,
            "examples": [dict(x) for x in (runaway_examples or [])[:RUNAWAY_EXAMPLES]],
        },
    }


def cost_text(tail: Mapping[str, Any]) -> str | None:
    o = tail.get("outcome")
    if not o or tail.get("cap") is None:
        return None
    return (f"{o['new_tokens']:,} new tokens ({pct(o.get('budget_share'))} of the {tail['budget_tokens']:,}-token "
            f"budget, {pct(o.get('pilot_share'))} of the pilot's {tail['pilot_tokens']:,}); "
            f"{o['prefix_tokens_reused']:,} prefix tokens reused, not paid again")


def summary_lines(sec: Mapping[str, Any] | None) -> list[str]:
    """A few lines for the task log."""
    if not sec:
        return []
    lines = []
    tail = sec.get("tail")
    if tail and tail.get("cap") is not None and tail.get("outcome"):
        o = tail["outcome"]
        lines.append(f"tail measured to {tail['cap']:,}: {o['rows']:,} truncated pilot rows continued, "
                     f"{o['finished']:,} finished, {o['still_truncated']:,} still truncated; {cost_text(tail)}")
    elif tail:
        lines.append(f"tail not measured: {tail.get('reason')}")
    r = sec.get("runaway")
    if r and r.get("rows"):
        lines.append(f"runaways (tail loops, no cap finishes them): {r['rows']:,} rows, {pct(r.get('share'))} "
                     f"of ok rows; runaway_policy={r.get('policy')}")
    return lines


def html(sec: Mapping[str, Any] | None) -> str:
    """The report's section (empty when there is nothing to say)."""
    if not sec:
        return ""
    tail, policy = sec.get("tail"), (sec.get("runaway") or {}).get("policy")
    return render("measurement.html.j2", sec=sec, cost=cost_text(tail) if tail else None,
                  policy_effect=POLICY_EFFECTS.get(policy or "", policy))
