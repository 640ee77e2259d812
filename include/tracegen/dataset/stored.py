"""The dataset's row index, kept in the output root (`dataset/index.json`) so mapped tasks never rescan
the dataset, and the binding that keeps two datasets from mixing in one output root."""

from __future__ import annotations

import numpy as np

from tracegen.common.locations import shown_location
from tracegen.dataset.blocks import check_unchanged, iter_block_items, open_data, with_block_hashes
from tracegen.dataset.conversation import decode
from tracegen.dataset.index import DatasetIndex, build_index
from tracegen.dataset.reading import Reading
from tracegen.dataset.source import DatasetError
from tracegen.store.records import FAILED, INVALID
from tracegen.store.root import OutputRoot
from tracegen.store.storage import StorageKeyError

DATASET_INDEX_KEY = "dataset/index.json"


def load_index(root: OutputRoot, aws_conn_id: str = "aws_default") -> DatasetIndex:
    """The index a run's first task stored, with its blocks' hashes, which every read checks; `StorageKeyError`
    when no run has indexed this root yet. An index stored before blocks were hashed gets them from the file,
    read once and checked against the fingerprint (`with_block_hashes`), until a run's first task stores it
    again with them."""
    return with_block_hashes(_stored_index(root), aws_conn_id)


def chain_turn_starts(root: OutputRoot) -> np.ndarray | None:
    """Under `turns=chain`, each conversation's first prompt row of the root's stored index (the plan's
    `held_turns`); None under any other reading, or before any run indexed the root."""
    try:
        index = _stored_index(root)
    except StorageKeyError:
        return None
    return index.turn_starts if index.reading.chained else None


def _stored_index(root: OutputRoot) -> DatasetIndex:
    return DatasetIndex.from_bytes(root.storage.get(DATASET_INDEX_KEY))


class ReadingMismatchError(DatasetError):
    """The output root's dataset was indexed read another way (form, fields or turns): its row indices mean
    other prompts under this run's reading."""


def bind_index(root: OutputRoot, dataset_uri: str, aws_conn_id: str, reading: Reading | None = None) -> DatasetIndex:
    """Index `dataset_uri` (or reuse the stored index of the same URI) and bind its fingerprint to the
    output root; a second, different dataset is refused before anything describing it is written, and so is
    the same dataset read another way (`reading`, the default when None)."""
    reading = reading or Reading()
    storage = root.storage
    try:
        index = _stored_index(root)
    except StorageKeyError:
        index = None
    if index is not None and index.reading != reading:
        raise ReadingMismatchError(
            f"output root {storage.uri} holds dataset {shown_location(index.source_uri)} read with "
            f"{index.reading.describe()}; this run reads it with {reading.describe()}, which numbers its rows "
            "otherwise, so completions committed here would be paired with other prompts. Use the root's "
            "settings, or a new output_uri for this reading"
        )
    if index is not None and index.source_uri == dataset_uri:
        # The same URI is not the same dataset: a file edited in place since the index was stored is
        # refused here (naming both fingerprints), before a new run records it or reads a row of it. Its size
        # and version cannot vouch for its bytes (an edit can keep both), so the file is hashed again, once
        # per run.
        check_unchanged(index, aws_conn_id, rehash=True)
        if not index.reading_recorded:
            check_earlier_reading(root, index, aws_conn_id)
        if index.source_version is None or index.block_hashes is None or not index.reading_recorded:
            # An index stored before versions or block hashes were recorded: indexed again (which also checks
            # the rows' ids) and stored with them, so later reads need no whole-file hash.
            index = _index_rows(dataset_uri, storage.uri_for("cache"), aws_conn_id, reading)
            root.run_files.bind_dataset(index.fingerprint, _info(index))
            storage.put(DATASET_INDEX_KEY, index.to_bytes())
        else:
            root.run_files.bind_dataset(index.fingerprint, _info(index))
        return index
    index = _index_rows(dataset_uri, storage.uri_for("cache"), aws_conn_id, reading)
    root.run_files.bind_dataset(index.fingerprint, _info(index))
    storage.put(DATASET_INDEX_KEY, index.to_bytes())
    return index


class EarlierReadingError(DatasetError):
    """The output root holds rows committed under the reading tracegen used before it read conversations by
    their turns, which this reading would pair with other prompts."""


def check_earlier_reading(root: OutputRoot, index: DatasetIndex, aws_conn_id: str) -> None:
    """An index stored before readings were recorded was read `messages` only, a conversation's final assistant
    message sent as part of the prompt (the model answered its own answer), and any other form recorded invalid.
    Read the default way now, such a row's prompt is the conversation before that message, and a ShareGPT or
    prompt-string row is a prompt: a row committed for either under the earlier reading belongs to another
    prompt, so the root is refused, naming them (nothing is changed); a root without such rows goes on, its
    index stored again with the reading recorded. One pass over the dataset, once per such root."""
    frame = root.snapshots.frame()
    if frame.empty:
        return
    committed = frame[frame["status"] != FAILED]
    status = dict(zip(committed["index"].to_numpy(np.int64).tolist(), committed["status"].tolist(), strict=True))
    answered, refused = [], []
    reading = Reading()
    src = open_data(index, aws_conn_id)
    for row, item in iter_block_items(index, src, 0, index.n_blocks):
        was = status.get(row)
        if was is None:
            continue
        conversation = decode(item, reading, columnar=index.format == "parquet")
        if isinstance(conversation, str):
            continue
        if was == INVALID:
            refused.append(row)
        elif conversation.messages and conversation.messages[-1].get("role") == "assistant":
            answered.append(row)
    found = [f"{_rows(answered)} end with an assistant message, which was sent as part of the prompt (the model "
             "answered its own answer)"] if answered else []
    found += [f"{_rows(refused)} were recorded invalid and now read as prompts"] if refused else []
    if found:
        raise EarlierReadingError(
            f"output root {root.storage.uri} was filled by an earlier tracegen, which read dataset "
            f"{shown_location(index.source_uri)} as `messages` rows only: {'; '.join(found)}. Their committed "
            "rows answer other prompts than this reading gives and are left as they are; generate this dataset "
            "into a new output_uri"
        )


def _rows(rows: list[int]) -> str:
    shown = ", ".join(str(r) for r in rows[:5]) + (", ..." if len(rows) > 5 else "")
    return f"{len(rows):,} rows" + (f" ({shown})" if rows else "")


def _info(index: DatasetIndex) -> dict:
    return {"uri": shown_location(index.source_uri), "rows": index.n_rows, "prompt_rows": index.n_prompt_rows,
            "reading": index.reading.to_json()}


def _index_rows(dataset_uri: str, cache_uri: str, aws_conn_id: str, reading: Reading) -> DatasetIndex:
    """The dataset's index, refused when it holds no row: a run over it would generate nothing and report
    success, and binding it would tie the root to an empty file."""
    index = build_index(dataset_uri, cache_uri=cache_uri, aws_conn_id=aws_conn_id, reading=reading)
    if index.n_rows == 0:
        raise DatasetError(f"dataset {dataset_uri} holds no rows (no non-blank line, or no Parquet row): "
                           "there is nothing to generate; check dataset_uri")
    return index
