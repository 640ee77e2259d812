"""The audit report: a versioned ``report.json`` and a self-contained ``report.html`` reviewers open from Airflow.

This module builds and checks report.json (its schema, the examples, the summary for the task log);
``report_html`` renders the page from it.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Iterable, Mapping
from typing import Any

from tracegen.audit import measure_report
from tracegen.audit.formats import num, pct
from tracegen.audit.pivot import pivot_text
from tracegen.audit.report_html import render_html
from tracegen.audit.token_account import prefill_line

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


def summary_text(audit: Any, capfit: Any = None, gate: Any = None, measurement: Any = None,
                 account: Mapping[str, Any] | None = None) -> str:
    """A few lines for the task log; `account`: the run's token account (`audit.token_account`), when kept."""
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
        f"tokens: mean {num(tok['mean'])}, median {num(tok['median'])}, P90 {num(tok['p90'])}, "
        f"P99 {num(tok['p99'])}, max {num(tok['max'])}; truncated {pct(t['rate'])} "
        f"({t['truncated']:,}; {t['cut_in_reasoning']:,} in thinking, {t['cut_in_answer']:,} in answer)"
    )
    if (pivot := pivot_text(a.get("pivot") or {})) is not None:
        lines.append(f"pivot: {pivot}")
    if (a.get("pivot") or {}).get("joined_seams"):
        lines.append(f"pivot: {a['pivot']['joined_seams']:,} extended rows joined from two texts (no /detokenize): "
                     "their seams may hold U+FFFD")
    if capfit is not None:
        cells = [f"{row.cap}: {pct(row.truncation)}" for row in capfit.rows]
        lines.append("predicted truncation by cap — " + ", ".join(cells))
    flagged = [s for s in a["by_server"] if s["flags"]]
    for s in flagged:
        lines.append(f"server {s['server']}: " + "; ".join(s["flags"]))
    if account and (prefill := prefill_line(account)) is not None:
        lines.append(f"prefill: {prefill}")
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
) -> tuple[dict[str, Any], str]:
    """Build (report.json as a dict, report.html as a string) from an AuditResult, CapTable, GateDecision,
    and the reviewer's decisions (`CapDecision.to_json()` dicts) when the run asked."""
    if run_meta is not None and not isinstance(run_meta, Mapping):
        raise ValueError(f"run_meta must be a dict, got {type(run_meta).__name__}")
    a = audit.to_json()
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
        "summary": summary_text(a, capfit, gate, measurement, (run_meta or {}).get("token_account")),
        "decisions": [_jsonable(dict(d)) for d in decisions],
        "measurement": _jsonable(dict(measurement)) if measurement is not None else None,
    }
    validate_report_json(report)
    return report, render_html(report, EXAMPLE_OUTCOMES)
