"""The worker-local spool: finished rows that are not committed yet survive a SIGKILL.

One directory per (output root, run, chunk), held by one process at a time (an flock).
Rows go into the current *segment*, a JSONL file `open-<id>.jsonl`; each append writes one whole
line and fsyncs, so a kill loses nothing appended (at worst the line being written is torn).
`seal()` renames it to `seg-<id>.jsonl`; the segment id (time + random) becomes the ledger
segment id, which is what makes commits idempotent across crashes.

The protocol the engine follows (`flush` and `recover` below implement it):

    at start:  for seg in spool.pending():            # sealed, and unsealed left by a dead process
                   if not commits.has_segment(seg):   # crash before the entry PUT: commit it now
                       commits.commit(seg.rows, segment=seg.id)
                   spool.discard(seg)                 # crash after the entry PUT: just discard
    loop:      spool.append(row) for every finished row
               every N rows or T seconds (spool.should_seal): flush =
                   spool.seal(), then commit-or-discard every sealed segment as at start
    at end:    flush once more.

Crash windows and why each is safe:
- mid-append: the torn last line is dropped by `pending()`; that row was never committed, so it is
  regenerated (the only loss is work in flight, at most one part interval).
- after seal, before/while the part PUT; between part PUT and entry PUT: no entry exists, so the
  segment is committed again under the same id (the orphan part is overwritten with the same rows).
- between entry PUT and discard: the entry exists, so recovery only discards. Never committed twice.
- S3 down during commit: `commit` retries, then raises; the sealed segment stays in the spool and
  the next flush/recover commits it.
- lease lost or chunk claimed by a newer attempt (`Fenced`): nothing is committed, the segment stays;
  the next recovery commits only its rows whose index is not committed at their cap by then.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tracegen.store.commits import Commits, Fence
from tracegen.store.entries import check_name
from tracegen.store.records import GeneratedRow, duplicate_key
from tracegen.store.storage import fsync_dir

log = logging.getLogger(__name__)

_OPEN, _SEALED, _SUFFIX = "open-", "seg-", ".jsonl"
_FILE_RE = re.compile(r"(open|seg)-(?P<id>[0-9]{8}T[0-9]{12}Z-[0-9a-f]{12})\.jsonl")


class SpoolBusyError(RuntimeError):
    """Another live process holds this spool (two task instances for one chunk)."""


@dataclass(frozen=True, slots=True)
class Segment:
    id: str
    path: Path
    rows: list[GeneratedRow] = field(repr=False)
    sealed: bool = True

    def __len__(self) -> int:
        return len(self.rows)


def default_spool_dir() -> Path:
    """$TRACEGEN_SPOOL_DIR, else $XDG_CACHE_HOME/tracegen/spool, else ~/.cache/tracegen/spool."""
    if env := os.environ.get("TRACEGEN_SPOOL_DIR"):
        return Path(env)
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "tracegen" / "spool"


def _root_slug(output_uri: str) -> str:
    # Readable tail + hash: two output roots never share a spool even when their tails collide.
    tail = re.sub(r"[^A-Za-z0-9._-]+", "_", output_uri.rstrip("/").rsplit("/", 1)[-1])[:40] or "root"
    return f"{tail}-{hashlib.sha256(output_uri.encode()).hexdigest()[:12]}"


def new_segment_id() -> str:
    # Time first so ids sort oldest-first (recovery commits in order); the random tail makes them unique.
    return f"{datetime.now(UTC).strftime('%Y%m%dT%H%M%S%fZ')}-{uuid.uuid4().hex[:12]}"


class Spool:
    """Local, durable staging for one chunk's finished rows.

    One thread appends and seals. `pending`/`discard` (hence `recover`) may run meanwhile in one other
    thread, e.g. a commit in a worker thread: they never touch the open segment, whose id is set
    before its file is created.
    """

    def __init__(self, output_uri: str, run_id: str, chunk: int, base_dir: str | os.PathLike[str] | None = None):
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
            raise ValueError(f"chunk must be a non-negative int, got {chunk!r}")
        self.output_uri = output_uri
        self.run_id = check_name("run_id", run_id)
        self.chunk = chunk
        self.dir = Path(base_dir or default_spool_dir()) / _root_slug(output_uri) / run_id / f"c{chunk:05d}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(self.dir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            # The kernel drops the lock when the holder dies, SIGKILL included: no stale-lock cleanup.
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise SpoolBusyError(f"spool {self.dir} is held by another live process") from None
        self._fd: int | None = None
        self._seg_id: str | None = None
        self._rows: list[GeneratedRow] = []
        self._size = 0  # bytes of whole rows in the current segment
        self._broken: OSError | None = None
        self._opened_at = 0.0

    # ---- writing -------------------------------------------------------------------------------

    def append(self, row: GeneratedRow) -> None:
        """Durably add one finished row to the current segment (one JSON line + fsync)."""
        if self._lock_fd < 0:
            raise RuntimeError(f"spool {self.dir} is closed")
        if row.run_id != self.run_id or row.chunk != self.chunk:
            # Checked here, not at commit: a row that can never commit would wedge the spool forever.
            raise ValueError(
                f"row {row.index} says run {row.run_id!r} chunk {row.chunk}; this spool is run "
                f"{self.run_id!r} chunk {self.chunk}"
            )
        if self._broken is not None:
            raise OSError(f"spool {self.dir} cannot be appended to since an earlier write failed and could not be "
                          f"undone ({self._broken})")
        # Encoded before anything is written: a row that cannot be encoded leaves the segment as it was.
        line = (json.dumps(row.to_json(), ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")
        if self._fd is None:
            self._seg_id = new_segment_id()
            path = self.dir / f"{_OPEN}{self._seg_id}{_SUFFIX}"
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
            fsync_dir(self.dir)
            self._opened_at = time.monotonic()
        try:
            view = memoryview(line)
            while view:
                n = os.write(self._fd, view)
                view = view[n:]
            os.fsync(self._fd)
        except OSError:
            self._undo_write()
            raise
        self._size += len(line)
        self._rows.append(row)

    def _undo_write(self) -> None:
        """Cut the segment back to its last whole row after a failed write (a full disk, an I/O error), so the
        rows appended after it are not glued to a torn line; when even that fails, refuse further appends
        (the torn line is then the last one, which `pending()` drops)."""
        try:
            os.ftruncate(self._fd, self._size)
            os.fsync(self._fd)
        except OSError as exc:
            self._broken = exc

    @property
    def current_rows(self) -> int:
        return len(self._rows)

    def current_age_s(self) -> float:
        return time.monotonic() - self._opened_at if self._rows else 0.0

    def should_seal(self, max_rows: int, max_age_s: float) -> bool:
        """True once the current segment holds `max_rows` rows or is `max_age_s` old."""
        return bool(self._rows) and (len(self._rows) >= max_rows or self.current_age_s() >= max_age_s)

    def seal(self) -> Segment | None:
        """Close the current segment under its id; None when nothing was appended since the last seal."""
        if self._fd is None or self._seg_id is None:
            return None
        os.fsync(self._fd)
        os.close(self._fd)
        src = self.dir / f"{_OPEN}{self._seg_id}{_SUFFIX}"
        dst = self.dir / f"{_SEALED}{self._seg_id}{_SUFFIX}"
        os.replace(src, dst)
        fsync_dir(self.dir)
        seg = Segment(self._seg_id, dst, self._rows, sealed=True)
        self._fd, self._seg_id, self._rows, self._size = None, None, [], 0
        return seg

    def discard(self, segment: Segment) -> None:
        """Forget a segment once its commit is durable."""
        if segment.path.parent != self.dir:
            raise ValueError(f"segment {segment.id} is not in spool {self.dir}")
        if segment.id == self._seg_id:
            raise ValueError(f"segment {segment.id} is still open for appends; seal it first")
        try:
            segment.path.unlink()
        except FileNotFoundError:
            pass
        fsync_dir(self.dir)

    # ---- recovery ------------------------------------------------------------------------------

    def pending(self) -> list[Segment]:
        """Segments left from before (oldest first), excluding the one this process is writing.

        Unsealed leftovers are cut back to their last whole line and sealed, so what is returned is
        exactly what will be committed, and asking again after a crash gives the same rows.
        """
        out: list[Segment] = []
        for path in sorted(self.dir.iterdir(), key=lambda p: p.name.split("-", 1)[-1]):
            m = _FILE_RE.fullmatch(path.name)
            if m is None or m["id"] == self._seg_id:
                continue
            rows, good_len, size = _read_segment(path)
            if path.name.startswith(_OPEN):
                if good_len < size:
                    log.warning("spool %s: dropping a torn last line (%d bytes)", path, size - good_len)
                    os.truncate(path, good_len)
                dst = self.dir / f"{_SEALED}{m['id']}{_SUFFIX}"
                os.replace(path, dst)
                fsync_dir(self.dir)
                path = dst
            if not rows:
                path.unlink()
                fsync_dir(self.dir)
                continue
            out.append(Segment(m["id"], path, rows, sealed=True))
        return out

    def close(self) -> None:
        """Release the spool. The current segment stays on disk unsealed, for the next `pending()`."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def __enter__(self) -> Spool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _read_segment(path: Path) -> tuple[list[GeneratedRow], int, int]:
    """Rows of a segment file, the byte length of its whole lines, and its size."""
    data = path.read_bytes()
    good_len = data.rfind(b"\n") + 1  # a torn last line has no newline yet
    rows: list[GeneratedRow] = []
    for n, line in enumerate(data[:good_len].splitlines(), 1):
        try:
            rows.append(GeneratedRow.from_json(json.loads(line)))
        except (ValueError, TypeError) as exc:
            # Only disk corruption gets here (appends are whole lines + fsync). Losing the row just means
            # it is generated again, which is better than wedging the chunk.
            log.warning("spool %s line %d is unreadable, dropping it: %s", path, n, exc)
    return rows, good_len, len(data)


