"""
### tracegen_export_consumer — test only: a training DAG's first step, scheduled on new exports

Scheduled on the AssetAlias `tracegen_export`: each export `tracegen_export` publishes triggers it. It reads
the manifest the triggering event names, checks its sha256 against the event's extra, and returns what a
trainer would start from. Lives with the e2e tests (added to the cluster as a DAG bundle of its own by
tests/e2e/test_export_asset.py), so production deployments never parse it.
"""

from __future__ import annotations

import pendulum
from airflow.sdk import AssetAlias, dag, task


@dag(
    dag_id="tracegen_export_consumer",
    schedule=AssetAlias("tracegen_export"),
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    tags=["tracegen", "test"],
    default_args={"retries": 0},
)
def tracegen_export_consumer():
    @task
    def read_manifest(*, triggering_asset_events) -> dict:
        import hashlib
        import json
        from urllib.parse import urlparse

        events = [e for asset_events in triggering_asset_events.values() for e in asset_events]
        event = events[-1]
        path = urlparse(event.asset.uri).path
        body = open(path, "rb").read()
        if hashlib.sha256(body).hexdigest() != event.extra["sha256"]:
            raise ValueError(f"{path}: not the manifest the event announced")
        manifest = json.loads(body)
        return {"uri": event.asset.uri, "extra": event.extra, "export_id": manifest["export_id"],
                "rows": manifest["rows"], "layout": manifest["layout"], "data_file": manifest.get("data_file"),
                "trainers": manifest.get("trainers")}

    read_manifest()


tracegen_export_consumer()
