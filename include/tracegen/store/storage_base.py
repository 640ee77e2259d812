"""What every output-root storage is: the `Storage` interface, its errors, and the rules for keys.

Writes are whole-object and atomic: a reader sees the old object or the new one, never a torn one. The two
backends are `local_storage.LocalStorage` and `s3_storage.S3Storage`; `storage.open_storage` picks one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping

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


class Fenced(RuntimeError):
    """A fenced write was refused: an object it was guarded by changed or is gone (another writer took the
    root, a newer attempt claimed the chunk), or its deadline passed. Nothing was sent past the deadline; a
    write sent before it whose answer was lost may have landed (the message says so), which is why a commit
    of a segment whose entry exists is a no-op. Not a StorageError: retrying cannot help, and callers that retry storage errors must not swallow it."""


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
    def version(self, key: str) -> str:
        """The object's current version (S3's ETag, locally the sha256 of its bytes); StorageKeyError if
        missing. Two writes of the same bytes may share a version: objects that are swapped (`swap`) hold a
        unique token and a counter, so each write of theirs has its own."""

    @abstractmethod
    def swap(self, key: str, data: bytes, expected: str | None, *, deadline: float | None = None) -> str | None:
        """Compare-and-swap: write `data` only if the object's version is still `expected` (None: only if
        there is no object). The new version, or None when the condition failed (the object changed, or is
        gone). Atomic against every other swap, `remove_if` and `put_guarded` of the root (If-Match /
        If-None-Match on S3; locally under the root's lock). With a `deadline` (`time.monotonic()`), a write
        that is no longer worth anything past it (a lease's renewal) is sent as `put_guarded`'s is, and
        `Fenced` when the deadline passed first."""

    @abstractmethod
    def remove_if(self, key: str, expected: str) -> bool:
        """Delete the object only if its version is still `expected` (If-Match on S3; locally under the
        root's lock). False when it changed or is gone."""

    @abstractmethod
    def put_guarded(self, key: str, data: bytes, guards: Mapping[str, str], deadline: float) -> None:
        """Write `data` at `key` only while every guard key still has its version and before `deadline`
        (`time.monotonic()`); `Fenced` naming the first that failed otherwise, with nothing written.

        Locally the guards are compared and the object renamed into place under the root's lock, which every
        `swap` and `remove_if` also takes: a guard removed or replaced by another process either happened
        before the check (refused) or waits until the write is in place. S3 has no condition on another
        object: the guards are read (HEAD) just before the PUT, and the PUT is sent only before `deadline`,
        each attempt once (no retry inside the S3 client) with its connect and read timeouts within the time
        left. What remains is a request sent before the deadline and held in the network (or a writer paused
        between the HEAD and the send) for longer than the margin the lease leaves past the deadline
        (docs/reliability.md, "Fencing")."""

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


