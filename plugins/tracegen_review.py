"""Registers the tracegen review pages with Airflow: the `/tracegen` app, a menu entry and a DAG-run tab.

Registration only; the pages live in `tracegen.review_app` (which enforces Airflow authentication).
"""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from tracegen.review_app import EXTERNAL_VIEWS, URL_PREFIX, create_app


class TracegenReviewPlugin(AirflowPlugin):
    name = "tracegen_review"
    fastapi_apps = [{"app": create_app(), "url_prefix": URL_PREFIX, "name": "tracegen reports"}]
    external_views = EXTERNAL_VIEWS
