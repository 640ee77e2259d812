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

from tracegen.dataset.blocks import DatasetBlockChangedError, DatasetChangedError
from tracegen.generate.chunk import run_chunk
from tracegen.generate.engine import ChunkOptions
from tracegen.run.run_record import latest_run
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
                     options=ChunkOptions(spool_dir=str(spool)))


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
    from tracegen.run.run_spec import RunSpec

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


def _member(text: bytes, size: int | None = None) -> bytes:
    """One gzip member of `text`, `size` bytes long (its header's file name pads it; 64 bytes of name without)."""
    import gzip
    import io

    name = 64 if size is None else size - len(gzip.compress(text, compresslevel=9, mtime=0)) - 1
    buf = io.BytesIO()
    with gzip.GzipFile(filename="x" * name, mode="wb", fileobj=buf, mtime=0, compresslevel=9) as gz:
        gz.write(text)
    assert size is None or len(buf.getvalue()) == size
    return buf.getvalue()


def _edit_keeping_size_and_mtime(path: Path, old: bytes, new: bytes) -> None:
    """The edit that size and mtime cannot see: same length, and the modification time put back."""
    st = path.stat()
    data = path.read_bytes()
    assert len(old) == len(new) and data.count(old) == 1
    path.write_bytes(data.replace(old, new))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns


@pytest.mark.parametrize("fmt", ["jsonl", "jsonl.gz", "parquet"])
def test_an_edit_that_keeps_size_and_mtime_is_refused_by_the_block_it_touched(tmp_path, sim_server, fmt):
    """A chunk hashes the blocks it reads: the edited one is refused, naming it and the dataset, and nothing
    is committed; a chunk whose blocks are untouched still reads them."""
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq

    from tracegen.dataset.index import build_index
    from tracegen.dataset.reader import read_rows

    sim = sim_server(max_running_requests=8)
    n_rows = 80  # three blocks of 32 rows (JSONL), or row groups of 32 rows (Parquet)
    plain = write_dataset(tmp_path / "prompts.jsonl", n_rows)
    if fmt == "jsonl":
        dataset = plain
    elif fmt == "jsonl.gz":  # members of 32 rows, read in place
        dataset = tmp_path / "prompts.jsonl.gz"
        lines = plain.read_bytes().splitlines(keepends=True)
        dataset.write_bytes(b"".join(_member(b"".join(lines[k : k + 32])) for k in range(0, n_rows, 32)))
    else:
        dataset = tmp_path / "prompts.parquet"
        rows = [json.loads(line) for line in plain.read_text().splitlines()]
        table = pa.table({"id": [r["id"] for r in rows], "category": [r["category"] for r in rows],
                          "messages": [json.dumps(r["messages"]) for r in rows]})
        pq.write_table(table, dataset, row_group_size=32, compression="none", use_dictionary=False)
    config = make_config(dataset, tmp_path / "out", part_rows=4)
    spec = prepare(config, "run-1")
    _generate(config, "run-1", sim, tmp_path / "spool", range(4))
    before = _committed(config)

    # Row 40 lies in block 1 (rows 32-63).
    if fmt == "jsonl.gz":
        # Block 1's member recompressed from edited text, to its old size (its header's file name pads it).
        members = dataset.read_bytes()
        begin, end = build_index(str(dataset)).block_span(1, 2)
        text = gzip.decompress(members[begin:end]).replace(b"Task 40: explain", b"Task 40: EXPLAIN")
        st = dataset.stat()
        dataset.write_bytes(members[:begin] + _member(text, end - begin) + members[end:])
        os.utime(dataset, ns=(st.st_atime_ns, st.st_mtime_ns))
    else:
        _edit_keeping_size_and_mtime(dataset, b"Task 40: explain", b"Task 40: EXPLAIN")

    what = "row group 1" if fmt == "parquet" else "block 1"
    with pytest.raises(DatasetBlockChangedError) as info:
        _generate(config, "run-1", sim, tmp_path / "spool", range(n_rows))
    message = str(info.value)
    assert f"dataset {dataset}: {what} (rows 32-63," in message and spec.dataset.fingerprint in message
    assert _committed(config) == before, "a refused chunk commits nothing"
    # Rows of the blocks nobody touched are still the ones indexed.
    from tracegen.dataset.stored import load_index

    index = load_index(root_of(config))
    assert len(list(read_rows(index, 64, n_rows))) == n_rows - 64
    # A new run is refused too: its first task hashes the file, whatever its size and mtime say.
    with pytest.raises(DatasetChangedError, match="changed since it was indexed"):
        prepare(config, "run-2")


def test_an_index_stored_before_blocks_were_hashed_still_checks_every_block(tmp_path, sim_server):
    """Such an index is read back with its blocks hashed from the file (checked against its fingerprint), so a
    chunk still refuses a block edited behind size and mtime; the next run's first task stores the hashes."""
    from tracegen.dataset.stored import DATASET_INDEX_KEY

    sim = sim_server(max_running_requests=8)
    dataset = write_dataset(tmp_path / "prompts.jsonl", 80)
    config = make_config(dataset, tmp_path / "out", part_rows=4)
    spec = prepare(config, "run-old")
    root = root_of(config)
    old = json.loads(root.storage.get(DATASET_INDEX_KEY))
    del old["block_hashes"], old["footer_hash"]
    root.storage.put(DATASET_INDEX_KEY, json.dumps(old).encode())
    _generate(config, "run-old", sim, tmp_path / "spool", range(4))
    assert "block_hashes" not in json.loads(root.storage.get(DATASET_INDEX_KEY)), "a chunk task writes no index"

    prepare(config, "run-new")
    assert json.loads(root.storage.get(DATASET_INDEX_KEY))["block_hashes"]
    root.storage.put(DATASET_INDEX_KEY, json.dumps(old).encode())
    before = _committed(config)
    _edit_keeping_size_and_mtime(dataset, b"Task 70: explain", b"Task 70: EXPLAIN")
    with pytest.raises(DatasetChangedError, match=rf"dataset {dataset} changed since it was indexed") as info:
        _generate(config, "run-new", sim, tmp_path / "spool", range(80))
    assert spec.dataset.fingerprint in str(info.value)
    assert _committed(config) == before
