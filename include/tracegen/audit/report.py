"""The audit report: a versioned ``report.json`` and a self-contained ``report.html`` reviewers open from Airflow.

The HTML loads nothing: CSS is inline, plots are inline SVG drawn here, there is no script. Everything that
comes from the data (model text, error messages, server names, categories, run metadata) goes through
``html.escape(..., quote=True)`` before it reaches the page, so model output can never become markup.
Order: verdict (what happened, why, what to do), cap table, plots, finish reasons, breakdowns, examples.
"""

from __future__ import annotations

import datetime as dt
import html
import math
from collections.abc import Iterable, Mapping
from typing import Any

from tracegen.audit import measure_report
from tracegen.audit.stats import pivot_text

SCHEMA_VERSION = 1
EXAMPLE_OUTCOMES = ("truncated_in_thinking", "truncated_in_answer", "error")
EXAMPLES_PER_OUTCOME = 3
EXCERPT_HEAD = 600
EXCERPT_TAIL = 1500

# report.json, version 1: top-level keys and their JSON types (None allowed where the tuple says so).
REPORT_SCHEMA: dict[str, tuple[type, ...]] = {
    "schema_version": (int,),
    "generated_at": (str,),
    "run": (dict,),
    "verdict": (dict, type(None)),
    "audit": (dict,),
    "cap_table": (dict, type(None)),
    "examples": (list,),
    "summary": (str,),
    "decisions": (list,),  # the reviewer's answers to the gate's questions (gate_mode=ask), oldest first
    "measurement": (dict, type(None)),  # the tail measurement and runaway rows (`audit.measure_report`)
}
VERDICT_KEYS = {"verdict": str, "reason": str, "action": str, "truncated": int, "total": int, "threshold": float}
EXAMPLE_KEYS = {"outcome": str, "index": int, "finish_reason": (str, type(None)), "reasoning_excerpt": str,
                "content_excerpt": str, "error": (str, type(None))}


def validate_report_json(report: Mapping[str, Any]) -> None:
    """Raise ValueError naming the first key whose presence or type breaks schema version 1."""
    if report.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(f"schema_version must be {SCHEMA_VERSION}, got {report.get('schema_version')!r}")
    for key, types in REPORT_SCHEMA.items():
        if key not in report:
            raise ValueError(f"report.json is missing key {key!r}")
        if not isinstance(report[key], types):
            raise ValueError(f"report.json key {key!r} has type {type(report[key]).__name__}, expected {types}")
    extra = set(report) - set(REPORT_SCHEMA)
    if extra:
        raise ValueError(f"report.json has unexpected keys {sorted(extra)}")
    if report["verdict"] is not None:
        for key, types in VERDICT_KEYS.items():
            if not isinstance(report["verdict"].get(key), types):
                raise ValueError(f"report.json verdict.{key} missing or not {types}")
    for i, ex in enumerate(report["examples"]):
        for key, types in EXAMPLE_KEYS.items():
            if key not in ex or not isinstance(ex[key], types):
                raise ValueError(f"report.json examples[{i}].{key} missing or not {types}")
        if ex["outcome"] not in EXAMPLE_OUTCOMES:
            raise ValueError(f"report.json examples[{i}].outcome {ex['outcome']!r} not in {EXAMPLE_OUTCOMES}")


def _e(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def _pct(x: float | None, digits: int = 1) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.{digits}f}%"


# The two truncation figures a reviewer reads, each under one name wherever it is shown: this report, the
# review pages (progress, run list), the gate's question and `python -m tracegen status`.
AT_CAP = "truncated at the cap"
AT_CAP_MEANS = ("of the rows judged at the run's cap, those it cuts: rows since continued past the cap count, "
                "rows cut under a lower cap do not (the gate's figure)")
STILL = "still truncated"
STILL_MEANS = "of all completed rows (each index's current row), those that end cut by a cap: the export leaves them out"


def figure(count: int, of: int) -> str:
    """One figure as every place writes it: '56 of 3,000 (1.9%)'."""
    return f"{count:,} of {of:,} ({_pct(count / of if of else None)})"


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


def _hours(x: Any) -> str:
    """Hours with the precision a person needs: minutes for short runs, whole hours for week-long ones."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if x < 1:
        return f"{x * 60:.1f} min"
    return f"{x:,.1f} h" if x < 100 else f"{x:,.0f} h"


def _sig(x: float, digits: int = 3) -> str:
    """`digits` significant digits: costs that differ by a few percent still read differently."""
    if x == 0:
        return "0"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(x))))
    return f"{x:,.{decimals}f}"


def _duration_fine(hours: Any) -> str:
    """A cost in time to three significant digits, in seconds, minutes or hours (the cap table's ETA)."""
    if hours is None or (isinstance(hours, float) and math.isnan(hours)):
        return "–"
    seconds = hours * 3600
    if seconds < 90:
        return f"{_sig(seconds)} s"
    if seconds < 5400:
        return f"{_sig(seconds / 60)} min"
    return f"{_sig(hours)} h"


def _gpu_hours(x: Any) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{_sig(x)} GPU-h"


def _num(x: Any, digits: int = 0) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:,.{digits}f}" if isinstance(x, float) else f"{x:,}"


