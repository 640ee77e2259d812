"""`tracegen_generate` and `tracegen_rerun_failed` end to end with `airflow dags test` on SQLite.

Real components: stand-in servers launched over a real OpenSSH sshd (host keys verified), output on an
S3-compatible server through the real AWS connection, the real DAG files. The stand-in's "short" length
model is the reference job's distribution at 1/40 scale, so cap 100 plays the reference job's 4096 and 200 plays 8192.
"""

from __future__ import annotations

import gzip
import json
import sys
import uuid
from pathlib import Path

import httpx
import numpy as np
import pytest
from engine_support.dags_test import DagsTest, migrated_env
from fixtures.ports import free_port
from fixtures.procs import is_alive

from tracegen.config import SAMPLE_DATASET, RunConfig
from tracegen.export import export_dataset
from tracegen.fleet import FleetSpec, status, teardown
from tracegen.run.plan import pilot_indices
from tracegen.status import dataset_status
from tracegen.store.records import FAILED, GeneratedRow
from tracegen.store.root import OutputRoot
from tracegen.store.storage import open_storage

ROOT = Path(__file__).resolve().parents[2]
N_ROWS = 600


@pytest.fixture(scope="module")
def airflow_env(tmp_path_factory, sshd, s3):
    """A migrated SQLite metadata DB and the environment every `airflow` command of this module uses."""
    # The fleet files the tests' triggers name are written under pytest's temporary directory.
    return migrated_env(tmp_path_factory.mktemp("airflow-home"), ROOT, tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def dags(airflow_env):
    """`airflow dags test` of this project's DAGs with that environment (engine_support.dags_test)."""
    with DagsTest(airflow_env, ROOT / "dags") as runner:
        yield runner


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    """The first N_ROWS bundled prompts as plain JSONL."""
    path = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    with gzip.open(SAMPLE_DATASET, "rt") as src, path.open("w") as dst:
        for _, line in zip(range(N_ROWS), src, strict=False):
            dst.write(line)
    return str(path)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, sshd):
    """Two stand-ins on 'GPU host' fleet_ssh, reached over SSH, stopped at the end by process group."""
    work = tmp_path_factory.mktemp("fleet")
    spec = {
        "hosts": [{"conn_id": sshd.conn_id, "gpus": [0, 1], "base_port": free_port(2)}],
        "model_path": "Qwen/Qwen3.6-27B",
        "served_model_name": "qwen-test",
        "python": sys.executable,
        "launch_module": "tracegen.simulator",
        "sglang_flags": {
            "--reasoning-parser": "qwen3",
            "--max-running-requests": 32,
            "--enable-metrics": True,
            "--sim-length-model": "short",
            "--sim-time-scale": 1000,
        },
        "work_dir": str(work / "remote"),
        "health_timeout_s": 60,
        "stop_timeout_s": 10,
    }
    path = work / "fleet.json"
    path.write_text(json.dumps(spec))
    yield path
    teardown(FleetSpec.from_dict(spec))


def base_conf(dataset: str, output: str, fleet: Path, **overrides) -> dict:
    conf = {"dataset_uri": dataset, "output_uri": output, "fleet": str(fleet), "pilot_size": 300,
            "chunk_size": 200, "max_tokens": 200}
    conf.update(overrides)
    return conf


def root_of(output: str) -> OutputRoot:
    return OutputRoot(open_storage(output))


def assert_complete_and_clean(output: str) -> None:
    root = root_of(output)
    assert root.repair.check_invariants() == []
    st = dataset_status(output)
    assert st["done"] == N_ROWS and st["left"] == 0
    frame = root.snapshots.frame()
    # The ledger invariant (docs/architecture.md): done indices == unique indices across committed parts.
    assert frame["index"].nunique() == N_ROWS


def newest_run(root: OutputRoot) -> str:
    runs = {r: json.loads(root.run_files.get(r, "run.json"))["created_at"] for r in root.run_files.runs()
            if _has(root, r, "run.json")}
    return max(runs, key=runs.get)


def _has(root: OutputRoot, run_id: str, name: str) -> bool:
    try:
        root.run_files.get(run_id, name)
        return True
    except KeyError:
        return False


