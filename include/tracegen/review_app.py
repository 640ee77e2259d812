"""The review pages reviewers open from the Airflow UI: every run of every output root, and each run's report.

A FastAPI app that `plugins/tracegen_review.py` mounts into Airflow's api-server under `/tracegen`.
It only reads what `tracegen.run.report.audit_and_report` stored (`runs/<run_id>/{pilot-report,report}.
{json,html}` and `run.json`) through `tracegen.store.storage`, so local and s3:// output roots look the same.

Every route requires an Airflow user allowed to see plugin views and to read the runs of
`tracegen_generate`, the DAG every report belongs to: mounted plugin apps are NOT authenticated by the
api-server, so the app checks both itself with Airflow's own user resolution (bearer token or the UI's
session cookie) and authorization calls.

Output roots are never taken from the request: a page names a root by a short hash of a known root, and
run ids must match the alphabet `tracegen.config.safe_run_id` produces, so no request can reach outside
`runs/`. The known roots are the default output root, the `tracegen_output_roots` Variable's, and the
`output_uri` each `tracegen_generate` run was triggered with (its conf in Airflow's metadata DB), checked
by the config's `Uri` rule. A run's conf only names where its data is: the pages read that root with the
api-server's own connection (never one the conf names) and serve only report files from it.

Stored reports are served under a CSP that forbids scripts, forms, `<base>`, framing by other origins,
and (`sandbox`) gives them an opaque origin, so a report planted in an output root can do nothing on the
Airflow origin. The pages this app renders itself get the same CSP without `sandbox` (the live progress
page refreshes itself with `<meta http-equiv="refresh">`, which a sandbox would block).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import html
import json
import logging
import math
import re
import shlex
import urllib.parse
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import HTTPException
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException

from tracegen.config import RUN_ID_PATTERN, ConfigError, safe_run_id
from tracegen.run import RUN_FILE
from tracegen.run.stage import ASKING, GOING, STOPPED, run_stage

log = logging.getLogger(__name__)

URL_PREFIX = "/tracegen"
# The stored files a page may serve; anything else under runs/<run_id>/ stays private. gate-report is the
# audit a mid-run question of the gate was built from (gate_mode=ask).
REPORT_FILES = ("report.html", "pilot-report.html", "gate-report.html", "report.json", "pilot-report.json",
                "gate-report.json")
MAX_RUNS_PER_ROOT = 200  # newest first; an output root rarely has more, and each run costs two reads
_ROOT_KEY_RE = re.compile(r"[0-9a-f]{12}")
GENERATE_DAG = "tracegen_generate"  # the DAG whose runs write runs/<run_id>/: access to a report is read access to it
MAX_CONF_RUNS = 500  # newest DAG runs whose conf is read for output roots (one indexed query)
PROGRESS_REFRESH_S = 5
# The pages this app renders: inline CSS only, no script, no form, not framed by another origin.
_PAGE_CSP = ("default-src 'none'; style-src 'unsafe-inline'; img-src data:; form-action 'none'; "
             "base-uri 'none'; frame-ancestors 'self'")
# Stored reports are self-contained (inline CSS and SVG, no script), but they are files in an output root
# that anyone who can write there could replace: `sandbox` (no allow-*) gives them an opaque origin and
# blocks forms, scripts and automatic navigation such as a meta refresh, on top of the page rules.
_REPORT_CSP = _PAGE_CSP + "; sandbox"

_bearer = HTTPBearer(auto_error=False)


async def require_airflow_access(
    request: Request,
    bearer: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> None:
    """Airflow's own authentication and authorization for plugin views (401 / 403 otherwise).

    Imported lazily: Airflow loads plugin modules in every task process, and the api-server's
    security module costs seconds to import there for nothing.
    """
    from airflow.api_fastapi.auth.managers.models.resource_details import AccessView
    from airflow.api_fastapi.core_api.security import get_user, requires_access_view

    user = await get_user(request, None, bearer)
    requires_access_view(AccessView.PLUGINS)(request, user)
    request.state.tracegen_user = user


def require_dag_read(request: Request, dag_id: str = GENERATE_DAG) -> None:
    """403 unless the user may read the runs of `dag_id`: plugin access alone must not open every DAG's
    reports (an auth manager may scope DAG access per user or team)."""
    from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity
    from airflow.api_fastapi.core_api.security import requires_access_dag

    requires_access_dag("GET", DagAccessEntity.RUN, param_dag_id=dag_id)(request, request.state.tracegen_user)


def configured_roots() -> list[str]:
    """The default output root, then the roots of the `tracegen_output_roots` Variable, deduplicated."""
    from tracegen import params

    roots = [params.default_params()["output_uri"]]
    roots.extend(params.output_roots())
    return list(dict.fromkeys(r.strip() for r in roots if r and r.strip()))


@dataclass(frozen=True)
class AirflowRun:
    """What Airflow's metadata DB says about one `tracegen_generate` run: its state, the output root its
    conf names (checked by the `Uri` rule; `root_problem` says why it was refused), its conf (for the
    "trigger again" hint) and whether `prepare_run` finished (then it wrote `run.json`)."""

    run_id: str
    state: str | None
    output_uri: str | None
    conf: dict[str, Any]
    prepared: bool = False
    root_problem: str | None = None


def conf_output_root(conf: Any) -> tuple[str | None, str | None]:
    """(root, problem): the output root a run's conf names, validated by RunConfig's rule for the field.
    Only `output_uri` is taken from the conf: never a connection, a fleet or anything else."""
    from tracegen.config import rule_of

    if not isinstance(conf, dict) or "output_uri" not in conf:
        return None, None
    value = conf["output_uri"]
    try:
        rule_of("output_uri").check("output_uri", value)
    except ConfigError as exc:
        return None, f"the run's conf names an output root the review pages refuse: {exc}"
    return value.strip(), None


def airflow_runs(run_id: str | None = None, limit: int = MAX_CONF_RUNS) -> list[AirflowRun]:
    """`tracegen_generate` runs from the metadata DB, newest first (or the one `run_id`)."""
    from airflow.models.dagrun import DagRun
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session
    from sqlalchemy import select

    query = select(DagRun.run_id, DagRun.state, DagRun.conf).where(DagRun.dag_id == GENERATE_DAG)
    query = query.where(DagRun.run_id == run_id) if run_id is not None else query.order_by(DagRun.id.desc())
    with create_session() as session:
        rows = session.execute(query.limit(limit)).all()
        prepared = set(session.scalars(select(TaskInstance.run_id).where(
            TaskInstance.dag_id == GENERATE_DAG, TaskInstance.task_id == "prepare_run",
            TaskInstance.state == "success", TaskInstance.run_id.in_([r.run_id for r in rows]))))
    out = []
    for r in rows:
        conf = r.conf if isinstance(r.conf, dict) else {}
        uri, problem = conf_output_root(conf)
        out.append(AirflowRun(r.run_id, None if r.state is None else str(r.state), uri, conf,
                              r.run_id in prepared, problem))
    return out


def root_key(uri: str) -> str:
    """A stable, opaque name for an output root in URLs (the URI itself never comes from a request)."""
    return hashlib.sha256(uri.encode()).hexdigest()[:12]


def report_file_path(output_uri: str, run_id: str, name: str) -> str:
    """The path (under the api-server's root) of the page serving one of a run's report files."""
    return f"{URL_PREFIX}/roots/{root_key(output_uri)}/runs/{run_id}/{name}"


def check_run_id(run_id: str) -> str:
    """A stored (sanitised) run id, or a 404 saying what a run id looks like."""
    if not RUN_ID_PATTERN.fullmatch(run_id or ""):
        raise HTTPException(
            404, f"invalid run id {run_id!r}: stored run ids use only letters, digits, '.', '_' and '-'"
        )
    return run_id




@dataclass(frozen=True)
class RunSummary:
    """One line of the run list, read from a run's stored files (never from the ledger's rows)."""

    run_id: str
    created: str | None
    max_tokens: int | None
    pilot_verdict: str | None
    final_verdict: str | None
    rows: int | None
    truncation_rate: float | None
    reports: tuple[str, ...]
    problem: str | None = None
    stage: str | None = None  # STOPPED, ASKING, or None (running or finished: Airflow's state says which)
    deciding_report: str | None = None  # the report whose verdict stopped the run or asked the question
    recommended_cap: int | None = None

    @property
    def verdict(self) -> str | None:
        return self.final_verdict or self.pilot_verdict


@dataclass(frozen=True)
class RootListing:
    key: str
    uri: str
    runs: tuple[RunSummary, ...]
    problem: str | None = None
    missing: str | None = None  # why the root holds no runs when it does not exist (nothing is created)


def _created(run_doc: dict[str, Any] | None, report: dict[str, Any] | None) -> str | None:
    ts = (run_doc or {}).get("created_at")
    if isinstance(ts, int | float) and math.isfinite(ts):
        return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    generated = (report or {}).get("generated_at")
    return generated if isinstance(generated, str) else None


class StoredFileError(ValueError):
    """A run's stored JSON file does not parse, or is not an object: a page that needs it says so (422)."""


