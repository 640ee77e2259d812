"""Two rows never share an id: a duplicate id, or a dataset id equal to another row's fallback id, is refused
when the dataset is indexed, naming both rows.

The export names each row by its id, its own or `index-<n>` when it has none: a dataset holding `same` twice
and `index-3` beside an id-less row 3 was exported as `['same', 'same', 'index-3', 'index-3']` without a word.
Checked in every format the index pass reads (plain JSONL, a gzip stream it copies, multi-member gzip read in
place, Parquet), and through `prepare_run`, which then writes nothing into the output root.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from engine_support.helpers import make_config, prepare, prompt

from tracegen.dataset.index import build_index, write_multimember_gzip
from tracegen.dataset.row_ids import line_id, row_id
from tracegen.dataset.source import DatasetError

N = 8


def _rows(ids: dict[int, object]) -> list[dict]:
    """N prompts; `ids` sets row i's id (None: the row has no id)."""
    rows = []
    for i in range(N):
        row = prompt(i)
        if i in ids:
            row.pop("id")
            if ids[i] is not None:
                row["id"] = ids[i]
        rows.append(row)
    return rows


def _write(path: Path, fmt: str, rows: list[dict]) -> Path:
    lines = [json.dumps(r).encode() + b"\n" for r in rows]
    if fmt == "jsonl":
        path.write_bytes(b"".join(lines))
    elif fmt == "gzip-stream":
        path.write_bytes(gzip.compress(b"".join(lines)))
    elif fmt == "gzip-members":
        with open(path, "wb") as fh:
            write_multimember_gzip(lines, fh, rows_per_member=3)
    else:
        table = pa.table({"id": [r.get("id") for r in rows],
                          "messages": [json.dumps(r["messages"]) for r in rows]})
        pq.write_table(table, path, row_group_size=3)
    return path


FORMATS = ["jsonl", "gzip-stream", "gzip-members", "parquet"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_duplicate_id_is_refused_naming_both_rows(tmp_path, fmt):
    path = _write(tmp_path / "prompts", fmt, _rows({1: "same", 5: "same"}))
    with pytest.raises(DatasetError, match=r"row 1 and row 5 are both 'same'"):
        build_index(str(path), cache_uri=str(tmp_path / "cache"))


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_dataset_id_equal_to_a_fallback_id_is_refused_naming_both_rows(tmp_path, fmt):
    path = _write(tmp_path / "prompts", fmt, _rows({3: None, 6: "index-3"}))
    with pytest.raises(DatasetError, match=r"row 3 \(no id of its own, so named 'index-3'\) and row 6 are both "
                                           r"'index-3'"):
        build_index(str(path), cache_uri=str(tmp_path / "cache"))


@pytest.mark.parametrize("fmt", FORMATS)
def test_unique_ids_and_rows_without_ids_are_indexed(tmp_path, fmt):
    # An integer id is named by its text, like a string one; ids of another form are not the fallback's.
    # (A Parquet column holds one type: there the integer is a string.)
    path = _write(tmp_path / "prompts", fmt, _rows({0: None, 2: "7" if fmt == "parquet" else 7, 4: None,
                                                    6: "index-x"}))
    assert build_index(str(path), cache_uri=str(tmp_path / "cache")).n_rows == N


def test_an_integer_id_and_its_text_are_one_id(tmp_path):
    path = _write(tmp_path / "prompts.jsonl", "jsonl", _rows({2: 7, 4: "7"}))
    with pytest.raises(DatasetError, match=r"row 2 and row 4 are both '7'"):
        build_index(str(path))


def test_the_ids_are_read_as_the_rows_are():
    assert line_id(b'{"id": "a", "messages": [], "id": "b"}') == "b"  # json.loads keeps the last
    assert line_id(b'{"id": 12, "x": NaN}') == 12  # JSON msgspec refuses, read as json.loads reads it
    assert line_id(b'{"id": "\\ud800"}') == "\ud800"
    assert line_id(b'{"id": 1, "x": ' + b"[" * 200_000) is None  # too deep for either parser: the rows' to name
    assert line_id(b'{"id": true}') is None and line_id(b"[1]") is None and line_id(b'{"id": ') is None
    assert row_id(None, 3) == "index-3" and row_id(3, 9) == "3"


def test_prepare_run_refuses_a_dataset_with_a_shared_id_and_writes_nothing(tmp_path):
    rows = _rows({1: "same", 2: "same", 3: None, 4: "index-3"})  # the finding's dataset
    dataset = _write(tmp_path / "prompts.jsonl", "jsonl", rows)
    out = tmp_path / "out"
    with pytest.raises(DatasetError) as info:
        prepare(make_config(dataset, out), "run-ids")
    message = str(info.value)
    assert "row 1 and row 2 are both 'same'" in message
    assert "row 3 (no id of its own, so named 'index-3') and row 4 are both 'index-3'" in message
    assert str(dataset) in message
    assert not (out / "dataset.json").exists() and not (out / "dataset" / "index.json").exists()
    assert not (out / "runs").exists()
