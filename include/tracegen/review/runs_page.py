"""The run list: every `tracegen_generate` run, newest first, in every state (a run Airflow knows but that
wrote nothing yet is listed from Airflow's metadata), each output root once; and `runs.json`."""

from __future__ import annotations

import datetime as dt
from dataclasses import asdict
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse

from tracegen.audit.figures import AT_CAP, AT_CAP_MEANS, STILL, STILL_MEANS, figure
from tracegen.review.access import GENERATE_DAG, AirflowRun, airflow_run_path, require_dag_read
from tracegen.review.page import badge, e, file_url, html_response, page, progress_url
from tracegen.review.roots import RootListing, Site, list_root
from tracegen.review.summary import RunSummary
from tracegen.run.stage import ASKING, STOPPED


def _stage_cell(r: RunSummary | None, af: AirflowRun | None) -> str:
    """What the run is doing, in the words an operator looks for: the gate's stop is not a crash."""
    if r is not None and r.stage == STOPPED:
        return f'<span class="badge stop">{e(STOPPED)}</span>' + (f'<div class="uri">{e(r.decision)}</div>'
                                                                   if r.decision else "")
    if r is not None and r.stage == ASKING:
        return f'<span class="badge warn">{e(ASKING)}</span>'
    state = af.state if af else None
    if state in ("running", "queued"):
        return f'<span class="badge none">{e(state)}</span>'
    if state == "failed":
        return '<span class="badge stop">failed</span>'
    if r is not None and "report.html" in r.reports:
        return '<span class="badge pass">finished</span>'
    return e(state or "–")


def _pilot_cell(r: RunSummary) -> str:
    """The pilot gate's verdict; a stop the reviewer answered by continuing is not a red stop any more."""
    if r.pilot_verdict == "stop" and r.decision and not r.decision.startswith("stopped"):
        return f'<span class="badge warn">stop, answered</span><div class="uri">{e(r.decision)}</div>'
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


def _reports_cell(request: Request, key: str, r: RunSummary) -> str:
    names = list(r.reports)
    if r.deciding_report in names:  # the report that decided first
        names.remove(r.deciding_report)
        names.insert(0, r.deciding_report)
    links = [f'<a href="{e(file_url(request, key, r.run_id, name))}">{e(name)}</a>'
             + (" (decided)" if name == r.deciding_report else "") for name in names]
    if r.has_record:
        links.insert(0, f'<a href="{e(progress_url(request, key, r.run_id))}">progress</a>')
    cell = " · ".join(links)
    if r.problem:
        cell += f' <span class="problem">{e(r.problem)}</span>'
    return cell or "no report yet"


def _row(request: Request, listing: RootListing | None, r: RunSummary | None, af: AirflowRun | None,
         stored: str) -> str:
    run_cell = f'<a href="{e(airflow_run_path(af.run_id))}">{e(stored)}</a>' if af else e(stored)
    if r is None:  # known to Airflow only: nothing written yet, or its root unreadable
        why = (af.root_problem if af and af.root_problem else
               "nothing written yet" + (": its task logs in Airflow say why" if af and af.state == "failed" else ""))
        return (f'<tr><td class="l id">{run_cell}</td><td class="l">{e(_when(None, af) or "–")}</td><td>–</td>'
                f'<td class="l">{_stage_cell(None, af)}</td><td class="l">–</td><td class="l">–</td><td>–</td>'
                f'<td>–</td><td>–</td><td>–</td><td class="l wrap">{e(why)}</td></tr>')
    figures = r.truncation_figures or {}
    at_cap, still = (e(figure(*figures[n])) if n in figures else "–" for n in (AT_CAP, STILL))
    rec = "–" if r.recommended_cap is None else f"{r.recommended_cap:,}"
    return (f'<tr><td class="l id">{run_cell}</td><td class="l">{e(r.created or "–")}</td>'
            f"<td>{e(f'{r.max_tokens:,}' if r.max_tokens is not None else '–')}</td>"
            f'<td class="l">{_stage_cell(r, af)}</td>'
            f'<td class="l">{_pilot_cell(r)}</td>'
            f'<td class="l">{badge(r.final_verdict) if r.final_verdict else _pilot_cell(r)}</td>'
            f"<td>{e(f'{r.rows:,}' if r.rows is not None else '–')}</td><td>{at_cap}</td><td>{still}</td>"
            f"<td>{rec}</td>"
            f'<td class="l wrap">{_reports_cell(request, listing.key, r)}</td></tr>')


def render_index(request: Request, listings: list[RootListing], problems: list[str],
                 airflow: dict[str, AirflowRun]) -> str:
    out = ["<h1>tracegen reports</h1>",
           "<p>Every generation run, newest first: those in the default output root, the roots of the "
           "<code>tracegen_output_roots</code> Variable and the root each <code>tracegen_generate</code> run was "
           "triggered with, and the runs Airflow knows that have written nothing yet. The verdict is the final "
           f"audit's when the run reached it, else the pilot gate's. "
           f"<a href=\"{e(f'/dags/{GENERATE_DAG}')}\">{e(GENERATE_DAG)} in Airflow</a></p>"]
    out.extend(f'<p class="problem">{e(p)}</p>' for p in problems)
    out.append("<h2>Output roots</h2><ul>")
    for listing in listings:
        note = (f'<span class="problem">{e(listing.problem)}</span>' if listing.problem else
                f"{len(listing.runs):,} runs" if listing.runs else
                "No runs yet." + (f' <span class="uri">{e(listing.missing)}</span>' if listing.missing else ""))
        out.append(f'<li><span class="uri">{e(listing.uri)}</span>: {note}</li>')
    out.append("</ul><h2>Runs</h2>")
    lines: list[tuple[str, str]] = []
    listed: set[str] = set()
    for listing in listings:
        for r in listing.runs:
            af = airflow.get(r.run_id)
            listed.add(r.run_id)
            lines.append((_when(r, af), _row(request, listing, r, af, r.run_id)))
    for stored, af in airflow.items():
        if stored not in listed:
            lines.append((_when(None, af), _row(request, None, None, af, stored)))
    lines.sort(key=lambda line: line[0], reverse=True)
    out.append('<table><tr><th class="l">run id</th><th class="l">created</th><th>cap</th>'
               '<th class="l">state</th><th class="l">pilot gate</th><th class="l">verdict</th><th>rows</th>'
               f'<th title="{e(AT_CAP_MEANS)}">{e(AT_CAP)}</th><th title="{e(STILL_MEANS)}">{e(STILL)}</th>'
               '<th>recommended cap</th><th class="l">reports</th></tr>')
    out.extend(line for _, line in lines)
    out.append("</table>")
    return page("tracegen reports", "".join(out))


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