def _excerpt(text: str | None) -> str:
    """Head and tail of a long text: a truncated row is judged by how it ends."""
    text = text or ""
    if len(text) <= EXCERPT_HEAD + EXCERPT_TAIL + 20:
        return text
    return f"{text[:EXCERPT_HEAD]}\n[… {len(text) - EXCERPT_HEAD - EXCERPT_TAIL:,} characters …]\n{text[-EXCERPT_TAIL:]}"


def classify_example(row: Mapping[str, Any]) -> str | None:
    """Which example outcome a row (GeneratedRow.to_json() shape) illustrates, or None for a complete row."""
    if row.get("status") in ("failed", "rejected", "invalid"):
        return "error"
    if row.get("finish_reason") == "length":
        return "truncated_in_thinking" if not row.get("content") and row.get("reasoning_content") else (
            "truncated_in_answer")
    return None


def _normalise_examples(examples: Iterable[Mapping[str, Any]] | Mapping[str, Iterable[Mapping[str, Any]]] | None):
    if examples is None:
        return []
    items: list[tuple[str | None, Mapping[str, Any]]] = []
    if isinstance(examples, Mapping):
        for outcome, rows in examples.items():
            items.extend((outcome, r) for r in rows)
    else:
        items.extend((r.get("outcome"), r) for r in examples)
    out, per = [], dict.fromkeys(EXAMPLE_OUTCOMES, 0)
    for outcome, r in items:
        if not isinstance(r, Mapping):
            raise ValueError(f"an example must be a dict of row fields, got {type(r).__name__}")
        outcome = outcome or classify_example(r)
        if outcome is None:
            continue
        if outcome not in EXAMPLE_OUTCOMES:
            raise ValueError(f"example outcome {outcome!r} is not one of {EXAMPLE_OUTCOMES}")
        if per[outcome] >= EXAMPLES_PER_OUTCOME:
            continue
        per[outcome] += 1
        try:
            index = int(r.get("index", -1))
        except (TypeError, ValueError):
            raise ValueError(f"example index {r.get('index')!r} is not an integer") from None
        out.append(
            {
                "outcome": outcome,
                "index": index,
                "status": None if r.get("status") is None else str(r.get("status")),
                "finish_reason": None if r.get("finish_reason") is None else str(r.get("finish_reason")),
                "max_tokens": r.get("max_tokens"),
                "completion_tokens": r.get("completion_tokens"),
                "reasoning_tokens": r.get("reasoning_tokens"),
                "server": None if r.get("server") is None else str(r.get("server")),
                "error": None if r.get("error") is None else str(r.get("error"))[:2000],
                "reasoning_excerpt": _excerpt(None if r.get("reasoning_content") is None
                                              else str(r.get("reasoning_content"))),
                "content_excerpt": _excerpt(None if r.get("content") is None else str(r.get("content"))),
            }
        )
    return out


def joined_seams(root: Any, frame: Any) -> int:
    """Current extended rows whose text was joined from two decodings (the server had no /detokenize:
    provenance `text: joined`): where the cut fell inside a character their seam holds U+FFFD. Reads the
    parts that hold current extended rows (the ledger does not record how a text was made)."""
    from tracegen.store.current import current_mask
    from tracegen.store.records import EXTENDED

    if len(frame) == 0 or "pivot" not in frame.columns:
        return 0
    rows = frame.loc[current_mask(frame) & (frame["pivot"] == EXTENDED).to_numpy(bool)]
    count = 0
    for part, group in rows.groupby("part", sort=True):
        wanted = {(int(i), int(c)) for i, c in zip(group["index"], group["max_tokens"], strict=True)}
        for row in root.commits.read_part(str(part)):
            if (row.index, row.max_tokens) in wanted and (row.provenance or {}).get("text") == "joined":
                count += 1
    return count


def _jsonable(value: Any) -> Any:
    """Run metadata as plain JSON values (anything else becomes its string form)."""
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    return str(value)


