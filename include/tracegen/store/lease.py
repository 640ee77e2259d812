"""Who is generating into an output root right now: one writer per root, arbitrated in the root itself.

Airflow's metadata says whether a `tracegen_generate` run is live, but only to the Airflow that runs it: a
second deployment on the same bucket, or a run whose worker and scheduler died together, is invisible
there. So every task that generates holds a lease on the root while it does:

- A lease is one object per holding task, `lease/<owner digest>.<token>.json`, created exclusively
  (`Storage.create`) and renewed by rewriting it every `ttl_s / 4`. All tasks of one owner (one run, or
  one run of the rerun DAG) share the root; a task of any other owner yields while any of their objects
  is fresh.
- Acquiring is create-then-look: create our object, then list. If another owner's fresh object is
  there, delete ours and yield. Of two owners racing, the later lister always sees the other's object,
  so they never both hold; both may yield, and a caller that waits retries after a random delay.
- A lease is data, not authority. Its freshness is the storage's own modification time plus the
  *reader's* TTL, never what the object says, and a time in the future is ignored: a planted or stale
  lease can only delay work by one TTL after it was last written, and never chooses what runs, where,
  or with which config. Its text only names the holder in the log of the one that yields.
- Released (deleted) when the task ends. A task killed with SIGKILL leaves its object, which expires.
- Fencing: every write of the object is a compare-and-swap on the version last written, and taking the root
  removes the other owners' stale objects (each at the version judged stale), so a holder that was paused
  past its TTL finds its lease gone. Each commit's ledger entry is written guarded by the lease's version
  and a deadline (`RootLease.fence`), so such a holder commits nothing.

The clock compared with the storage's modification times is this machine's: workers and the storage
must agree within `CLOCK_SKEW_S`, which also bounds how long a lease stamped in the future is trusted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from tracegen.store.storage import Fenced, Storage, StorageError, StorageKeyError

log = logging.getLogger(__name__)

LEASE_PREFIX = "lease/"
# How long a holder may go without renewing before its lease is void. Renewals come every quarter of it,
# so a worker stalls for three renewals before another writer may start. Operators with slow storage or
# long stop-the-world pauses raise it (TRACEGEN_LEASE_TTL_S).
DEFAULT_TTL_S = 300.0
CLOCK_SKEW_S = 60.0
# A commit's ledger entry must be written within this share of a TTL after the lease was renewed for it
# (`RootLease.fence`); another writer waits a whole TTL. The rest is the margin a pause, a slow PUT or clock
# skew between a worker and the storage must stay within.
FENCE_SHARE = 0.5
_KEY = re.compile(r"lease/([0-9a-f]{16})\.([0-9a-f]{32})\.json")
_HOLDER_TEXT_MAX = 300
# Taking the root gives up after this many writes of the lease in a row that each took over half a TTL.
_SLOW_TAKES = 3


def lease_ttl_s() -> float:
    raw = os.environ.get("TRACEGEN_LEASE_TTL_S", "")
    try:
        ttl = float(raw) if raw else DEFAULT_TTL_S
    except ValueError:
        raise ValueError(f"TRACEGEN_LEASE_TTL_S={raw!r} is not a number of seconds") from None
    if not 1.0 <= ttl <= 86_400.0:
        raise ValueError(f"TRACEGEN_LEASE_TTL_S={raw!r} must be between 1 and 86400 seconds")
    return ttl


def owner_digest(owner: str) -> str:
    return hashlib.sha256(owner.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Holder:
    """A fresh lease object of some owner: who (as its text says, for messages only) and since when."""

    key: str
    digest: str
    text: str
    age_s: float

    def describe(self) -> str:
        return f"{self.text} (lease {self.key}, renewed {self.age_s:.0f}s ago)"


class RootHeld(RuntimeError):
    """Another owner generates into this root; the message names it."""

    def __init__(self, uri: str, holders: list[Holder]) -> None:
        self.holders = holders
        named = "; ".join(h.describe() for h in holders[:3])
        super().__init__(f"{uri} is held by another writer: {named}")


class LeaseLost(Fenced):
    """Our lease went stale (not renewed within its TTL) and may have been taken, or was taken (removed)."""


def _printable(text: str) -> str:
    """A holder's text as read from storage, safe for a log line: printable, bounded."""
    clean = "".join(c if c.isprintable() else "?" for c in text)
    return clean[:_HOLDER_TEXT_MAX] + ("…" if len(clean) > _HOLDER_TEXT_MAX else "")


