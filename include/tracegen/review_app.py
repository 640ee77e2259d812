"""The review pages reviewers open from the Airflow UI: every run of every output root, and each run's report.

A FastAPI app that `plugins/tracegen_review.py` mounts into Airflow's api-server under `/tracegen`.
It only reads what `tracegen.audit.run_report.audit_and_report` stored (`runs/<run_id>/{pilot-report,report}.
{json,html}` and `run.json`) through `tracegen.store.storage`, so local and s3:// output roots look the same.

Every route requires an Airflow user allowed to see plugin views: mounted plugin apps are NOT
authenticated by the api-server, so the app checks it itself with Airflow's own user resolution
(bearer token or the UI's session cookie) and authorization call.

Output roots are never taken from the request: a page names a root by a short hash of a configured
root (the default output root plus the `tracegen_output_roots` Variable), and run ids must match the
alphabet `tracegen.config.safe_run_id` produces, so no request can reach outside `runs/`.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import html
import json
import logging
import math
import re
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

log = logging.getLogger(__name__)

URL_PREFIX = "/tracegen"
# The stored files a page may serve; anything else under runs/<run_id>/ stays private. gate-report is the
# audit a mid-run question of the gate was built from (gate_mode=ask).
REPORT_FILES = ("report.html", "pilot-report.html", "gate-report.html", "report.json", "pilot-report.json",
                "gate-report.json")
MAX_RUNS_PER_ROOT = 200  # newest first; an output root rarely has more, and each run costs two reads
_ROOT_KEY_RE = re.compile(r"[0-9a-f]{12}")
# Reports are self-contained (inline CSS and SVG, no script): forbid everything else, so even a
# rendering bug could never run code or load anything from the page.
_REPORT_CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"

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


def configured_roots() -> list[str]:
    """The default output root, then the roots of the `tracegen_output_roots` Variable, deduplicated."""
    from tracegen import params

    roots = [params.default_params()["output_uri"]]
    roots.extend(params.output_roots())
    return list(dict.fromkeys(r.strip() for r in roots if r and r.strip()))


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

    @property
    def verdict(self) -> str | None:
        return self.final_verdict or self.pilot_verdict


@dataclass(frozen=True)
class RootListing:
    key: str
    uri: str
    runs: tuple[RunSummary, ...]
    problem: str | None = None


def _created(run_doc: dict[str, Any] | None, report: dict[str, Any] | None) -> str | None:
    ts = (run_doc or {}).get("created_at")
    if isinstance(ts, int | float) and math.isfinite(ts):
        return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    generated = (report or {}).get("generated_at")
    return generated if isinstance(generated, str) else None


def _get_json(ledger: Any, run_id: str, name: str) -> dict[str, Any] | None:
    from tracegen.store.storage import StorageKeyError

    try:
        doc = json.loads(ledger.get_run_file(run_id, name))
    except StorageKeyError:
        return None
    except ValueError as exc:
        raise ValueError(f"{name} is not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{name} is not a JSON object")
    return doc


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
    return RunSummary(
        run_id=run_id,
        created=_created(run_doc, shown),
        max_tokens=config.get("max_tokens") if isinstance(config.get("max_tokens"), int) else None,
        pilot_verdict=((pilot or {}).get("verdict") or {}).get("verdict"),
        final_verdict=((final or {}).get("verdict") or {}).get("verdict"),
        rows=rows if isinstance(rows, int) else None,
        truncation_rate=float(rate) if isinstance(rate, int | float) else None,
        reports=reports,
    )


def list_root(uri: str, limit: int = MAX_RUNS_PER_ROOT) -> RootListing:
    """Runs of one output root, newest first. A root that cannot be read says why instead of failing."""
    from tracegen.store.ledger import RUNS_DIR, Ledger
    from tracegen.store.storage import open_storage

    key = root_key(uri)
    try:
        ledger = Ledger(open_storage(uri))
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


def _e(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def _badge(verdict: str | None) -> str:
    cls = verdict if verdict in ("pass", "stop", "warn") else "none"
    return f'<span class="badge {cls}">{_e(verdict or "–")}</span>'


def _page(title: str, body: str) -> str:
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title>'
            f"<style>{_CSS}</style></head><body><main>{body}</main></body></html>")


def _file_url(request: Request, key: str, run_id: str, name: str) -> str:
    return request.url_for("report_file", root=key, run_id=run_id, name=name).path


def render_index(request: Request, listings: list[RootListing], problems: list[str]) -> str:
    out = ["<h1>tracegen reports</h1>",
           "<p>Every generation run of each output root, newest first. The verdict is the final audit's "
           "when the run reached it, else the pilot gate's.</p>"]
    out.extend(f'<p class="problem">{_e(p)}</p>' for p in problems)
    for listing in listings:
        out.append(f'<h2>Output root</h2><div class="uri">{_e(listing.uri)}</div>')
        if listing.problem:
            out.append(f'<p class="problem">{_e(listing.problem)}</p>')
            continue
        if not listing.runs:
            out.append("<p>No runs yet.</p>")
            continue
        out.append('<table><tr><th class="l">run id</th><th class="l">created</th><th>cap</th>'
                   '<th class="l">pilot gate</th><th class="l">verdict</th><th>rows</th>'
                   '<th>truncated</th><th class="l">reports</th></tr>')
        for r in listing.runs:
            links = " · ".join(
                f'<a href="{_e(_file_url(request, listing.key, r.run_id, name))}">{_e(name)}</a>'
                for name in r.reports
            )
            if r.problem:
                links += f' <span class="problem">{_e(r.problem)}</span>'
            rate = "–" if r.truncation_rate is None else f"{100 * r.truncation_rate:.1f}%"
            out.append(
                f'<tr><td class="l id">{_e(r.run_id)}</td><td class="l">{_e(r.created or "–")}</td>'
                f"<td>{_e(f'{r.max_tokens:,}' if r.max_tokens is not None else '–')}</td>"
                f'<td class="l">{_badge(r.pilot_verdict)}</td><td class="l">{_badge(r.verdict)}</td>'
                f"<td>{_e(f'{r.rows:,}' if r.rows is not None else '–')}</td><td>{rate}</td>"
                f'<td class="l wrap">{links or "no report yet"}</td></tr>'
            )
        out.append("</table>")
    return _page("tracegen reports", "".join(out))


def with_nav(report_html: str, nav: str) -> str:
    """The stored report with a small navigation bar at the top (the report itself stays untouched)."""
    bar = f'<nav style="{_NAV_CSS}">{nav}</nav>'
    match = re.search(r"<body[^>]*>", report_html, flags=re.IGNORECASE)
    if match is None:
        return bar + report_html
    return report_html[: match.end()] + bar + report_html[match.end():]


def _nav_for(request: Request, key: str, run_id: str, present: set[str], current: str) -> str:
    links = [f'<a href="{_e(request.url_for("index").path)}">all runs</a>', f"<b>{_e(run_id)}</b>"]
    for name in REPORT_FILES:
        if name in present and name != current:
            links.append(f'<a href="{_e(_file_url(request, key, run_id, name))}">{_e(name)}</a>')
    return " · ".join(links)


# ---- the app ------------------------------------------------------------------------------------


def _wants_html(request: Request) -> bool:
    return "text/html" in request.headers.get("accept", "") and not request.url.path.endswith(".json")


def create_app(roots: Callable[[], list[str]] = configured_roots) -> FastAPI:
    """The review app; `roots` lists the output roots it may read (default: Airflow's configuration)."""
    app = FastAPI(
        title="tracegen reports",
        lifespan=_warm_imports,
        dependencies=[Depends(require_airflow_access)],
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )

    def resolve_roots() -> tuple[dict[str, str], list[str]]:
        try:
            uris = roots()
        except Exception as exc:  # e.g. a malformed Variable: say so, still show the default root
            log.warning("output roots: %s", exc)
            from tracegen import params

            return {root_key(u): u for u in [params.default_params()["output_uri"]]}, [str(exc)]
        return {root_key(u): u for u in uris}, []

    def open_ledger(key: str):
        from tracegen.store.ledger import Ledger
        from tracegen.store.storage import open_storage

        if not _ROOT_KEY_RE.fullmatch(key):
            raise HTTPException(404, f"invalid output root key {key!r}")
        uri = resolve_roots()[0].get(key)
        if uri is None:
            raise HTTPException(404, f"no configured output root has key {key!r}; open the run list again")
        return Ledger(open_storage(uri))

    def run_files(ledger: Any, run_id: str) -> set[str]:
        return {k.rsplit("/", 1)[1] for k in ledger.storage.list(f"runs/{run_id}/")}

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        # A person in a browser who is not logged in goes to Airflow's login page and comes back.
        if exc.status_code == 401 and _wants_html(request):
            from airflow.api_fastapi.app import get_auth_manager

            return RedirectResponse(get_auth_manager().get_url_login(next_url=str(request.url)), 303)
        if _wants_html(request):
            body = _page(f"{exc.status_code}", f"<h1>{exc.status_code}</h1><p>{_e(exc.detail)}</p>"
                         f'<p><a href="{_e(URL_PREFIX)}/">all tracegen runs</a></p>')
            return HTMLResponse(body, exc.status_code, headers=getattr(exc, "headers", None))
        return JSONResponse({"detail": exc.detail}, exc.status_code, headers=getattr(exc, "headers", None))

    @app.get("/", response_class=HTMLResponse, name="index")
    def index(request: Request) -> HTMLResponse:
        by_key, problems = resolve_roots()
        listings = [list_root(uri) for uri in by_key.values()]
        return HTMLResponse(render_index(request, listings, problems))

    @app.get("/runs.json", name="runs_json")
    def runs_json() -> dict[str, Any]:
        by_key, problems = resolve_roots()
        roots_out = []
        for uri in by_key.values():
            listing = list_root(uri)
            roots_out.append({"key": listing.key, "uri": listing.uri, "problem": listing.problem,
                              "runs": [asdict(r) | {"verdict": r.verdict} for r in listing.runs]})
        return {"roots": roots_out, "problems": problems}

    @app.get("/roots/{root}/runs/{run_id}/{name}", name="report_file")
    def report_file(request: Request, root: str, run_id: str, name: str) -> Response:
        from tracegen.store.storage import StorageError, StorageKeyError

        check_run_id(run_id)
        if name not in REPORT_FILES:
            raise HTTPException(404, f"no such report file {name!r}; a run has {', '.join(REPORT_FILES)}")
        ledger = open_ledger(root)
        try:
            data = ledger.get_run_file(run_id, name)
            present = run_files(ledger, run_id)
        except StorageKeyError:
            raise HTTPException(404, f"run {run_id!r} has no {name} in {ledger.storage.uri}") from None
        except StorageError as exc:
            raise HTTPException(503, f"cannot read {name} of run {run_id!r}: {exc}") from None
        return _serve(request, root, run_id, name, data, present)

    @app.get("/runs/{run_id}", name="run_report")
    def run_report(request: Request, run_id: str, dag_id: str | None = None) -> Response:
        """The Airflow DAG run's report (final if written, else the pilot's), found in any output root."""
        from tracegen.store.storage import StorageError

        try:
            stored = safe_run_id(run_id)  # Airflow run ids carry ':' and '+'; storage has them replaced
        except ConfigError:
            stored = ""
        check_run_id(stored)
        by_key, _problems = resolve_roots()
        for key in by_key:
            ledger = open_ledger(key)
            try:
                present = run_files(ledger, stored)
                for name in ("report.html", "pilot-report.html"):
                    if name in present:
                        return _serve(request, key, stored, name, ledger.get_run_file(stored, name), present)
            except StorageError as exc:
                log.warning("run %s in %s: %s", stored, ledger.storage.uri, exc)
        where = f" of DAG {dag_id!r}" if dag_id else ""
        raise HTTPException(
            404,
            f"no tracegen report for run {run_id!r}{where} (stored as {stored!r}) in "
            f"{len(by_key)} output root(s). Reports exist for tracegen_generate runs that reached the "
            "pilot audit; a run that failed before it has none.",
        )

    def _serve(request: Request, key: str, run_id: str, name: str, data: bytes, present: set[str]) -> Response:
        if name.endswith(".json"):
            return Response(data, media_type="application/json")
        page = with_nav(data.decode("utf-8", errors="replace"), _nav_for(request, key, run_id, present, name))
        return HTMLResponse(page, headers={"Content-Security-Policy": _REPORT_CSP,
                                           "X-Content-Type-Options": "nosniff"})

    @app.get("/{path:path}", include_in_schema=False)
    def not_a_page(path: str) -> None:
        # Starlette decodes %2F before routing, so "../" tricks end here, with a message instead of a bare 404.
        raise HTTPException(404, f"no tracegen page at {path!r}; the run list is at {URL_PREFIX}/")

    return app


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