def summary_text(audit: Any, capfit: Any = None, gate: Any = None, measurement: Any = None) -> str:
    """A few lines for the task log."""
    a = audit.to_json() if hasattr(audit, "to_json") else audit
    t, tok, r = a["truncation"], a["tokens"], a["rows"]
    lines = []
    if gate is not None:
        lines.append(f"gate: {gate.verdict.upper()} — {gate.reason}")
        if gate.verdict != "pass":
            lines.append(f"next: {gate.action}")
    lines.append(
        f"rows: {r['current_rows']:,} indices ({r['current_by_status']['ok']:,} ok, "
        f"{r['current_by_status']['failed']:,} failed, {r['current_by_status']['rejected']:,} rejected, "
        f"{r['current_by_status']['invalid']:,} invalid); {r['superseded_rows']:,} superseded ledger rows"
    )
    lines.append(
        f"tokens: mean {_num(tok['mean'])}, median {_num(tok['median'])}, P90 {_num(tok['p90'])}, "
        f"P99 {_num(tok['p99'])}, max {_num(tok['max'])}; truncated {_pct(t['rate'])} "
        f"({t['truncated']:,}; {t['cut_in_reasoning']:,} in thinking, {t['cut_in_answer']:,} in answer)"
    )
    if (pivot := pivot_text(a.get("pivot") or {})) is not None:
        lines.append(f"pivot: {pivot}")
    if (a.get("pivot") or {}).get("joined_seams"):
        lines.append(f"pivot: {a['pivot']['joined_seams']:,} extended rows joined from two texts (no /detokenize): "
                     "their seams may hold U+FFFD")
    if capfit is not None:
        cells = [f"{row.cap}: {_pct(row.truncation)}" for row in capfit.rows]
        lines.append("predicted truncation by cap — " + ", ".join(cells))
    flagged = [s for s in a["by_server"] if s["flags"]]
    for s in flagged:
        lines.append(f"server {s['server']}: " + "; ".join(s["flags"]))
    lines.extend(measure_report.summary_lines(measurement))
    return "\n".join(lines)


def render_report(
    audit: Any,
    capfit: Any = None,
    gate: Any = None,
    run_meta: Mapping[str, Any] | None = None,
    examples: Iterable[Mapping[str, Any]] | Mapping[str, Iterable[Mapping[str, Any]]] | None = None,
    *,
    decisions: Iterable[Mapping[str, Any]] = (),
    measurement: Mapping[str, Any] | None = None,
    seams: int | None = None,
) -> tuple[dict[str, Any], str]:
    """Build (report.json as a dict, report.html as a string) from an AuditResult, CapTable, GateDecision,
    and the reviewer's decisions (`CapDecision.to_json()` dicts) when the run asked. `seams`: the extended
    rows whose text was joined (`joined_seams`), reported under `audit.pivot.joined_seams`."""
    if run_meta is not None and not isinstance(run_meta, Mapping):
        raise ValueError(f"run_meta must be a dict, got {type(run_meta).__name__}")
    a = audit.to_json()
    if seams is not None:
        a["pivot"] = {**(a.get("pivot") or {}), "joined_seams": int(seams)}
    cap_json = capfit.to_json() if capfit is not None else None
    gate_json = gate.to_json() if gate is not None else None
    ex = _normalise_examples(examples)
    report = {
        "schema_version": SCHEMA_VERSION,
        "generated_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "run": _jsonable(dict(run_meta or {})),
        "verdict": _jsonable(gate_json) if gate_json is not None else None,
        "audit": _jsonable(a),
        "cap_table": _jsonable(cap_json) if cap_json is not None else None,
        "examples": ex,
        "summary": summary_text(a, capfit, gate, measurement),
        "decisions": [_jsonable(dict(d)) for d in decisions],
        "measurement": _jsonable(dict(measurement)) if measurement is not None else None,
    }
    validate_report_json(report)
    return report, _html(report)


