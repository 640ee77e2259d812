"""tracegen on Airflow's distributed engine: PostgreSQL metadata DB, CeleryExecutor on Redis, two workers.

Every Airflow component runs as a real process (tests/e2e/airflow_cluster.py) on a fresh database; the
DAGs are triggered through the REST API with a token from /auth/token, as a person or a CI job would.
The tests run in file order and share the cluster: a full run, a run that loses a Celery worker to
SIGKILL mid-generation, the scheduled rerun DAG finding nothing left to do, then the rerun on a one-minute
schedule during a live run (it never writes the live run's root) and after that run's worker and
scheduler died (it finishes the run once the dead run's lease expires).
PostgreSQL or Redis missing is a failure, not a skip: CI runs both.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from e2e.airflow_cluster import AirflowApi, AirflowCluster, ClusterError, running_cluster, sample_prompts

from tracegen.config import safe_run_id
from tracegen.status import dataset_status
from tracegen.store.records import FAILED
from tracegen.store.root import OutputRoot
from tracegen.store.storage import open_storage

GENERATE = "tracegen_generate"
RERUN = "tracegen_rerun_failed"
CHUNK_TASKS = ("generate_alongside_pilot", "generate_chunk")
# Of the bundled prompts: chunks of 50 staggered over 3 tasks at once (plan.chunks), i.e. three of 50
# beside the 40-row pilot, then 17, 34 and the last 39 past the gate.
N_ROWS = 240
RUN_CONF = {"max_tokens": 8192, "pilot_size": 40, "chunk_size": 50, "teardown": True}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("cluster")
    # The rerun every minute, and leases void after 20 s without renewal, so a crashed run's hold expires
    # within the test.
    extra_env = {"TRACEGEN_RERUN_SCHEDULE": "* * * * *", "TRACEGEN_LEASE_TTL_S": "20"}
    with running_cluster(root, workers=2, worker_concurrency=2, extra_env=extra_env) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def api(cluster: AirflowCluster) -> AirflowApi:
    api = cluster.api()
    api.wait_for_dag(GENERATE)
    api.unpause(GENERATE)
    return api


@pytest.fixture(scope="module")
def dataset(cluster: AirflowCluster) -> Path:
    return sample_prompts(cluster.root / "prompts.jsonl", N_ROWS)


def _conf(dataset: Path, output: Path) -> dict:
    return {**RUN_CONF, "dataset_uri": str(dataset), "output_uri": str(output)}


def _wait_success(cluster: AirflowCluster, api: AirflowApi, dag_id: str, run_id: str, timeout: float) -> None:
    state = api.wait_run(dag_id, run_id, timeout)
    assert state == "success", (
        f"{dag_id} {run_id} ended {state}: {api.describe(dag_id, run_id)}\n{cluster.logs_summary()}"
    )


def _check_output(output: Path, run_id: str) -> dict:
    """Every row exactly once, the ledger healthy, and the final report beside the data."""
    status = dataset_status(str(output))
    assert (status["total"], status["done"], status["left"], status["failed"]) == (N_ROWS, N_ROWS, 0, 0), status
    output_root = OutputRoot(open_storage(str(output)))
    assert output_root.repair.check_invariants(deep=True) == []
    assert output_root.repair.orphan_parts() == []
    frame = output_root.snapshots.frame()
    kept = frame[frame["status"] != FAILED]
    assert sorted(kept["index"].tolist()) == list(range(N_ROWS)), "a row is missing or committed twice"
    assert set(frame["max_tokens"]) == {8192}
    run_dir = output / "runs" / status["newest_run"]
    assert safe_run_id(run_id) == status["newest_run"]
    report = json.loads((run_dir / "report.json").read_text())
    assert report["verdict"]["max_tokens"] == 8192 and report["verdict"]["total"] == N_ROWS
    assert report["verdict"]["blocks"] is False
    assert (run_dir / "report.html").read_text().lstrip().lower().startswith("<!doctype html")
    assert (run_dir / "pilot-report.json").exists()
    return status


@pytest.mark.timeout(420)
def test_generate_runs_on_celery_workers(cluster: AirflowCluster, api: AirflowApi, dataset: Path) -> None:
    output = cluster.root / "out-full"
    run_id = api.trigger(GENERATE, _conf(dataset, output))
    _wait_success(cluster, api, GENERATE, run_id, timeout=240)

    states = {(t["task_id"], t["map_index"]): t["state"] for t in api.task_instances(GENERATE, run_id)}
    generated = [k for k in states if k[0] in CHUNK_TASKS]
    # Six chunks: the first three beside the pilot, three past the gate.
    assert sorted(k[0] for k in generated) == ["generate_alongside_pilot"] * 3 + ["generate_chunk"] * 3, states
    assert generated and all(states[k] == "success" for k in generated), states
    assert states[("teardown_fleet", -1)] == "success" and states[("watcher", -1)] == "skipped", states
    _check_output(output, run_id)


def test_workers_import_the_heavy_libraries_before_forking_tasks(cluster: AirflowCluster) -> None:
    """tracegen.common.celery_config: a task process inherits pandas and pyarrow from its worker instead of
    importing them again (0.4-1.4 s of CPU per task, paid where the fleet idles)."""
    for name in cluster.worker_names:
        maps = Path(f"/proc/{cluster.components[name].proc.pid}/maps").read_text()
        assert "/pandas/_libs/" in maps and "/pyarrow/" in maps, f"{name} did not preload them"


def _kill_worker_running(cluster: AirflowCluster, api: AirflowApi, run_id: str, timeout: float) -> tuple:
    """SIGKILL the worker (every process of its session) that runs a chunk task, once that task has been
    running for a moment; returns (worker name, task id, map index)."""
    deadline = time.monotonic() + timeout
    seen: dict[tuple[str, int], float] = {}
    pids: dict[tuple[str, int], int] = {}
    while time.monotonic() < deadline:
        if api.run(GENERATE, run_id)["state"] in ("success", "failed"):
            break
        for ti in api.task_instances(GENERATE, run_id):
            if ti["task_id"] not in CHUNK_TASKS or ti["state"] != "running" or not ti.get("pid"):
                continue
            key = (ti["task_id"], ti["map_index"])
            first = seen.setdefault(key, time.monotonic())
            pids[key] = ti["pid"]
            if time.monotonic() - first < 1.5:  # let it get its requests in flight
                continue
            for name in cluster.worker_names:
                if ti["pid"] in cluster.components[name].session_pids():
                    cluster.components[name].kill()
                    return name, *key
        time.sleep(0.3)
    raise AssertionError(f"no chunk task seen running on a worker (task pids seen: {pids}): "
                         f"{api.describe(GENERATE, run_id)}")


@pytest.mark.timeout(420)
def test_run_survives_sigkill_of_a_celery_worker(cluster: AirflowCluster, api: AirflowApi, dataset: Path) -> None:
    output = cluster.root / "out-kill"
    run_id = api.trigger(GENERATE, _conf(dataset, output))
    killed, task_id, map_index = _kill_worker_running(cluster, api, run_id, timeout=180)
    assert not cluster.components[killed].alive
    survivors = [n for n in cluster.worker_names if n != killed]
    assert all(cluster.components[n].alive for n in survivors)

    _wait_success(cluster, api, GENERATE, run_id, timeout=300)
    lost = next(t for t in api.task_instances(GENERATE, run_id)
                if t["task_id"] == task_id and t["map_index"] == map_index)
    # The scheduler noticed the lost task (no heartbeat) and a surviving worker ran it again.
    assert lost["state"] == "success" and lost["try_number"] >= 2, lost
    _check_output(output, run_id)


@pytest.mark.timeout(240)
def test_rerun_failed_finds_nothing_to_do(cluster: AirflowCluster, api: AirflowApi) -> None:
    roots = [str(cluster.root / "out-full"), str(cluster.root / "out-kill")]
    _set_variable(api, "tracegen_output_roots", json.dumps(roots))
    api.wait_for_dag(RERUN)
    api.unpause(RERUN)
    run_id = api.trigger(RERUN, {})
    _wait_success(cluster, api, RERUN, run_id, timeout=180)

    found = api.xcom(RERUN, run_id, "find_unfinished_work")
    assert found == [], found
    reruns = [t for t in api.task_instances(RERUN, run_id) if t["task_id"] == "rerun_unfinished"]
    # Mapped over no work, the rerun task is one skipped instance: an empty list would prove nothing.
    assert reruns and all(t["state"] == "skipped" for t in reruns), reruns
    for root in roots:
        assert dataset_status(root)["left"] == 0


def _set_variable(api: AirflowApi, key: str, value: str) -> None:
    try:
        api.set_variable(key, value)
    except ClusterError:  # it exists: replace its value
        api._call("PATCH", f"/variables/{key}", json={"key": key, "value": value})


def _rerun_runs(api: AirflowApi) -> list[dict]:
    body = api._call("GET", f"/dags/{RERUN}/dagRuns", params={"limit": 100, "order_by": "start_date"})
    return body["dag_runs"]


def _generated(api: AirflowApi, rerun_id: str) -> list[dict]:
    """The rerun run's generation tasks that ran (not skipped)."""
    return [t for t in api.task_instances(RERUN, rerun_id)
            if t["task_id"] == "rerun_unfinished" and t["state"] not in ("skipped", None, "removed")]


