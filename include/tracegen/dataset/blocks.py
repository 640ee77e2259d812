"""Reading an indexed dataset: the rows of a range of its blocks, from a file checked to be the one indexed.

A chunk task reads only its own blocks, grouped into a few range requests, since rows of an edited file would
be paired with completions of other prompts: before any row is read the file is checked against the index
(size and version, the whole file re-hashed only when they differ), and every block read is hashed and
compared with the hash it had when indexed, before a row of it is parsed. Size and version alone never vouch
for content: an edit that keeps both (a same-size edit with the mtime put back) is refused by the block it
touched, naming the block and the dataset (`DatasetBlockChangedError`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from tracegen.common.locations import shown_location
from tracegen.dataset.folder import open_dataset_source
from tracegen.dataset.index import (
    DatasetIndex,
    block_digest,
    hash_blocks,
    parquet_footer_span,
    row_group_starts,
)
from tracegen.dataset.scan import fingerprint_source, gunzip_stream, split_rows
from tracegen.dataset.source import ByteSource, DatasetError, SourceFile, open_source, source_identity

log = logging.getLogger(__name__)

# Largest single range request while reading a chunk: bounds a chunk task's memory whatever its size.
_WINDOW_BYTES = 4 << 20


class DatasetChangedError(DatasetError):
    """The dataset file is no longer the one the output root's index (and its runs) describe."""


class DatasetBlockChangedError(DatasetChangedError):
    """A block's bytes, as a chunk read them, are not the bytes that block had when the dataset was indexed."""


def check_block(index: DatasetIndex, b: int, data: bytes | memoryview, what: str = "") -> None:
    """Refuse block `b` of `index` when `data`, its bytes as read, do not hash to what they did when indexed."""
    if index.block_hashes is None:
        raise DatasetError(f"dataset index of {index.source_uri} holds no block hashes: load it with "
                           "dataset.stored.load_index, which hashes its blocks from the file")
    if block_digest(data) == int(index.block_hashes[b]):
        return
    first, stop = index.block_row_range(b)
    begin, end = index.block_span(b, b + 1)
    raise DatasetBlockChangedError(
        f"dataset {index.source_uri}: {what or f'block {b}'} (rows {first}-{stop - 1}, bytes {begin}-{end} of "
        f"{index.data_uri}) is not what was indexed for this output root: its bytes changed since "
        f"(the file was indexed as {index.fingerprint}), whatever its size and modification time say. Its rows "
        "would no longer match the completions committed for them, so none is read: restore the original "
        "file, or give the edited dataset a new output_uri"
    )


def _check_footer(index: DatasetIndex, src: ByteSource) -> tuple[int, bytes]:
    """A Parquet file's footer (where it starts, its bytes), refused when it is not the one indexed."""
    begin, end = parquet_footer_span(src)
    footer = src.read(begin, end - begin)
    if block_digest(footer) != index.footer_hash:
        raise DatasetBlockChangedError(
            f"dataset {index.source_uri}: the Parquet footer of {index.data_uri} (bytes {begin}-{end}, where each "
            "row group's pages are) is not what was indexed for this output root; nothing is read: restore the "
            "original file, or give the edited dataset a new output_uri"
        )
    return begin, footer


# (uri, size, version) -> fingerprint, for versions whose content was hashed in this process: a touched but
# unchanged file (new mtime, same bytes) is re-hashed once, not before every chunk's read.
_HASHED: dict[tuple[str, int, str | None], str] = {}


def check_unchanged(index: DatasetIndex, aws_conn_id: str = "aws_default", source: ByteSource | None = None,
                    *, rehash: bool = False) -> None:
    """Refuse to read a dataset whose content is no longer what `index` (and the runs that recorded its
    fingerprint) describe: rows read from it would be paired with completions of other prompts.

    Cheap when nothing changed: the size and version (mtime / ETag) recorded at indexing still match, and the
    blocks read are checked against their hashes (`check_block`) anyway. When either differs, or `rehash`, the
    file is hashed again; same bytes (a touch, a copy back) pass, other bytes raise `DatasetChangedError`
    naming the file and both identities."""
    src = source or open_dataset_source(index.source_uri, aws_conn_id)
    size, version = source_identity(src)
    if not rehash and size == index.source_size and version is not None and version == index.source_version:
        return
    memo = (index.source_uri, size, version)
    fingerprint = None if rehash else _HASHED.get(memo)
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


