"""What every review page shares: the templates (`templates/`: `base.html.j2` holds the head and the CSS,
`macros.html.j2` the navigation and the badges), the Content-Security-Policies, the URLs of a run's pages.

The pages this app renders get a CSP with inline CSS only, no script, no form, no `<base>`, not framed by
another origin. Stored reports are files in an output root that anyone who can write there could replace:
they are served raw only under the same CSP plus `sandbox` (an opaque origin, no forms, scripts or
automatic navigation), and shown inside an app page that frames them. An opaque origin sends no session,
so every link a reviewer follows is on the app page, never inside the stored report.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import HTMLResponse

from tracegen.audit.rendering import environment
from tracegen.review.read_model import REPORT_FILES

PAGE_CSP = ("default-src 'none'; style-src 'unsafe-inline'; img-src data:; form-action 'none'; "
            "base-uri 'none'; frame-ancestors 'self'")
# An app page that shows a stored report frames its raw URL (same origin, itself sandboxed by REPORT_CSP).
FRAMING_CSP = PAGE_CSP + "; frame-src 'self'"
REPORT_CSP = PAGE_CSP + "; sandbox"

ENV = environment(Path(__file__).with_name("templates"))


def render_page(template: str, **context: Any) -> str:
    """A page from its template in `templates/` (autoescaped: every value from a run or a request is text)."""
    return ENV.get_template(template).render(**context)


def html_response(body: str, status_code: int = 200, headers: dict[str, str] | None = None,
                  csp: str = PAGE_CSP) -> HTMLResponse:
    return HTMLResponse(body, status_code, headers={**(headers or {}), "Content-Security-Policy": csp,
                                                    "X-Content-Type-Options": "nosniff"})


def wants_html(request: Request) -> bool:
    return "text/html" in request.headers.get("accept", "") and not request.url.path.endswith(".json")


def framed(request: Request) -> bool:
    """The page is loaded inside a frame (the run's tab in the Airflow UI): links into Airflow's own pages
    would nest Airflow inside Airflow there, and the UI's frame allows no top navigation or new tab."""
    return request.headers.get("sec-fetch-dest") == "iframe"


def file_url(request: Request, key: str, run_id: str, name: str) -> str:
    return request.url_for("report_file", root=key, run_id=run_id, name=name).path


def raw_url(request: Request, key: str, run_id: str, name: str) -> str:
    return request.url_for("raw_report_file", root=key, run_id=run_id, name=name).path


def progress_url(request: Request, key: str, run_id: str) -> str:
    return request.url_for("run_progress", root=key, run_id=run_id).path


def nav_for(request: Request, key: str, run_id: str, present: frozenset[str], current: str,
            has_record: bool) -> list[tuple[str | None, str]]:
    """The navigation between a run's pages, as (href, text); href None for the run itself."""
    links: list[tuple[str | None, str]] = [(request.url_for("index").path, "all runs"), (None, run_id)]
    if has_record and current != "progress":
        links.append((progress_url(request, key, run_id), "progress"))
    for name in REPORT_FILES:
        if name in present and name != current:
            links.append((file_url(request, key, run_id, name), name))
    return links


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