def fresh_holders(storage: Storage, ttl_s: float, *, now: float | None = None) -> list[Holder]:
    """Every fresh lease object in the root, of any owner. Objects whose name is not a lease's, whose
    time is past its TTL, or stamped in the future beyond the clock skew are not holders."""
    now = time.time() if now is None else now
    holders = []
    for key in storage.list(LEASE_PREFIX):
        match = _KEY.fullmatch(key)
        if match is None:
            continue
        try:
            age = now - storage.modified(key)
        except StorageKeyError:
            continue  # released between the listing and the look
        if age > ttl_s or age < -CLOCK_SKEW_S:
            continue
        holders.append(Holder(key, match.group(1), _holder_text(storage, key), max(age, 0.0)))
    return holders


def _holder_text(storage: Storage, key: str) -> str:
    try:
        doc = json.loads(storage.get_range(key, 0, 4096))
        return _printable(str(doc.get("holder", "?"))) if isinstance(doc, dict) else "?"
    except (StorageError, ValueError, UnicodeDecodeError):
        return "?"


class RootLease:
    """This task's lease on a root for `owner` (`acquire`, then `renew` from a heartbeat, then `release`).

    Every write of the object is a compare-and-swap on the version we last wrote (`Storage.swap`), and the
    text holds a renewal counter, so each write has its own version: a lease another writer removed when it
    took the root is never written back, and its holder learns so at its next renewal or commit (`fence`)."""

    def __init__(self, storage: Storage, owner: str, holder: str, *, ttl_s: float | None = None) -> None:
        self.storage, self.owner = storage, owner
        self.ttl_s = lease_ttl_s() if ttl_s is None else ttl_s
        self.digest = owner_digest(owner)
        self.key = f"{LEASE_PREFIX}{self.digest}.{uuid.uuid4().hex}.json"
        self._meta = {"owner": owner, "holder": holder, "host": socket.gethostname(), "pid": os.getpid(),
                      "token": self.key}
        self._renewals = 0
        self._renewed = 0.0  # time.monotonic() when the last successful write of the object was sent
        self.version: str | None = None
        self._lock = threading.Lock()  # the heartbeat and the commits renew; one swap at a time
        self.held = False

    def _doc(self) -> bytes:
        return json.dumps({**self._meta, "renewal": self._renewals}).encode()

    def others(self) -> list[Holder]:
        return [h for h in fresh_holders(self.storage, self.ttl_s) if h.digest != self.digest]

    def try_acquire(self) -> list[Holder]:
        """Hold the root, or return the other owners' fresh leases that keep us from it (ours withdrawn).

        Holding it removes the other owners' stale leases, each only if it is still the version judged stale
        (`remove_if`): their holders, should they wake up, find their lease gone and commit nothing (`fence`).
        One renewed meanwhile is fresh again, and we yield to it.

        A write that waited on the root's lock (a holder stopped inside it) for over half a TTL is withdrawn
        and the look repeated: the lease would be stale before its first renewal, and the holder it waited
        for has just been continued and may be fresh again."""
        for _ in range(_SLOW_TAKES):
            if others := self.others():
                return others
            started = time.monotonic()
            try:
                version = self.storage.swap(self.key, self._doc(), None, deadline=started + self.ttl_s / 2)
            except Fenced as exc:
                # Not sent within half a TTL, or sent and unanswered: withdrawn (it is ours alone) like a slow write.
                log.warning("lease %s: not written within half its %.0fs TTL (%s); withdrawn, looking again",
                            self.storage.uri_for(self.key), self.ttl_s, exc)
                self.storage.delete(self.key)
                continue
            if version is None:
                raise StorageError(f"lease {self.storage.uri_for(self.key)} exists already (a token collision)")
            if time.monotonic() - started <= self.ttl_s / 2:
                break
            log.warning("lease %s: its write took %.1fs of a %.0fs TTL; withdrawn, looking again",
                        self.storage.uri_for(self.key), time.monotonic() - started, self.ttl_s)
            self.storage.remove_if(self.key, version)
        else:
            raise StorageError(f"lease {self.storage.uri_for(self.key)}: {_SLOW_TAKES} writes in a row took over "
                               f"half its {self.ttl_s:.0f}s TTL")
        self.version, self._renewed = version, started
        if not (others := self.others()):
            stale = stale_leases(self.storage, self.ttl_s, but=self.digest)
            # Not removed and still there: renewed since it was judged stale, so its holder is alive.
            kept = [key for key, v in stale if not self.storage.remove_if(key, v) and self.storage.exists(key)]
            if kept:
                others = self.others() or [Holder(key, key[len(LEASE_PREFIX):][:16], "?", 0.0) for key in kept]
        if others:
            self.storage.delete(self.key)
            self.version = None
            return others
        self.held = True
        return []

    def acquire(self, wait_s: float = 0.0) -> None:
        """Hold the root, waiting up to `wait_s` for others' leases to be released or expire; raises
        `RootHeld` naming them otherwise."""
        deadline = time.monotonic() + wait_s
        logged = 0.0
        while True:
            others = self.try_acquire()
            if not others:
                return
            now = time.monotonic()
            if now >= deadline:
                raise RootHeld(self.storage.uri, others)
            if now - logged > 60:
                log.warning("waiting for %s", RootHeld(self.storage.uri, others))
                logged = now
            time.sleep(min(deadline - now, min(5.0, self.ttl_s / 4) * (0.5 + random.random())))

    def renew(self) -> None:
        """Rewrite our object if it is still the one we wrote (its modification time is the lease's
        freshness). Raises `LeaseLost` when the last renewal is older than the TTL (another writer may have
        taken the root meanwhile), or when the object was removed or replaced (another writer did)."""
        with self._lock:
            self._renew()

    def _renew(self) -> None:
        if not self.held:
            raise LeaseLost(f"lease {self.storage.uri_for(self.key)} is no longer held")
        self._check_fresh()
        started = time.monotonic()
        self._renewals += 1
        try:
            # Not sent once the lease is void: a renewal landing then would hold off a writer that may start.
            version = self.storage.swap(self.key, self._doc(), self.version, deadline=self._renewed + self.ttl_s)
        except Fenced as exc:
            self.held = False
            raise LeaseLost(f"lease {self.storage.uri_for(self.key)} could not be renewed within its "
                            f"{self.ttl_s:.0f}s TTL ({exc})") from exc
        if version is None:
            self.held = False
            raise LeaseLost(f"lease {self.storage.uri_for(self.key)} was removed or replaced: another writer "
                            "took the root")
        # Checked again after the write: a swap that retried past the TTL left the lease void to others
        # meanwhile, and another writer may have taken the root in that window.
        self._check_fresh()
        self.version, self._renewed = version, started

    def _check_fresh(self) -> None:
        if time.monotonic() - self._renewed > self.ttl_s:
            self.held = False
            raise LeaseLost(f"lease {self.storage.uri_for(self.key)} was not renewed for over {self.ttl_s:.0f}s")

    @contextmanager
    def fence(self) -> Iterator[tuple[dict[str, str], float]]:
        """Renew, then, inside the block, what a commit's ledger entry is written under (`Storage.put_guarded`):
        our object at the version just written, and the deadline FENCE_SHARE of a TTL after that renewal was
        sent. The heartbeat waits for the block, so our own renewal never changes the version it guards. Another
        writer takes the root only once the object is a whole TTL old by the storage's clock, so an entry
        written by the deadline lands before any take-over (given clocks within (1 - FENCE_SHARE) TTL of
        the storage's). Raises `LeaseLost` when the lease is gone: nothing is to be committed then."""
        with self._lock:
            self._renew()
            yield {self.key: self.version or ""}, self._renewed + FENCE_SHARE * self.ttl_s

    def release(self) -> None:
        if self.held:
            self.held = False
            self.storage.delete(self.key)


