"""A conf key no param of the DAG declares fails the run's task, naming the key and the closest param:
Airflow merges such keys into the params as they are, and nothing would read them."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from airflow.sdk.definitions.param import process_params
from airflow.sdk.exceptions import AirflowFailException
from engine_support.helpers import write_dataset

from tracegen import steps

DAGS = Path(__file__).resolve().parents[2] / "dags"


@pytest.fixture(scope="module")
def dagbag():
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(str(DAGS))


def _context(dagbag, dag_id: str, task_id: str, conf: dict, **more) -> dict:
    """A task's context as Airflow builds it for a DagRun triggered with `conf`: the DAG's and the task's
    params merged with the conf (`process_params`, what the task runner calls)."""
    dag = dagbag.dags[dag_id]
    task = dag.get_task(task_id)
    params = process_params(dag, task, conf, suppress_exception=False)
    return {"dag": dag, "task": task, "dag_run": SimpleNamespace(conf=conf), "params": params,
            "run_id": "manual__2026-12-03T13:00:00+00:00", **more}


def test_misspelt_generate_conf_fails_prepare_run_naming_each_key(dagbag, tmp_path, monkeypatch) -> None:
    dataset = write_dataset(tmp_path / "d.jsonl", 20)
    conf = {"dataset_uri": str(dataset), "output_uri": str(tmp_path / "out"), "pilot_size": 0,
            "max_token": 16384, "truncation_treshold": 0.01}
    ctx = _context(dagbag, "tracegen_generate", "prepare_run", conf)
    assert ctx["params"]["max_token"] == 16384 and ctx["params"]["max_tokens"] == 4096  # what Airflow hands over
    monkeypatch.setattr(steps, "_context", lambda: ctx)
    with pytest.raises(AirflowFailException) as refused:
        steps.prepare_run(1)
    message = str(refused.value)
    assert "'max_token' (did you mean 'max_tokens'?)" in message
    assert "'truncation_treshold' (did you mean 'truncation_threshold'?)" in message
    assert not (tmp_path / "out" / "runs").exists()  # nothing written for a run that was not meant


@pytest.mark.parametrize(("dag_id", "task_id", "call", "conf", "named"), [
    ("tracegen_raise_cap", "raise_cap", steps.raise_cap, {"run_id": "r", "max_tokens": 8192, "max_token": 1},
     "'max_token' (did you mean 'max_tokens'?)"),
    ("tracegen_fleet", "fleet_action", steps.fleet_action, {"action": "status", "fleet": "local-sim", "acton": "stop"},
     "'acton' (did you mean 'action'?)"),
    ("tracegen_rerun_failed", "find_unfinished_work", steps.find_unfinished_work, {"output_uri": "/x"},
     "'output_uri'"),
])
def test_every_dag_taking_conf_refuses_unknown_keys(dagbag, monkeypatch, dag_id, task_id, call, conf, named) -> None:
    ctx = _context(dagbag, dag_id, task_id, conf, ti=None)
    monkeypatch.setattr(steps, "_context", lambda: ctx)
    with pytest.raises(AirflowFailException, match="unknown conf key") as refused:
        call()
    assert named in str(refused.value)


def test_the_export_task_refuses_unknown_keys_before_exporting(dagbag, tmp_path, monkeypatch) -> None:
    conf = {"output_uri": str(tmp_path / "out"), "dest_uri": str(tmp_path / "dest"), "layout": "tokens",
            "include_truncted": True}
    ctx = _context(dagbag, "tracegen_export", "export", conf)
    monkeypatch.setattr(steps, "_context", lambda: ctx)
    with pytest.raises(AirflowFailException, match=r"'include_truncted' \(did you mean 'include_truncated'\?\)"):
        dagbag.dags["tracegen_export"].get_task("export").python_callable(params=ctx["params"], outlet_events={})
    assert not (tmp_path / "dest").exists()


def test_known_keys_and_no_conf_pass() -> None:
    from tracegen.config import ConfigError, check_conf_keys

    check_conf_keys({"a": 1}, {"a", "b"}, dag_id="d")
    check_conf_keys(None, {"a"}, dag_id="d")
    check_conf_keys({}, set(), dag_id="d")
    with pytest.raises(ConfigError, match="'zzz': d takes a, b"):
        check_conf_keys({"zzz": 1}, {"a", "b"}, dag_id="d")
    with pytest.raises(ConfigError, match="JSON object"):
        check_conf_keys([1], {"a"}, dag_id="d")
