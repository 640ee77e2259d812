"""One small object-store interface over a local directory or an S3 prefix.

Everything tracegen keeps (parts, ledger entries, run files, dataset indexes) goes through
`Storage`, so the same code runs against `file:///...` in the demo and `s3://...` in production.
Writes are whole-object and atomic: a reader sees the old object or the new one, never a torn one.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import re
import secrets
import stat
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import unquote, urlparse

log = logging.getLogger(__name__)

T = TypeVar("T")

# Local temp files start with this; `list` hides them so a crashed writer's leftovers never look like data.
_TMP_PREFIX = ".tmp-"
_BAD_SEGMENTS = {"", ".", ".."}


class StorageError(Exception):
    """A storage operation failed (after retries, for transient errors)."""


class StorageKeyError(StorageError, KeyError):
    """The key does not exist."""

    def __init__(self, uri: str) -> None:
        super().__init__(uri)
        self.uri = uri

    def __str__(self) -> str:  # KeyError would repr() the argument; keep the message readable.
        return f"no such object: {self.uri}"


class StorageLinkError(StorageKeyError):
    """The key, or a directory on its way, is a symbolic link (or not a regular file) inside a local output
    root. Links inside the root are data, never followed: to every reader such a key is not an object."""

    def __init__(self, uri: str, what: str) -> None:
        super().__init__(uri)
        self.what = what

    def __str__(self) -> str:
        return f"refused {self.uri}: {self.what}; storage never follows a link inside an output root"


class StorageRootError(StorageError):
    """A read-only open found no output root there: nothing is created, the path is named."""


def check_key(key: str) -> str:
    """Reject keys that could escape the root or mean different things on the two backends."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"storage key must be a non-empty string, got {key!r}")
    if key.startswith("/") or "\\" in key or "\x00" in key:
        raise ValueError(f"storage key {key!r} must be relative, with '/' separators")
    parts = key.split("/")
    if any(p in _BAD_SEGMENTS for p in parts) or parts[-1].startswith(_TMP_PREFIX):
        raise ValueError(f"storage key {key!r} has an empty, '.', '..' or reserved segment")
    return key


def _check_prefix(prefix: str) -> str:
    if prefix == "":
        return prefix
    if prefix.startswith("/") or "\\" in prefix or any(p in (".", "..") for p in prefix.split("/")):
        raise ValueError(f"storage prefix {prefix!r} must be relative, with '/' separators")
    return prefix


