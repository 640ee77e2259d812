"""The mid-run pivot on a real Airflow: `tracegen_raise_cap` raises a running run's cap, nothing is killed.

Every Airflow component runs as a real process (tests/e2e/airflow_cluster.py: PostgreSQL, Celery on
Redis, api-server, scheduler), with the bundled simulated fleet (SGLang stand-ins) and the bundled
prompts, whose length law truncates about 18% of rows at the reference job's 4096. The run has no pilot and
gate_mode=warn, so its fan-out runs at 4096 until the operator raises the cap through the REST API (the
same call the trigger form makes).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from e2e.airflow_cluster import AirflowApi, AirflowCluster, sample_prompts

from tracegen.config import safe_run_id
from tracegen.run.cap_raise import variable_key
from tracegen.status import dataset_status
from tracegen.store.root import OutputRoot
from tracegen.store.storage import open_storage

GENERATE, RAISE = "tracegen_generate", "tracegen_raise_cap"
N_ROWS = 240
# 12 chunks, three at a time: the raise lands while most of them are still to start.
CONF = {"max_tokens": 4096, "pilot_size": 0, "chunk_size": 20, "gate_mode": "warn"}


@pytest.fixture(scope="module")
def cluster(shared_cluster: AirflowCluster) -> AirflowCluster:
    # e2e.shared_cluster: the stand-ins' clock at 20x, slow enough that chunks are still to start when the
    # raise lands; a worker slot beyond the three chunk tasks runs the raise itself.
    return shared_cluster


@pytest.fixture(scope="module")
def api(cluster: AirflowCluster) -> AirflowApi:
    api = cluster.api()
    for dag_id in (GENERATE, RAISE):
        api.wait_for_dag(dag_id)
        api.unpause(dag_id)
    return api


@pytest.fixture(scope="module")
def dataset(cluster: AirflowCluster) -> Path:
    return sample_prompts(cluster.root / "prompts.jsonl", N_ROWS)


def _states(api: AirflowApi, run_id: str) -> dict[str, list[str]]:
    states: dict[str, list[str]] = {}
    for t in api.task_instances(GENERATE, run_id):
        states.setdefault(t["task_id"], []).append(t["state"])
    return states


def _raise(cluster: AirflowCluster, api: AirflowApi, run_id: str, cap: int) -> tuple[str, str]:
    """Trigger the raise; its final state and its task's log."""
    raise_run = api.trigger(RAISE, {"run_id": run_id, "max_tokens": cap})
    state = api.wait_run(RAISE, raise_run, 120)
    body = api._call("GET", f"/dags/{RAISE}/dagRuns/{raise_run}/taskInstances/raise_cap/logs/1",
                     params={"full_content": True})
    content = body.get("content") or []
    # Structured log lines: the message is each line's "event", an exception's is in its "error_detail".
    log = "\n".join(json.dumps(line) if isinstance(line, dict) else str(line) for line in content)
    return state, log


def _variable(api: AirflowApi, key: str) -> str | None:
    response = api.client.get(f"/variables/{key}")
    return response.json()["value"] if response.status_code == 200 else None


@pytest.mark.timeout(900)
def test_a_raise_mid_run_takes_the_chunks_not_started_and_extends_the_truncated_rows(
    cluster: AirflowCluster, api: AirflowApi, dataset: Path
) -> None:
    output = cluster.root / "out-raise"
    run_id = api.trigger(GENERATE, {**CONF, "dataset_uri": str(dataset), "output_uri": str(output)})

    # Wait until some chunk has committed rows at 4096 (so truncated rows exist under the old cap), while
    # chunks are still waiting to start.
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        states = _states(api, run_id)
        chunk_states = states.get("generate_chunk", []) + states.get("generate_alongside_pilot", [])
        if "success" in chunk_states:
            break
        assert api.run(GENERATE, run_id)["state"] in ("queued", "running"), api.describe(GENERATE, run_id)
        time.sleep(1)
    else:
        raise AssertionError(f"no chunk finished in 300 s: {api.describe(GENERATE, run_id)}")
    waiting = [s for s in _states(api, run_id).get("generate_chunk", []) if s in (None, "scheduled", "queued")]
    assert waiting, f"every chunk had started before the raise: the test proves nothing: {api.describe(GENERATE, run_id)}"

    state, log = _raise(cluster, api, run_id, 8192)
    assert state == "success", log[-3000:]
    assert json.loads(_variable(api, variable_key(safe_run_id(run_id))))["cap"] == 8192

    # A raise that is not one is refused, saying why, and changes nothing: not above the raised cap ...
    state, log = _raise(cluster, api, run_id, 6144)
    assert state == "failed" and "already raised to 8,192 by admin" in log, log[-2000:]
    # ... nor within the servers' context length (40,960 tokens, read by provision_fleet).
    state, log = _raise(cluster, api, run_id, 50_000)
    assert state == "failed" and "enter at most 40,959" in log, log[-2000:]
    assert json.loads(_variable(api, variable_key(safe_run_id(run_id))))["cap"] == 8192

    assert api.wait_run(GENERATE, run_id, 600) == "success", (
        f"{api.describe(GENERATE, run_id)}\n{cluster.logs_summary()}")

    # The same run, at the new cap: every row done at 8192, the raise recorded as its decision.
    run_dir = output / "runs" / safe_run_id(run_id)
    record = json.loads((run_dir / "run.json").read_text())
    report = json.loads((run_dir / "report.json").read_text())
    assert record["config"]["max_tokens"] == 8192 and record["config"]["gate_mode"] == "warn"
    decision = record["decisions"][-1]
    assert (decision["trigger"], decision["cap"], decision["from_cap"], decision["responded_by"]) == (
        "raise", 8192, 4096, "admin"), decision
    assert report["decisions"] == record["decisions"] and report["audit"]["max_tokens"] == 8192
    status = dataset_status(str(output))
    assert (status["total"], status["done"], status["left"], status["max_tokens"]) == (N_ROWS, N_ROWS, 0, 8192), status

    output_root = OutputRoot(open_storage(str(output)))
    assert output_root.repair.check_invariants() == []
    frame = output_root.snapshots.frame()
    assert set(frame["run_id"]) == {safe_run_id(run_id)}  # one run: nothing killed, nothing re-triggered
    # Chunks that started after the raise generated at 8192 from the prompt ...
    direct = frame[(frame["max_tokens"] == 8192) & (frame["pivot"].fillna("") != "extended")]
    assert len(direct) > 0
    # ... and every row cut at 4096 before it was continued from its tokens at 8192, not generated again.
    cut = frame[(frame["max_tokens"] == 4096) & (frame["finish_reason"] == "length")]["index"]
    assert len(cut) > 0
    redone = frame[frame["index"].isin(cut) & (frame["max_tokens"] == 8192)]
    assert sorted(redone["index"]) == sorted(cut) and set(redone["pivot"]) == {"extended"}, redone["pivot"].tolist()
    states = _states(api, run_id)
    assert states["ask_about_cap"] == ["success"] and states["review_cap"] == ["success"], states
    assert set(states["generate_at_decided_cap"]) == {"success"}, states

    # Once the run has decided, a raise is refused: a new run is how to go further.
    state, log = _raise(cluster, api, run_id, 12288)
    assert state == "failed" and "only a running run's cap can be raised" in log, log[-2000:]
