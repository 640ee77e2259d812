"""The Airflow DAG run's "tracegen report" tab: the report that decided when the gate stopped the run or
asks about it, the final report once written, live progress while it runs, else the pilot's. The run is
found in the root its conf names first, then in the configured roots; when nothing is there, the page says
why, from what Airflow knows about the run."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import HTTPException
from fastapi.responses import RedirectResponse, Response

from tracegen.config import ConfigError, safe_run_id, stored_as
from tracegen.review.access import AirflowRun, require_dag_read
from tracegen.review.files_page import show_report
from tracegen.review.page import progress_url
from tracegen.review.read_model import FINAL_HTML, PILOT_HTML, read_run, run_files
from tracegen.review.roots import Site, check_run_id, root_key
from tracegen.review.summary import summarise
from tracegen.run.run_record import stored_run_id

log = logging.getLogger(__name__)

LIVE_STATES = ("running", "queued")


def missing_run_message(run_id: str, stored: str, dag_id: str | None, af: AirflowRun | None, n_roots: int) -> str:
    """Why a run has no report to show: its output root refused, its output gone (prepare_run wrote its
    record there, and it is not there any more), a run not started yet, or one that never reached the
    pilot audit."""
    where = f" of DAG {dag_id!r}" if dag_id else ""
    if af is not None and af.root_problem:
        return f"no tracegen report for run {run_id!r}{where}: {af.root_problem}"
    if af is not None and af.prepared:
        root = af.output_uri or "the default output root"
        return (f"the output of run {run_id!r}{where} is gone: its first task wrote the run's record to {root} "
                f"(runs/{stored}/), and nothing of the run is there any more: that output root was deleted, "
                "moved or replaced since (`make demo` starts each demo in a new output root and says where "
                "earlier ones went). The run's task logs are still in Airflow.")
    if af is not None and af.state in LIVE_STATES:
        return (f"run {run_id!r}{where} is {af.state} and has not written its record yet: its first task, "
                "prepare_run, writes it, and this tab shows the run's progress from then on. Reload in a moment.")
    state = f" (Airflow state: {af.state})" if af is not None and af.state else ""
    return (f"no tracegen report for run {run_id!r}{where} (stored as {stored!r}) in {n_roots} output root(s)"
            f"{state}. Reports exist for tracegen_generate runs that reached the pilot audit; a run that failed "
            "before it has none: its task logs in Airflow say why.")


def register(app: FastAPI, site: Site) -> None:
    @app.get("/runs/{run_id}", name="run_report")
    def run_report(request: Request, run_id: str, dag_id: str | None = None) -> Response:
        from tracegen.store.storage import StorageError

        require_dag_read(request)
        try:
            stored = safe_run_id(run_id)  # Airflow run ids carry ':' and '+'; storage has them replaced
        except ConfigError:
            stored = ""
        check_run_id(stored)
        found, _ = site.known_runs(run_id)
        af = found[0] if found else site.airflow_run_for(stored)
        the_id = stored
        by_key, _problems = site.resolve_roots()
        order = list(by_key)
        if af is not None and af.output_uri:
            own = root_key(af.output_uri)
            order = [own] + [k for k in order if k != own]
        for key in order:
            output_root, uri = site.open_root(key, by_key)
            try:
                # In each root: under its stored id, or the earlier id form its record names it by.
                stored = stored_run_id(output_root, run_id)
                present = run_files(output_root, stored)
                if not present:
                    continue
                view = read_run(output_root, stored, present)
                if not stored_as(stored, run_id, view.airflow_run_id):
                    continue  # another run's record: not this run's report
                summary = summarise(view)
                if summary.stage is not None and summary.deciding_report:
                    name = summary.deciding_report
                elif FINAL_HTML in present:
                    name = FINAL_HTML
                elif af is not None and af.state in LIVE_STATES and view.has_record:
                    return RedirectResponse(progress_url(request, key, stored), 303)
                elif PILOT_HTML in present:
                    name = PILOT_HTML
                else:
                    continue
                return show_report(request, site, key, uri, view, name, af, raw_run_id=run_id)
            except StorageError as exc:
                log.warning("run %s in %s: %s", stored, output_root.storage.uri, exc)
        raise HTTPException(404, missing_run_message(run_id, the_id, dag_id, af, len(by_key)))