class Storage(ABC):
    """Whole-object store rooted at `uri`. Keys are '/'-separated paths relative to the root."""

    uri: str

    @abstractmethod
    def put(self, key: str, data: bytes) -> None:
        """Write the whole object atomically (replacing any previous one)."""

    @abstractmethod
    def create(self, key: str, data: bytes) -> bool:
        """Write the whole object only if `key` does not exist yet: True when this call created it, False
        when another writer's object is there. Atomic against concurrent creators (O_EXCL-like locally, a
        conditional PUT on S3), so it can arbitrate who holds a lock. A create retried after a lost reply
        still answers True: the object then holds exactly `data` (callers put a unique token in it)."""

    @abstractmethod
    def modified(self, key: str) -> float:
        """When the object was last written, in seconds since the epoch, by the storage's own clock (the
        file's mtime, S3's LastModified); StorageKeyError if missing. Never what the object says."""

    @abstractmethod
    def get(self, key: str) -> bytes:
        """The whole object; StorageKeyError if missing."""

    @abstractmethod
    def get_range(self, key: str, start: int, length: int) -> bytes:
        """`length` bytes from `start` (fewer at the end of the object; b"" past it)."""

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def size(self, key: str) -> int:
        """Size in bytes; StorageKeyError if missing."""

    @abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Sorted keys (relative to the root) that start with `prefix` (a plain string prefix, as on S3)."""

    def sizes(self, prefix: str = "") -> dict[str, int]:
        """Size in bytes of every key that starts with `prefix`: what `list` lists, with sizes."""
        out = {}
        for key in self.list(prefix):
            try:
                out[key] = self.size(key)
            except StorageKeyError:  # deleted between the listing and the stat
                pass
        return out

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object; missing is not an error (deletes are idempotent)."""

    @abstractmethod
    def uri_for(self, key: str) -> str:
        """The full URI of `key`, for messages and for other tools."""

    def require_root(self) -> None:
        """StorageRootError naming the root unless it exists: what read-only tools call, so a mistyped root is
        an error rather than an empty root. An S3 prefix has no existence of its own: nothing to check."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"


def _check_range(start: int, length: int) -> None:
    if start < 0 or length < 0:
        raise ValueError(f"byte range start={start} length={length} must be non-negative")


_ROOT_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
# Below the root every component is opened without following links: a link inside the root is data.
_DIR_FLAGS = _ROOT_FLAGS | os.O_NOFOLLOW
# O_NONBLOCK: a FIFO planted under a key must not hang the reader before fstat says it is no file.
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_TMP_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class LocalStorage(Storage):
    """A directory. put = temp file in the same dir + fsync + os.replace + fsync(dir).

    The root path is the operator's configuration: links in it (the root itself a link to a volume) are
    followed, once, when the root is opened. Everything below it is data: each component is opened with
    O_NOFOLLOW relative to its parent's descriptor, so no read, write, listing or delete ever leaves the
    root through a link, and a link swapped in between a check and an open is refused too. Listings skip
    links (and FIFOs, sockets, devices); reading one is a `StorageLinkError`.

    Opening creates nothing: a reader of a missing root sees no objects (`require_root` makes that an
    error naming the path), and only `put` creates the root and its directories.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        path = Path(root)
        if not path.is_absolute():
            raise ValueError(f"local storage root must be an absolute path, got {str(root)!r}")
        self.root = path
        self.uri = path.as_uri() + "/"

    def require_root(self) -> None:
        try:
            st = os.stat(self.root)
        except (FileNotFoundError, NotADirectoryError):
            if os.path.islink(self.root):
                raise StorageRootError(
                    f"output root {self.root} does not exist: it is a symbolic link to "
                    f"{os.readlink(self.root)!r}, which is missing (nothing was created)"
                ) from None
            raise StorageRootError(
                f"output root {self.root} does not exist (nothing was created; check the path)"
            ) from None
        if not stat.S_ISDIR(st.st_mode):
            raise StorageRootError(f"output root {self.root} is not a directory")

    def _open_root(self, create: bool) -> int:
        try:
            return os.open(self.root, _ROOT_FLAGS)
        except FileNotFoundError:
            if not create:
                raise
            if os.path.islink(self.root):
                # A dangling link is often an unmounted volume: creating its target would write elsewhere.
                raise StorageRootError(
                    f"output root {self.root} is a symbolic link to {os.readlink(self.root)!r}, which does not "
                    "exist; not creating it"
                ) from None
            os.makedirs(self.root, exist_ok=True)
            return os.open(self.root, _ROOT_FLAGS)
        except NotADirectoryError:
            raise StorageError(f"output root {self.root} is not a directory") from None

    def _link_error(self, key: str, parent_fd: int, name: str, shown: str) -> StorageLinkError | None:
        """A StorageLinkError when `name` (under `parent_fd`) is a link, else None."""
        try:
            st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
        except OSError:
            return None
        if stat.S_ISLNK(st.st_mode):
            return StorageLinkError(self.uri + key, f"{shown} is a symbolic link")
        return None

    def _dir_fd(self, dirs: list[str], key: str, *, create: bool = False) -> int:
        """A descriptor of root/dirs[0]/dirs[1]/..., no component below the root followed if it is a link.
        FileNotFoundError / NotADirectoryError when a component is missing or not a directory (a reader's
        missing key), StorageLinkError when one is a link; with `create`, missing ones are made."""
        fd = self._open_root(create)
        try:
            for i, name in enumerate(dirs):
                try:
                    sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    try:
                        os.mkdir(name, dir_fd=fd)
                    except FileExistsError:  # a concurrent writer made it (or it is a dangling link: see below)
                        pass
                    try:
                        sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
                    except NotADirectoryError:
                        raise self._link_error(key, fd, name, "/".join(dirs[: i + 1])) or StorageError(
                            f"{self.uri}{'/'.join(dirs[: i + 1])} is not a directory (writing {key})"
                        ) from None
                except NotADirectoryError:  # a file, or (O_NOFOLLOW | O_DIRECTORY) a link
                    link = self._link_error(key, fd, name, "/".join(dirs[: i + 1]))
                    if link is not None:
                        raise link from None
                    raise
                os.close(fd)
                fd = sub
        except BaseException:
            os.close(fd)
            raise
        return fd

    @contextmanager
    def _parent(self, key: str, *, create: bool = False) -> Iterator[tuple[int, str]]:
        """(descriptor of the key's directory, the key's last segment); StorageKeyError if it is missing."""
        parts = check_key(key).split("/")
        try:
            fd = self._dir_fd(parts[:-1], key, create=create)
        except (FileNotFoundError, NotADirectoryError):
            raise StorageKeyError(self.uri_for(key)) from None
        try:
            yield fd, parts[-1]
        finally:
            os.close(fd)

    def _open_read(self, key: str) -> int:
        """A descriptor of the regular file at `key`, read-only; never through a link."""
        with self._parent(key) as (dfd, name):
            try:
                fd = os.open(name, _READ_FLAGS, dir_fd=dfd)
            except (FileNotFoundError, NotADirectoryError):
                raise StorageKeyError(self.uri_for(key)) from None
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise StorageLinkError(self.uri_for(key), f"{key} is a symbolic link") from None
                raise
        try:
            st = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        if stat.S_ISREG(st.st_mode):
            return fd
        os.close(fd)
        if stat.S_ISDIR(st.st_mode):  # a directory is not an object, as before
            raise StorageKeyError(self.uri_for(key))
        raise StorageLinkError(self.uri_for(key), f"{key} is not a regular file")

    def _lstat(self, key: str) -> os.stat_result:
        with self._parent(key) as (dfd, name):
            try:
                return os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except (FileNotFoundError, NotADirectoryError):
                raise StorageKeyError(self.uri_for(key)) from None

    def put(self, key: str, data: bytes) -> None:
        with self._parent(key, create=True) as (dfd, name):
            tmp = _write_temp(dfd, data)
            try:
                # Replaces a link planted at `key` itself, never writes through it.
                os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            except BaseException:
                try:
                    os.unlink(tmp, dir_fd=dfd)
                except FileNotFoundError:
                    pass
                raise
            # The rename is durable only once the directory entry is on disk.
            os.fsync(dfd)

    def create(self, key: str, data: bytes) -> bool:
        with self._parent(key, create=True) as (dfd, name):
            tmp = _write_temp(dfd, data)
            try:
                # link() fails with EEXIST when the name exists (a link planted there too), atomically: the
                # whole object appears or none.
                try:
                    os.link(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
                except FileExistsError:
                    return False
            finally:
                try:
                    os.unlink(tmp, dir_fd=dfd)
                except FileNotFoundError:
                    pass
            os.fsync(dfd)
            return True

    def modified(self, key: str) -> float:
        st = self._lstat(key)
        if not stat.S_ISREG(st.st_mode):
            raise StorageKeyError(self.uri_for(key))
        return st.st_mtime

    def get(self, key: str) -> bytes:
        with os.fdopen(self._open_read(key), "rb") as f:
            return f.read()

    def get_range(self, key: str, start: int, length: int) -> bytes:
        _check_range(start, length)
        with os.fdopen(self._open_read(key), "rb") as f:
            f.seek(start)
            return f.read(length)

    def exists(self, key: str) -> bool:
        try:
            return stat.S_ISREG(self._lstat(key).st_mode)
        except StorageKeyError:  # missing, or a link on the way
            return False

    def size(self, key: str) -> int:
        st = self._lstat(key)
        if stat.S_ISREG(st.st_mode):
            return st.st_size
        if stat.S_ISLNK(st.st_mode):
            raise StorageLinkError(self.uri_for(key), f"{key} is a symbolic link")
        raise StorageKeyError(self.uri_for(key))

    def list(self, prefix: str = "") -> list[str]:
        return sorted(self._scan(prefix))

    def sizes(self, prefix: str = "") -> dict[str, int]:
        # The walk's own lstat gives the sizes: no second walk down to each key.
        return dict(sorted(self._scan(prefix, with_sizes=True).items()))

    def _scan(self, prefix: str, with_sizes: bool = False) -> dict[str, int]:
        """Regular files under the root whose keys start with `prefix`. Walks only the deepest directory the
        prefix names, never into a link, and skips links, FIFOs, sockets and crashed writers' temp files."""
        _check_prefix(prefix)
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        try:
            fd = self._dir_fd(base.split("/") if base else [], prefix or ".")
        except (FileNotFoundError, NotADirectoryError, StorageLinkError):
            return {}  # nothing there, or a link: nothing listed
        out: dict[str, int] = {}
        try:
            self._scan_dir(fd, base, prefix, with_sizes, out)
        finally:
            os.close(fd)
        return out

    def _scan_dir(self, fd: int, rel: str, prefix: str, with_sizes: bool, out: dict[str, int]) -> None:
        subdirs = []
        with os.scandir(fd) as entries:
            for entry in entries:
                key = f"{rel}/{entry.name}" if rel else entry.name
                if not key.startswith(prefix):
                    continue
                if entry.is_dir(follow_symlinks=False):
                    subdirs.append((entry.name, key))
                elif entry.is_file(follow_symlinks=False) and not entry.name.startswith(_TMP_PREFIX):
                    out[key] = entry.stat(follow_symlinks=False).st_size if with_sizes else 0
        # One directory open at a time per level: a root with thousands of runs needs no more descriptors.
        for name, key in subdirs:
            try:
                sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except (FileNotFoundError, NotADirectoryError):  # gone since, or swapped for a link
                continue
            try:
                self._scan_dir(sub, key, prefix, with_sizes, out)
            finally:
                os.close(sub)

    def delete(self, key: str) -> None:
        try:
            with self._parent(key) as (dfd, name):
                os.unlink(name, dir_fd=dfd)  # a link at `key` itself is removed, never followed
        except StorageLinkError:
            raise
        except (StorageKeyError, FileNotFoundError):
            pass

    def uri_for(self, key: str) -> str:
        return self.uri + check_key(key)


def _write_temp(dfd: int, data: bytes) -> str:
    """`data` in a fresh, fsynced temp file of the directory `dfd`: the name to rename or link into place.
    A failed write removes it."""
    tmp = f"{_TMP_PREFIX}{secrets.token_hex(8)}"
    fd = os.open(tmp, _TMP_FLAGS, 0o600, dir_fd=dfd)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dfd)
        except FileNotFoundError:
            pass
        raise
    return tmp


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# S3 error codes worth retrying: throttling and server-side trouble. Everything else (403, 404, bad
# request) is permanent and retrying would only delay a clear error.
_RETRYABLE_CODES = {
    "Throttling",
    "ThrottlingException",
    "SlowDown",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "InternalError",
    "ServiceUnavailable",
    "RequestLimitExceeded",
    "TooManyRequestsException",
}
_MISSING_CODES = {"NoSuchKey", "404", "NotFound"}
# What S3 answers a conditional write whose condition failed (another writer's object is there).
CONFLICT_CODES = ("PreconditionFailed", "ConditionalRequestConflict")