@pytest.mark.timeout(600)
def test_gate_stops_then_the_pivot_resumes_without_regenerating(dags, dataset, fleet, s3_uri, tmp_path):
    # 1. The reference job's cap: the pilot gate stops the run (gate_mode=stop: an unattended run, nobody to ask).
    # Six chunks of 100: the first three run beside the pilot (and stop with its gate), the other three
    # wait for the gate and never start.
    # measure_tail="never": this test is about the pivot continuing what the pilot cut at 100. Measuring the
    # tail (the default, and cheap at 4 x 100 tokens) would already have continued those rows.
    result = dags.run("tracegen_generate",
                      base_conf(dataset, s3_uri, fleet, max_tokens=100, chunk_size=100, gate_mode="stop",
                                measure_tail="never"))
    # Stopped by the gate is not a failure: the gate's task and the chunks after it are skipped.
    assert result.returncode == 0, result.stdout[-3000:]
    root = root_of(s3_uri)
    run1 = newest_run(root)
    pilot = json.loads(root.run_files.get(run1, "pilot-report.json"))
    assert pilot["verdict"]["verdict"] == "stop"
    assert "> 5.0% at max_tokens=100" in pilot["verdict"]["reason"]
    assert pilot["cap_table"]["recommended_cap"] is not None
    frame = root.snapshots.frame()
    pilot_rows = set(pilot_indices(RunConfig(dataset_uri=dataset, output_uri=s3_uri, pilot_size=300), N_ROWS).tolist())
    beyond_pilot = set(frame["index"].tolist()) - pilot_rows
    assert pilot_rows <= set(frame["index"].tolist())
    assert all(i < 300 for i in beyond_pilot), "a chunk past the gate ran although the gate said stop"
    assert frame["index"].is_unique  # the chunks beside the pilot left the pilot's rows to it
    kept = frame[frame["finish_reason"] != "length"]["index"].to_numpy()
    truncated = set(frame.loc[frame["finish_reason"] == "length", "index"].tolist())

    # 2. The pivot, with the default policy: a higher cap continues what was truncated from its tokens
    # and generates what was never generated.
    result = dags.run("tracegen_generate", base_conf(dataset, s3_uri, fleet, max_tokens=200))
    assert result.returncode == 0, result.stdout[-3000:]
    assert_complete_and_clean(s3_uri)
    root = root_of(s3_uri)
    run2 = newest_run(root)
    frame = root.snapshots.frame()
    mine = frame[frame["run_id"] == run2]
    assert not np.isin(kept, mine["index"].to_numpy()).any()  # finished rows were kept, not generated again
    extended = mine[mine["pivot"] == "extended"]
    assert set(extended["index"].tolist()) == truncated and (extended["prefix_tokens"] == 100).all()
    assert mine.loc[~mine["index"].isin(truncated), "pivot"].isna().all()  # the rest: first generations
    report = json.loads(root.run_files.get(run2, "report.json"))
    assert report["verdict"]["verdict"] == "pass"
    assert report["audit"]["pivot"]["extended"] == len(truncated) and "pivot:" in report["summary"]
    # What the servers said about themselves when the fleet came up is kept beside the run, and an export's
    # manifest names it as the provenance of its tokens.
    served = json.loads(root.run_files.get(run2, "servers.json"))
    assert served["agree"] and served["model_path"] and served["sglang_version"] and len(served["servers"]) == 2
    exported = export_dataset(s3_uri, str(tmp_path / "export"), layout="tokens")
    provenance = json.loads((tmp_path / "export" / "manifest.json").read_text())["provenance"]
    assert exported.rows > 0 and provenance["servers_note"] is None
    assert (provenance["servers"]["model_path"], provenance["servers"]["sglang_version"]) == (
        served["model_path"], served["sglang_version"])

    # 3. Same cap again: nothing left, nothing generated, the run still succeeds.
    before = len(frame)
    result = dags.run("tracegen_generate", base_conf(dataset, s3_uri, fleet, max_tokens=200))
    assert result.returncode == 0, result.stdout[-3000:]
    assert len(root_of(s3_uri).snapshots.frame()) == before


def test_a_server_dying_mid_run_loses_nothing(dags, dataset, fleet, s3_uri):
    spec = FleetSpec.from_json(fleet.read_text())
    first = spec.hosts[0].port(0)
    # Make sure the servers are up (reused by the run), then arm GPU 0 to crash after 80 requests.
    from tracegen.fleet import provision

    crashing_pid = provision(spec)[0].pid
    httpx.post(f"http://127.0.0.1:{first}/sim/faults", json={"crash_after": 80}, timeout=10).raise_for_status()
    result = dags.run("tracegen_generate", base_conf(dataset, s3_uri, fleet, pilot_size=0))
    assert result.returncode == 0, result.stdout[-3000:]
    assert_complete_and_clean(s3_uri)
    assert not is_alive(crashing_pid), "the armed server never crashed: the test proved nothing"
    frame = root_of(s3_uri).snapshots.frame()
    assert frame["index"].is_unique  # every row exactly once
    # Rows name the GPU that made them, not the task's SSH tunnel port.
    assert set(frame["server"]) == {f"{spec.hosts[0].conn_id}:gpu0", f"{spec.hosts[0].conn_id}:gpu1"}


