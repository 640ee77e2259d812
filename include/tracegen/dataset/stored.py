"""The dataset's row index, kept in the output root (`dataset/index.json`) so mapped tasks never rescan
the dataset, and the binding that keeps two datasets from mixing in one output root."""

from __future__ import annotations

from tracegen.dataset.index import DatasetIndex, build_index
from tracegen.store.ledger import Ledger
from tracegen.store.storage import StorageKeyError

DATASET_INDEX_KEY = "dataset/index.json"


def load_index(ledger: Ledger) -> DatasetIndex:
    """The index a run's first task stored; `StorageKeyError` when no run has indexed this root yet."""
    return DatasetIndex.from_bytes(ledger.storage.get(DATASET_INDEX_KEY))


def bind_index(ledger: Ledger, dataset_uri: str, aws_conn_id: str) -> DatasetIndex:
    """Index `dataset_uri` (or reuse the stored index of the same URI) and bind its fingerprint to the
    output root; a second, different dataset is refused before anything describing it is written."""
    storage = ledger.storage
    try:
        index = load_index(ledger)
    except StorageKeyError:
        index = None
    if index is None or index.source_uri != dataset_uri:
        index = build_index(dataset_uri, cache_uri=storage.uri_for("cache"), aws_conn_id=aws_conn_id)
        ledger.bind_dataset(index.fingerprint, {"uri": dataset_uri, "rows": index.n_rows})
        storage.put(DATASET_INDEX_KEY, index.to_bytes())
    else:
        ledger.bind_dataset(index.fingerprint, {"uri": dataset_uri, "rows": index.n_rows})
    return index
