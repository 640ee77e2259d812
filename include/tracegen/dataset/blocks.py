"""Reading an indexed dataset: the rows of a range of its blocks, from a file checked to be the one indexed.

A chunk task reads only its own blocks, grouped into a few range requests; before any row is read, the file
is checked against the index (size and version, re-hashed only when they differ), since rows of an edited
file would be paired with completions of other prompts.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from tracegen.common.locations import shown_location
from tracegen.dataset.index import DatasetIndex
from tracegen.dataset.scan import fingerprint_source, gunzip_stream, split_rows
from tracegen.dataset.source import ByteSource, DatasetError, SourceFile, open_source, source_identity

log = logging.getLogger(__name__)

# Largest single range request while reading a chunk: bounds a chunk task's memory whatever its size.
_WINDOW_BYTES = 4 << 20


class DatasetChangedError(DatasetError):
    """The dataset file is no longer the one the output root's index (and its runs) describe."""


# (uri, size, version) -> fingerprint, for versions whose content was hashed in this process: a touched but
# unchanged file (new mtime, same bytes) is re-hashed once, not before every chunk's read.
_HASHED: dict[tuple[str, int, str | None], str] = {}


def check_unchanged(index: DatasetIndex, aws_conn_id: str = "aws_default", source: ByteSource | None = None) -> None:
    """Refuse to read a dataset whose content is no longer what `index` (and the runs that recorded its
    fingerprint) describe: rows read from it would be paired with completions of other prompts.

    Cheap when nothing changed: the size and version (mtime / ETag) recorded at indexing still match. When
    either differs, the file is hashed again; same bytes (a touch, a copy back) pass, other bytes raise
    `DatasetChangedError` naming the file and both identities."""
    src = source or open_source(index.source_uri, aws_conn_id)
    size, version = source_identity(src)
    if size == index.source_size and version is not None and version == index.source_version:
        return
    memo = (index.source_uri, size, version)
    fingerprint = _HASHED.get(memo)
    if fingerprint is None:
        fingerprint = fingerprint_source(src)
        if version is not None:
            _HASHED[memo] = fingerprint
    if fingerprint == index.fingerprint:
        if version != index.source_version:
            log.info("dataset %s: version %s differs from the indexed %s but its bytes are the same (%s)",
                     shown_location(index.source_uri), version, index.source_version, fingerprint[:19])
        return
    raise DatasetChangedError(
        f"dataset {index.source_uri} changed since it was indexed for this output root: it is now "
        f"{fingerprint} ({size} bytes, {version or 'no version'}), the runs here read "
        f"{index.fingerprint} ({index.source_size} bytes, {index.source_version or 'no version'}). "
        "Its rows would no longer match the completions committed for them, so nothing is read: restore the "
        "original file, or give the edited dataset a new output_uri"
    )


def open_data(index: DatasetIndex, aws_conn_id: str = "aws_default") -> ByteSource:
    """The source to read rows from, checked against the index: a dataset edited in place (or a replaced
    seekable copy) is refused before any row is read."""
    src = open_source(index.data_uri, aws_conn_id)
    check_unchanged(index, aws_conn_id, source=src if index.data_uri == index.source_uri else None)
    if src.size() != index.data_size:
        raise DatasetError(
            f"dataset {index.data_uri}: size {src.size()} differs from the indexed {index.data_size}; "
            "the file changed after indexing (rebuild the index)"
        )
    return src


def iter_block_items(index: DatasetIndex, src: ByteSource, lo: int, hi: int) -> Iterator[tuple[int, Any]]:
    """(row index, raw item) for every row of blocks [lo, hi): bytes lines, or dicts for Parquet."""
    if lo >= hi:
        return
    if index.format == "parquet":
        yield from _iter_parquet(index, src, lo, hi)
        return
    # Group consecutive blocks into windows of about _WINDOW_BYTES: one range request each.
    b = lo
    while b < hi:
        begin, _ = index.block_span(b, b + 1)
        e = b + 1
        while e < hi and index.block_span(b, e + 1)[1] - begin <= _WINDOW_BYTES:
            e += 1
        _, end = index.block_span(b, e)
        data = src.read(begin, end - begin)
        if len(data) != end - begin:
            raise DatasetError(f"dataset {index.data_uri}: short read at byte {begin}")
        if index.format == "jsonl.gz":
            lines = split_rows(gunzip_stream(index.data_uri, [data]))
        else:
            lines = split_rows([data])
        row = int(index.block_rows[b])
        for line in lines:
            yield row, line
            row += 1
        b = e


def _iter_parquet(index: DatasetIndex, src: ByteSource, lo: int, hi: int) -> Iterator[tuple[int, Any]]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(SourceFile(src))
    except Exception as exc:
        raise DatasetError(f"dataset {index.data_uri}: not a readable Parquet file ({exc})") from None
    if pf.metadata.num_row_groups != index.n_blocks:
        raise DatasetError(f"dataset {index.data_uri}: row groups differ from the index; rebuild it")
    for g in range(lo, hi):
        row = int(index.block_rows[g])
        for item in pf.read_row_group(g).to_pylist():
            yield row, item
            row += 1
