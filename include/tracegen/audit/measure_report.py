"""The report's account of the tail measurement and of runaway rows: which part of the cap table is
measured and which modelled, what measuring cost, and the rows no cap finishes.

`section` builds the report JSON's `measurement` value from the run's `measure.json`
(`tracegen.generate.measure`) and the runaways found in the report's scope; `html` and `summary_lines`
render it. Everything from the data is escaped (`html.escape`), model text included.
"""

from __future__ import annotations

import html as _html
import json
from collections.abc import Mapping
from typing import Any

from tracegen.store.layout import MEASURE_FILE
from tracegen.store.root import OutputRoot
from tracegen.store.storage import StorageKeyError

RUNAWAY_EXAMPLES = 3


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


def _e(value: Any) -> str:
    return _html.escape("" if value is None else str(value), quote=True)


def _n(x: Any) -> str:
    return "–" if x is None else f"{x:,}"


def _pct(x: Any) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def cost_text(tail: Mapping[str, Any]) -> str | None:
    o = tail.get("outcome")
    if not o or tail.get("cap") is None:
        return None
    return (f"{o['new_tokens']:,} new tokens ({_pct(o.get('budget_share'))} of the {tail['budget_tokens']:,}-token "
            f"budget, {_pct(o.get('pilot_share'))} of the pilot's {tail['pilot_tokens']:,}); "
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
        lines.append(f"runaways (tail loops, no cap finishes them): {r['rows']:,} rows, {_pct(r.get('share'))} "
                     f"of ok rows; runaway_policy={r.get('policy')}")
    return lines


def html(sec: Mapping[str, Any] | None) -> str:
    """The report's section (empty when there is nothing to say)."""
    if not sec:
        return ""
    out = ["<h2>Measured and modelled</h2>"]
    tail, observed = sec.get("tail"), sec.get("observed_up_to")
    if tail and tail.get("cap") is not None:
        o = tail.get("outcome") or {}
        out.append(
            f"<p>Why measured: {_e(tail.get('trigger'))}. The pilot's {_n(len(tail.get('indices') or []))} rows "
            f"truncated at {_n(tail.get('run_cap'))} were continued from their exact tokens to "
            f"<b>{_n(tail['cap'])}</b> ({_e(tail.get('reason'))}): {_n(o.get('finished'))} finished, "
            f"{_n(o.get('still_truncated'))} are still cut at {_n(tail['cap'])}"
            + (f", {_n(o.get('failed_or_rejected'))} could not be continued (the second fan-out extends them)"
               if o.get("failed_or_rejected") else "") + ".</p>")
        out.append("<p>Every truncated row went to the same cap: a measurement that stopped rows when a budget "
                   "ran out, or chose the cheap ones, would cut exactly the long rows short and bias the "
                   "Kaplan-Meier estimate low. These rows are part of the dataset: a row that finished is "
                   "complete at any cap, one still cut is truncated at any cap up to the measured one, and "
                   "none is generated again.</p>")
        if (cost := cost_text(tail)) is not None:
            out.append(f"<p><b>Cost:</b> {_e(cost)}. The budget bounds the worst case (every row running to the "
                       f"cap: {_n(tail.get('worst_case_tokens'))} tokens); the budget: "
                       f"{_e(tail.get('budget_source'))}.</p>")
        past = (o.get("past_cap") or {})
        if past:
            rows = "".join(f"<tr><td>{_n(int(c))}</td><td>{_n(v)}</td></tr>" for c, v in past.items())
            out.append(f"<table><thead><tr><th>cap</th><th>of the {_n(o.get('measured'))} measured rows, longer than "
                       f"it</th></tr></thead><tbody>{rows}</tbody></table>")
    elif tail:
        out.append(f'<p class="muted">The tail was not measured: {_e(tail.get("reason"))}.</p>')
    if observed is not None:
        out.append(f"<p>The cap table is <b>observed</b> up to {_n(observed)} (Kaplan-Meier on rows whose lengths "
                   "are known there) and <b>modelled</b> above it (the fitted tail): a modelled row is an "
                   "extrapolation, read its interval.</p>")
    else:
        out.append("<p>No row of the cap table is observed: every candidate cap is above the lengths the rows "
                   "show, so the table extrapolates the fitted tail.</p>")
    r = sec.get("runaway")
    if r is not None:
        out.append("<h3>Runaway rows</h3>")
        what = {"drop": "left out of the export (listed in its manifest)",
                "keep": "exported with the truncated rows when those are exported",
                "resample": "generated once more from scratch; the fresh sample replaces them"}.get(
                    r.get("policy") or "", _e(r.get("policy")))
        if r.get("rows"):
            by_cap = ", ".join(f"{_n(int(c))}: {_n(v)}" for c, v in (r.get("by_cap") or {}).items())
            out.append(f"<p>{_n(r.get('rows'))} of {_n(r.get('ok_rows'))} judged rows ({_pct(r.get('share'))}) loop "
                       f"at their end (by the cap that cut them: {_e(by_cap)}). No cap finishes them: they are a "
                       f"floor under every cap's truncation. runaway_policy={_e(r.get('policy'))}: {what}.</p>")
        else:
            out.append(f"<p>None of the {_n(r.get('ok_rows'))} judged rows loops at its end.</p>")
        if r.get("resampled"):
            out.append(f"<p>{_n(r['resampled'])} runaway rows were generated once more from scratch "
                       "(runaway_policy=resample); the rows counted above are those whose fresh sample looped "
                       "again.</p>")
        if not r.get("whole_scope"):
            out.append('<p class="muted">Judged on a fixed random sample of the dataset (reading every '
                       "truncated row would read most parts); the export judges every truncated row it "
                       "writes.</p>")
        for x in r.get("examples") or []:
            out.append(f'<div class="ex"><div class="muted">index {_n(x.get("index"))} · cut at '
                       f'{_n(x.get("max_tokens"))} · loop score {_e(x.get("score"))}</div>'
                       f"<pre>{_e(x.get('tail'))}</pre></div>")
    return "\n".join(out)
