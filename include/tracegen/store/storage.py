"""One small object-store interface over a local directory or an S3 prefix.

Everything tracegen keeps (parts, ledger entries, run files, dataset indexes) goes through `Storage`, so the
same code runs against `file:///...` in the demo and `s3://...` in production. `open_storage` picks the
backend for a URI; the interface and its errors are `storage_base`, the backends `local_storage` and
`s3_storage`. This module is where callers import all of them from.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote, urlparse

from tracegen.store.local_storage import LocalStorage, fsync_dir
from tracegen.store.s3_storage import CONFLICT_CODES, S3Storage
from tracegen.store.storage_base import (
    Fenced,
    Storage,
    StorageError,
    StorageKeyError,
    StorageLinkError,
    StorageRootError,
    check_key,
)

__all__ = [
    "CONFLICT_CODES", "Fenced", "LocalStorage", "S3Storage", "Storage", "StorageError", "StorageKeyError", "StorageLinkError",
    "StorageRootError", "check_key", "fsync_dir", "open_storage",
]


def open_storage(uri: str, aws_conn_id: str = "aws_default", *, must_exist: bool = False,
                 **s3_options: Any) -> Storage:
    """`file:///abs/dir`, `/abs/dir` or `s3://bucket/prefix` → a Storage rooted there. Opening creates
    nothing; with `must_exist` (read-only tools) a missing local root is a StorageRootError naming it."""
    storage = _open_storage(uri, aws_conn_id, **s3_options)
    if must_exist:
        storage.require_root()
    return storage


def _open_storage(uri: str, aws_conn_id: str, **s3_options: Any) -> Storage:
    if not isinstance(uri, str) or not uri.strip():
        raise ValueError(f"storage URI must be a non-empty string, got {uri!r}")
    uri = uri.strip()
    if uri.startswith("/"):
        return LocalStorage(uri)
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"file URI {uri!r} names a host; use file:///absolute/path")
        return LocalStorage(unquote(parsed.path))
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise ValueError(f"S3 URI {uri!r} has no bucket; use s3://bucket/prefix")
        return S3Storage(parsed.netloc, parsed.path, aws_conn_id=aws_conn_id, **s3_options)
    raise ValueError(f"unsupported storage URI {uri!r}: use file:///abs/dir, /abs/dir or s3://bucket/prefix")
