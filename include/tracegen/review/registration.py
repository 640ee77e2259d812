"""What `plugins/tracegen_review.py` registers with Airflow besides the app: the pages' URL prefix, the menu
entry and the DAG-run tab.

Import-light on purpose: every process that loads Airflow's plugins imports this (each task, the scheduler,
the DAG processor's parsers, the triggerer), and only the api-server serves the pages. The app itself
(`tracegen.review.app`) imports FastAPI, the pages and their templates, about a second of CPU: the plugin
builds it only when the api-server asks for it.
"""

from __future__ import annotations

URL_PREFIX = "/tracegen"

# The `external_views` the plugin registers: a menu entry, and a tab on every DAG run showing its report.
# The menu entry has no `url_route`: it opens the run list as a page of its own, outside the UI's frame.
EXTERNAL_VIEWS = [
    {"name": "tracegen reports", "href": f"{URL_PREFIX}/", "destination": "nav", "category": "browse"},
    {"name": "tracegen report", "href": f"{URL_PREFIX}/runs/{{RUN_ID}}?dag_id={{DAG_ID}}", "destination": "dag_run",
     "url_route": "tracegen-run-report"},
]
