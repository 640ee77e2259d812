"""What every review page shares: the CSS, the Content-Security-Policies, escaping, the navigation bar.

The pages this app renders get a CSP with inline CSS only, no script, no form, no `<base>`, not framed by
another origin. Stored reports are files in an output root that anyone who can write there could replace:
they are served raw only under the same CSP plus `sandbox` (an opaque origin, no forms, scripts or
automatic navigation), and shown inside an app page that frames them. An opaque origin sends no session,
so every link a reviewer follows is on the app page, never inside the stored report.
"""

from __future__ import annotations

import html
from typing import Any

from fastapi import Request
from fastapi.responses import HTMLResponse

from tracegen.review.read_model import REPORT_FILES

PAGE_CSP = ("default-src 'none'; style-src 'unsafe-inline'; img-src data:; form-action 'none'; "
            "base-uri 'none'; frame-ancestors 'self'")
# An app page that shows a stored report frames its raw URL (same origin, itself sandboxed by REPORT_CSP).
FRAMING_CSP = PAGE_CSP + "; frame-src 'self'"
REPORT_CSP = PAGE_CSP + "; sandbox"

CSS = """
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
.problem{color:#a40e26} a{color:#0969da} td.wrap{white-space:normal;min-width:200px;max-width:420px}
td div.uri{white-space:normal;min-width:200px;max-width:320px;word-break:normal}
"""
NAV_CSS = ("position:sticky;top:0;z-index:10;background:#f6f8fa;border-bottom:1px solid #d0d7de;"
           "padding:6px 24px;font:13px system-ui,sans-serif")
STATUS_CSS = "margin:6px 0 2px;padding:6px 10px;border-radius:6px;background:"


def e(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def badge(verdict: str | None) -> str:
    cls = verdict if verdict in ("pass", "stop", "warn") else "none"
    return f'<span class="badge {cls}">{e(verdict or "–")}</span>'


def page(title: str, body: str, head: str = "", css: str = CSS) -> str:
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{e(title)}</title>{head}'
            f"<style>{css}</style></head><body><main>{body}</main></body></html>")


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
            has_record: bool) -> str:
    links = [f'<a href="{e(request.url_for("index").path)}">all runs</a>', f"<b>{e(run_id)}</b>"]
    if has_record and current != "progress":
        links.append(f'<a href="{e(progress_url(request, key, run_id))}">progress</a>')
    for name in REPORT_FILES:
        if name in present and name != current:
            links.append(f'<a href="{e(file_url(request, key, run_id, name))}">{e(name)}</a>')
    return " · ".join(links)


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
