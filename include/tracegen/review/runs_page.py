"""The run list: every `tracegen_generate` run, newest first, in every state (a run Airflow knows but that
wrote nothing yet is listed from Airflow's metadata), each output root once; and `runs.json`."""

from __future__ import annotations

import datetime as dt
from dataclasses import asdict
from typing import Any, NamedTuple

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse

from tracegen.audit.figures import AT_CAP, AT_CAP_MEANS, STILL, STILL_MEANS, figure
from tracegen.audit.token_account import account_lines, prefill_line, stopped_line
from tracegen.config import safe_run_id
from tracegen.review.access import GENERATE_DAG, AirflowRun, airflow_run_path, require_dag_read
from tracegen.review.page import file_url, html_response, progress_url, render_page
from tracegen.review.roots import RootListing, Site, airflow_run_of, list_root
from tracegen.review.summary import RunSummary
from tracegen.run.stage import ASKING, STOPPED


class Badge(NamedTuple):
    """A cell of the list as `macros.badge` shows it: a coloured badge (`cls`) with a line under it, or plain
    text when `cls` is None."""

    cls: str | None
    text: str
    note: str | None = None


def badge(verdict: str | None) -> Badge:
    return Badge(verdict if verdict in ("pass", "stop", "warn") else "none", verdict or "–")


def _stage_cell(r: RunSummary | None, af: AirflowRun | None) -> Badge:
    """What the run is doing, in the words an operator looks for: the gate's stop is not a crash."""
    if r is not None and r.stage == STOPPED:
        return Badge("stop", STOPPED, r.decision)
    if r is not None and r.stage == ASKING:
        return Badge("warn", ASKING)
    state = af.state if af else None
    if state in ("running", "queued"):
        return Badge("none", state)
    if state == "failed":
        return Badge("stop", "failed")
    if r is not None and "report.html" in r.reports:
        return Badge("pass", "finished")
    return Badge(None, state or "–")


def _pilot_cell(r: RunSummary) -> Badge:
    """The pilot gate's verdict; a stop the reviewer answered by continuing is not a red stop any more."""
    if r.pilot_verdict == "stop" and r.decision and not r.decision.startswith("stopped"):
        return Badge("warn", "stop, answered", r.decision)
    return badge(r.pilot_verdict)


def _when(r: RunSummary | None, af: AirflowRun | None) -> str:
    """A sortable 'YYYY-MM-DD HH:MM:SS UTC' from the run's record, else from when Airflow queued it."""
    if r is not None and r.created:
        return r.created
    if af is not None and af.queued_at:
        try:
            return dt.datetime.fromisoformat(af.queued_at).astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        except ValueError:
            return ""
    return ""


def _reports(request: Request, key: str, r: RunSummary) -> list[tuple[str, str, bool]]:
    """(href, text, decided) of the run's pages: its progress, then its reports, the one that decided first."""
    names = list(r.reports)
    if r.deciding_report in names:
        names.remove(r.deciding_report)
        names.insert(0, r.deciding_report)
    links = [(file_url(request, key, r.run_id, name), name, name == r.deciding_report) for name in names]
    if r.has_record:
        links.insert(0, (progress_url(request, key, r.run_id), "progress", False))
    return links


def _line(request: Request, listing: RootListing | None, r: RunSummary | None, af: AirflowRun | None,
          stored: str) -> dict[str, Any]:
    """One run's row: from its summary, or from what Airflow knows when the run wrote nothing readable."""
    line: dict[str, Any] = {"run_id": stored, "href": airflow_run_path(af.run_id) if af else None,
                            "stage": _stage_cell(r, af), "summary": None}
    if r is None:  # known to Airflow only: nothing written yet, or its root unreadable
        line["created"] = _when(None, af) or "–"
        line["why"] = (af.root_problem if af and af.root_problem else "nothing written yet"
                       + (": its task logs in Airflow say why" if af and af.state == "failed" else ""))
        return line
    figures = r.truncation_figures or {}
    line["created"] = r.created or "–"
    line["summary"] = {
        "cap": f"{r.max_tokens:,}" if r.max_tokens is not None else "–",
        "pilot": _pilot_cell(r),
        "verdict": badge(r.final_verdict) if r.final_verdict else _pilot_cell(r),
        "rows": f"{r.rows:,}" if r.rows is not None else "–",
        "at_cap": figure(*figures[AT_CAP]) if AT_CAP in figures else "–",
        "still": figure(*figures[STILL]) if STILL in figures else "–",
        "recommended": "–" if r.recommended_cap is None else f"{r.recommended_cap:,}",
        **_tokens_cell(r.token_account),
        "reports": _reports(request, listing.key, r),
        "problem": r.problem,
    }
    return line


TOKENS_MEANS = ("tokens the fleet generated for the output root, per token in the rows the export keeps "
                "(1.00: nothing spent on rows left out, runaways or superseded rows)")


def _tokens_cell(account: dict[str, Any] | None) -> dict[str, str]:
    """The run's tokens generated per token kept, and where the rest went (its title)."""
    ratio = (account or {}).get("generated_per_kept")
    if not isinstance(ratio, int | float):
        return {"tokens": "–", "tokens_note": ""}
    lines = "; ".join(f"{n:,} {what} ({share})" for what, n, share in account_lines(account))
    notes = [lines, *(line for line in (stopped_line(account), prefill_line(account)) if line)]
    return {"tokens": f"{ratio:.2f}", "tokens_note": ". ".join(notes)}


def render_index(request: Request, listings: list[RootListing], problems: list[str],
                 airflow: dict[str, AirflowRun]) -> str:
    lines: list[tuple[str, dict[str, Any]]] = []
    listed: set[str] = set()
    for listing in listings:
        for r in listing.runs:
            af = airflow_run_of(r.run_id, r.airflow_run_id, airflow)
            listed.add(r.run_id)
            if af is not None:
                listed.add(safe_run_id(af.run_id))  # a run stored under the earlier id form is listed once
            lines.append((_when(r, af), _line(request, listing, r, af, r.run_id)))
    for stored, af in airflow.items():
        if stored not in listed:
            lines.append((_when(None, af), _line(request, None, None, af, stored)))
    lines.sort(key=lambda line: line[0], reverse=True)
    return render_page("runs.html.j2", title="tracegen reports", dag=GENERATE_DAG, problems=problems,
                       listings=listings, lines=[line for _, line in lines], AT_CAP=AT_CAP,
                       AT_CAP_MEANS=AT_CAP_MEANS, STILL=STILL, STILL_MEANS=STILL_MEANS, TOKENS_MEANS=TOKENS_MEANS)


def register(app: FastAPI, site: Site) -> None:
    @app.get("/", response_class=HTMLResponse, name="index")
    def index(request: Request) -> HTMLResponse:
        require_dag_read(request)
        by_key, problems = site.resolve_roots()
        listings = [list_root(uri) for uri in by_key.values()]
        return html_response(render_index(request, listings, problems, site.by_stored_id()))

    @app.get("/runs.json", name="runs_json")
    def runs_json(request: Request) -> dict[str, Any]:
        require_dag_read(request)
        by_key, problems = site.resolve_roots()
        roots_out = []
        for uri in by_key.values():
            listing = list_root(uri)
            roots_out.append({"key": listing.key, "uri": listing.uri, "problem": listing.problem,
                              "missing": listing.missing,
                              "runs": [asdict(r) | {"verdict": r.verdict} for r in listing.runs]})
        return {"roots": roots_out, "problems": problems}