@pytest.mark.timeout(600)  # three `airflow dags test` runs of 600 and 400 rows: 150-360 s on 2 cores
def test_teardown_then_rerun_failed_repairs_injected_failures_then_idles(dags, dataset, fleet, s3_uri):
    from tracegen.fleet import provision

    spec = FleetSpec.from_json(fleet.read_text())
    pids = [h.pid for h in provision(spec)]  # the servers this run reuses
    result = dags.run("tracegen_generate", base_conf(dataset, s3_uri, fleet, pilot_size=0, teardown=True))
    assert result.returncode == 0, result.stdout[-3000:]
    # teardown=true: every server's process group is gone, checked by pid.
    assert [s.healthy for s in status(spec)] == [False, False]
    for pid in pids:
        assert not is_alive(pid), f"server pid {pid} outlived teardown"

    root = root_of(s3_uri)
    run = newest_run(root)
    # Inject: one chunk's commits vanish (its task died before committing) and 25 rows of another chunk
    # are recorded as failed (their retries ran out).
    entries = [k for k in root.commits.entries() if "/c00001-" in k]
    assert entries
    for key in entries:
        root.storage.delete(key)
    for key in [k for k in root.commits.entries() if "/c00002-" in k]:
        root.storage.delete(key)
    rows = [GeneratedRow(index=i, status=FAILED, max_tokens=200, run_id=run, chunk=2,
                         error="injected: 6 attempts failed") for i in range(400, 425)]
    root.commits.commit(rows, run, 2, f"injected-{uuid.uuid4().hex[:8]}")
    assert dataset_status(s3_uri)["left"] == 200 + 200

    # The scheduled DAG relaunches the operator's fleet (TRACEGEN_FLEET: the same file the run recorded by
    # digest) and finishes both chunks with the run's own config.
    roots = {"AIRFLOW_VAR_TRACEGEN_OUTPUT_ROOTS": json.dumps([s3_uri]), "TRACEGEN_FLEET": str(fleet)}
    result = dags.run("tracegen_rerun_failed", extra_env=roots)
    assert result.returncode == 0, result.stdout[-3000:]
    assert_complete_and_clean(s3_uri)

    # Nothing failed any more: the scheduled DAG finds no work and maps nothing.
    before = len(root_of(s3_uri).snapshots.frame())
    result = dags.run("tracegen_rerun_failed", extra_env=roots)
    assert result.returncode == 0, result.stdout[-3000:]
    assert len(root_of(s3_uri).snapshots.frame()) == before


def test_a_bad_fleet_flag_fails_the_run_naming_it_before_anything_starts(dags, dataset, fleet, tmp_path):
    # prepare_run validates the params before it writes anything, and nothing is launched before it.
    spec = json.loads(fleet.read_text())
    port = free_port(2)
    spec["hosts"][0]["base_port"] = port
    spec["sglang_flags"]["--max-running-requests"] = "lots"
    bad_fleet = tmp_path / "bad-fleet.json"
    bad_fleet.write_text(json.dumps(spec))
    output = tmp_path / "out"
    result = dags.run("tracegen_generate", base_conf(dataset, str(output), bad_fleet))
    assert result.returncode != 0
    logs = result.stdout + result.stderr
    assert "sglang_flags[--max-running-requests]: 'lots' must be a positive integer" in logs, logs[-3000:]
    assert not output.exists() or not any(output.rglob("*")), "the output root was written to"
    for gpu in (0, 1):
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{port + gpu}/health", timeout=2)


@pytest.mark.timeout(600)
def test_the_bundled_sft_conversations_generate_each_assistant_turn_through_the_dag(dags, fleet, s3_uri, tmp_path):
    # ShareGPT rows that end with their own answers, read with turns=each: one row per assistant turn, counted
    # as rows by the plan, the ledger, status and the export, each turn after its real history.
    from tracegen.sample_data import SFT_SAMPLE_DATASET

    output = s3_uri
    conf = base_conf(str(SFT_SAMPLE_DATASET), output, fleet, turns="each", pilot_size=40, chunk_size=60,
                     runaway_policy="keep",
                     gate_mode="warn")
    result = dags.run("tracegen_generate", conf)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    st = dataset_status(output)
    assert st["total"] == st["done"] == 156 and st["left"] == 0  # 40 conversations, 156 assistant turns
    dest = tmp_path / "conv"
    export_dataset(output, str(dest), layout="conversations", include_truncated=True)
    manifest = json.loads((dest / "manifest.json").read_text())
    rows = [json.loads(line) for line in (dest / manifest["data_file"]).read_text().splitlines()]
    assert len(rows) == 156 and len({r["id"] for r in rows}) == 156
    by_id = {r["id"]: r["conversations"] for r in rows}
    first, second = by_id["sft-0000#turn-1"], by_id["sft-0000#turn-2"]
    # Turn 1 is the first tool call, made after the user's request; turn 2 sees that call and its result.
    assert [m["role"] for m in first] == ["system", "user", "assistant"]
    assert [m["role"] for m in second] == ["system", "user", "assistant", "tool", "assistant"]
    assert all(c[-2]["role"] in ("user", "tool") for c in by_id.values())