def flush(spool: Spool, commits: Commits) -> int:
    """Seal the current segment and commit-or-discard every sealed segment. Returns rows committed.

    Committing all of them (not just the one sealed now) means a segment whose commit failed earlier,
    e.g. during an S3 outage, goes out with the next flush instead of waiting for a restart.
    """
    spool.seal()
    return recover(spool, commits)


def recover(spool: Spool, commits: Commits, on_commit: Callable[[int], None] | None = None, *,
            fence: Fence | None = None,
            committed: Callable[[list[GeneratedRow]], set[tuple[int, int, bool]]] | None = None) -> int:
    """Commit-or-discard every pending segment (the start-up half of the protocol). Returns rows committed.

    `on_commit(n)` hears of each segment as it becomes durable, so a caller's count stays right even when
    a later segment's commit raises (an S3 outage that outlasts the storage retries). `fence` guards each
    entry write (`Commits.commit`): once it raises `Fenced` the segment and those after it stay in the
    spool, neither committed nor discarded. `committed(rows)` gives the `duplicate_key`s the ledger already
    holds among those rows' indices: rows another writer committed meanwhile (a segment left by an attempt
    that lost its lease or its claim) are left out, so a recovery never commits an index twice under one cap.
    """
    committed_rows = 0
    for seg in spool.pending():
        if not commits.has_segment(spool.run_id, spool.chunk, seg.id):
            rows = seg.rows
            if committed is not None:
                there = committed(rows)
                rows = [r for r in rows if duplicate_key(r.index, r.max_tokens, r.status, r.pivot) not in there]
                if len(rows) < len(seg.rows):
                    log.warning("spool %s: %d of its %d rows were committed by another writer meanwhile; "
                                "not committing them again", seg.path, len(seg.rows) - len(rows), len(seg.rows))
            if rows:
                n = commits.commit(rows, spool.run_id, spool.chunk, seg.id, fence=fence).n_rows
                committed_rows += n
                if on_commit is not None:
                    on_commit(n)
        spool.discard(seg)
    return committed_rows