# ---------------------------------------------------------------------------------------------- HTML

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0 auto;max-width:1100px;
padding:16px 24px;color:#1d2430;background:#fff}
h1{font-size:22px;margin:8px 0}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #dde;padding-bottom:4px}
table{border-collapse:collapse;margin:6px 0 12px;font-variant-numeric:tabular-nums}
th,td{border:1px solid #dde;padding:3px 8px;text-align:right;vertical-align:top}td{white-space:nowrap}
td.l{white-space:normal}.figures{margin:6px 0}.figures span{border-bottom:1px dotted #889;cursor:help}
th{background:#f3f5f9}td.l,th.l{text-align:left}
.verdict{border-radius:8px;padding:12px 16px;margin:10px 0;border:2px solid}
.pass{background:#eaf7ee;border-color:#2e8b57}.stop{background:#fdecec;border-color:#c0392b}
.warn{background:#fff6e0;border-color:#d4a017}.damaged{background:#fdecec;border-color:#7b1e12}.none{background:#f3f5f9;border-color:#889}
.verdict b.v{font-size:20px;text-transform:uppercase;margin-right:8px}
tr.rec td{background:#eaf7ee;font-weight:600}tr.cur td{background:#f3f5f9}
.flag{color:#c0392b;font-weight:600}pre{white-space:pre-wrap;word-break:break-word;background:#f7f7fa;
border:1px solid #e3e3ea;padding:8px;max-height:420px;overflow:auto;font-size:12px}
.muted{color:#667}svg{display:block;margin:6px 0}svg text{font:11px sans-serif;fill:#334}
.ex{border:1px solid #dde;border-radius:6px;padding:8px 12px;margin:8px 0}
"""


def _table(headers: list[str], rows: list[list[str]], left: int = 1, row_class: list[str] | None = None) -> str:
    """Cells are already escaped/formatted strings; the first ``left`` columns are left-aligned."""
    head = "".join(f'<th class="{"l" if i < left else ""}">{_e(h)}</th>' for i, h in enumerate(headers))
    body = []
    for j, r in enumerate(rows):
        cls = f' class="{row_class[j]}"' if row_class and row_class[j] else ""
        body.append(f"<tr{cls}>" + "".join(
            f'<td class="{"l" if i < left else ""}">{c}</td>' for i, c in enumerate(r)) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _svg_histogram(hist: dict[str, list[int]], cap: int) -> str:
    edges, counts = hist["edges"], hist["counts"]
    if not counts or not any(counts):
        return '<p class="muted">no completed rows</p>'
    w, h, ml, mb, mt = 680, 220, 50, 30, 12
    pw, ph = w - ml - 10, h - mb - mt
    x0, x1 = edges[0], edges[-1]
    top = max(counts)

    def sx(v: float) -> float:
        return ml + (v - x0) / (x1 - x0) * pw

    parts = [f'<svg width="{w}" height="{h}" role="img" aria-label="histogram of completion tokens">']
    for lo, hi, c in zip(edges[:-1], edges[1:], counts, strict=True):
        bh = c / top * ph
        color = "#c0392b" if lo >= cap else "#4a7bd0"
        parts.append(f'<rect x="{sx(lo):.1f}" y="{mt + ph - bh:.1f}" width="{max(sx(hi) - sx(lo) - 1, 0.5):.1f}" '
                     f'height="{bh:.1f}" fill="{color}"><title>{lo}–{hi - 1}: {c:,}</title></rect>')
    parts.append(f'<line x1="{ml}" y1="{mt + ph}" x2="{ml + pw}" y2="{mt + ph}" stroke="#334"/>')
    for k in range(5):
        v = x0 + (x1 - x0) * k / 4
        parts.append(f'<text x="{sx(v):.1f}" y="{h - 10}" text-anchor="middle">{int(v):,}</text>')
    parts.append(f'<text x="{ml - 6}" y="{mt + 8}" text-anchor="end">{top:,}</text>')
    parts.append(f'<text x="{ml - 6}" y="{mt + ph}" text-anchor="end">0</text>')
    cx = sx(cap)
    parts.append(f'<line x1="{cx:.1f}" y1="{mt}" x2="{cx:.1f}" y2="{mt + ph}" stroke="#c0392b" '
                 f'stroke-dasharray="4 3" stroke-width="2"/>')
    parts.append(f'<text x="{cx - 4:.1f}" y="{mt + 10}" text-anchor="end" fill="#c0392b">cap {cap:,}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _svg_bars(items: list[tuple[str, int]]) -> str:
    if not items:
        return '<p class="muted">none</p>'
    total = sum(c for _, c in items) or 1
    top = max(c for _, c in items) or 1
    w, row, ml = 680, 24, 130
    colors = {"stop": "#2e8b57", "length": "#c0392b", "tool_calls": "#4a7bd0"}
    parts = [f'<svg width="{w}" height="{row * len(items) + 6}" role="img" aria-label="finish reasons">']
    for i, (name, c) in enumerate(items):
        bw = c / top * (w - ml - 160)
        y = 3 + i * row
        parts.append(f'<text x="{ml - 8}" y="{y + 15}" text-anchor="end">{_e(name)}</text>')
        parts.append(f'<rect x="{ml}" y="{y + 2}" width="{max(bw, 1):.1f}" height="{row - 6}" '
                     f'fill="{colors.get(name, "#889")}"/>')
        parts.append(f'<text x="{ml + bw + 6:.1f}" y="{y + 15}">{c:,} ({_pct(c / total)})</text>')
    parts.append("</svg>")
    return "".join(parts)


def _svg_cap_curve(cap_table: dict[str, Any]) -> str:
    rows = cap_table["rows"]
    if len(rows) < 2:
        return ""
    w, h, ml, mb, mt, mr = 680, 240, 50, 32, 12, 16
    pw, ph = w - ml - mr, h - mb - mt
    caps = [r["cap"] for r in rows]
    c0, c1 = min(caps), max(caps)
    ymax = max(max(r["truncation_high"] for r in rows), cap_table["threshold"]) * 1.1 or 0.01

    def sx(c: float) -> float:
        return ml + (c - c0) / (c1 - c0) * pw

    def sy(p: float) -> float:
        return mt + ph - min(p, ymax) / ymax * ph

    band = [f"{sx(r['cap']):.1f},{sy(r['truncation_high']):.1f}" for r in rows]
    band += [f"{sx(r['cap']):.1f},{sy(r['truncation_low']):.1f}" for r in reversed(rows)]
    line = " ".join(f"{sx(r['cap']):.1f},{sy(r['truncation']):.1f}" for r in rows)
    thr = cap_table["threshold"]
    parts = [f'<svg width="{w}" height="{h}" role="img" aria-label="predicted truncation by cap">',
             f'<polygon points="{" ".join(band)}" fill="#4a7bd0" fill-opacity="0.18"/>',
             f'<polyline points="{line}" fill="none" stroke="#4a7bd0" stroke-width="2"/>',
             f'<line x1="{ml}" y1="{sy(thr):.1f}" x2="{ml + pw}" y2="{sy(thr):.1f}" stroke="#c0392b" '
             f'stroke-dasharray="5 4"/>',
             f'<text x="{ml + pw}" y="{sy(thr) - 4:.1f}" text-anchor="end" fill="#c0392b">threshold '
             f'{_pct(thr)}</text>',
             f'<line x1="{ml}" y1="{mt + ph}" x2="{ml + pw}" y2="{mt + ph}" stroke="#334"/>',
             f'<text x="{ml - 6}" y="{mt + 8}" text-anchor="end">{_pct(ymax, 0)}</text>',
             f'<text x="{ml - 6}" y="{mt + ph}" text-anchor="end">0%</text>']
    for r in rows:
        rec = r["cap"] == cap_table["recommended_cap"]
        cur = r["cap"] == cap_table["current_cap"]
        fill = "#2e8b57" if rec else ("#c0392b" if cur else "#4a7bd0")
        parts.append(f'<circle cx="{sx(r["cap"]):.1f}" cy="{sy(r["truncation"]):.1f}" r="{5 if rec or cur else 3}" '
                     f'fill="{fill}"><title>{r["cap"]}: {_pct(r["truncation"])}</title></circle>')
        parts.append(f'<text x="{sx(r["cap"]):.1f}" y="{h - 12}" text-anchor="middle">{r["cap"]:,}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _verdict_html(v: dict[str, Any] | None, final: bool = False, asks: bool = False) -> str:
    if v is None:
        return '<div class="verdict none"><b class="v">no gate</b> this report has no truncation gate.</div>'
    cls = v["verdict"] if v["verdict"] in ("pass", "stop", "warn", "damaged") else "none"
    # The gate's action ("proceed with generation", "trigger again with ...") is advice for a run still to
    # generate; a finished run's next steps follow in their own box (`_final_next_steps`), and a run that
    # asks its reviewer goes on at the cap they answer. Damaged parts are the exception: what to do about
    # them comes first, finished or not.
    todo = v["action"]
    if asks and cls == "stop":
        todo = ("answer the run's question in Airflow's Required Actions: continue at the recommended cap or at "
                "another one (the same run goes on; finished rows are kept), accept this truncation, or stop")
    action = "" if final and cls != "damaged" else f'<div><b>What to do:</b> {_e(todo)}</div>'
    return f'<div class="verdict {cls}"><b class="v">{_e(v["verdict"])}</b>{_e(v["reason"])}{action}</div>'


def _figures_html(report: dict[str, Any]) -> str:
    """The two truncation figures under their names, each name explained on hover and below."""
    figures = figures_from_report(report)
    if not figures:
        return ""
    means = {AT_CAP: AT_CAP_MEANS, STILL: STILL_MEANS}
    cells = [f'<span title="{_e(means[n])}">{_e(n)}</span>: <b>{_e(figure(*figures[n]))}</b>'
             for n in (AT_CAP, STILL) if n in figures]
    return (f'<p class="figures">{" · ".join(cells)}</p><p class="muted">{_e(AT_CAP)}: {_e(AT_CAP_MEANS)}. '
            f"{_e(STILL)}: {_e(STILL_MEANS)}.</p>")


def _run_value(key: str, value: Any, decisions: list[dict[str, Any]]) -> str:
    """A run table cell: the config as JSON (as the trigger form's conf reads), said to be the decided one."""
    if key != "config" or not isinstance(value, Mapping):
        return _e(value)
    import json

    note = ("" if not decisions else '<div class="muted">as decided: after a decision (the reviewer\'s answer or a '
            "raise), max_tokens is the chosen cap and gate_mode is stop (a new cap) or warn (the truncation "
            "accepted), whatever the run was triggered with.</div>")
    return f"<pre>{_e(json.dumps(value, indent=1, sort_keys=True, default=str))}</pre>{note}"


def _finished(report: dict[str, Any]) -> bool:
    """The final audit of a run that generated past its gate (not one the gate stopped: a reviewer's or a
    timeout's stop, or a stop verdict under gate_mode stop or ask with nobody having decided)."""
    run = report["run"]
    if run.get("report") != "report":
        return False
    decisions = report["decisions"]
    if decisions:
        return decisions[-1].get("cap") is not None
    mode = (run.get("config") or {}).get("gate_mode")
    return not ((report["verdict"] or {}).get("verdict") == "stop" and mode in ("stop", "ask"))


def _final_next_steps(report: dict[str, Any]) -> str:
    """A finished run's next steps: the gate's "proceed with generation" is about a run still to
    generate; after the final audit, what is left is the export and the rows still truncated or failed."""
    a, config = report["audit"], (report["run"].get("config") or {})
    tr, cs = a["truncation"], a["rows"]["current_by_status"]
    root = config.get("output_uri") or "OUTPUT_URI"
    steps = [f"export the dataset: <code>python -m tracegen export {_e(root)} EXPORT_DIR</code>"]
    if tr["truncated"]:
        steps.append(f"{STILL}: {figure(tr['truncated'], tr.get('ok_rows') or 0)} rows; the export leaves them out unless "
                     "<code>--include-truncated</code>; to finish them, trigger again at a higher cap (they are "
                     "continued from their tokens)")
    if cs["failed"]:
        steps.append(f"{_num(cs['failed'])} rows failed: <code>tracegen_rerun_failed</code> retries them hourly")
    return ('<div class="verdict none"><b class="v">next</b>this is the final audit of a finished run.'
            f'<div><b>What to do:</b> {"; ".join(steps)}.</div></div>')


def _decision_html(d: dict[str, Any]) -> str:
    """A reviewer's answer to the gate's question: who, when, what, and the table they decided on; or an
    operator's mid-run raise of the cap (no question, no table)."""
    if d.get("trigger") == "raise":
        return (f'<div class="verdict none"><b class="v">decision</b>the cap was raised mid-run by '
                f"<b>{_e(d.get('responded_by') or 'unknown')}</b>, {_e(d.get('responded_at'))}: continue at "
                f"max_tokens=<b>{_num(d.get('cap'))}</b> (from {_num(d.get('from_cap'))}); the chunks started "
                "after it generated at the new cap, and the rows truncated under the old one were taken up "
                "at it afterwards.</div>")
    gate = "pilot gate" if d.get("trigger") == "pilot" else "continuous gate (mid-run)"
    who = ("nobody answered before the question timed out; the run took its default" if d.get("timed_out")
           else f"answered by <b>{_e(d.get('responded_by') or 'unknown')}</b>")
    what = (f"continue at max_tokens=<b>{_num(d['cap'])}</b> (from {_num(d.get('from_cap'))})"
            if d.get("cap") is not None else "<b>stop the run</b>")
    rows = [[f"{_num(r.get('cap'))}", _pct(r.get("truncation")),
             f"{_pct(r.get('truncation_low'))}–{_pct(r.get('truncation_high'))}",
             _num(r.get("expected_tokens_per_row")), _duration_fine(r.get("eta_hours")), _gpu_hours(r.get("gpu_hours")),
             _e(r.get("basis"))] for r in d.get("cap_rows") or []]
    table = _table(["max_tokens", "predicted truncation", "interval", "tokens/row", "ETA", "GPU time", "basis"],
                   rows, row_class=["rec" if r.get("cap") == d.get("cap") else "" for r in d.get("cap_rows") or []])
    verdict = (d.get("verdict") or {}).get("reason")
    return (f'<div class="verdict none"><b class="v">decision</b>at the {gate}: {who}, '
            f"{_e(d.get('responded_at'))}: &ldquo;{_e(d.get('option'))}&rdquo;, i.e. {what}."
            + (f"<div>The question said: {_e(verdict)}</div>" if verdict else "")
            + f"<details><summary>The cap table they saw</summary>{table}"
              f'<p class="muted">report: {_e(d.get("report_uri"))}</p></details></div>')


def _cap_table_html(ct: dict[str, Any] | None) -> str:
    if ct is None:
        return '<p class="muted">no cap table (the lengths could not be fitted: too few complete rows)</p>'
    has_tp = ct["throughput"] is not None
    headers = ["max_tokens", "predicted truncation", f"{round(ct['confidence'] * 100)}% interval",
               "tokens/row", "vs current", "basis"]
    if has_tp:
        left = ct["throughput"]["rows_remaining"]
        headers += [f"tokens for the {left:,} rows left", "ETA", "GPU time"]
    rows, classes = [], []
    for r in ct["rows"]:
        cells = [f"{r['cap']:,}" + (" (context)" if r["clipped_to_context"] else ""), _pct(r["truncation"]),
                 f"{_pct(r['truncation_low'])}–{_pct(r['truncation_high'])}", _num(r["expected_tokens_per_row"]),
                 f"{r['tokens_vs_current']:.2f}×", _e(r["basis"])]
        if has_tp:
            tokens = r["expected_tokens_per_row"] * left if r["expected_tokens_per_row"] is not None else None
            cells += [_num(None if tokens is None else round(tokens)), _duration_fine(r["eta_hours"]),
                      _gpu_hours(r["gpu_hours"])]
        rows.append(cells)
        classes.append("rec" if r["cap"] == ct["recommended_cap"] else ("cur" if r["cap"] == ct["current_cap"]
                                                                         else ""))
    rec = (f"smallest cap meeting {_pct(ct['threshold'])}: <b>{ct['recommended_cap']:,}</b> "
           f"(predicted {_pct(ct['recommended_truncation'])})" if ct["recommended_cap"] is not None
           else f"no candidate cap meets {_pct(ct['threshold'])}")
    fit = ct["fit"]
    note = (f'<p class="muted">fit: {_e(fit["model"])}; {fit["rows"]:,} rows, {fit["censored_rows"]:,} censored; '
            f"log-normal median {_num(fit['lognormal_median'])}, sigma {fit['lognormal_sigma']:.3f}; "
            f"spliced at {_num(fit['splice_at'])}; {fit['bootstrap_replicates']} bootstrap replicates."
            + (f" Throughput: {_num(ct['throughput']['tokens_per_s_per_gpu'])} tokens/s per GPU × "
               f"{ct['throughput']['n_gpus']} GPUs, {ct['throughput']['rows_remaining']:,} rows remaining."
               if has_tp else "") + "</p>")
    notes = "".join(f'<p class="muted">{_e(n)}</p>' for n in ct["notes"])
    return f"<p>{rec}</p>" + _table(headers, rows, row_class=classes) + note + notes


def _breakdown(rows: list[dict[str, Any]], key: str, title: str) -> str:
    if not rows:
        return ""
    body = [[_e(r[key]), _num(r["rows"]), _num(r["truncated"]), _pct(r["truncation_rate"]),
             _num(r["cut_in_reasoning"]), _num(r["mean_completion_tokens"])] for r in rows]
    return f"<h3>{_e(title)}</h3>" + _table(
        [key, "rows", "truncated", "rate", "cut in thinking", "mean tokens"], body)


def _html(report: dict[str, Any]) -> str:
    a, run, ct = report["audit"], report["run"], report["cap_table"]
    tok, tr, rows = a["tokens"], a["truncation"], a["rows"]
    title = f"tracegen audit — run {run.get('run_id', a.get('run_id') or '')}"
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           '<meta name="viewport" content="width=device-width, initial-scale=1">',
           f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>",
           f"<h1>{_e(title)}</h1>",
           f'<p class="muted">max_tokens={a["max_tokens"]:,} · generated {_e(report["generated_at"])}</p>',
           _verdict_html(report["verdict"], final=_finished(report),
                         asks=(run.get("config") or {}).get("gate_mode") == "ask" and not report["decisions"]),
           _figures_html(report)]
    if _finished(report):
        out.append(_final_next_steps(report))
    out.extend(_decision_html(d) for d in report["decisions"])
    for n in a["notes"]:
        out.append(f'<p class="muted">{_e(n)}</p>')

    out.append("<h2>Cap table</h2>" + _cap_table_html(ct))
    if ct is not None:
        out.append(_svg_cap_curve(ct))
    out.append(measure_report.html(report.get("measurement")))

    out.append("<h2>Completion tokens</h2>")
    out.append(_svg_histogram(a["histogram"], a["max_tokens"]))
    out.append(_table(
        ["rows", "mean", "median", "P90", "P99", "max", "reasoning share", "mean thinking", "mean answer"],
        [[_num(tok["count"]), _num(tok["mean"]), _num(tok["median"]), _num(tok["p90"]), _num(tok["p99"]),
          _num(tok["max"]), _pct(tok["reasoning_share"]), _num(tok["reasoning_mean"]), _num(tok["answer_mean"])]],
        left=0))
    out.append(_table(["bucket", "rows", "share"],
                      [[_e(b["label"]), _num(b["count"]), _pct(b["share"])] for b in a["buckets"]]))

    out.append("<h2>Finish reasons</h2>")
    out.append(_svg_bars(sorted(a["finish_reasons"].items(), key=lambda kv: -kv[1])))
    out.append(_table(["", "rows"], [
        [f"{STILL}, of all completed rows (each index's current row, any cap)",
         f"{_num(tr['truncated'])} of {_num(tr.get('ok_rows'))} ({_pct(tr['rate'])})"],
        [f"truncated, of the rows generated at max_tokens={a['max_tokens']:,} (this cap only)",
         f"{_num(tr['at_cap_truncated'])} of "
                                                          f"{_num(tr['at_cap_rows'])} ({_pct(tr['at_cap_rate'])})"],
        ["… cut inside the thinking trace", _num(tr["cut_in_reasoning"])],
        ["… cut inside the answer", _num(tr["cut_in_answer"])],
        ["truncated under a lower cap", _num(tr["truncated_under_lower_cap"])],
    ]))

    out.append("<h2>Rows</h2>")
    cs = rows["current_by_status"]
    out.append(_table(["ledger rows", "indices", "ok", "failed", "rejected", "invalid", "superseded",
                       "superseded truncated", "superseded failed"],
                      [[_num(rows["ledger_rows"]), _num(rows["indices"]), _num(cs["ok"]), _num(cs["failed"]),
                        _num(cs["rejected"]), _num(cs["invalid"]), _num(rows["superseded_rows"]),
                        _num(rows["superseded_truncated"]), _num(rows["superseded_failed"])]], left=0))

    pv = a.get("pivot") or {}
    if pivot_text(pv) is not None:
        out.append("<h2>The pivot</h2>")
        out.append('<p class="muted">Rows of this run that replaced a row truncated under a lower cap: '
                   "continued from its exact tokens (extended), or generated again from scratch.</p>")
        out.append(_table(["", "rows", "tokens spent"], [
            ["extended from their tokens", _num(pv["extended"]), _num(pv["extended_new_tokens"])],
            ["… of which now finish", _num(pv["extended_finished"]), ""],
            ["regenerated", _num(pv["regenerated"]), ""],
            ["regenerated: no token ids to extend from", _num(pv["fallback_regenerated"]), ""],
            ["regenerated (both)", _num(pv["regenerated"] + pv["fallback_regenerated"]),
             _num(pv["regenerated_tokens"])],
            ["tokens saved against regenerating the extended rows (their prefixes)", "", _num(pv["tokens_saved"])],
        ]))
    if pv.get("joined_seams"):
        out.append(f'<p class="flag">{_num(pv["joined_seams"])} extended rows have their text joined from two '
                   "decodings (the server had no /detokenize): where the cut fell inside a character, the seam "
                   "holds U+FFFD.</p>")

    out.append("<h2>Breakdowns</h2>")
    out.append(_breakdown(a["by_prompt_length"], "prompt_tokens", "By prompt length"))
    out.append(_breakdown(a["by_category"], "category", "By category"))
    if a["by_server"]:
        out.append("<h3>By server</h3>" + _table(
            ["server", "rows", "ok", "error rate", "truncation", "latency p50 (s)", "latency p90 (s)",
             "tokens/s per request", "flags"],
            [[_e(s["server"]), _num(s["rows"]), _num(s["ok"]), _pct(s["error_rate"]), _pct(s["truncation_rate"]),
              _num(s["latency_p50_s"], 1), _num(s["latency_p90_s"], 1), _num(s["tokens_per_s_per_request"], 1),
              '<span class="flag">' + _e("; ".join(s["flags"])) + "</span>" if s["flags"] else ""]
             for s in a["by_server"]]))
    if a["by_chunk"]:
        out.append(f"<details><summary>By chunk ({len(a['by_chunk']):,} chunks)</summary>" + _table(
            ["chunk", "rows", "ok", "failed", "rejected", "invalid", "truncated", "rate", "mean latency (s)"],
            [[_num(c["chunk"]), _num(c["rows"]), _num(c["ok"]), _num(c["failed"]), _num(c["rejected"]),
              _num(c["invalid"]), _num(c["truncated"]), _pct(c["truncation_rate"]), _num(c["mean_latency_s"], 1)]
             for c in a["by_chunk"]], left=1) + "</details>")

    err, inv = a["errors"], a["invalid"]
    out.append(f"<h2>Errors</h2><p>{_num(err['failed_rows'])} failed and {_num(err['rejected_rows'])} rejected "
               f"ledger rows; {_num(err['current_failed'])} indices still failed, "
               f"{_num(err['current_rejected'])} rejected; {_num(inv['rows'])} invalid dataset rows.</p>")
    msgs = err["top_messages"] + inv["top_messages"]
    if msgs:
        out.append(_table(["status", "message", "rows"],
                          [[_e(m["status"]), _e(m["message"]), _num(m["count"])] for m in msgs], left=2))

    out.append("<h2>Examples</h2>")
    if not report["examples"]:
        out.append('<p class="muted">no examples were passed to the report</p>')
    for outcome in EXAMPLE_OUTCOMES:
        group = [x for x in report["examples"] if x["outcome"] == outcome]
        if not group:
            continue
        out.append(f"<h3>{_e(outcome.replace('_', ' '))}</h3>")
        for x in group:
            meta = (f"index {x['index']:,} · status {_e(x['status'])} · finish {_e(x['finish_reason'])} · "
                    f"{_num(x['completion_tokens'])} tokens ({_num(x['reasoning_tokens'])} thinking) · "
                    f"max_tokens {_num(x['max_tokens'])} · server {_e(x['server'])}")
            body = f'<div class="ex"><div class="muted">{meta}</div>'
            if x["error"]:
                body += f"<b>error</b><pre>{_e(x['error'])}</pre>"
            if x["reasoning_excerpt"]:
                body += f"<b>thinking</b><pre>{_e(x['reasoning_excerpt'])}</pre>"
            if x["content_excerpt"]:
                body += f"<b>answer</b><pre>{_e(x['content_excerpt'])}</pre>"
            out.append(body + "</div>")

    if run:
        out.append("<h2>Run</h2>" + _table(["key", "value"], [[_e(k), _run_value(k, v, report["decisions"])]
                                                              for k, v in run.items()], left=2))
    out.append("</body></html>")
    return "\n".join(out)
