"""`airflow dags test` of the real `tracegen_generate` DAG with `turns=chain` on the bundled chat sample (12
conversations, 34 turns), on two local stand-ins: every turn generated after the model's own earlier answers,
no conversation split between chunks or between the pilot and a chunk, and the `conversations` export one
regenerated conversation a row. Small on purpose: one DAG run, short answers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from engine_support.dags_test import DagsTest, migrated_env
from fixtures.ports import free_port

from tracegen.dataset.stored import load_index
from tracegen.export import export_dataset
from tracegen.fleet import FleetSpec, teardown
from tracegen.sample_data import CHAT_SAMPLE_DATASET, CHAT_SAMPLE_ROWS, CHAT_SAMPLE_TURNS
from tracegen.status import dataset_status
from tracegen.store.root import open_root

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def chain_env(tmp_path_factory):
    home = tmp_path_factory.mktemp("chain-dag")
    fleets = home / "fleets"
    fleets.mkdir()
    spec = {
        "hosts": [{"conn_id": "local", "gpus": [0, 1], "base_port": free_port(2)}],
        "model_path": "Qwen/Qwen3.6-27B", "served_model_name": "qwen-test", "python": sys.executable,
        "launch_module": "tracegen.simulator",
        "sglang_flags": {"--reasoning-parser": "qwen3", "--max-running-requests": 32, "--context-length": 40960,
                         "--sim-length-model": "short", "--sim-time-scale": 1000},
        "work_dir": str(home / "remote"), "health_timeout_s": 60, "stop_timeout_s": 10,
    }
    fleet = fleets / "fleet.json"
    fleet.write_text(json.dumps(spec))
    env = migrated_env(home / "airflow", ROOT, fleets)
    try:
        with DagsTest(env, ROOT / "dags") as dags:
            yield home, fleet, dags
    finally:
        teardown(FleetSpec.from_dict(spec))


@pytest.mark.timeout(600)
def test_the_chat_sample_chains_through_the_generate_dag(chain_env, tmp_path):
    home, fleet, dags = chain_env
    output = str(home / "airflow" / "state" / "chain-out")
    conf = {"dataset_uri": str(CHAT_SAMPLE_DATASET), "output_uri": output, "fleet": str(fleet), "turns": "chain",
            "pilot_size": 8, "chunk_size": 10, "max_tokens": 4096, "gate_mode": "warn"}
    result = dags.run("tracegen_generate", conf)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    st = dataset_status(output)
    assert st["total"] == st["done"] == CHAT_SAMPLE_TURNS and st["left"] == 0
    root = open_root(output)
    frame = root.snapshots.frame()
    index = load_index(root)
    conv = index.conversations(frame["index"].to_numpy())
    assert (frame.groupby(conv)["chunk"].nunique() == 1).all()  # a conversation's turns: one chunk
    assert frame["chunk"].nunique() > 2  # the pilot and several chunks
    dest = tmp_path / "conv"
    export_dataset(output, str(dest), layout="conversations")
    manifest = json.loads((dest / "manifest.json").read_text())
    rows = [json.loads(line) for line in (dest / manifest["data_file"]).read_text().splitlines()]
    assert len(rows) == CHAT_SAMPLE_ROWS and manifest["trainers"]["specforge"]["data.train_only_last_turn"] is False
    answers = {r.index: r.content for part in set(frame["part"]) for r in root.commits.read_part(part)}
    for c, row in enumerate(rows):
        first = index.first_prompt_row(c)
        mine = [answers[first + t] for t in range(index.prompt_rows_of(c))]
        assert [m["content"] for m in row["conversations"] if m["role"] == "assistant"] == mine
