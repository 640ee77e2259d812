"""The review plugin as every process that loads Airflow's plugins sees it: each task, the scheduler, the DAG
processor's parsers and the triggerer import it without FastAPI or the pages; the api-server, asking for
`fastapi_apps`, gets the review app (its pages are checked in test_review_page.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_loading_the_plugin_imports_no_fastapi_until_the_api_server_asks_for_the_app() -> None:
    probe = (
        "import json, sys\n"
        f"sys.path.insert(0, {str(ROOT / 'plugins')!r})\n"
        "import airflow.plugins_manager\n"
        "before = {m for m in ('fastapi', 'tracegen.review.app', 'jinja2') if m in sys.modules}\n"
        "import tracegen_review\n"
        "plugin = tracegen_review.TracegenReviewPlugin()\n"
        "loaded = sorted({m for m in ('fastapi', 'tracegen.review.app') if m in sys.modules} - before)\n"
        "views = plugin.external_views\n"
        "(entry,) = plugin.fastapi_apps\n"
        "again = plugin.fastapi_apps[0]['app'] is entry['app']\n"
        "print(json.dumps({'loaded': loaded, 'views': [v['href'] for v in views], 'prefix': entry['url_prefix'],\n"
        "                  'app': type(entry['app']).__name__, 'once': again}))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT)
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    assert doc["loaded"] == [], f"importing the plugin imported {doc['loaded']}"
    assert doc["prefix"] == "/tracegen" and doc["app"] == "FastAPI" and doc["once"], doc
    assert doc["views"] == ["/tracegen/", "/tracegen/runs/{RUN_ID}?dag_id={DAG_ID}"], doc
