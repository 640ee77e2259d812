"""One export at a time per destination: `export.lock`, created exclusively (`Storage.create` locally; a
conditional PUT, `If-None-Match: *`, on S3), naming its holder (host, pid, start time) and
rewritten after every shard; a second export refuses, naming the holder. A lock not rewritten for
LOCK_STALE_S (judged by the lock object's own modification time, not by what it says) belongs to an export
that died, and the next export takes it over. The lock also publishes the manifest, only if it is still the
one read at the start (compared locally; `If-Match` on S3).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tracegen.export.errors import ExportError, ExportLockError
from tracegen.store.storage import CONFLICT_CODES, LocalStorage, S3Storage, Storage, StorageKeyError

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
LOCK = "export.lock"
# A holder rewrites its lock after every shard (seconds apart); a lock left alone this long belongs to an
# export that died, and the next one takes it over. Generous: a clock skew or a stall never loses a live lock.
LOCK_STALE_S = 3600.0


class DestinationLock:
    """`export.lock` in a destination: created exclusively, naming its holder, rewritten while the export
    writes, taken over once LOCK_STALE_S old (by the object's modification time), removed at the end. It
    also publishes the manifest, only over the one read at the start."""

    def __init__(self, dest: Storage, stale_s: float | None = None) -> None:
        self.dest = dest
        self.stale_s = LOCK_STALE_S if stale_s is None else stale_s
        self.token = uuid.uuid4().hex
        self.holder = {"host": socket.gethostname(), "pid": os.getpid(),
                       "started_at": datetime.now(UTC).isoformat(timespec="seconds"), "token": self.token}
        self.held = False

    @staticmethod
    def of(dest: Storage, stale_s: float | None = None) -> DestinationLock:
        if isinstance(dest, LocalStorage):
            return _LocalLock(dest, stale_s)
        if isinstance(dest, S3Storage):
            return _S3Lock(dest, stale_s)
        raise ExportError(f"no exclusive lock for {type(dest).__name__} destinations ({dest.uri})")

    def _body(self) -> bytes:
        return json.dumps(self.holder | {"written_at": datetime.now(UTC).isoformat(timespec="seconds")}).encode()

    def _ours(self, raw: bytes | None) -> bool:
        return raw is not None and _lock_doc(raw).get("token") == self.token

    def acquire(self) -> None:
        for _ in range(5):
            if self._create():
                self.held = True
                return
            found = self._read()
            if found is None:
                continue  # released meanwhile
            raw, version, age = found
            if self._ours(raw):  # our own create, retried after the storage had written it
                self._adopt(version)
                self.held = True
                return
            if age < self.stale_s:
                raise ExportLockError(
                    f"export destination {self.dest.uri} is held by another export: {_describe(raw)}, lock "
                    f"{self.dest.uri_for(LOCK)} last written {age:.0f} s ago; one export at a time per "
                    f"destination: wait for it, or remove the lock if no such export runs (it expires "
                    f"{self.stale_s - age:.0f} s from now)"
                )
            log.warning("export: taking over %s, not written for %.0f s (%s)", self.dest.uri_for(LOCK), age,
                        _describe(raw))
            if self._take_over(raw, version):
                self.held = True
                return
        raise ExportLockError(f"export destination {self.dest.uri}: other exports kept taking {LOCK}; try again")

    def refresh(self) -> None:
        """Rewrite the lock (it stays fresh); ExportLockError when it is no longer ours."""
        if not self._rewrite():
            found = self._read()
            raise ExportLockError(
                f"export into {self.dest.uri} lost its lock {self.dest.uri_for(LOCK)}: "
                + (f"now held by {_describe(found[0])}" if found else "it was removed")
                + "; this export publishes nothing"
            )

    def publish(self, manifest: bytes, expected: Any) -> None:
        """Write the manifest if the destination's is still `expected` (as `read_manifest` gave it)."""
        self.refresh()
        if not self._put_manifest(manifest, expected):
            raise ExportLockError(
                f"{self.dest.uri_for(MANIFEST)} changed while this export wrote (another export published "
                "there); not published over it, and this export's shards are removed"
            )

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        try:
            self._delete_if_ours()
        except Exception as exc:  # the lock expires; the export's own outcome must not be hidden
            log.warning("export: could not remove %s: %s", self.dest.uri_for(LOCK), exc)

    # ---- what each storage does; `version` is what a conditional write compares against

    def _create(self) -> bool:
        """Create the lock if there is none; False if there is one."""
        raise NotImplementedError

    def _read(self) -> tuple[bytes, Any, float] | None:
        """(its bytes, its version, seconds since it was last written), or None if there is no lock."""
        raise NotImplementedError

    def _adopt(self, version: Any) -> None:
        """The lock found is our own (a create retried after it succeeded): remember its version."""

    def _take_over(self, raw: bytes, version: Any) -> bool:
        """Replace the stale lock read as (`raw`, `version`) by ours; False if it changed meanwhile."""
        raise NotImplementedError

    def _rewrite(self) -> bool:
        """Rewrite our lock; False if it is no longer ours."""
        raise NotImplementedError

    def _delete_if_ours(self) -> None:
        raise NotImplementedError

    def read_manifest(self) -> tuple[bytes | None, Any]:
        """(the published manifest's bytes or None, its version) as this export starts."""
        raise NotImplementedError

    def _put_manifest(self, manifest: bytes, expected: Any) -> bool:
        """Write the manifest if the published one is still `expected`; False if it is not."""
        raise NotImplementedError


class _LocalLock(DestinationLock):
    """A file: created exclusively by the storage (`Storage.create`: never half-written, and the export's
    directory made with it), aged by the file's modification time (`Storage.modified`); taken over by
    renaming the stale one away first, which the storage's interface has no word for."""

    dest: LocalStorage

    @property
    def path(self) -> Path:
        return self.dest.root / LOCK

    def _create(self) -> bool:
        return self.dest.create(LOCK, self._body())

    def _read(self) -> tuple[bytes, Any, float] | None:
        try:
            raw = self.dest.get(LOCK)
            # Aged after its bytes are read: a lock rewritten in between looks fresh, never a fresh one stale.
            return raw, None, time.time() - self.dest.modified(LOCK)
        except StorageKeyError:
            return None

    def _take_over(self, raw: bytes, version: Any) -> bool:
        moved = self.dest.root / f".tmp-stale-{uuid.uuid4().hex}"
        try:
            os.rename(self.path, moved)
        except FileNotFoundError:
            return False
        if moved.read_bytes() != raw:  # another export took it over first: put its lock back
            try:
                os.link(moved, self.path)
            except FileExistsError:
                pass
            moved.unlink()
            return False
        moved.unlink()
        return self._create()

    def _rewrite(self) -> bool:
        found = self._read()
        if found is None or not self._ours(found[0]):
            return False
        self.dest.put(LOCK, self._body())
        return True

    def _delete_if_ours(self) -> None:
        found = self._read()
        if found is not None and self._ours(found[0]):
            self.dest.delete(LOCK)

    def read_manifest(self) -> tuple[bytes | None, Any]:
        try:
            data = self.dest.get(MANIFEST)
        except StorageKeyError:
            return None, None
        return data, data

    def _put_manifest(self, manifest: bytes, expected: Any) -> bool:
        current, _ = self.read_manifest()
        if current != expected:
            return False
        self.dest.put(MANIFEST, manifest)
        return True


_CONFLICT = {*CONFLICT_CODES, "412", "409"}


class _S3Lock(DestinationLock):
    """An object written with conditional PUTs: `If-None-Match: *` creates it, `If-Match: <ETag>` rewrites,
    takes over and removes it, and publishes the manifest over the one read at the start. Those compare
    ETags, which `Storage` does not carry, so the calls go to the client (through the storage's retries);
    a lock's age is the LastModified of the very GET that read its bytes."""

    dest: S3Storage

    def __init__(self, dest: S3Storage, stale_s: float | None = None) -> None:
        super().__init__(dest, stale_s)
        self.etag: str | None = None

    def _conditional(self, what: str, key: str, **kw: Any) -> dict[str, Any] | None:
        """One S3 call through the storage's retries; None when its condition failed."""
        from botocore.exceptions import ClientError

        def call(client: Any) -> dict[str, Any] | None:
            try:
                return getattr(client, what)(Bucket=self.dest.bucket, Key=self.dest.prefix + key, **kw)
            except ClientError as exc:
                error = exc.response.get("Error", {})
                status = str(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
                if str(error.get("Code", "")) in _CONFLICT or status in ("412", "409"):
                    return None
                raise

        return self.dest._call(what, key, call)

    def _create(self) -> bool:
        resp = self._conditional("put_object", LOCK, Body=self._body(), IfNoneMatch="*")
        if resp is None:
            return False
        self.etag = resp["ETag"]
        return True

    def _get(self, key: str) -> dict[str, Any] | None:
        try:
            return self._conditional("get_object", key)
        except StorageKeyError:
            return None

    def _read(self) -> tuple[bytes, Any, float] | None:
        resp = self._get(LOCK)
        if resp is None:
            return None
        return resp["Body"].read(), resp["ETag"], time.time() - resp["LastModified"].timestamp()

    def _adopt(self, version: Any) -> None:
        self.etag = version

    def _take_over(self, raw: bytes, version: Any) -> bool:
        resp = self._conditional("put_object", LOCK, Body=self._body(), IfMatch=version)
        if resp is None:
            return False
        self.etag = resp["ETag"]
        return True

    def _rewrite(self) -> bool:
        resp = self._conditional("put_object", LOCK, Body=self._body(), IfMatch=self.etag)
        if resp is None:
            found = self._read()  # a retried rewrite the storage had already done is still ours
            if found is None or not self._ours(found[0]):
                return False
            resp = {"ETag": found[1]}
        self.etag = resp["ETag"]
        return True

    def _delete_if_ours(self) -> None:
        if self.etag is not None and self._conditional("delete_object", LOCK, IfMatch=self.etag) is None:
            log.warning("export: %s is no longer ours; left in place", self.dest.uri_for(LOCK))

    def read_manifest(self) -> tuple[bytes | None, Any]:
        resp = self._get(MANIFEST)
        if resp is None:
            return None, None
        return resp["Body"].read(), resp["ETag"]

    def _put_manifest(self, manifest: bytes, expected: Any) -> bool:
        cond = {"IfMatch": expected} if expected is not None else {"IfNoneMatch": "*"}
        if self._conditional("put_object", MANIFEST, Body=manifest, **cond) is not None:
            return True
        current, _ = self.read_manifest()
        return current == manifest  # a retried PUT the storage had already done: published


def _lock_doc(raw: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(raw)
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def _describe(raw: bytes) -> str:
    """Who holds a lock, from what it says (a lock's text names its holder; it decides nothing)."""
    doc = _lock_doc(raw)
    if not doc:
        return "an unreadable lock"
    return (f"host {str(doc.get('host'))[:100]!r}, pid {str(doc.get('pid'))[:20]}, "
            f"started {str(doc.get('started_at'))[:40]}")
