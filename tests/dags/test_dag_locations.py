"""The real DAGs, run with `airflow dags test` as a trigger would: where a run reads and writes is the operator's
choice (TRACEGEN_WRITE_PREFIXES, TRACEGEN_READ_PREFIXES in the environment), never the trigger's conf.

Before, `tracegen_export` (conf default overwrite on) replaced another root's published export with its own rows
and removed the old files, and created a directory tree wherever `dest_uri` said; `tracegen_generate` created
and wrote whatever `output_uri` named. Now each is refused, naming the param and the setting, with nothing written.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from e2e.airflow_cluster import free_port
from engine_support.dags_test import DagsTest
from engine_support.helpers import make_config, prepare, root_of, write_dataset

from tracegen.export import export_dataset
from tracegen.store.records import OK, GeneratedRow, pack_token_ids

ROOT = Path(__file__).resolve().parents[2]
WRITE, READ = "TRACEGEN_WRITE_PREFIXES", "TRACEGEN_READ_PREFIXES"


@pytest.fixture(scope="module")
def airflow_env(tmp_path_factory):
    """A migrated SQLite metadata DB; only `allowed/` may be written, and `datasets/` read, besides it."""
    home = tmp_path_factory.mktemp("locations")
    (home / "allowed").mkdir()
    env = {
        **os.environ,
        "AIRFLOW_HOME": str(home / "airflow"),
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home}/airflow.db",
        "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "dags"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "PYTHONPATH": str(ROOT / "include"),
        "TRACEGEN_STATE_DIR": str(home / "state"),
        "TRACEGEN_SPOOL_DIR": str(home / "state" / "spool"),
        "TRACEGEN_SIM_PORT": str(free_port(2)),
        WRITE: str(home / "allowed"),
        READ: str(home / "datasets"),
    }
    subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], env=env, check=True, capture_output=True,
                   timeout=300)
    with DagsTest(env, ROOT / "dags") as dags:
        yield home, dags


def _dags_test(dags: DagsTest, dag_id: str, conf: dict) -> str:
    done = dags.run(dag_id, conf, timeout=300)
    return done.stdout + done.stderr


def _root(base: Path, name: str, rows: int, monkeypatch) -> Path:
    monkeypatch.setenv(WRITE, str(base))
    dataset = write_dataset(base / f"{name}.jsonl", rows)
    config = make_config(dataset, base / name)
    prepare(config, "run-a")
    root_of(config).commits.commit(
        [GeneratedRow(index=i, status=OK, max_tokens=4096, run_id="run-a", chunk=0, finish_reason="stop",
                      content=f"{name} {i}", reasoning_content="t", prompt_tokens=3, completion_tokens=4, attempt=1,
                      server="http://127.0.0.1:1", prompt_token_ids=pack_token_ids(range(3)),
                      response_token_ids=pack_token_ids([7, 8, 151645])) for i in range(rows)], "run-a", 0, "seg-a")
    return base / name


def _files(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_the_export_dag_writes_nothing_outside_the_prefixes(airflow_env, monkeypatch):
    home, dags = airflow_env
    root = _root(home / "allowed", "root-x", 3, monkeypatch)
    dest = home / "elsewhere" / "export"
    log = _dags_test(dags, "tracegen_export", {"output_uri": str(root), "dest_uri": str(dest)})
    assert "dest_uri" in log and "TRACEGEN_WRITE_PREFIXES" in log, log[-3000:]
    assert not dest.exists() and not dest.parent.exists()


def test_the_export_dag_never_replaces_another_roots_export(airflow_env, monkeypatch):
    home, dags = airflow_env
    allowed = home / "allowed"
    dest = allowed / "drafter"
    published = export_dataset(str(_root(allowed, "root-a", 9, monkeypatch)), str(dest), layout="tokens")
    assert published.rows == 9
    before = _files(dest)
    other = _root(allowed, "root-b", 2, monkeypatch)

    # The conf default does not replace; asked to, it still refuses another root's export.
    log = _dags_test(dags, "tracegen_export", {"output_uri": str(other), "dest_uri": str(dest)})
    assert "is not empty" in log and "replace_existing_export" in log, log[-3000:]
    log = _dags_test(dags, "tracegen_export", {"output_uri": str(other), "dest_uri": str(dest),
                                              "replace_existing_export": True})
    assert "holds the export of another output root" in log, log[-3000:]
    assert _files(dest) == before


@pytest.mark.parametrize("field", ["output_uri", "dataset_uri"])
def test_the_generate_dag_refuses_a_location_outside_the_prefixes_before_any_write(airflow_env, field):
    home, dags = airflow_env
    (home / "datasets").mkdir(exist_ok=True)
    dataset = write_dataset(home / "datasets" / "prompts.jsonl", 5)
    outside = {"output_uri": str(home / "elsewhere" / "out"),
               "dataset_uri": str(write_dataset(home / "prompts.jsonl", 5))}
    # teardown: were the run to go on, its stand-ins would not outlive it.
    conf = {"dataset_uri": str(dataset), "output_uri": str(home / "allowed" / f"out-{field}"), "pilot_size": 0,
            "teardown": True, field: outside[field]}
    log = _dags_test(dags, "tracegen_generate", conf)
    assert f"{field}: " in log and "outside the prefixes" in log, log[-3000:]
    assert not (home / "elsewhere").exists() and not (home / "allowed" / f"out-{field}").exists()
    assert not (home / "state" / "fleet").exists()  # no server was launched either