def stale_leases(storage: Storage, ttl_s: float, *, but: str, now: float | None = None) -> list[tuple[str, str]]:
    """(key, version) of every lease object of an owner other than digest `but` that is past its TTL. The
    version is read before the time, so a renewal between the two reads as fresh, never as stale."""
    now = time.time() if now is None else now
    out = []
    for key in storage.list(LEASE_PREFIX):
        match = _KEY.fullmatch(key)
        if match is None or match.group(1) == but:
            continue
        try:
            version = storage.version(key)
            age = now - storage.modified(key)
        except StorageKeyError:
            continue
        if age > ttl_s:
            out.append((key, version))
    return out


@contextmanager
def holding_root(storage: Storage, owner: str, holder: str, *, wait_s: float = 0.0,
                 ttl_s: float | None = None) -> Iterator[RootLease]:
    """Hold `storage`'s root for `owner` inside the block, renewed by a heartbeat thread. The lease's
    `held` turns False if a renewal finds it lost; callers that can stop early poll it."""
    lease = RootLease(storage, owner, holder, ttl_s=ttl_s)
    lease.acquire(wait_s)
    stop = threading.Event()

    def heartbeat() -> None:
        while not stop.wait(lease.ttl_s / 4):
            try:
                lease.renew()
            except LeaseLost as exc:
                log.error("%s: stopping generation into this root", exc)
                return
            except Exception as exc:  # noqa: BLE001 - a failed renewal is retried at the next beat
                log.warning("lease %s: renewal failed (%s); retrying", lease.key, exc)

    thread = threading.Thread(target=heartbeat, name="root-lease", daemon=True)
    thread.start()
    try:
        yield lease
    finally:
        stop.set()
        thread.join(timeout=5)
        try:
            lease.release()
        except Exception as exc:  # noqa: BLE001 - an unreleased lease only expires
            log.warning("lease %s: release failed (%s); it expires in %.0fs", lease.key, exc, lease.ttl_s)
