"""A run's report files: JSON as stored; an HTML report shown on an app page (navigation, the run's state and
next step) that frames the stored file, which is served raw, sandboxed, at `raw/<name>`."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import HTTPException
from fastapi.responses import HTMLResponse, Response

from tracegen.review.access import AirflowRun, require_dag_read
from tracegen.review.next_step import NextStep, status_for
from tracegen.review.page import FRAMING_CSP, REPORT_CSP, framed, html_response, nav_for, raw_url, render_page
from tracegen.review.read_model import REPORT_FILES, RunView, read_run
from tracegen.review.roots import Site, check_run_id
from tracegen.review.summary import summarise
from tracegen.run.stage import ASKING


def report_page(request: Request, key: str, view: RunView, name: str, step: NextStep | None) -> HTMLResponse:
    """The app page showing one stored HTML report: links here are the app's, sent with the session."""
    body = render_page("report_page.html.j2", title=f"{name} · {view.run_id}", name=name, run_id=view.run_id,
                       nav=nav_for(request, key, view.run_id, view.present, name, view.has_record), step=step,
                       src=raw_url(request, key, view.run_id, name))
    return html_response(body, csp=FRAMING_CSP)


def show_report(request: Request, site: Site, key: str, uri: str, view: RunView, name: str,
                af: AirflowRun | None, raw_run_id: str | None = None) -> HTMLResponse:
    summary = summarise(view)
    refused = site.refused_answer(af.run_id) if af is not None and summary.stage == ASKING else None
    step = status_for(view, summary, name, uri, af, raw_run_id, framed=framed(request), refused=refused)
    return report_page(request, key, view, name, step)


def read_file(output_root: Any, run_id: str, name: str) -> bytes:
    from tracegen.store.storage import StorageError, StorageKeyError, StorageLinkError

    try:
        return output_root.run_files.get(run_id, name)
    except StorageLinkError as exc:
        # A link planted in the output root is data, never followed (tracegen.store.storage).
        raise HTTPException(404, f"run {run_id!r} has no {name} the pages can serve: {exc}") from None
    except StorageKeyError:
        raise HTTPException(404, f"run {run_id!r} has no {name} in {output_root.storage.uri}") from None
    except StorageError as exc:
        raise HTTPException(503, f"cannot read {name} of run {run_id!r}: {exc}") from None


def _checked(request: Request, site: Site, root: str, run_id: str, name: str) -> tuple[Any, str, bytes]:
    require_dag_read(request)
    check_run_id(run_id)
    if name not in REPORT_FILES:
        raise HTTPException(404, f"no such report file {name!r}; a run has {', '.join(REPORT_FILES)}")
    output_root, uri = site.open_root(root)
    return output_root, uri, read_file(output_root, run_id, name)


def register(app: FastAPI, site: Site) -> None:
    @app.get("/roots/{root}/runs/{run_id}/raw/{name}", name="raw_report_file")
    def raw_report_file(request: Request, root: str, run_id: str, name: str) -> Response:
        """The stored file's bytes: an HTML report under the sandboxing CSP, framed by `report_file`."""
        _, _, data = _checked(request, site, root, run_id, name)
        if name.endswith(".json"):
            return Response(data, media_type="application/json")
        return Response(data, media_type="text/html; charset=utf-8",
                        headers={"Content-Security-Policy": REPORT_CSP, "X-Content-Type-Options": "nosniff"})

    @app.get("/roots/{root}/runs/{run_id}/{name}", name="report_file")
    def report_file(request: Request, root: str, run_id: str, name: str) -> Response:
        output_root, uri, data = _checked(request, site, root, run_id, name)
        if name.endswith(".json"):
            return Response(data, media_type="application/json")
        view = read_run(output_root, run_id)
        return show_report(request, site, root, uri, view, name, site.airflow_run_for(run_id, view.airflow_run_id))
