"""`tracegen_generate` end to end on real SGLang: `airflow dags test` of the real DAG file, whose fleet is the
real `sglang.launch_server` fixtures.real_sglang launched (the run's provision task finds it healthy and reuses
it), a few dozen of the bundled prompts at a small cap: pilot, gate, chunks, report, then the export.

The tiny model's weights are random: it rarely ends a row by itself and often loops, so the gate only warns and
the export keeps truncated rows and runaways; what is checked is that every row of the dataset reaches the ledger
from real SGLang's answers, held to the cap and to its token counts, and comes out of the export as it went in.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from engine_support.dags_test import DagsTest, migrated_env

from tracegen.audit.gate import STOP
from tracegen.config import SAMPLE_DATASET
from tracegen.export import export_dataset
from tracegen.status import dataset_status
from tracegen.store.current import current_rows
from tracegen.store.records import OK
from tracegen.store.root import OutputRoot
from tracegen.store.storage import open_storage

pytestmark = pytest.mark.real_sglang

ROOT = Path(__file__).resolve().parents[2]
N_ROWS, CAP = 24, 48


@pytest.fixture(scope="module")
def dags(tmp_path_factory, sshd):
    # The real server's fleet file is written under pytest's temporary directory.
    env = migrated_env(tmp_path_factory.mktemp("airflow-home"), ROOT, tmp_path_factory.getbasetemp())
    with DagsTest(env, ROOT / "dags") as runner:
        yield runner


@pytest.mark.timeout(900)
def test_a_generate_run_on_real_sglang_fills_the_ledger_and_exports(dags, real_sglang, tmp_path):
    dataset = tmp_path / "prompts.jsonl"
    with gzip.open(SAMPLE_DATASET, "rt") as src, dataset.open("w") as dst:
        for _, line in zip(range(N_ROWS), src, strict=False):
            dst.write(line)
    output = tmp_path / "output"
    conf = {"dataset_uri": str(dataset), "output_uri": str(output), "fleet": str(real_sglang.fleet_file),
            "max_tokens": CAP, "pilot_size": 8, "chunk_size": 10, "gate_mode": "warn", "runaway_policy": "keep",
            "measure_tail": "never"}
    result = dags.run("tracegen_generate", conf, timeout=800)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]

    # Every row from real SGLang, each held to the cap it was asked at.
    st = dataset_status(str(output))
    assert st["total"] == st["done"] == N_ROWS and st["left"] == 0
    root = OutputRoot(open_storage(str(output)))
    assert root.repair.check_invariants() == []
    current = current_rows(root.snapshots.frame())
    assert len(current) == N_ROWS and set(current["status"]) == {OK}
    assert set(current["max_tokens"]) == {CAP}
    assert (current["completion_tokens"] <= CAP).all() and (current["completion_tokens"] > 0).all()
    assert set(current["finish_reason"]) <= {"stop", "length", "loop", "tool_calls"}
    # The provision task reused the healthy server the fixture launched: the ledger names its one GPU.
    host = real_sglang.spec.hosts[0]
    assert set(current["server"]) == {f"{host.conn_id}:gpu0"}

    # The report was written and judged the run (pilot and final), from real SGLang's rows.
    runs = list(root.run_files.runs())
    assert len(runs) == 1
    report = json.loads(root.run_files.get(runs[0], "report.json"))
    # Nearly every row of a random model is cut at this cap: over the threshold, and gate_mode=warn went on.
    assert report["verdict"]["verdict"] == STOP and report["verdict"]["truncated"] > 0
    assert json.loads(root.run_files.get(runs[0], "pilot-report.json"))

    # The export holds every row once, each ending with the turn real SGLang generated.
    dest = tmp_path / "export"
    export_dataset(str(output), str(dest), layout="conversations", include_truncated=True)
    manifest = json.loads((dest / "manifest.json").read_text())
    rows = [json.loads(line) for line in (dest / manifest["data_file"]).read_text().splitlines()]
    assert len(rows) == N_ROWS and len({r["id"] for r in rows}) == N_ROWS
    assert all(r["conversations"][-1]["role"] == "assistant" for r in rows)
