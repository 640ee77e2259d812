"""A dataset of no rows fails `prepare_run` with a clear error, before anything is written: a run over it would
generate nothing and succeed, and the root would be bound to an empty file."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from engine_support.helpers import make_config, prepare

from tracegen.dataset.source import DatasetError


def _empty_parquet(path):
    pq.write_table(pa.table({"messages": pa.array([], pa.string())}), path)


@pytest.mark.parametrize("name, write", [
    ("empty.jsonl", lambda p: p.write_bytes(b"")),
    ("blank.jsonl", lambda p: p.write_bytes(b"\n  \n\t\n")),
    ("empty.parquet", _empty_parquet),
])
def test_an_empty_dataset_fails_prepare_run_and_writes_nothing(tmp_path, name, write):
    dataset = tmp_path / name
    write(dataset)
    out = tmp_path / "out"
    with pytest.raises(DatasetError, match=rf"dataset {dataset} holds no rows .*nothing to generate"):
        prepare(make_config(dataset, out), "run-empty")
    assert not out.exists() or not any(p.is_file() for p in out.rglob("*"))
