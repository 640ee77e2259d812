"""A dataset edited in place after a run indexed it.

Rows are paired with prompts by position. A file edited in place with the same byte size passes a size
check, so a later chunk would generate for the new prompts under the old fingerprint, and export would pair
the old completions with the new prompts. The run therefore records the file's size and version (mtime / ETag);
chunk reads and export compare them and re-hash when they differ, and refuse other bytes, naming the file
and both identities, before reading a row or writing anything. Checked on a local file and on the
S3-compatible server, through the chunk task's callable and the CLI.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from engine_support.helpers import ROOT, endpoints, make_config, prepare, root_of, write_dataset

from tracegen.dataset.blocks import DatasetChangedError
from tracegen.generate.chunk import run_chunk
from tracegen.run.records import latest_run
from tracegen.store.storage import open_storage

N_ROWS = 12


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "include")}
    return subprocess.run([sys.executable, "-m", "tracegen", *args], capture_output=True, text=True, env=env,
                          timeout=120, check=False)


def _same_size_edit(data: bytes) -> bytes:
    # "explain" -> "EXPLAIN": same length, other prompt text.
    edited = data.replace(b"Task 3: explain", b"Task 3: EXPLAIN")
    assert edited != data and len(edited) == len(data)
    return edited


def _generate(config, run_id, sim, spool, indices):
    root = root_of(config)
    spec = latest_run(root, config.aws_conn_id)
    assert spec is not None and spec.run_id == run_id
    return run_chunk(spec, root=root, chunk=0, label="chunk 0", indices=indices, endpoints=endpoints(sim),
                     spool_dir=str(spool))


def _committed(config) -> list[str]:
    return sorted(root_of(config).commits.entries())


def _check_refusals(config, run_id, sim, tmp_path, dataset_uri, original_fp):
    """After the same-size edit: a chunk, an export and a new run are refused; the committed data is intact."""
    before = _committed(config)
    with pytest.raises(DatasetChangedError) as info:
        _generate(config, run_id, sim, tmp_path / "spool", range(N_ROWS))
    message = str(info.value)
    assert dataset_uri in message and original_fp in message
    new_fp = message.split("it is now ")[1].split()[0]
    assert new_fp.startswith("sha256:") and new_fp != original_fp
    assert _committed(config) == before, "a refused chunk must not commit anything"

    dest = tmp_path / "export"
    result = _cli("export", config.output_uri, str(dest))
    assert result.returncode == 2, result
    assert dataset_uri in result.stderr and original_fp in result.stderr and new_fp in result.stderr
    assert not dest.exists() or not any(dest.iterdir()), "nothing is exported from an edited dataset"

    with pytest.raises(DatasetChangedError):
        prepare(config, run_id + "-again")
    assert root_of(config).repair.check_invariants(deep=True) == []
    assert _committed(config) == before


def test_a_local_dataset_edited_in_place_with_the_same_size_is_refused(tmp_path, sim_server):
    sim = sim_server(max_running_requests=8)
    dataset = write_dataset(tmp_path / "prompts.jsonl", N_ROWS)
    config = make_config(dataset, tmp_path / "out", part_rows=4)
    spec = prepare(config, "run-1")
    # The run records the file's identity, not only its fingerprint.
    assert spec.dataset.size == dataset.stat().st_size
    assert spec.dataset.version == f"mtime_ns:{dataset.stat().st_mtime_ns}"
    record = json.loads((tmp_path / "out" / "runs" / "run-1" / "run.json").read_text())
    assert record["dataset"]["version"] == spec.dataset.version
    _generate(config, "run-1", sim, tmp_path / "spool", range(6))

    # A touch (new mtime, same bytes) is not an edit: the file is re-hashed and the chunk goes on.
    original = dataset.read_bytes()
    st = dataset.stat()
    os.utime(dataset, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    _generate(config, "run-1", sim, tmp_path / "spool", range(6, 8))
    assert _cli("export", str(tmp_path / "out"), str(tmp_path / "export-touched")).returncode == 0

    dataset.write_bytes(_same_size_edit(original))
    assert dataset.stat().st_size == st.st_size
    _check_refusals(config, "run-1", sim, tmp_path, str(dataset), spec.dataset.fingerprint)

    # Restored, the run goes on and exports every row.
    dataset.write_bytes(original)
    _generate(config, "run-1", sim, tmp_path / "spool", range(N_ROWS))
    result = _cli("export", str(tmp_path / "out"), str(tmp_path / "export-final"), "--include-truncated")
    assert result.returncode == 0, result.stderr
    assert f"exported {N_ROWS} rows" in result.stdout


def test_an_s3_dataset_overwritten_with_the_same_size_is_refused(tmp_path, sim_server, s3, s3_uri):
    sim = sim_server(max_running_requests=8)
    local = write_dataset(tmp_path / "prompts.jsonl", N_ROWS)
    data_root = open_storage(s3_uri + "data")
    data_root.put("prompts.jsonl", local.read_bytes())
    dataset_uri = s3_uri + "data/prompts.jsonl"
    config = make_config(dataset_uri, s3_uri + "out", part_rows=4)
    spec = prepare(config, "run-s3")
    assert spec.dataset.version and spec.dataset.version.startswith("etag:")
    _generate(config, "run-s3", sim, tmp_path / "spool", range(6))

    # The same bytes PUT again: same ETag, nothing to re-hash.
    data_root.put("prompts.jsonl", local.read_bytes())
    _generate(config, "run-s3", sim, tmp_path / "spool", range(6, 8))

    data_root.put("prompts.jsonl", _same_size_edit(local.read_bytes()))
    _check_refusals(config, "run-s3", sim, tmp_path, dataset_uri, spec.dataset.fingerprint)


def test_records_without_a_version_still_read_and_check(tmp_path, sim_server):
    """A run.json and index written before versions were recorded decode, and an edit is still refused
    (by the fingerprint: the file is hashed once per process)."""
    from tracegen.dataset.stored import DATASET_INDEX_KEY, load_index
    from tracegen.run.spec import RunSpec

    sim = sim_server(max_running_requests=8)
    dataset = write_dataset(tmp_path / "prompts.jsonl", N_ROWS)
    config = make_config(dataset, tmp_path / "out", part_rows=4)
    spec = prepare(config, "run-old")
    doc = spec.to_json()
    del doc["dataset"]["size"], doc["dataset"]["version"]
    assert RunSpec.from_json(doc).dataset.version is None
    root = root_of(config)
    index = load_index(root)
    index.source_version = None
    old = index.to_json()
    del old["source_version"]
    root.storage.put(DATASET_INDEX_KEY, json.dumps(old).encode())
    _generate(config, "run-old", sim, tmp_path / "spool", range(4))
    dataset.write_bytes(_same_size_edit(dataset.read_bytes()))
    with pytest.raises(DatasetChangedError):
        _generate(config, "run-old", sim, tmp_path / "spool", range(N_ROWS))
    assert Path(tmp_path / "out" / "dataset" / "index.json").exists()
