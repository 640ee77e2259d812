"""A dataset that is a local folder: Parquet shards, or a Hugging Face dataset saved with `save_to_disk`
(Arrow IPC stream files, in the order its `state.json` lists them).

The folder is one `ByteSource`: its data files' bytes one after another, in their order. So the index pass
fingerprints it like a file, and a chunk's read checks it against the index (size and version, re-hashed
when they differ) like a file. Rows are never read from the shards themselves: the index pass writes them
once into one seekable Parquet copy (small row groups, as for a Parquet file with huge ones) and every read
goes to that copy, checked block by block.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from tracegen.dataset.source import DatasetError, open_source, split_uri

ARROW, PARQUET = "arrow", "parquet"
HF_STATE = "state.json"


def data_files(path: str) -> tuple[str, list[str]]:
    """(kind, files in row order) of a dataset folder; `DatasetError` naming the folder when it holds none."""
    root = Path(path)
    state = root / HF_STATE
    if state.is_file():
        try:
            listed = [f["filename"] for f in json.loads(state.read_text())["_data_files"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise DatasetError(f"dataset {path}: {HF_STATE} does not list its data files ({exc})") from None
        files = [str(root / name) for name in listed]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise DatasetError(f"dataset {path}: {HF_STATE} lists {missing[0]}, which is not there")
        return ARROW, files
    for kind, pattern in ((PARQUET, "*.parquet"), (ARROW, "*.arrow")):
        files = sorted(str(p) for p in root.rglob(pattern) if p.is_file())
        if files:
            return kind, files
    raise DatasetError(f"dataset {path}: a folder, but neither a Hugging Face dataset saved to disk ({HF_STATE} "
                       "and .arrow files) nor a folder of .parquet shards")


class FolderSource:
    """A dataset folder's data files as one run of bytes (the files in row order)."""

    def __init__(self, path: str, uri: str | None = None) -> None:
        self.path = path
        self.uri = uri or path
        self.kind, self.files = data_files(path)
        self._sizes = [os.path.getsize(f) for f in self.files]
        self._starts = [0]
        for size in self._sizes:
            self._starts.append(self._starts[-1] + size)

    def size(self) -> int:
        return self._starts[-1]

    def identity(self) -> tuple[int, str]:
        # Every file's name, size and mtime: a shard rewritten, added or renamed changes the version.
        digest = hashlib.sha256()
        for f in self.files:
            st = os.stat(f)
            digest.update(f"{os.path.relpath(f, self.path)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        return self.size(), f"files:{digest.hexdigest()[:32]}"

    def read(self, start: int, length: int) -> bytes:
        out = bytearray()
        pos, stop = start, min(start + length, self.size())
        for f, begin, size in zip(self.files, self._starts, self._sizes, strict=False):
            end = begin + size
            if end <= pos or begin >= stop:
                continue
            with open(f, "rb") as fh:
                fh.seek(pos - begin)
                take = min(end, stop) - pos
                data = fh.read(take)
            if len(data) != take:
                raise DatasetError(f"dataset {self.uri}: short read of {f}")
            out += data
            pos += take
        return bytes(out)


def _batches(kind: str, path: str, batch_rows: int) -> Any:
    import pyarrow as pa
    import pyarrow.parquet as pq

    if kind == PARQUET:
        yield from pq.ParquetFile(path).iter_batches(batch_size=batch_rows)
        return
    with pa.memory_map(path) as mapped:
        try:
            reader = pa.ipc.open_stream(mapped)  # what save_to_disk writes
        except pa.ArrowInvalid:
            mapped.seek(0)
            reader = pa.ipc.open_file(mapped)
            for i in range(reader.num_record_batches):
                yield reader.get_batch(i)
            return
        yield from reader


def write_copy(source: FolderSource, out_path: str, row_group: int) -> int:
    """Every row of the folder, in order, into one Parquet file of `row_group`-row groups; returns the rows.
    Shards must share one schema (a row's fields must mean the same in every shard)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    writer = None
    schema = None
    rows = 0
    try:
        for f in source.files:
            try:
                for batch in _batches(source.kind, f, row_group):
                    if schema is None:
                        schema = batch.schema.remove_metadata()
                        writer = pq.ParquetWriter(out_path, schema)
                    elif not batch.schema.remove_metadata().equals(schema):
                        raise DatasetError(f"dataset {source.uri}: {f} has columns {batch.schema.names} of other "
                                           f"types than the first shard's {schema.names}")
                    table = pa.Table.from_batches([batch]).replace_schema_metadata(None)
                    writer.write_table(table, row_group_size=row_group)
                    rows += batch.num_rows
            except DatasetError:
                raise
            except Exception as exc:  # pyarrow's several error types for an unreadable shard
                raise DatasetError(f"dataset {source.uri}: cannot read {f} ({exc})") from None
        if writer is None:  # no rows: an empty file the index refuses
            pq.write_table(pa.table({"id": pa.array([], pa.string())}), out_path)
    finally:
        if writer is not None:
            writer.close()
    return rows


def open_dataset_source(uri: str, aws_conn_id: str = "aws_default") -> Any:
    """The bytes of a dataset as its URI names it: a local folder as a `FolderSource`, anything else as
    `source.open_source` opens it (a file, local or on S3)."""
    path, key = split_uri(uri)
    if key is None and os.path.isdir(path):
        return FolderSource(path, uri)
    return open_source(uri, aws_conn_id)
