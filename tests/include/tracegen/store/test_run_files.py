"""Run files: one dataset per root, run files beside the data under checked names."""

from __future__ import annotations

import pytest
from engine_support.store_rows import RUN

from tracegen.store.root import OutputRoot
from tracegen.store.run_files import DatasetMismatchError
from tracegen.store.storage import Storage


def test_dataset_fingerprint_is_bound_once(store: Storage) -> None:
    root = OutputRoot(store)
    assert root.run_files.dataset() is None
    root.run_files.bind_dataset("sha256:aaa", {"uri": "s3://in/data.jsonl", "n_rows": 10})
    root.run_files.bind_dataset("sha256:aaa")  # same dataset: fine, resumes
    with pytest.raises(DatasetMismatchError, match="already holds dataset 'sha256:aaa'.*'sha256:bbb'"):
        OutputRoot(store).run_files.bind_dataset("sha256:bbb")
    assert root.run_files.dataset()["info"]["n_rows"] == 10


def test_run_files(store: Storage) -> None:
    root = OutputRoot(store)
    uri = root.run_files.put(RUN, "config.json", b'{"max_tokens": 8192}')
    root.run_files.put("run2", "report.html", b"<html></html>")
    assert uri.endswith(f"runs/{RUN}/config.json")
    assert root.run_files.get(RUN, "config.json") == b'{"max_tokens": 8192}'
    assert root.run_files.runs() == sorted([RUN, "run2"])
    with pytest.raises(ValueError, match="run file name"):
        root.run_files.put(RUN, "../escape", b"x")