ONE_WRITER_ROWS = 600


@pytest.mark.timeout(900)
def test_the_rerun_never_races_a_live_run_and_finishes_a_crashed_one(cluster: AirflowCluster,
                                                                      api: AirflowApi) -> None:
    """The rerun DAG unpaused on a one-minute schedule during a live multi-minute run generates none
    of its rows; the run's worker and scheduler then die (the run marked failed, as its retries would end
    it), and once the dead tasks' lease expires the next rerun finishes the run. No index is ever
    committed twice under one cap."""
    dataset = sample_prompts(cluster.root / "prompts-one-writer.jsonl", ONE_WRITER_ROWS)
    output = cluster.root / "out-one-writer"
    _set_variable(api, "tracegen_output_roots", json.dumps([str(output)]))
    api.unpause(RERUN)
    before = {r["dag_run_id"] for r in _rerun_runs(api)}
    # Triggered 10 to 30 s before a minute starts, so the rerun the scheduler starts on that minute runs beside
    # the run's first minute of generating, whatever the clock says: triggered just after a minute, the
    # rerun would come about 70 s in, and the run could finish before step 2 sees a chunk task to kill.
    second = time.time() % 60
    time.sleep(0 if 30 <= second < 50 else (40 - second) % 60)
    run_id = api.trigger(GENERATE, {**_conf(dataset, output), "teardown": False})

    # 1. Live: wait for a scheduled rerun that started and ended while the run was generating.
    live: list[str] = []
    deadline = time.monotonic() + 240
    while not live and time.monotonic() < deadline:
        assert api.run(GENERATE, run_id)["state"] in ("queued", "running"), (
            f"the run ended before a rerun ran beside it: {api.describe(GENERATE, run_id)}")
        for r in _rerun_runs(api):
            if r["dag_run_id"] not in before and r["state"] in ("success", "failed"):
                live.append(r["dag_run_id"])
        time.sleep(2)
    assert live, "no scheduled rerun ran during the live run"
    assert api.run(GENERATE, run_id)["state"] == "running"
    for rerun_id in live:
        assert api.xcom(RERUN, rerun_id, "find_unfinished_work") == [], rerun_id
        assert _generated(api, rerun_id) == [], rerun_id

    # 2. The run's worker and the scheduler die; the run is failed (what its retries would come to).
    killed, _, _ = _kill_worker_running(cluster, api, run_id, timeout=120)
    cluster.components["scheduler"].kill()
    api._call("PATCH", f"/dags/{GENERATE}/dagRuns/{run_id}", json={"state": "failed"})
    crashed_at = time.time()
    left_at_crash = dataset_status(str(output))["left"]
    assert left_at_crash > 0, "the run finished before the crash"
    cluster.restart("scheduler")
    cluster.restart(killed)

    # 3. A rerun finishes it, once the dead tasks' leases (20 s) have expired.
    deadline = time.monotonic() + 480
    while dataset_status(str(output))["left"] and time.monotonic() < deadline:
        time.sleep(5)
    status = dataset_status(str(output))
    assert status["left"] == 0, f"{status}; reruns: {[(r['dag_run_id'], r['state']) for r in _rerun_runs(api)]}"
    finishers = [r["dag_run_id"] for r in _rerun_runs(api) if r["dag_run_id"] not in before
                 and r["dag_run_id"] not in live and _generated(api, r["dag_run_id"])]
    assert finishers, "rows were finished, but by no rerun task"
    # The first rerun that found work began once the dead tasks' leases had expired: no other writer was
    # left, so none of its chunk tasks yielded (the tasks of one rerun run share the root). Its last rows can
    # be committed while their task is still finishing, so its states are read once the run has ended.
    api.wait_run(RERUN, finishers[0], timeout=120)
    first = [t for t in api.task_instances(RERUN, finishers[0]) if t["task_id"] == "rerun_unfinished"]
    assert first and all(t["state"] == "success" for t in first), (
        [(t["map_index"], t["state"]) for t in first if t["state"] != "success"])
    output_root = OutputRoot(open_storage(str(output)))
    assert output_root.repair.check_invariants(deep=True) == []
    frame = output_root.snapshots.frame()
    kept = frame[frame["status"] != FAILED]
    twice = kept.groupby(["index", "max_tokens"]).size()
    assert (twice == 1).all(), f"indices committed twice under one cap: {twice[twice > 1].head()}"
    assert sorted(set(kept["index"])) == list(range(ONE_WRITER_ROWS))
    print(f"one writer: {len(live)} live reruns found nothing; {left_at_crash} rows left at the crash "
          f"({crashed_at:.0f}) finished by {len(finishers)} rerun runs")