def _get_json(ledger: Any, run_id: str, name: str) -> dict[str, Any] | None:
    from tracegen.store.storage import StorageKeyError

    try:
        doc = json.loads(ledger.get_run_file(run_id, name))
    except StorageKeyError:
        return None
    except ValueError as exc:
        raise StoredFileError(f"{name} is not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise StoredFileError(f"{name} is not a JSON object")
    return doc


def gate_stage(run_doc: dict[str, Any] | None, pilot: dict[str, Any] | None,
               present: set[str]) -> tuple[str | None, str | None]:
    """(stage, the report that decided it) from the stored files by `run.records.run_stage`, the rule every
    reader uses; the stage is None while no gate holds the run."""
    decisions = [d for d in (run_doc or {}).get("decisions") or [] if isinstance(d, dict)]
    last = decisions[-1] if decisions else None
    pilot_says = ((pilot or {}).get("verdict") or {}).get("verdict")
    mode = (((run_doc or {}).get("config")) or {}).get("gate_mode")
    asked = "question.json" in present
    stage = run_stage(gate_mode=mode if isinstance(mode, str) else None, pilot_verdict=pilot_says,
                      question_asked=asked, last_decision_continues=None if last is None else last.get("cap") is not None)
    if stage == GOING:
        return None, None
    if last is not None:
        name = {"pilot": "pilot-report.html", "drift": "gate-report.html"}.get(last.get("trigger"), "pilot-report.html")
    elif asked and pilot_says != "stop" and "gate-report.html" in present:
        name = "gate-report.html"
    else:
        name = "pilot-report.html"
    return stage, name if name in present else None


def summarise_run(ledger: Any, run_id: str, present: set[str]) -> RunSummary:
    """Summary of one run; an unreadable file becomes `problem` on its line, not a failed page."""
    reports = tuple(name for name in REPORT_FILES if name in present)
    try:
        run_doc = _get_json(ledger, run_id, RUN_FILE) if RUN_FILE in present else None
        pilot = _get_json(ledger, run_id, "pilot-report.json") if "pilot-report.json" in present else None
        final = _get_json(ledger, run_id, "report.json") if "report.json" in present else None
    except ValueError as exc:
        return RunSummary(run_id, None, None, None, None, None, None, reports, problem=str(exc))
    shown = final or pilot or {}
    audit = shown.get("audit") or {}
    config = (run_doc or {}).get("config") or (shown.get("run") or {}).get("config") or {}
    rate = (audit.get("truncation") or {}).get("rate")
    rows = (audit.get("rows") or {}).get("current_rows")
    stage, deciding = gate_stage(run_doc, pilot, present)
    # A run held at its gate goes on at the cap of the report that decided; a finished one at its final's.
    decided_by = (pilot if deciding == "pilot-report.html" else None) or shown
    rec = (decided_by.get("cap_table") or {}).get("recommended_cap")
    return RunSummary(
        run_id=run_id,
        created=_created(run_doc, shown),
        max_tokens=config.get("max_tokens") if isinstance(config.get("max_tokens"), int) else None,
        pilot_verdict=((pilot or {}).get("verdict") or {}).get("verdict"),
        final_verdict=((final or {}).get("verdict") or {}).get("verdict"),
        rows=rows if isinstance(rows, int) else None,
        truncation_rate=float(rate) if isinstance(rate, int | float) else None,
        reports=reports,
        stage=stage,
        deciding_report=deciding,
        recommended_cap=rec if isinstance(rec, int) else None,
    )


def list_root(uri: str, limit: int = MAX_RUNS_PER_ROOT) -> RootListing:
    """Runs of one output root, newest first. A root that cannot be read says why instead of failing."""
    from tracegen.store.ledger import RUNS_DIR, Ledger
    from tracegen.store.storage import StorageRootError, open_storage

    key = root_key(uri)
    try:
        try:
            # Read-only: a root that does not exist is listed as such, never created.
            ledger = Ledger(open_storage(uri, must_exist=True))
        except StorageRootError as exc:
            return RootListing(key, uri, (), missing=str(exc))
        files: dict[str, set[str]] = {}
        for k in ledger.storage.list(RUNS_DIR):
            parts = k.split("/")
            if len(parts) == 3 and RUN_ID_PATTERN.fullmatch(parts[1]):
                files.setdefault(parts[1], set()).add(parts[2])
        runs = [summarise_run(ledger, run_id, names) for run_id, names in files.items()]
    except Exception as exc:  # any storage or config failure: show it on the page, keep other roots
        log.warning("output root %s: %s", uri, exc)
        return RootListing(key, uri, (), problem=f"cannot read this output root: {exc}")
    runs.sort(key=lambda r: (r.created or "", r.run_id), reverse=True)
    return RootListing(key, uri, tuple(runs[:limit]))


# ---- HTML ---------------------------------------------------------------------------------------

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;color:#1f2328;background:#fff}
main{padding:16px 24px;max-width:1200px}
h1{font-size:20px;margin:4px 0 12px} h2{font-size:16px;margin:22px 0 6px}
.uri{font-family:ui-monospace,monospace;font-size:12px;color:#57606a;word-break:break-all}
table{border-collapse:collapse;width:100%;margin-top:6px}
th,td{border-bottom:1px solid #d0d7de;padding:5px 8px;text-align:right;white-space:nowrap}
th{background:#f6f8fa;font-weight:600} td.l,th.l{text-align:left}
td.id{font-family:ui-monospace,monospace;font-size:12px}
.badge{display:inline-block;padding:1px 8px;border-radius:10px;font-weight:600;font-size:12px}
.pass{background:#dafbe1;color:#116329} .stop{background:#ffebe9;color:#a40e26}
.warn{background:#fff8c5;color:#7d4e00} .none{background:#eaeef2;color:#57606a}
.problem{color:#a40e26} a{color:#0969da} td.wrap{white-space:normal;max-width:420px}
"""
_NAV_CSS = ("position:sticky;top:0;z-index:10;background:#f6f8fa;border-bottom:1px solid #d0d7de;"
            "padding:6px 24px;font:13px system-ui,sans-serif")
_STATUS_CSS = "margin:6px 0 2px;padding:6px 10px;border-radius:6px;background:"


def _e(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def _badge(verdict: str | None) -> str:
    cls = verdict if verdict in ("pass", "stop", "warn") else "none"
    return f'<span class="badge {cls}">{_e(verdict or "–")}</span>'


def _page(title: str, body: str, head: str = "") -> str:
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title>{head}'
            f"<style>{_CSS}</style></head><body><main>{body}</main></body></html>")


def _file_url(request: Request, key: str, run_id: str, name: str) -> str:
    return request.url_for("report_file", root=key, run_id=run_id, name=name).path


def _stage_cell(r: RunSummary, af: AirflowRun | None) -> str:
    """What the run is doing, in the words an operator looks for: the gate's stop is not a crash."""
    if r.stage == STOPPED:
        return f'<span class="badge stop">{_e(STOPPED)}</span>'
    if r.stage == ASKING:
        return f'<span class="badge warn">{_e(ASKING)}</span>'
    state = af.state if af else None
    if state in ("running", "queued"):
        return f'<span class="badge none">{_e(state)}</span>'
    if state == "failed":
        return '<span class="badge stop">failed</span>'
    if "report.html" in r.reports:
        return '<span class="badge pass">finished</span>'
    return _e(state or "–")


def render_index(request: Request, listings: list[RootListing], problems: list[str],
                 airflow: dict[str, AirflowRun] | None = None) -> str:
    airflow = airflow or {}
    out = ["<h1>tracegen reports</h1>",
           "<p>Every generation run of each output root, newest first: the default output root, the roots of "
           "the <code>tracegen_output_roots</code> Variable, and the root each <code>tracegen_generate</code> run "
           "was triggered with. The verdict is the final audit's when the run reached it, else the pilot "
           f"gate's. <a href=\"{_e(f'/dags/{GENERATE_DAG}')}\">{_e(GENERATE_DAG)} in Airflow</a></p>"]
    out.extend(f'<p class="problem">{_e(p)}</p>' for p in problems)
    for listing in listings:
        out.append(f'<h2>Output root</h2><div class="uri">{_e(listing.uri)}</div>')
        if listing.problem:
            out.append(f'<p class="problem">{_e(listing.problem)}</p>')
            continue
        if not listing.runs:
            out.append("<p>No runs yet.</p>")
            if listing.missing:
                out.append(f'<p class="uri">{_e(listing.missing)}</p>')
            continue
        out.append('<table><tr><th class="l">run id</th><th class="l">created</th><th>cap</th>'
                   '<th class="l">state</th><th class="l">pilot gate</th><th class="l">verdict</th><th>rows</th>'
                   '<th>truncated</th><th>recommended cap</th><th class="l">reports</th></tr>')
        for r in listing.runs:
            af = airflow.get(r.run_id)
            names = list(r.reports)
            if r.deciding_report in names:  # the report that decided first
                names.remove(r.deciding_report)
                names.insert(0, r.deciding_report)
            links = [f'<a href="{_e(_file_url(request, listing.key, r.run_id, name))}">{_e(name)}</a>'
                     + (" (decided)" if name == r.deciding_report else "") for name in names]
            if RUN_FILE in _present_hint(r):
                links.insert(0, f'<a href="{_e(_progress_url(request, listing.key, r.run_id))}">progress</a>')
            cell = " · ".join(links)
            if r.problem:
                cell += f' <span class="problem">{_e(r.problem)}</span>'
            rate = "–" if r.truncation_rate is None else f"{100 * r.truncation_rate:.1f}%"
            rec = "–" if r.recommended_cap is None else f"{r.recommended_cap:,}"
            # Back to Airflow: the run's own page, when the metadata DB still has it.
            run_cell = (f'<a href="{_e(airflow_run_path(af.run_id))}">{_e(r.run_id)}</a>' if af else _e(r.run_id))
            out.append(
                f'<tr><td class="l id">{run_cell}</td><td class="l">{_e(r.created or "–")}</td>'
                f"<td>{_e(f'{r.max_tokens:,}' if r.max_tokens is not None else '–')}</td>"
                f'<td class="l">{_stage_cell(r, af)}</td>'
                f'<td class="l">{_badge(r.pilot_verdict)}</td><td class="l">{_badge(r.verdict)}</td>'
                f"<td>{_e(f'{r.rows:,}' if r.rows is not None else '–')}</td><td>{rate}</td><td>{rec}</td>"
                f'<td class="l wrap">{cell or "no report yet"}</td></tr>'
            )
        out.append("</table>")
    return _page("tracegen reports", "".join(out))


def _present_hint(r: RunSummary) -> set[str]:
    # A run listed with a created time has its record (run.json): it can show progress.
    return {RUN_FILE} if r.created or r.max_tokens is not None else set()


def _progress_url(request: Request, key: str, run_id: str) -> str:
    return request.url_for("run_progress", root=key, run_id=run_id).path


def with_nav(report_html: str, nav: str, status: str = "") -> str:
    """The stored report with a small navigation bar at the top and, under it, the run's state and next
    step (the report itself stays untouched)."""
    bar = f'<nav style="{_NAV_CSS}">{nav}</nav>' + (f'<div style="padding:0 24px">{status}</div>' if status else "")
    match = re.search(r"<body[^>]*>", report_html, flags=re.IGNORECASE)
    if match is None:
        return bar + report_html
    return report_html[: match.end()] + bar + report_html[match.end():]


def _nav_for(request: Request, key: str, run_id: str, present: set[str], current: str) -> str:
    links = [f'<a href="{_e(request.url_for("index").path)}">all runs</a>', f"<b>{_e(run_id)}</b>"]
    if RUN_FILE in present:
        links.append(f'<a href="{_e(_progress_url(request, key, run_id))}">progress</a>')
    for name in REPORT_FILES:
        if name in present and name != current:
            links.append(f'<a href="{_e(_file_url(request, key, run_id, name))}">{_e(name)}</a>')
    return " · ".join(links)


RAISE_CAP_DAG = "tracegen_raise_cap"


def airflow_run_path(airflow_run_id: str) -> str:
    """The run's page in the Airflow UI."""
    return f"/dags/{GENERATE_DAG}/runs/{urllib.parse.quote(airflow_run_id, safe='')}"


def required_actions_path(airflow_run_id: str) -> str:
    """The Airflow UI page where the run's open question is answered."""
    return f"/dags/{GENERATE_DAG}/runs/{urllib.parse.quote(airflow_run_id, safe='')}/tasks/review_cap/required_actions"


def retrigger_conf(conf: dict[str, Any], cap: int) -> dict[str, Any]:
    """The settings a stopped run was triggered with, at the recommended cap: what its next run takes."""
    return {**{k: v for k, v in conf.items() if not str(k).startswith("_")}, "max_tokens": cap}


def next_step_html(summary: RunSummary, shown: str, *, root_uri: str, airflow_run_id: str | None,
                   conf: dict[str, Any] | None, truncated_left: int | None) -> str:
    """The line above a report saying what the run's state is and what to do next, one click or one
    command away: the question to answer, the run to trigger at the recommended cap, or the export."""
    if summary.stage == ASKING:
        link = (f'<a href="{_e(required_actions_path(airflow_run_id))}">answer the question in Required Actions</a>'
                if airflow_run_id else "answer it under Browse → Required Actions")
        return (f'<div style="{_STATUS_CSS}#fff8c5"><b>Waiting for the reviewer\'s answer.</b> This is the report '
                f"the question was built from ({_e(shown)}): {link}.</div>")
    if summary.stage == STOPPED:
        text = (f'<div style="{_STATUS_CSS}#ffebe9"><b>Stopped by the gate.</b> This is the report that decided '
                f"({_e(shown)}); the run ended without generating past the gate. ")
        cap = summary.recommended_cap
        if cap is not None and (summary.max_tokens is None or cap > summary.max_tokens):
            settings = json.dumps(retrigger_conf(conf or {}, cap), sort_keys=True)
            text += (f'Next: trigger <a href="{_e(f"/dags/{GENERATE_DAG}")}">{GENERATE_DAG}</a> again at the '
                     f"recommended cap, <b>max_tokens={cap:,}</b>, with the same settings (paste into the trigger "
                     f"form's JSON conf): <code>{_e(settings)}</code>. Rows already finished are kept.")
        else:
            text += "The cap table recommends no higher cap that meets the threshold: see its notes."
        return text + "</div>"
    if shown == "report.html":
        command = f"python -m tracegen export {shlex.quote(root_uri)} EXPORT_DIR"
        left = ""
        if truncated_left:
            left = (f" {truncated_left:,} rows are still truncated: the export leaves them out (add "
                    "<code>--include-truncated</code> to keep them), or trigger again at a higher cap to finish "
                    "them from their tokens.")
        return (f'<div style="{_STATUS_CSS}#dafbe1"><b>Finished.</b> Next: export the dataset: '
                f"<code>{_e(command)}</code>.{left}</div>")
    return ""


# ---- the progress page ------------------------------------------------------------------------------


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def render_progress(request: Request, key: str, run_id: str, progress: dict[str, Any], present: set[str],
                    live: bool, state: str | None) -> str:
    p = progress
    pct = 100 * p["done"] / p["total"] if p["total"] else 100.0
    rate = "–" if p["truncation_rate"] is None else f"{100 * p['truncation_rate']:.1f}%"
    interval = ("–" if p["truncation_low"] is None
                else f"{100 * p['truncation_low']:.1f}%–{100 * p['truncation_high']:.1f}%")
    window = f"over the last {p['window_s'] / 60:.0f} min"
    rows = [
        ("done", f"{p['done']:,} of {p['total']:,} dataset rows ({pct:.1f}%) at max_tokens={p['max_tokens']:,}; "
                 f"{p['left']:,} left"),
        ("rows/s", "idle: nothing committed " + window if p["rows_per_s"] is None
         else f"{p['rows_per_s']:,.2f} {window}"),
        ("tokens/s", "–" if p["tokens_per_s"] is None else f"{p['tokens_per_s']:,.0f} completion tokens/s {window}"),
        ("truncated so far", f"{rate} ({p['truncated']:,} of the {p['completed_by_run']:,} rows this run completed "
                             f"at its cap); 95% interval {interval}; threshold {100 * p['threshold']:.1f}%"),
        ("ETA", "done" if p["left"] == 0 else _duration(p["eta_s"]) + (" at the current rate" if p["eta_s"] else "")),
    ]
    table = "".join(f'<tr><th class="l">{_e(k)}</th><td class="l" id="progress-{_e(k.split()[0].replace("/", "-"))}">'
                    f"{_e(v)}</td></tr>" for k, v in rows)
    if live and p.get("airflow_run_id"):
        # The mid-run pivot: the same run goes on at a higher cap, nothing is stopped (tracegen.run.cap_raise).
        table += (f'<tr><th class="l">raise the cap</th><td class="l" id="progress-raise">without stopping the run: '
                  f'trigger <a href="{_e(f"/dags/{RAISE_CAP_DAG}")}">{RAISE_CAP_DAG}</a> with run_id '
                  f"<code>{_e(p['airflow_run_id'])}</code> and the new max_tokens (above {p['max_tokens']:,}); "
                  "chunks starting after it use the new cap, rows already truncated are extended to it.</td></tr>")
    links = _nav_for(request, key, run_id, present, current="progress")
    refresh = (f'<p class="uri">Refreshes every {PROGRESS_REFRESH_S} s while the run is {state or "running"}.</p>'
               if live else f'<p class="uri">Not refreshing: the run is {_e(state or "not running")}.</p>')
    body = f"<p>{links}</p><h1>Progress of run {_e(run_id)}</h1><table>{table}</table>{refresh}"
    head = f'<meta http-equiv="refresh" content="{PROGRESS_REFRESH_S}">' if live else ""
    return _page(f"progress {run_id}", body, head=head)


# ---- the app ------------------------------------------------------------------------------------


def _wants_html(request: Request) -> bool:
    return "text/html" in request.headers.get("accept", "") and not request.url.path.endswith(".json")


def _html(body: str, status_code: int = 200, headers: dict[str, str] | None = None) -> HTMLResponse:
    return HTMLResponse(body, status_code, headers={**(headers or {}), "Content-Security-Policy": _PAGE_CSP,
                                                    "X-Content-Type-Options": "nosniff"})


def create_app(roots: Callable[[], list[str]] = configured_roots,
               runs: Callable[..., list[AirflowRun]] = airflow_runs) -> FastAPI:
    """The review app; `roots` lists the configured output roots, `runs` reads `tracegen_generate` runs
    from Airflow's metadata DB (their state and the output roots their conf names)."""
    app = FastAPI(
        title="tracegen reports",
        lifespan=_warm_imports,
        dependencies=[Depends(require_airflow_access)],
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )

    def known_runs(run_id: str | None = None) -> tuple[list[AirflowRun], list[str]]:
        try:
            return runs(run_id) if run_id is not None else runs(), []
        except Exception as exc:  # the metadata DB is the api-server's; if it fails, the configured roots remain
            log.warning("tracegen runs from the metadata DB: %s", exc)
            return [], [f"cannot read {GENERATE_DAG}'s runs from Airflow's metadata DB: {exc}"]

    def resolve_roots(extra: list[str] = ()) -> tuple[dict[str, str], list[str]]:
        problems: list[str] = []
        try:
            uris = list(roots())
        except Exception as exc:  # e.g. a malformed Variable: say so, still show the default root
            log.warning("output roots: %s", exc)
            from tracegen import params

            uris, problems = [params.default_params()["output_uri"]], [str(exc)]
        found, run_problems = known_runs()
        uris.extend(r.output_uri for r in found if r.output_uri)
        uris.extend(extra)
        return {root_key(u): u for u in dict.fromkeys(uris)}, problems + run_problems

    def open_root(key: str, by_key: dict[str, str] | None = None):
        from tracegen.store.ledger import Ledger
        from tracegen.store.storage import open_storage

        if not _ROOT_KEY_RE.fullmatch(key):
            raise HTTPException(404, f"invalid output root key {key!r}")
        uri = (by_key if by_key is not None else resolve_roots()[0]).get(key)
        if uri is None:
            raise HTTPException(404, f"no known output root has key {key!r}; open the run list again")
        return Ledger(open_storage(uri)), uri

    def run_files(ledger: Any, run_id: str) -> set[str]:
        return {k.rsplit("/", 1)[1] for k in ledger.storage.list(f"runs/{run_id}/")}

    def airflow_run_for(stored: str) -> AirflowRun | None:
        """The Airflow run stored as `stored` (Airflow's ids carry ':' and '+', storage has them replaced)."""
        for r in known_runs()[0]:
            try:
                if safe_run_id(r.run_id) == stored:
                    return r
            except ConfigError:
                continue
        return None

    @app.exception_handler(StoredFileError)
    async def stored_file_error(request: Request, exc: StoredFileError) -> Response:
        # A run's stored JSON that a page needs does not parse: say which file and what is wrong (escaped by
        # the error page), not a 500.
        run_id = request.path_params.get("run_id", "?")
        detail = f"run {run_id!r}: {exc}; the page cannot be shown until the audit writes the file again"
        return await http_error(request, HTTPException(422, detail))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        # A person in a browser who is not logged in goes to Airflow's login page and comes back.
        if exc.status_code == 401 and _wants_html(request):
            from airflow.api_fastapi.app import get_auth_manager

            return RedirectResponse(get_auth_manager().get_url_login(next_url=str(request.url)), 303)
        if _wants_html(request):
            body = _page(f"{exc.status_code}", f"<h1>{exc.status_code}</h1><p>{_e(exc.detail)}</p>"
                         f'<p><a href="{_e(URL_PREFIX)}/">all tracegen runs</a></p>')
            return _html(body, exc.status_code, headers=getattr(exc, "headers", None))
        return JSONResponse({"detail": exc.detail}, exc.status_code, headers=getattr(exc, "headers", None))

    @app.get("/", response_class=HTMLResponse, name="index")
    def index(request: Request) -> HTMLResponse:
        require_dag_read(request)
        by_key, problems = resolve_roots()
        listings = [list_root(uri) for uri in by_key.values()]
        airflow = {}
        for r in known_runs()[0]:
            try:
                airflow[safe_run_id(r.run_id)] = r
            except ConfigError:
                continue
        return _html(render_index(request, listings, problems, airflow))

    @app.get("/runs.json", name="runs_json")
    def runs_json(request: Request) -> dict[str, Any]:
        require_dag_read(request)
        by_key, problems = resolve_roots()
        roots_out = []
        for uri in by_key.values():
            listing = list_root(uri)
            roots_out.append({"key": listing.key, "uri": listing.uri, "problem": listing.problem,
                              "missing": listing.missing,
                              "runs": [asdict(r) | {"verdict": r.verdict} for r in listing.runs]})
        return {"roots": roots_out, "problems": problems}

    def progress_of(request: Request, root: str, run_id: str) -> tuple[dict[str, Any], set[str], bool, str | None]:
        from tracegen.run.records import read_run_record
        from tracegen.run.spec import RunSpecError
        from tracegen.status import run_progress
        from tracegen.store.storage import StorageError, StorageKeyError

        require_dag_read(request)
        check_run_id(run_id)
        ledger, uri = open_root(root)
        try:
            record = read_run_record(ledger, run_id)
            present = run_files(ledger, run_id)
            progress = run_progress(ledger, record)
        except StorageKeyError:
            raise HTTPException(404, f"run {run_id!r} has no run record in {uri}: no progress to show") from None
        except (StorageError, RunSpecError) as exc:
            raise HTTPException(503, f"cannot read the progress of run {run_id!r}: {exc}") from None
        af = airflow_run_for(run_id)
        state = af.state if af else None
        stage, _ = gate_stage(_get_json(ledger, run_id, RUN_FILE), _get_json(ledger, run_id, "pilot-report.json")
                              if "pilot-report.json" in present else None, present)
        live = state in ("running", "queued") and stage is None and progress["left"] > 0
        return (progress | {"state": stage or state, "live": live, "airflow_run_id": af.run_id if af else None},
                present, live, stage or state)

    @app.get("/roots/{root}/runs/{run_id}/progress.json", name="run_progress_json")
    def run_progress_json(request: Request, root: str, run_id: str) -> dict[str, Any]:
        return progress_of(request, root, run_id)[0]

    @app.get("/roots/{root}/runs/{run_id}/progress", name="run_progress")
    def run_progress_page(request: Request, root: str, run_id: str) -> HTMLResponse:
        progress, present, live, state = progress_of(request, root, run_id)
        return _html(render_progress(request, root, run_id, progress, present, live, state))

    @app.get("/roots/{root}/runs/{run_id}/{name}", name="report_file")
    def report_file(request: Request, root: str, run_id: str, name: str) -> Response:
        from tracegen.store.storage import StorageError, StorageKeyError, StorageLinkError

        require_dag_read(request)
        check_run_id(run_id)
        if name not in REPORT_FILES:
            raise HTTPException(404, f"no such report file {name!r}; a run has {', '.join(REPORT_FILES)}")
        ledger, uri = open_root(root)
        try:
            data = ledger.get_run_file(run_id, name)
            present = run_files(ledger, run_id)
        except StorageLinkError as exc:
            # A link planted in the output root is data, never followed (tracegen.store.storage).
            raise HTTPException(404, f"run {run_id!r} has no {name} the pages can serve: {exc}") from None
        except StorageKeyError:
            raise HTTPException(404, f"run {run_id!r} has no {name} in {ledger.storage.uri}") from None
        except StorageError as exc:
            raise HTTPException(503, f"cannot read {name} of run {run_id!r}: {exc}") from None
        if name.endswith(".json"):
            return _serve(request, root, run_id, name, data, present)
        summary = summarise_run(ledger, run_id, present)
        af = airflow_run_for(run_id)
        return _serve(request, root, run_id, name, data, present,
                      status=_status_for(ledger, summary, name, uri, af, None))

    def _status_for(ledger: Any, summary: RunSummary, shown: str, uri: str, af: AirflowRun | None,
                    raw_run_id: str | None) -> str:
        left = None
        if shown == "report.html":
            final = _get_json(ledger, summary.run_id, "report.json") or {}
            left = ((final.get("audit") or {}).get("truncation") or {}).get("truncated")
        return next_step_html(summary, shown, root_uri=uri, airflow_run_id=af.run_id if af else raw_run_id,
                              conf=af.conf if af else None, truncated_left=left if isinstance(left, int) else None)

    @app.get("/runs/{run_id}", name="run_report")
    def run_report(request: Request, run_id: str, dag_id: str | None = None) -> Response:
        """The Airflow DAG run's tab: the report that decided when the gate stopped it or asks about it,
        the final report once written, live progress while it runs, else the pilot's; found in the root its
        conf names first, then in the configured roots. When nothing is there, says why truthfully."""
        from tracegen.store.storage import StorageError

        require_dag_read(request)
        try:
            stored = safe_run_id(run_id)  # Airflow run ids carry ':' and '+'; storage has them replaced
        except ConfigError:
            stored = ""
        check_run_id(stored)
        found, _ = known_runs(run_id)
        af = found[0] if found else airflow_run_for(stored)
        by_key, _problems = resolve_roots()
        order = list(by_key)
        if af is not None and af.output_uri:
            own = root_key(af.output_uri)
            order = [own] + [k for k in order if k != own]
        for key in order:
            ledger, uri = open_root(key, by_key)
            try:
                present = run_files(ledger, stored)
                if not present:
                    continue
                summary = summarise_run(ledger, stored, present)
                running = af is not None and af.state in ("running", "queued")
                if summary.stage is not None and summary.deciding_report:
                    name = summary.deciding_report
                elif "report.html" in present:
                    name = "report.html"
                elif running and RUN_FILE in present:
                    return RedirectResponse(_progress_url(request, key, stored), 303)
                elif "pilot-report.html" in present:
                    name = "pilot-report.html"
                else:
                    continue
                return _serve(request, key, stored, name, ledger.get_run_file(stored, name), present,
                              status=_status_for(ledger, summary, name, uri, af, run_id))
            except StorageError as exc:
                log.warning("run %s in %s: %s", stored, ledger.storage.uri, exc)
        raise HTTPException(404, _missing_run_message(run_id, stored, dag_id, af, len(by_key)))

    def _serve(request: Request, key: str, run_id: str, name: str, data: bytes, present: set[str],
               status: str = "") -> Response:
        if name.endswith(".json"):
            return Response(data, media_type="application/json")
        page = with_nav(data.decode("utf-8", errors="replace"), _nav_for(request, key, run_id, present, name), status)
        return HTMLResponse(page, headers={"Content-Security-Policy": _REPORT_CSP,
                                           "X-Content-Type-Options": "nosniff"})

    @app.get("/{path:path}", include_in_schema=False)
    def not_a_page(path: str) -> None:
        # Starlette decodes %2F before routing, so "../" tricks end here, with a message instead of a bare 404.
        raise HTTPException(404, f"no tracegen page at {path!r}; the run list is at {URL_PREFIX}/")

    return app


def _missing_run_message(run_id: str, stored: str, dag_id: str | None, af: AirflowRun | None, n_roots: int) -> str:
    """Why a run has no report to show, told from what Airflow knows about it: its output root refused,
    its output gone (prepare_run wrote its record there, and it is not there any more), or a run that
    never reached the pilot audit."""
    where = f" of DAG {dag_id!r}" if dag_id else ""
    if af is not None and af.root_problem:
        return f"no tracegen report for run {run_id!r}{where}: {af.root_problem}"
    if af is not None and af.prepared:
        root = af.output_uri or "the default output root"
        return (f"the output of run {run_id!r}{where} is gone: its first task wrote the run's record to {root} "
                f"(runs/{stored}/), and nothing of the run is there any more: that output root was deleted, "
                "moved or replaced since (`make demo` starts each demo in a new output root and says where "
                "earlier ones went). The run's task logs are still in Airflow.")
    state = f" (Airflow state: {af.state})" if af is not None and af.state else ""
    return (f"no tracegen report for run {run_id!r}{where} (stored as {stored!r}) in {n_roots} output root(s)"
            f"{state}. Reports exist for tracegen_generate runs that reached the pilot audit; a run that failed "
            "before it has none.")


@asynccontextmanager
async def _warm_imports(app: FastAPI) -> AsyncIterator[None]:
    """Import the storage readers (pandas) when the api-server starts, not on a reviewer's first click."""
    import tracegen.store.ledger  # noqa: F401

    yield


# The `external_views` the plugin registers: a menu entry, and a tab on every DAG run showing its report.
# The menu entry has no `url_route` on purpose: it opens the run list as a page of its own, because the
# UI's sandboxed iframe does not send the session cookie when a link inside it is followed.
EXTERNAL_VIEWS = [
    {
        "name": "tracegen reports",
        "href": f"{URL_PREFIX}/",
        "destination": "nav",
        "category": "browse",
    },
    {
        "name": "tracegen report",
        "href": f"{URL_PREFIX}/runs/{{RUN_ID}}?dag_id={{DAG_ID}}",
        "destination": "dag_run",
        "url_route": "tracegen-run-report",
    },
]
