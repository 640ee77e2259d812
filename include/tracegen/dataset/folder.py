"""A dataset that is a folder, local or an S3 prefix: Parquet shards, or a Hugging Face dataset saved with
`save_to_disk` (Arrow IPC stream files, in the order its `state.json` lists them).

The folder is one `ByteSource`: its data files' bytes one after another, in their order. So the index pass
fingerprints it like a file, and a chunk's read checks it against the index (size and version, re-hashed
when they differ) like a file. Rows are never read from the shards themselves: the index pass writes them
once into one seekable Parquet copy (small row groups, as for a Parquet file with huge ones) and every read
goes to that copy, checked block by block.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tracegen.dataset.source import (
    ByteSource,
    DatasetError,
    LocalSource,
    StorageSource,
    open_source,
    split_uri,
)

ARROW, PARQUET = "arrow", "parquet"
HF_STATE = "state.json"
# A shard of an S3 folder is copied to a local file in reads of this size while its rows are written out.
_DOWNLOAD_BYTES = 64 << 20


def _listed(uri: str, state_text: str, names: set[str] | None) -> list[str]:
    """The data files a Hugging Face `state.json` lists, in order (checked against `names` when given)."""
    try:
        listed = [f["filename"] for f in json.loads(state_text)["_data_files"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise DatasetError(f"dataset {uri}: {HF_STATE} does not list its data files ({exc})") from None
    if names is not None:
        missing = [f for f in listed if f not in names]
        if missing:
            raise DatasetError(f"dataset {uri}: {HF_STATE} lists {missing[0]}, which is not there")
    return listed


def _by_kind(uri: str, names: list[str]) -> tuple[str, list[str]]:
    for kind, suffix in ((PARQUET, ".parquet"), (ARROW, ".arrow")):
        files = sorted(n for n in names if n.endswith(suffix))
        if files:
            return kind, files
    raise DatasetError(f"dataset {uri}: a folder, but neither a Hugging Face dataset saved to disk ({HF_STATE} "
                       "and .arrow files) nor a folder of .parquet shards")


def data_files(path: str) -> tuple[str, list[str]]:
    """(kind, files in row order) of a local dataset folder; `DatasetError` naming the folder when it holds none."""
    root = Path(path)
    state = root / HF_STATE
    if state.is_file():
        names = {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}
        return ARROW, [str(root / name) for name in _listed(path, state.read_text(), names)]
    names = [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()]
    kind, files = _by_kind(path, names)
    return kind, [str(root / name) for name in files]


class FolderSource:
    """A dataset folder's data files as one run of bytes (the files in row order): a local folder, or the
    objects under an S3 prefix (`storage` and `prefix`: keys relative to the storage's root)."""

    def __init__(self, path: str, uri: str | None = None, *, storage: Any = None, prefix: str = "") -> None:
        self.path = path
        self.uri = uri or path
        self._storage = storage
        self._prefix = prefix
        self.files: list[str]
        if storage is None:
            self.kind, self.files = data_files(path)
            self._parts: list[ByteSource] = [LocalSource(f) for f in self.files]
        else:
            self.kind, self.files = self._object_files()
            self._parts = [StorageSource(storage, prefix + f, f"{self.uri.rstrip('/')}/{f}") for f in self.files]
        self._sizes = [part.size() for part in self._parts]
        self._starts = [0]
        for size in self._sizes:
            self._starts.append(self._starts[-1] + size)

    def _object_files(self) -> tuple[str, list[str]]:
        try:
            names = [k[len(self._prefix):] for k in self._storage.list(self._prefix)]
        except Exception as exc:  # any backend failure becomes one clear error
            raise DatasetError(f"dataset {self.uri}: cannot list the folder ({exc})") from exc
        if not names:
            raise DatasetError(f"dataset {self.uri}: object not found, nor a folder of that name")
        if HF_STATE in names:
            state = self._storage.get(self._prefix + HF_STATE).decode("utf-8", "replace")
            return ARROW, _listed(self.uri, state, set(names))
        return _by_kind(self.uri, names)

    def size(self) -> int:
        return self._starts[-1]

    def identity(self) -> tuple[int, str]:
        # Every file's name, size and version (mtime, or ETag): a shard rewritten, added or renamed changes it.
        digest = hashlib.sha256()
        for name, part in zip(self.files, self._parts, strict=True):
            size, version = part.identity()
            relative = os.path.relpath(name, self.path) if self._storage is None else name
            digest.update(f"{relative}\0{size}\0{version}\n".encode())
        return self.size(), f"files:{digest.hexdigest()[:32]}"

    def read(self, start: int, length: int) -> bytes:
        out = bytearray()
        pos, stop = start, min(start + length, self.size())
        for name, part, begin, size in zip(self.files, self._parts, self._starts[:-1], self._sizes, strict=True):
            end = begin + size
            if end <= pos or begin >= stop:
                continue
            take = min(end, stop) - pos
            data = part.read(pos - begin, take)
            if len(data) != take:
                raise DatasetError(f"dataset {self.uri}: short read of {name}")
            out += data
            pos += take
        return bytes(out)

    @contextlib.contextmanager
    def local_file(self, i: int) -> Iterator[str]:
        """A local path holding data file `i`: the file itself, or a temporary copy of an S3 object."""
        if self._storage is None:
            yield self.files[i]
            return
        fd, tmp = tempfile.mkstemp(prefix=".tracegen-shard-")
        try:
            with os.fdopen(fd, "wb") as out:
                for start in range(0, self._sizes[i], _DOWNLOAD_BYTES):
                    out.write(self._parts[i].read(start, min(_DOWNLOAD_BYTES, self._sizes[i] - start)))
            yield tmp
        finally:
            os.unlink(tmp)


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
        for i, f in enumerate(source.files):
            try:
                with source.local_file(i) as local:
                    for batch in _batches(source.kind, local, row_group):
                        if schema is None:
                            schema = batch.schema.remove_metadata()
                            writer = pq.ParquetWriter(out_path, schema)
                        elif not batch.schema.remove_metadata().equals(schema):
                            raise DatasetError(f"dataset {source.uri}: {f} has columns {batch.schema.names} of "
                                               f"other types than the first shard's {schema.names}")
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
    if key is None:
        return FolderSource(path, uri) if os.path.isdir(path) else open_source(uri, aws_conn_id)
    if uri.endswith("/"):  # s3://bucket/folder/: the objects under it
        return _s3_folder(uri.rstrip("/"), aws_conn_id)
    source = _s3_object_or_none(uri, aws_conn_id)
    return source if source is not None else _s3_folder(uri, aws_conn_id)


def _s3_object_or_none(uri: str, aws_conn_id: str) -> ByteSource | None:
    try:
        return open_source(uri, aws_conn_id)
    except DatasetError as exc:
        if "object not found" in str(exc):
            return None
        raise


def _s3_folder(uri: str, aws_conn_id: str) -> FolderSource:
    """The objects under `uri`/ as one dataset folder."""
    from tracegen.store.storage import open_storage  # imported late: local datasets need no AWS stack

    parent, name = split_uri(uri)
    try:
        storage = open_storage(parent, aws_conn_id=aws_conn_id)
    except Exception as exc:
        raise DatasetError(f"dataset {uri}: cannot open storage {parent} ({exc})") from exc
    return FolderSource(uri, uri, storage=storage, prefix=f"{name}/")
