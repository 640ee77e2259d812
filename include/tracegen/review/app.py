"""The review app: the pages assembled, and errors answered as pages or JSON.

`plugins/tracegen_review.py` builds it when the api-server asks for it and mounts it under `/tracegen`. It only
reads what `tracegen.run.run_report.audit_and_report` stored and the run's record, through
`tracegen.store.storage`, so local and s3:// output roots look the same.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import HTTPException
from fastapi.responses import JSONResponse, RedirectResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tracegen.review import files_page, progress_page, run_tab, runs_page
from tracegen.review.access import AirflowRun, airflow_runs, require_airflow_access
from tracegen.review.page import html_response, render_page, wants_html
from tracegen.review.read_model import StoredFileError
from tracegen.review.registration import URL_PREFIX
from tracegen.review.roots import Site, configured_roots


@asynccontextmanager
async def _warm_imports(app: FastAPI) -> AsyncIterator[None]:
    """Import the storage readers (pandas) when the api-server starts, not on a reviewer's first click."""
    import tracegen.store.root  # noqa: F401

    yield


def create_app(roots: Callable[[], list[str]] = configured_roots,
               runs: Callable[..., list[AirflowRun]] = airflow_runs) -> FastAPI:
    """The review app; `roots` lists the configured output roots, `runs` reads `tracegen_generate` runs
    from Airflow's metadata DB (their state and the output roots their conf names)."""
    app = FastAPI(title="tracegen reports", lifespan=_warm_imports, dependencies=[Depends(require_airflow_access)],
                  docs_url=None, redoc_url=None, openapi_url=None)
    site = Site(roots, runs)

    @app.exception_handler(StoredFileError)
    async def stored_file_error(request: Request, exc: StoredFileError) -> Response:
        # A run's stored JSON that a page needs does not parse: say which file and what is wrong.
        run_id = request.path_params.get("run_id", "?")
        detail = f"run {run_id!r}: {exc}; the page cannot be shown until the audit writes the file again"
        return await http_error(request, HTTPException(422, detail))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        # A person in a browser who is not logged in goes to Airflow's login page and comes back.
        if exc.status_code == 401 and wants_html(request):
            from airflow.api_fastapi.app import get_auth_manager

            return RedirectResponse(get_auth_manager().get_url_login(next_url=str(request.url)), 303)
        if wants_html(request):
            body = render_page("error.html.j2", title=f"{exc.status_code}", status=exc.status_code,
                               detail=exc.detail, home=f"{URL_PREFIX}/")
            return html_response(body, exc.status_code, headers=getattr(exc, "headers", None))
        return JSONResponse({"detail": exc.detail}, exc.status_code, headers=getattr(exc, "headers", None))

    # Order matters: the progress routes before a run's `{name}` files, the catch-all last.
    runs_page.register(app, site)
    progress_page.register(app, site)
    files_page.register(app, site)
    run_tab.register(app, site)

    @app.get("/{path:path}", include_in_schema=False)
    def not_a_page(path: str) -> None:
        # Starlette decodes %2F before routing, so "../" tricks end here, with a message instead of a bare 404.
        raise HTTPException(404, f"no tracegen page at {path!r}; the run list is at {URL_PREFIX}/")

    return app
