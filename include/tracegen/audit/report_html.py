"""report.html: the self-contained page reviewers open from Airflow, rendered from report.json's dict.

The page loads nothing: its CSS is inline, its plots are inline SVG (`charts`), there is no script. It is
the template `templates/report.html.j2`, autoescaped (`rendering`), so model text, error messages, server
names, categories and run metadata reach it as text. This module works out what the page says: the
verdict and what to do, whether the run is finished, the reviewers' decisions, the cap table's rows.
Order: verdict (what happened, why, what to do), cap table, plots, finish reasons, breakdowns, examples.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from markupsafe import Markup

from tracegen.audit import charts, measure_report
from tracegen.audit.figures import AT_CAP, AT_CAP_MEANS, STILL, STILL_MEANS, figure, figures_from_report
from tracegen.audit.formats import duration_fine, gpu_hours, num, pct
from tracegen.audit.pivot import pivot_text
from tracegen.audit.rendering import render
from tracegen.audit.token_account import account_lines, prefill_line, stopped_line

VERDICT_CLASSES = ("pass", "stop", "warn", "damaged")
# What to do about a stop verdict when the run asks its reviewer: the gate's own action is advice for a run
# that stops there, not for one waiting on an answer.
ASKED_ACTION = ("answer the run's question in Airflow's Required Actions: continue at the recommended cap or at "
                "another one (the same run goes on; finished rows are kept), accept this truncation, or stop")


def render_html(report: dict[str, Any], example_outcomes: tuple[str, ...]) -> str:
    """The page for `report` (report.json's dict), its examples grouped in the order of `example_outcomes`."""
    a, run = report["audit"], report["run"]
    finished = _finished(report)
    pv = a.get("pivot") or {}
    return render(
        "report.html.j2",
        title=f"tracegen audit — run {run.get('run_id', a.get('run_id') or '')}",
        report=report, a=a, tr=a["truncation"], run=run, pv=pv, has_pivot=pivot_text(pv) is not None,
        verdict=_verdict(report["verdict"], final=finished,
                         asks=(run.get("config") or {}).get("gate_mode") == "ask" and not report["decisions"]),
        figures=[(n, {AT_CAP: AT_CAP_MEANS, STILL: STILL_MEANS}[n], figure(*f))
                 for n, f in figures_from_report(report).items()],
        AT_CAP=AT_CAP, AT_CAP_MEANS=AT_CAP_MEANS, STILL=STILL, STILL_MEANS=STILL_MEANS,
        next_steps=_final_next_steps(report) if finished else None,
        decisions=[_decision(d) for d in report["decisions"]],
        cap_table=_cap_table(report["cap_table"]),
        cap_curve=charts.cap_curve(report["cap_table"]) if report["cap_table"] is not None else "",
        # The section is rendered by the same autoescaping environment: its markup is already safe.
        measurement=Markup(measure_report.html(report.get("measurement"))),
        histogram=charts.histogram(a["histogram"], a["max_tokens"]),
        finish_bars=charts.finish_bars(sorted(a["finish_reasons"].items(), key=lambda kv: -kv[1])),
        cells=_list_cells(a),
        examples=[(o, [x for x in report["examples"] if x["outcome"] == o]) for o in example_outcomes],
        while_asking=(run.get("while_asking") or {}).get("text"),
        token_rows=[(what, num(n), share) for what, n, share in account_lines(run["token_account"])]
        if run.get("token_account") else None,
        stopped_loops=stopped_line(run["token_account"]) if run.get("token_account") else None,
        prefill=prefill_line(run["token_account"]) if run.get("token_account") else None,
        run_rows=[(k, _run_value(k, v, report["decisions"])) for k, v in run.items()
                  if k not in ("while_asking", "token_account")],
    )


def _verdict(v: dict[str, Any] | None, final: bool = False, asks: bool = False) -> dict[str, Any] | None:
    """The verdict box: its class, verdict, reason and what to do (`todo` None: nothing here)."""
    if v is None:
        return None
    cls = v["verdict"] if v["verdict"] in VERDICT_CLASSES else "none"
    # The gate's action ("proceed with generation", "trigger again with ...") is advice for a run still to
    # generate; a finished run's next steps follow in their own box (`_final_next_steps`), and a run that
    # asks its reviewer goes on at the cap they answer. Damaged parts are the exception: what to do about
    # them comes first, finished or not.
    todo = ASKED_ACTION if asks and cls == "stop" else v["action"]
    return {"cls": cls, "verdict": v["verdict"], "reason": v["reason"],
            "todo": None if final and cls != "damaged" else todo}


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


def _final_next_steps(report: dict[str, Any]) -> dict[str, Any]:
    """A finished run's next steps: the gate's "proceed with generation" is about a run still to
    generate; after the final audit, what is left is the export and the rows still truncated or failed."""
    a, config = report["audit"], (report["run"].get("config") or {})
    tr, cs = a["truncation"], a["rows"]["current_by_status"]
    return {"root": config.get("output_uri") or "OUTPUT_URI",
            "still": figure(tr["truncated"], tr.get("ok_rows") or 0) if tr["truncated"] else None,
            "failed": cs["failed"]}


def _decision(d: dict[str, Any]) -> dict[str, Any]:
    """A reviewer's answer to the gate's question (who, when, what, and the table they decided on), or an
    operator's mid-run raise of the cap (no question, no table)."""
    rows = d.get("cap_rows") or []
    return {
        "raise": d.get("trigger") == "raise",
        "gate": "pilot gate" if d.get("trigger") == "pilot" else "continuous gate (mid-run)",
        "by": d.get("responded_by") or "unknown", "at": d.get("responded_at"), "timed_out": d.get("timed_out"),
        "option": d.get("option"), "cap": d.get("cap"), "from_cap": d.get("from_cap"),
        "question": (d.get("verdict") or {}).get("reason"), "report_uri": d.get("report_uri"),
        "rows": [[num(r.get("cap")), pct(r.get("truncation")),
                  f"{pct(r.get('truncation_low'))}–{pct(r.get('truncation_high'))}",
                  num(r.get("expected_tokens_per_row")), duration_fine(r.get("eta_hours")),
                  gpu_hours(r.get("gpu_hours")), r.get("basis")] for r in rows],
        "row_class": ["rec" if r.get("cap") == d.get("cap") else "" for r in rows],
    }


def _cap_table(ct: dict[str, Any] | None) -> dict[str, Any] | None:
    """The cap table's headers, rows (each cell as shown) and row classes: the recommended cap, the current."""
    if ct is None:
        return None
    tp = ct["throughput"]
    headers = ["max_tokens", "predicted truncation", f"{round(ct['confidence'] * 100)}% interval",
               "tokens/row", "vs current", "basis"]
    if tp is not None:
        headers += [f"tokens for the {tp['rows_remaining']:,} rows left", "ETA", "GPU time"]
    rows, classes = [], []
    for r in ct["rows"]:
        cells = [f"{r['cap']:,}" + (" (context)" if r["clipped_to_context"] else ""), pct(r["truncation"]),
                 f"{pct(r['truncation_low'])}–{pct(r['truncation_high'])}", num(r["expected_tokens_per_row"]),
                 f"{r['tokens_vs_current']:.2f}×", r["basis"]]
        if tp is not None:
            per_row = r["expected_tokens_per_row"]
            cells += [num(None if per_row is None else round(per_row * tp["rows_remaining"])),
                      duration_fine(r["eta_hours"]), gpu_hours(r["gpu_hours"])]
        rows.append(cells)
        classes.append("rec" if r["cap"] == ct["recommended_cap"] else "cur" if r["cap"] == ct["current_cap"] else "")
    return {**ct, "headers": headers, "cells": rows, "row_class": classes}


def _list_cells(a: dict[str, Any]) -> dict[str, list[list[Any]]]:
    """The cells of the tables with a row per item of one of the audit's lists, each as shown."""

    def breakdown(rows: list[dict[str, Any]], key: str) -> list[list[Any]]:
        return [[r[key], num(r["rows"]), num(r["truncated"]), pct(r["truncation_rate"]), num(r["cut_in_reasoning"]),
                 num(r["mean_completion_tokens"])] for r in rows]

    def flags(s: dict[str, Any]) -> Markup | str:
        # The one cell with markup: Markup.format escapes the flags' text into it.
        return Markup('<span class="flag">{}</span>').format("; ".join(s["flags"])) if s["flags"] else ""

    return {
        "buckets": [[b["label"], num(b["count"]), pct(b["share"])] for b in a["buckets"]],
        "by_prompt_length": breakdown(a["by_prompt_length"], "prompt_tokens"),
        "by_category": breakdown(a["by_category"], "category"),
        "by_server": [[s["server"], num(s["rows"]), num(s["ok"]), pct(s["error_rate"]), pct(s["truncation_rate"]),
                       num(s["latency_p50_s"], 1), num(s["latency_p90_s"], 1), num(s["tokens_per_s_per_request"], 1),
                       flags(s)] for s in a["by_server"]],
        "by_chunk": [[num(c["chunk"]), num(c["rows"]), num(c["ok"]), num(c["failed"]), num(c["rejected"]),
                      num(c["invalid"]), num(c["truncated"]), pct(c["truncation_rate"]), num(c["mean_latency_s"], 1)]
                     for c in a["by_chunk"]],
        "messages": [[m["status"], m["message"], num(m["count"])]
                     for m in a["errors"]["top_messages"] + a["invalid"]["top_messages"]],
    }


def _run_value(key: str, value: Any, decisions: list[dict[str, Any]]) -> Any:
    """A run table cell: the config as JSON (as the trigger form's conf reads), said to be the decided one."""
    if key != "config" or not isinstance(value, Mapping):
        return value
    # Markup.format escapes the JSON; the note is this module's own text.
    config = Markup("<pre>{}</pre>").format(json.dumps(value, indent=1, sort_keys=True, default=str))
    if not decisions:
        return config
    return config + Markup('<div class="muted">as decided: after a decision (the reviewer\'s answer or a raise), '
                           "max_tokens is the chosen cap and gate_mode is stop (a new cap) or warn (the truncation "
                           "accepted), whatever the run was triggered with.</div>")
