"""The dataset's row index, kept in the output root (`dataset/index.json`) so mapped tasks never rescan
the dataset, and the binding that keeps two datasets from mixing in one output root."""

from __future__ import annotations

from tracegen.common.locations import shown_location
from tracegen.dataset.blocks import check_unchanged, with_block_hashes
from tracegen.dataset.index import DatasetIndex, build_index
from tracegen.dataset.source import DatasetError
from tracegen.store.root import OutputRoot
from tracegen.store.storage import StorageKeyError

DATASET_INDEX_KEY = "dataset/index.json"


def load_index(root: OutputRoot, aws_conn_id: str = "aws_default") -> DatasetIndex:
    """The index a run's first task stored, with its blocks' hashes, which every read checks; `StorageKeyError`
    when no run has indexed this root yet. An index stored before blocks were hashed gets them from the file,
    read once and checked against the fingerprint (`with_block_hashes`), until a run's first task stores it
    again with them."""
    return with_block_hashes(_stored_index(root), aws_conn_id)


def _stored_index(root: OutputRoot) -> DatasetIndex:
    return DatasetIndex.from_bytes(root.storage.get(DATASET_INDEX_KEY))


def bind_index(root: OutputRoot, dataset_uri: str, aws_conn_id: str) -> DatasetIndex:
    """Index `dataset_uri` (or reuse the stored index of the same URI) and bind its fingerprint to the
    output root; a second, different dataset is refused before anything describing it is written."""
    storage = root.storage
    try:
        index = _stored_index(root)
    except StorageKeyError:
        index = None
    if index is not None and index.source_uri == dataset_uri:
        # The same URI is not the same dataset: a file edited in place since the index was stored is
        # refused here (naming both fingerprints), before a new run records it or reads a row of it. Its size
        # and version cannot vouch for its bytes (an edit can keep both), so the file is hashed again, once
        # per run.
        check_unchanged(index, aws_conn_id, rehash=True)
        if index.source_version is None or index.block_hashes is None:
            # An index stored before versions or block hashes were recorded: indexed again (which also checks
            # the rows' ids) and stored with them, so later reads need no whole-file hash.
            index = _index_rows(dataset_uri, storage.uri_for("cache"), aws_conn_id)
            root.run_files.bind_dataset(index.fingerprint, {"uri": shown_location(dataset_uri), "rows": index.n_rows})
            storage.put(DATASET_INDEX_KEY, index.to_bytes())
        else:
            root.run_files.bind_dataset(index.fingerprint, {"uri": shown_location(dataset_uri), "rows": index.n_rows})
        return index
    index = _index_rows(dataset_uri, storage.uri_for("cache"), aws_conn_id)
    root.run_files.bind_dataset(index.fingerprint, {"uri": shown_location(dataset_uri), "rows": index.n_rows})
    storage.put(DATASET_INDEX_KEY, index.to_bytes())
    return index


def _index_rows(dataset_uri: str, cache_uri: str, aws_conn_id: str) -> DatasetIndex:
    """The dataset's index, refused when it holds no row: a run over it would generate nothing and report
    success, and binding it would tie the root to an empty file."""
    index = build_index(dataset_uri, cache_uri=cache_uri, aws_conn_id=aws_conn_id)
    if index.n_rows == 0:
        raise DatasetError(f"dataset {dataset_uri} holds no rows (no non-blank line, or no Parquet row): "
                           "there is nothing to generate; check dataset_uri")
    return index
