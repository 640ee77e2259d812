"""A run's live progress (`status.run_progress` from the ledger) and its history (`audit.timeline`, drawn by
`audit.charts`), refreshing itself while the run generates. Both come from one read of the ledger."""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import HTTPException
from fastapi.responses import HTMLResponse
from markupsafe import Markup

from tracegen.audit.figures import AT_CAP, AT_CAP_MEANS, STILL, STILL_MEANS, figure
from tracegen.review.access import RAISE_CAP_DAG, require_dag_read
from tracegen.review.page import duration, html_response, nav_for, render_page
from tracegen.review.read_model import RunView, read_run
from tracegen.review.roots import Site, check_run_id

PROGRESS_REFRESH_S = 5
LIVE_STATES = ("running", "queued")


def cap_decided(view: RunView) -> bool:
    """The run has decided its cap (a question asked or answered, or a raise taken): a raise is refused."""
    return view.asked or bool(view.decisions) or view.stage_and_decider[0] is not None


def progress_of(request: Request, site: Site, root: str, run_id: str) -> tuple[dict[str, Any], RunView]:
    from tracegen.run.run_record import read_run_record
    from tracegen.run.run_spec import RunSpecError
    from tracegen.store.storage import StorageError, StorageKeyError

    require_dag_read(request)
    check_run_id(run_id)
    output_root, uri = site.open_root(root)
    try:
        record = read_run_record(output_root, run_id)
        view = read_run(output_root, run_id)
        af = site.airflow_run_for(run_id, record.airflow_run_id)
        progress = read_progress(output_root, record, view, af.state if af else None)
    except StorageKeyError:
        raise HTTPException(404, f"run {run_id!r} has no run record in {uri}: no progress to show") from None
    except (StorageError, RunSpecError) as exc:
        raise HTTPException(503, f"cannot read the progress of run {run_id!r}: {exc}") from None
    return progress | {"airflow_run_id": af.run_id if af else None}, view


def read_progress(output_root: Any, record: Any, view: RunView, state: str | None) -> dict[str, Any]:
    """The run's progress and timeline from one read of the ledger; `state` is Airflow's for the run."""
    from tracegen.audit.timeline import run_timeline
    from tracegen.status import STATUS_COLUMNS, run_progress
    from tracegen.store.ledger_rows import ledger_rows

    frame = ledger_rows(output_root, STATUS_COLUMNS)
    now = time.time()
    progress = run_progress(output_root, record, now=now, frame=frame)
    stage = view.stage_and_decider[0]
    live = state in LIVE_STATES and stage is None and progress["left"] > 0
    if not live and progress["left"]:
        progress["eta_s"] = progress["eta_range_s"] = None  # a run that is not generating has no time of arrival
    timeline = run_timeline(frame, record.run_id, record.config.max_tokens, now=now if live else None)
    return progress | {"state": stage or state, "live": live, "raise_allowed": live and not cap_decided(view),
                       "timeline": timeline}


def _eta(p: dict[str, Any]) -> str:
    if p["left"] == 0:
        return "done"
    if not p["live"]:
        return f"none: the run is {p['state'] or 'not running'}"
    if not p["eta_s"]:
        return duration(p["eta_s"])
    text = duration(p["eta_s"]) + " at the current rate"
    if p.get("eta_range_s"):
        from tracegen.status import SPREAD_SLICES

        fast, slow = p["eta_range_s"]
        slowest = "more (a slice committed nothing)" if slow is None else duration(slow)
        text += (f"; {duration(fast)} to {slowest} at the fastest and the slowest "
                 f"{p['window_s'] / 60 / SPREAD_SLICES:.0f}-min rate of the window")
    return text


def _slug(name: str) -> str:
    return name.replace("/", "-").replace(" ", "-")


def live_charts(p: dict[str, Any]) -> list[tuple[str, str, Markup]]:
    """The run over its time, from `p["timeline"]`: (id, heading, chart) each."""
    from tracegen.audit import charts

    t = p["timeline"]
    return [
        ("rows", "rows/s", charts.time_series(t, [("rows_per_s", "rows/s", "#2e8b57")], "rows per second")),
        ("tokens", "completion tokens/s",
         charts.time_series(t, [("tokens_per_s", "tokens/s", "#4a7bd0")], "completion tokens per second")),
        ("truncation", f"{AT_CAP} of this run's rows, running, with its 95% interval",
         charts.time_series(t, [("truncation", "truncated", "#c0392b")], "running truncation at the cap",
                            band=("truncation_low", "truncation_high"), threshold=p["threshold"], share=True)),
        ("loops", "rows stopped in a loop", charts.time_bars(t, "loops_stopped", "loops stopped")),
        ("servers", "rows/s by server (a blank strip: the server committed nothing then)", charts.server_strips(t)),
    ]


def render_progress(nav: list[tuple[str | None, str]], view: RunView, p: dict[str, Any]) -> str:
    from tracegen.audit import charts
    from tracegen.audit.gate import wilson_interval

    pct = 100 * p["done"] / p["total"] if p["total"] else 100.0
    figures = p["truncation_figures"]
    low, high = wilson_interval(*figures[AT_CAP]) if figures[AT_CAP][1] else (None, None)
    interval = "–" if low is None else f"{100 * low:.1f}%–{100 * high:.1f}%"
    window = f"over the last {p['window_s'] / 60:.0f} min"
    rows = [
        ("done", f"{p['done']:,} of {p['total']:,} dataset rows ({pct:.1f}%) at max_tokens={p['max_tokens']:,}; "
                 f"{p['left']:,} left"),
        ("rows/s", "idle: nothing committed " + window if p["rows_per_s"] is None
         else f"{p['rows_per_s']:,.2f} {window}"),
        ("tokens/s", "–" if p["tokens_per_s"] is None else f"{p['tokens_per_s']:,.0f} completion tokens/s {window}"),
        (AT_CAP, f"{figure(*figures[AT_CAP])}; 95% interval {interval}; threshold {100 * p['threshold']:.1f}% "
                 f"({AT_CAP_MEANS})"),
        (STILL, f"{figure(*figures[STILL])} ({STILL_MEANS})"),
        ("ETA", _eta(p)),
    ]
    raise_run_id = p.get("airflow_run_id") if p["raise_allowed"] else None
    return render_page("progress.html.j2", title=f"progress {view.run_id}", run_id=view.run_id, nav=nav,
                       bar=charts.progress_bar(p["done"], p["total"]), charts=live_charts(p),
                       rows=[(k, _slug(k), v) for k, v in rows], live=p["live"], state=p["state"],
                       refresh_s=PROGRESS_REFRESH_S, raise_run_id=raise_run_id, raise_dag=RAISE_CAP_DAG,
                       max_tokens=p["max_tokens"])


def register(app: FastAPI, site: Site) -> None:
    @app.get("/roots/{root}/runs/{run_id}/progress.json", name="run_progress_json")
    def run_progress_json(request: Request, root: str, run_id: str) -> dict[str, Any]:
        return progress_of(request, site, root, run_id)[0]

    @app.get("/roots/{root}/runs/{run_id}/progress", name="run_progress")
    def run_progress_page(request: Request, root: str, run_id: str) -> HTMLResponse:
        progress, view = progress_of(request, site, root, run_id)
        nav = nav_for(request, root, view.run_id, view.present, "progress", view.has_record)
        return html_response(render_progress(nav, view, progress))
