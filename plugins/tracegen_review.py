"""Registers the tracegen review pages with Airflow: the `/tracegen` app, a menu entry and a DAG-run tab.

Registration only; the pages live in the `tracegen.review` package (which enforces Airflow authentication).
"""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from tracegen.review.app import EXTERNAL_VIEWS, create_app
from tracegen.review.roots import URL_PREFIX


class TracegenReviewPlugin(AirflowPlugin):
    name = "tracegen_review"
    fastapi_apps = [{"app": create_app(), "url_prefix": URL_PREFIX, "name": "tracegen reports"}]
    external_views = EXTERNAL_VIEWS
