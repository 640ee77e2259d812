"""Random-access bytes of one dataset file, local or on S3, behind one tiny interface.

The dataset reader never opens files itself: it asks a `ByteSource` for a size and for byte
ranges. A local file is read with `os.pread`; anything else goes through `tracegen.store.storage`
(S3 range GETs). Keeping this seam small is what lets a chunk task prove it reads only its own
slice: tests wrap a source and count the bytes that cross it.
"""

from __future__ import annotations

import io
import os
from typing import Any, Protocol
from urllib.parse import unquote, urlparse


class DatasetError(Exception):
    """The dataset (or its index) cannot be read as a whole; the message names the URI."""


class ByteSource(Protocol):
    """Size and byte ranges of one immutable file.

    A source may also offer `identity()`: (size, version), where the version changes whenever the
    content may have (a local file's mtime, an S3 object's ETag). `dataset.index` records it when it
    indexes the file and compares it before every read, so a file edited in place is noticed without
    hashing it again.
    """

    uri: str

    def size(self) -> int: ...

    def read(self, start: int, length: int) -> bytes: ...


class LocalSource:
    """A local file, read with pread so concurrent readers never share a file position."""

    def __init__(self, path: str, uri: str | None = None) -> None:
        self.path = path
        self.uri = uri or path
        try:
            self._fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise DatasetError(f"dataset {self.uri}: file not found") from None
        except IsADirectoryError:
            raise DatasetError(f"dataset {self.uri}: is a directory, not a file") from None
        except OSError as exc:
            raise DatasetError(f"dataset {self.uri}: cannot open ({exc.strerror})") from None
        if not os.path.isfile(path):
            os.close(self._fd)
            kind = "is a directory" if os.path.isdir(path) else "is not a regular file"
            raise DatasetError(f"dataset {self.uri}: {kind}, not a dataset file")

    def size(self) -> int:
        return os.fstat(self._fd).st_size

    def identity(self) -> tuple[int, str]:
        # fstat, not stat: the identity of the bytes this source reads, even if the path was replaced since.
        st = os.fstat(self._fd)
        return st.st_size, f"mtime_ns:{st.st_mtime_ns}"

    def read(self, start: int, length: int) -> bytes:
        try:
            return os.pread(self._fd, length, start)
        except OSError as exc:
            raise DatasetError(f"dataset {self.uri}: read failed at byte {start} ({exc.strerror})") from None

    def close(self) -> None:
        os.close(self._fd)

    def __del__(self) -> None:
        try:
            os.close(self._fd)
        except (OSError, AttributeError):
            pass


class StorageSource:
    """One object of a `tracegen.store.storage` backend (S3), read with range requests."""

    def __init__(self, storage: Any, key: str, uri: str) -> None:
        self.storage = storage
        self.key = key
        self.uri = uri
        self._size: int | None = None
        try:
            exists = storage.exists(key)
        except Exception as exc:  # any backend failure becomes one clear error
            raise DatasetError(f"dataset {uri}: cannot reach storage ({exc})") from exc
        if not exists:
            raise DatasetError(f"dataset {uri}: object not found")

    def size(self) -> int:
        if self._size is None:
            try:
                self._size = int(self.storage.size(self.key))
            except Exception as exc:
                raise DatasetError(f"dataset {self.uri}: cannot stat ({exc})") from exc
        return self._size

    def identity(self) -> tuple[int, str | None]:
        """Size and ETag in one HEAD request (a rewritten object gets a new ETag, whatever its size)."""
        head = getattr(self.storage, "_head", None)
        if head is None:  # a backend without object metadata: the size alone
            return self.size(), None
        try:
            meta = head(self.key)
        except Exception as exc:
            raise DatasetError(f"dataset {self.uri}: cannot stat ({exc})") from exc
        etag = meta.get("ETag")
        return int(meta["ContentLength"]), (f"etag:{etag.strip(chr(34))}" if etag else None)

    def read(self, start: int, length: int) -> bytes:
        if length <= 0:
            return b""
        try:
            return self.storage.get_range(self.key, start, length)
        except Exception as exc:
            raise DatasetError(f"dataset {self.uri}: range read {start}+{length} failed ({exc})") from exc


def source_identity(source: ByteSource) -> tuple[int, str | None]:
    """(size, version) of a source; version None when the source cannot tell (then only the size and
    the fingerprint can say whether it changed)."""
    identity = getattr(source, "identity", None)
    return identity() if identity is not None else (source.size(), None)


def split_uri(uri: str) -> tuple[str, str | None]:
    """(local path, None) for local files and file:// URIs, (parent URI, key) for object stores."""
    parsed = urlparse(uri)
    if parsed.scheme in ("", "file"):
        path = unquote(parsed.path) if parsed.scheme == "file" else uri
        return os.path.abspath(os.path.expanduser(path)), None
    if parsed.scheme == "s3":
        if not parsed.netloc or not parsed.path.strip("/"):
            raise DatasetError(f"dataset {uri}: expected s3://bucket/path/to/file")
        parent, _, key = parsed.path.lstrip("/").rpartition("/")
        root = f"s3://{parsed.netloc}/{parent}" if parent else f"s3://{parsed.netloc}"
        return root, key
    raise DatasetError(f"dataset {uri}: unsupported scheme {parsed.scheme!r} (use a path, file:// or s3://)")


def open_source(uri: str, aws_conn_id: str = "aws_default") -> ByteSource:
    """The byte source for a dataset URI: a local path, file:///abs/path or s3://bucket/key."""
    root, key = split_uri(uri)
    if key is None:
        return LocalSource(root, uri)
    from tracegen.store.storage import open_storage  # imported late: local datasets need no AWS stack

    try:
        storage = open_storage(root, aws_conn_id=aws_conn_id)
    except Exception as exc:
        raise DatasetError(f"dataset {uri}: cannot open storage {root} ({exc})") from exc
    return StorageSource(storage, key, uri)


class CountingSource:
    """Wraps a source and counts the bytes and requests that cross it (benchmarks, tests, logs)."""

    def __init__(self, inner: ByteSource) -> None:
        self.inner = inner
        self.uri = inner.uri
        self.bytes_read = 0
        self.requests = 0

    def size(self) -> int:
        return self.inner.size()

    def identity(self) -> tuple[int, str | None]:
        return source_identity(self.inner)

    def read(self, start: int, length: int) -> bytes:
        data = self.inner.read(start, length)
        self.bytes_read += len(data)
        self.requests += 1
        return data


class SourceFile(io.RawIOBase):
    """A seekable read-only file object over a ByteSource (what pyarrow and BufferedReader need).

    `on_read`, when given, sees every block in order; the index pass hashes through it so the
    fingerprint costs no second read.
    """

    def __init__(self, source: ByteSource, on_read: Any = None) -> None:
        super().__init__()
        self.source = source
        self._size = source.size()
        self._pos = 0
        self._on_read = on_read

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        want = min(len(buffer), self._size - self._pos)
        if want <= 0:
            return 0
        data = self.source.read(self._pos, want)
        n = len(data)
        buffer[:n] = data
        if self._on_read is not None:
            self._on_read(self._pos, data)
        self._pos += n
        return n

    def size(self) -> int:
        return self._size
