"""Which attempt of a chunk may commit: the newest one to claim it.

All tasks of one run share the root's lease (`store.lease`), and a chunk's spool lock is local to a worker,
so two attempts of one chunk on two workers (a retry started while the first attempt still runs, its
heartbeat lost) would both commit. Each chunk engine therefore claims its chunk when it starts: it writes
`claims/<run>/c<chunk>.json` by compare-and-swap on the version it read (`Storage.swap`), holding a unique
token, the task and its try number. Every commit's ledger entry is then written only while the claim is
still that version (a guard of `Storage.put_guarded`, with the lease's). A later claim replaces it, so once
a newer attempt has claimed the chunk, an older one commits nothing: its finished rows stay in its spool.

A newer try always wins: a try that finds the claim of a higher try of its own task, written within the
TTL, yields instead of claiming (`ChunkSuperseded`), so an older try that starts late cannot take the chunk
back. A claim is data, like a lease: one planted with a high try number holds that task's tries back for
one TTL after it was written, at most; it can never make anything commit.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass

from tracegen.store.entries import check_name
from tracegen.store.storage import Fenced, Storage, StorageError, StorageKeyError

log = logging.getLogger(__name__)

CLAIM_DIR = "claims/"
_SWAP_TRIES = 20


class ChunkSuperseded(Fenced):
    """A newer attempt claimed this chunk: this one commits nothing more."""


@dataclass(frozen=True)
class Attempt:
    """Who runs a chunk: the task (Airflow's task id and map index) and its try number, when known."""

    task: str
    try_number: int | None = None

    def describe(self) -> str:
        return self.task if self.try_number is None else f"{self.task} try {self.try_number}"


def claim_key(run_id: str, chunk: int) -> str:
    return f"{CLAIM_DIR}{check_name('run_id', run_id)}/c{int(chunk):05d}.json"


def _read(storage: Storage, key: str) -> tuple[str | None, dict | None, float | None]:
    """(version, parsed claim or None when it does not parse, its storage time) of the claim; all None
    when there is none. The version is read first: a claim replaced between the reads fails our swap."""
    try:
        version = storage.version(key)
        doc = json.loads(storage.get(key))
        modified = storage.modified(key)
    except StorageKeyError:
        return None, None, None
    except (ValueError, UnicodeDecodeError):
        return version, None, None
    return version, doc if isinstance(doc, dict) else None, modified


class ChunkClaim:
    """This attempt's claim on (run, chunk): `take` it when starting, then put `guard()` under every commit."""

    def __init__(self, storage: Storage, run_id: str, chunk: int, attempt: Attempt, holder: str,
                 *, ttl_s: float) -> None:
        self.storage, self.attempt, self.ttl_s = storage, attempt, ttl_s
        self.key = claim_key(run_id, chunk)
        self._doc = json.dumps({"run_id": run_id, "chunk": int(chunk), "task": attempt.task,
                                "try_number": attempt.try_number, "holder": holder, "host": socket.gethostname(),
                                "pid": os.getpid(), "token": uuid.uuid4().hex}).encode()
        self.version: str | None = None

    def take(self) -> None:
        """Claim the chunk, replacing any older attempt's claim; `ChunkSuperseded` when a newer try of this
        task holds it (written within the TTL)."""
        for _ in range(_SWAP_TRIES):
            version, doc, modified = _read(self.storage, self.key)
            if doc is not None and self._newer(doc, modified):
                raise ChunkSuperseded(
                    f"{self.attempt.describe()} yields: {self.storage.uri_for(self.key)} is claimed by try "
                    f"{int(doc['try_number'])} of the same task; an older try commits nothing")
            new = self.storage.swap(self.key, self._doc, version)
            if new is not None:
                self.version = new
                if doc is not None:
                    log.info("%s: claimed %s from %s", self.attempt.describe(), self.key,
                             _describe(doc))
                return
        raise StorageError(f"could not claim {self.storage.uri_for(self.key)}: it kept changing")

    def _newer(self, doc: dict, modified: float | None) -> bool:
        theirs, ours = doc.get("try_number"), self.attempt.try_number
        if doc.get("task") != self.attempt.task or not isinstance(theirs, int) or ours is None or theirs <= ours:
            return False
        return modified is not None and time.time() - modified <= self.ttl_s

    def guard(self) -> dict[str, str]:
        """What a commit is written under: this claim, as we wrote it."""
        if self.version is None:
            raise ChunkSuperseded(f"{self.attempt.describe()} has not claimed {self.key}")
        return {self.key: self.version}

    def check(self) -> None:
        """`ChunkSuperseded` once another attempt has claimed the chunk."""
        version, doc, _ = _read(self.storage, self.key)
        if version != self.version:
            raise ChunkSuperseded(f"{self.attempt.describe()}: {self.storage.uri_for(self.key)} was claimed by "
                                  f"{_describe(doc) if doc else 'another attempt'}; committing nothing more")


def _describe(doc: dict) -> str:
    """A claim's task and try as read from storage, safe for a log line: printable, bounded."""
    task = "".join(c if c.isprintable() else "?" for c in str(doc.get("task", "?")))[:200]
    tried = doc.get("try_number")
    return task if not isinstance(tried, int) else f"{task} try {tried}"
