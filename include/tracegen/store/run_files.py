"""What an output root keeps beside its rows: the fingerprint of the one dataset it belongs to
(`dataset.json`), and each run's files (`runs/<run_id>/<name>`: its record, reports, question, ...)."""

from __future__ import annotations

import json
from typing import Any

from tracegen.store.entries import SCHEMA, LedgerError, check_name, now
from tracegen.store.storage import Storage, StorageKeyError

RUNS_DIR = "runs/"
DATASET_FILE = "dataset.json"


class DatasetMismatchError(LedgerError):
    """The output root already belongs to a different dataset."""


class RunFiles:
    """The dataset fingerprint and the run files of one output root."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage

    def bind_dataset(self, fingerprint: str, info: dict[str, Any] | None = None) -> None:
        """Record the dataset this root holds (first run) or refuse a different one (later runs)."""
        if not isinstance(fingerprint, str) or not fingerprint:
            raise ValueError(f"dataset fingerprint must be a non-empty string, got {fingerprint!r}")
        existing = self.dataset()
        if existing is None:
            doc = {"schema": SCHEMA, "fingerprint": fingerprint, "info": info or {}, "created_at": now()}
            self.storage.put(DATASET_FILE, json.dumps(doc, indent=2).encode())
            existing = self.dataset()  # re-read: a concurrent first run with another dataset loses here
        assert existing is not None
        if existing.get("fingerprint") != fingerprint:
            raise DatasetMismatchError(
                f"output root {self.storage.uri} already holds dataset {existing.get('fingerprint')!r} "
                f"({existing.get('info', {})}); this run's dataset is {fingerprint!r}. "
                "Two datasets never share an output root: choose a new output_uri."
            )

    def dataset(self) -> dict[str, Any] | None:
        try:
            raw = self.storage.get(DATASET_FILE)
        except StorageKeyError:
            return None
        try:
            doc = json.loads(raw)
        except ValueError as exc:
            raise LedgerError(f"{self.storage.uri_for(DATASET_FILE)} is not valid JSON: {exc}") from exc
        if not isinstance(doc, dict):
            raise LedgerError(f"{self.storage.uri_for(DATASET_FILE)} is not a JSON object")
        return doc

    def put(self, run_id: str, name: str, data: bytes) -> str:
        """Write `runs/<run_id>/<name>`; returns its URI."""
        key = _key(run_id, name)
        self.storage.put(key, data)
        return self.storage.uri_for(key)

    def create(self, run_id: str, name: str, data: bytes) -> bool:
        """Write `runs/<run_id>/<name>` only if it is not there yet (`Storage.create`): True when this call
        wrote it."""
        return self.storage.create(_key(run_id, name), data)

    def get(self, run_id: str, name: str) -> bytes:
        return self.storage.get(_key(run_id, name))

    def runs(self) -> list[str]:
        """The run ids with files in this root, sorted."""
        return sorted({k.split("/")[1] for k in self.storage.list(RUNS_DIR) if k.count("/") >= 2})


def _key(run_id: str, name: str) -> str:
    return f"{RUNS_DIR}{check_name('run_id', run_id)}/{check_name('run file name', name)}"
