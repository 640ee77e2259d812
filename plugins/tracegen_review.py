"""Registers the tracegen review pages with Airflow: the `/tracegen` app, a menu entry and a DAG-run tab.

Registration only; the pages live in the `tracegen.review` package (which enforces Airflow authentication).
The app is built when the api-server asks for it (`fastapi_apps`): the other processes that load plugins,
every task among them, never import FastAPI or the pages (`tracegen.review.registration`).
"""

from __future__ import annotations

from functools import cache
from typing import Any

from airflow.plugins_manager import AirflowPlugin

from tracegen.review.registration import EXTERNAL_VIEWS, URL_PREFIX


@cache
def _review_app() -> Any:
    from tracegen.review.app import create_app

    return create_app()


class TracegenReviewPlugin(AirflowPlugin):
    name = "tracegen_review"
    external_views = EXTERNAL_VIEWS

    @property
    def fastapi_apps(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return [{"app": _review_app(), "url_prefix": URL_PREFIX, "name": "tracegen reports"}]