def _is_transient(exc: BaseException) -> bool:
    from botocore.exceptions import (
        ClientError,
        ConnectionClosedError,
        ConnectTimeoutError,
        EndpointConnectionError,
        ReadTimeoutError,
    )

    if isinstance(exc, EndpointConnectionError | ConnectionClosedError | ConnectTimeoutError | ReadTimeoutError):
        return True
    if isinstance(exc, ClientError):
        code = str(exc.response.get("Error", {}).get("Code", ""))
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        return code in _RETRYABLE_CODES or status >= 500 or status == 429
    # urllib3/socket level errors that botocore did not wrap.
    return isinstance(exc, ConnectionError | TimeoutError)


def _error_code(exc: BaseException) -> str:
    from botocore.exceptions import ClientError

    if isinstance(exc, ClientError):
        return str(exc.response.get("Error", {}).get("Code", ""))
    return ""


class S3Storage(Storage):
    """An S3 prefix reached through Airflow's S3Hook (so endpoint and credentials come from the connection).

    Each call is retried with exponential backoff and jitter on transient errors for up to
    `retry_deadline_s`, so a commit rides out an S3 blip; then it fails naming the object.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        aws_conn_id: str = "aws_default",
        *,
        retry_deadline_s: float = 120.0,
        backoff_initial_s: float = 0.2,
        backoff_max_s: float = 10.0,
        client: Any = None,
    ) -> None:
        if not re.fullmatch(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]", bucket):
            raise ValueError(f"invalid S3 bucket name {bucket!r}")
        if retry_deadline_s < 0 or backoff_initial_s <= 0 or backoff_max_s < backoff_initial_s:
            raise ValueError(
                f"bad retry settings: deadline={retry_deadline_s} initial={backoff_initial_s} max={backoff_max_s}"
            )
        prefix = prefix.strip("/")
        if prefix:
            check_key(prefix)
        self.bucket = bucket
        self.prefix = prefix + "/" if prefix else ""
        self.aws_conn_id = aws_conn_id
        self.uri = f"s3://{bucket}/{self.prefix}"
        self.retry_deadline_s = retry_deadline_s
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self._client = client

    @property
    def client(self) -> Any:
        # Created lazily: building the hook reads the Airflow connection, which a constructor should not do.
        if self._client is None:
            from airflow.providers.amazon.aws.hooks.s3 import S3Hook

            self._client = S3Hook(aws_conn_id=self.aws_conn_id).get_conn()
        return self._client

    def _call(self, what: str, key: str, fn: Callable[[], T]) -> T:
        deadline = time.monotonic() + self.retry_deadline_s
        delay = self.backoff_initial_s
        attempt = 0
        while True:
            attempt += 1
            try:
                return fn()
            except Exception as exc:
                if _error_code(exc) in _MISSING_CODES:
                    raise StorageKeyError(self.uri + key) from None
                if not _is_transient(exc):
                    raise StorageError(f"S3 {what} {self.uri + key} failed: {exc}") from exc
                now = time.monotonic()
                if now >= deadline:
                    raise StorageError(
                        f"S3 {what} {self.uri + key} failed after {attempt} attempts over "
                        f"{self.retry_deadline_s:.0f}s (bucket {self.bucket!r}): {exc}"
                    ) from exc
                sleep = min(delay * (0.5 + random.random()), deadline - now)
                log.warning("S3 %s %s: transient error (%s); retry %d in %.2fs", what, key, exc, attempt, sleep)
                time.sleep(max(sleep, 0.0))
                delay = min(delay * 2, self.backoff_max_s)

    def _key(self, key: str) -> str:
        return self.prefix + check_key(key)

    def put(self, key: str, data: bytes) -> None:
        # One PutObject is atomic on S3: readers see the previous object or this one.
        self._call("put", key, lambda: self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data))

    def create(self, key: str, data: bytes) -> bool:
        def put() -> None:
            self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, IfNoneMatch="*")

        try:
            self._call("create", key, put)
        except StorageError as exc:
            code = _error_code(exc.__cause__) if exc.__cause__ is not None else ""
            if code not in CONFLICT_CODES:
                raise
            # Someone's object is there: ours, if an earlier attempt of this call went through unanswered.
            try:
                return self.get(key) == data
            except StorageKeyError:
                return False
        return True

    def modified(self, key: str) -> float:
        return self._head(key)["LastModified"].timestamp()

    def get(self, key: str) -> bytes:
        def fetch() -> bytes:
            return self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()

        return self._call("get", key, fetch)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        _check_range(start, length)
        if length == 0:
            self.size(key)  # still raise for a missing key
            return b""

        def fetch() -> bytes:
            from botocore.exceptions import ClientError

            try:
                resp = self.client.get_object(
                    Bucket=self.bucket, Key=self._key(key), Range=f"bytes={start}-{start + length - 1}"
                )
            except ClientError as exc:
                if _error_code(exc) == "InvalidRange":  # start is past the end: same as a local read
                    return b""
                raise
            return resp["Body"].read()

        return self._call("get_range", key, fetch)

    def _head(self, key: str) -> dict[str, Any]:
        return self._call("head", key, lambda: self.client.head_object(Bucket=self.bucket, Key=self._key(key)))

    def exists(self, key: str) -> bool:
        try:
            self._head(key)
        except StorageKeyError:
            return False
        return True

    def size(self, key: str) -> int:
        return int(self._head(key)["ContentLength"])

    def list(self, prefix: str = "") -> list[str]:
        _check_prefix(prefix)
        full = self.prefix + prefix

        def fetch() -> list[str]:
            keys: list[str] = []
            paginator = self.client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=full):
                keys.extend(obj["Key"][len(self.prefix) :] for obj in page.get("Contents", []))
            return keys

        return sorted(self._call("list", prefix, fetch))

    def sizes(self, prefix: str = "") -> dict[str, int]:
        # The listing already carries each object's size: one LIST per 1000 keys instead of a HEAD per key.
        _check_prefix(prefix)
        full = self.prefix + prefix

        def fetch() -> dict[str, int]:
            out: dict[str, int] = {}
            paginator = self.client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=full):
                out.update((obj["Key"][len(self.prefix) :], int(obj["Size"])) for obj in page.get("Contents", []))
            return out

        return dict(sorted(self._call("list", prefix, fetch).items()))

    def delete(self, key: str) -> None:
        self._call("delete", key, lambda: self.client.delete_object(Bucket=self.bucket, Key=self._key(key)))

    def uri_for(self, key: str) -> str:
        return self.uri + check_key(key)


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
