"""Airflow hears of an export. On the real scheduler (PostgreSQL, CeleryExecutor on Redis), a
`tracegen_export` run publishes an export and emits an Asset event through the AssetAlias
`tracegen_export`, resolving to the destination's manifest; a downstream DAG scheduled on that alias
(tests/e2e/dags/tracegen_export_consumer.py, added to the cluster as a DAG bundle of its own: a test's DAG
never ships with the project's) runs after it and reads the manifest the event names. The cluster is the
one this module shares with test_raise_cap (`e2e.shared_cluster`).
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest
from e2e.airflow_cluster import ClusterError
from engine_support.helpers import make_config, prepare, root_of, write_dataset

from tracegen.store.records import OK, GeneratedRow, pack_token_ids

EXPORT, CONSUMER = "tracegen_export", "tracegen_export_consumer"
N_ROWS = 12


@pytest.fixture(scope="module")
def cluster(shared_cluster):
    return shared_cluster


def _root(tmp: Path) -> Path:
    """A small output root whose rows hold token ids (the engine is not what this test is about)."""
    dataset = write_dataset(tmp / "prompts.jsonl", N_ROWS)
    out = tmp / "output"
    config = make_config(dataset, out, max_tokens=4096)
    prepare(config, "run-a")
    rows = [GeneratedRow(index=i, status=OK, max_tokens=4096, run_id="run-a", chunk=0, finish_reason="stop",
                         content=f"answer {i}", reasoning_content=f"thinking {i}", prompt_tokens=5,
                         completion_tokens=3 + i, prompt_token_ids=pack_token_ids(range(5)),
                         response_token_ids=pack_token_ids([*range(100, 102 + i), 151645]))
            for i in range(N_ROWS)]
    root_of(config).commits.commit(rows, "run-a", 0, "seg-a")
    return out


def test_an_export_triggers_the_dag_scheduled_on_its_asset(cluster, tmp_path):
    api = cluster.api()
    for dag_id in (EXPORT, CONSUMER):
        api.wait_for_dag(dag_id, timeout=180)
        api.unpause(dag_id)
    out = _root(tmp_path)
    dest = tmp_path / "export"
    run_id = api.trigger(EXPORT, {"output_uri": str(out), "dest_uri": str(dest), "layout": "tokens",
                                  "include_truncated": False})
    state = api.wait_run(EXPORT, run_id, timeout=300)
    assert state == "success", f"{api.describe(EXPORT, run_id)}\n{cluster.logs_summary()}"
    announced = api.xcom(EXPORT, run_id, "export")
    manifest_bytes = (dest / "manifest.json").read_bytes()
    manifest = json.loads(manifest_bytes)
    assert announced["export_id"] == manifest["export_id"] and announced["rows"] == manifest["rows"] == N_ROWS
    assert announced["sha256"] == hashlib.sha256(manifest_bytes).hexdigest()

    # The downstream DAG runs because of that event, and reads the manifest it names.
    deadline, consumer_runs = time.monotonic() + 240, []
    while time.monotonic() < deadline and not consumer_runs:
        consumer_runs = api._call("GET", f"/dags/{CONSUMER}/dagRuns")["dag_runs"]
        time.sleep(2)
    if not consumer_runs:
        raise ClusterError(f"{CONSUMER} never ran after the export\n{cluster.logs_summary()}")
    (consumer,) = consumer_runs
    assert consumer["run_type"] == "asset_triggered", consumer
    state = api.wait_run(CONSUMER, consumer["dag_run_id"], timeout=240)
    assert state == "success", f"{api.describe(CONSUMER, consumer['dag_run_id'])}\n{cluster.logs_summary()}"
    read = api.xcom(CONSUMER, consumer["dag_run_id"], "read_manifest")
    assert read["uri"] == (dest / "manifest.json").as_uri() or read["uri"].endswith(str(dest / "manifest.json"))
    assert (read["export_id"], read["rows"], read["layout"]) == (manifest["export_id"], N_ROWS, "tokens")
    assert read["extra"]["sha256"] == announced["sha256"]
    assert read["trainers"]["specforge"]["data.max_length"] == 5 + 3 + N_ROWS - 1