def with_block_hashes(index: DatasetIndex, aws_conn_id: str = "aws_default") -> DatasetIndex:
    """`index`, with its blocks hashed from the file when it was stored before blocks were hashed (an index
    with hashes is returned as it is). The file is read once, and refused (`DatasetChangedError`) when its
    bytes are no longer the fingerprinted ones: hashes of other bytes would vouch for them."""
    if index.block_hashes is not None:
        return index
    log.warning("dataset index of %s holds no block hashes (stored by an earlier version): hashing its blocks "
                "from the file once; the next run's first task stores the index with them", shown_location(index.source_uri))
    src = open_source(index.data_uri, aws_conn_id)
    if index.block_offsets is None:  # Parquet indexed before its row groups' offsets were recorded
        import pyarrow.parquet as pq

        index.block_offsets = row_group_starts(pq.ParquetFile(SourceFile(src)).metadata)
    if index.data_uri != index.source_uri:
        check_unchanged(index, aws_conn_id, rehash=True)  # the source, whose copy is hashed below
    hashed = hash_blocks(index, src)
    if index.data_uri == index.source_uri and hashed != index.fingerprint:
        index.block_hashes = index.footer_hash = None
        raise DatasetChangedError(
            f"dataset {index.source_uri} changed since it was indexed for this output root: it is now {hashed}, "
            f"the runs here read {index.fingerprint}. Its rows would no longer match the completions committed "
            "for them, so nothing is read: restore the original file, or give the edited dataset a new output_uri"
        )
    return index


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
        view = memoryview(data)
        for k in range(b, e):  # every block of the window, before a row of it is parsed
            k_begin, k_end = index.block_span(k, k + 1)
            check_block(index, k, view[k_begin - begin : k_end - begin])
        if index.format == "jsonl.gz":
            lines = split_rows(gunzip_stream(index.data_uri, [data]))
        else:
            lines = split_rows([data])
        row = int(index.block_rows[b])
        for line in lines:
            yield row, line
            row += 1
        b = e


class _VerifiedBytes:
    """A Parquet file as pyarrow reads it: the byte ranges checked against the index served from memory, so
    the pages decoded are the bytes hashed; anything else (pyarrow's speculative read before the footer) from
    the file."""

    def __init__(self, src: ByteSource, ranges: list[tuple[int, bytes]]) -> None:
        self.uri, self._src, self._ranges = src.uri, src, sorted(ranges, key=lambda r: r[0])

    def size(self) -> int:
        return self._src.size()

    def read(self, start: int, length: int) -> bytes:
        out = bytearray()
        pos, stop = start, start + length
        for begin, data in self._ranges:
            end = begin + len(data)
            if end <= pos or begin >= stop:
                continue
            if begin > pos:
                out += self._src.read(pos, begin - pos)
                pos = begin
            take = min(end, stop)
            out += data[pos - begin : take - begin]
            pos = take
        if pos < stop:
            out += self._src.read(pos, stop - pos)
        return bytes(out)


def _iter_parquet(index: DatasetIndex, src: ByteSource, lo: int, hi: int) -> Iterator[tuple[int, Any]]:
    import pyarrow.parquet as pq

    begin, end = index.block_span(lo, hi)
    groups = src.read(begin, end - begin)
    if len(groups) != end - begin:
        raise DatasetError(f"dataset {index.data_uri}: short read at byte {begin}")
    view = memoryview(groups)
    for g in range(lo, hi):
        g_begin, g_end = index.block_span(g, g + 1)
        check_block(index, g, view[g_begin - begin : g_end - begin], f"row group {g}")
    footer_begin, footer = _check_footer(index, src)
    try:
        pf = pq.ParquetFile(SourceFile(_VerifiedBytes(src, [(begin, groups), (footer_begin, footer)])))
    except Exception as exc:
        raise DatasetError(f"dataset {index.data_uri}: not a readable Parquet file ({exc})") from None
    if pf.metadata.num_row_groups != index.n_blocks:
        raise DatasetError(f"dataset {index.data_uri}: row groups differ from the index; rebuild it")
    for g in range(lo, hi):
        row = int(index.block_rows[g])
        for item in pf.read_row_group(g).to_pylist():
            yield row, item
            row += 1
