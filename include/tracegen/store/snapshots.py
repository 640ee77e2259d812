"""The ledger as a frame, and the Parquet snapshots that make reading it cheap.

Snapshots are only a cache for fast reads: entries stay the truth, and entries committed after the newest
snapshot ("loose" entries) are read on top of it. An entry retired after a snapshot was taken still has
rows in it; every read drops them.
"""

from __future__ import annotations

import io
import json
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pandas as pd
import pyarrow.parquet as pq

from tracegen.store.commits import Commits
from tracegen.store.entries import INT_COLS, SCHEMA, LedgerError, now, part_for_entry
from tracegen.store.records import (
    BOOL_COLS,
    FLOAT_COLS,
    LEDGER_COLUMNS,
    LEDGER_DEFAULTS,
    PLAN_COLUMNS,
    GeneratedRow,
)
from tracegen.store.storage import StorageKeyError

FRAME_COLUMNS = (*LEDGER_COLUMNS, "part", "committed_at")
SNAPSHOT_DIR = "ledger-snapshots/"
_PLAN_BATCH = 256  # entries parsed at a time by plan_frame: bounds memory whatever the ledger's size

# Planner and audit reads fold the ledger into a Parquet snapshot once this many entries are not in one
# yet, so every later read (each chunk task's resume) costs one GET instead of thousands.
COMPACT_OVER = 200


def empty_frame() -> pd.DataFrame:
    return _frame_from_columns({c: [] for c in FRAME_COLUMNS})


def _frame_from_columns(cols: dict[str, list[Any]]) -> pd.DataFrame:
    data: dict[str, Any] = {}
    for c in FRAME_COLUMNS:
        v = cols[c]
        if c in INT_COLS:
            data[c] = np.asarray(v, dtype=np.int64)
        elif c in BOOL_COLS:
            data[c] = np.asarray(v, dtype=bool)
        elif c in FLOAT_COLS:
            data[c] = np.asarray(v, dtype=np.float64)
        elif c == "committed_at":
            data[c] = v if isinstance(v, pd.Series) else pd.to_datetime(pd.Series(v, dtype=object), utc=True, format="ISO8601")
        else:
            data[c] = pd.Series(v, dtype="str")
    return pd.DataFrame(data, columns=list(FRAME_COLUMNS))


def _normalise(frame: pd.DataFrame) -> pd.DataFrame:
    """Same dtypes whether the frame came from entries or from a Parquet snapshot."""
    out = {}
    for c in FRAME_COLUMNS:
        if c not in frame.columns and c in LEDGER_DEFAULTS:  # a snapshot from before the column existed
            frame = frame.assign(**{c: LEDGER_DEFAULTS[c]})
        s = frame[c]
        if c in INT_COLS:
            out[c] = s.astype(np.int64)
        elif c in BOOL_COLS:
            out[c] = s.astype(bool)
        elif c in FLOAT_COLS:
            out[c] = s.astype(np.float64)
        elif c == "committed_at":
            out[c] = pd.to_datetime(s, utc=True)
        else:
            out[c] = s.astype("str") if s.dtype != "str" else s
    return pd.DataFrame(out, columns=list(FRAME_COLUMNS))


def rows_to_frame(rows: Iterable[GeneratedRow], part: str = "", committed_at: str | None = None) -> pd.DataFrame:
    """A ledger-shaped frame built straight from rows (for tests and tools that have rows in hand)."""
    rows = list(rows)
    values = [r.ledger_values() for r in rows]
    cols: dict[str, list[Any]] = {c: [v[c] for v in values] for c in LEDGER_COLUMNS}
    cols["part"] = [part] * len(rows)
    cols["committed_at"] = [committed_at or now()] * len(rows)
    return _frame_from_columns(cols)


@dataclass(frozen=True, slots=True)
class Coverage:
    """How a read splits the ledger: the rows of the newest snapshot, then the entries it lacks."""

    snapshot: dict[str, Any] | None  # its manifest (None: no snapshot, or its Parquet was pruned meanwhile)
    covered: frozenset[str]  # entries the snapshot holds that still count
    stale: frozenset[str]  # entries the snapshot holds that were retired after it was taken
    loose: list[str]  # entries that count and the snapshot lacks, in key order

    def stale_parts(self) -> set[str]:
        """The parts of `stale`: a read drops the snapshot's rows of these."""
        return {part_for_entry(k) for k in self.stale}


class Snapshots:
    """Reads the ledger of one output root as frames, and writes the snapshots those reads start from."""

    def __init__(self, commits: Commits) -> None:
        self.commits = commits
        self.storage = commits.storage

    def latest(self) -> dict[str, Any] | None:
        """The newest snapshot's manifest (its key under "key"), or None when there is none."""
        manifests = [k for k in self.storage.list(SNAPSHOT_DIR) if k.endswith(".json")]
        if not manifests:
            return None
        key = manifests[-1]  # names sort by creation time
        try:
            doc = json.loads(self.storage.get(key))
        except ValueError as exc:
            raise LedgerError(f"snapshot manifest {self.storage.uri_for(key)} is not valid JSON: {exc}") from exc
        doc["key"] = key
        return doc

    def coverage(self, *, fetch: bool = True) -> tuple[Coverage, bytes | None]:
        """What a read takes from the newest snapshot and what from loose entries, with the snapshot's
        Parquet bytes when `fetch` (None otherwise, or when there is no snapshot)."""
        retired = self.commits.retired_entries()
        snap = self.latest()
        raw = None
        if snap is not None and fetch:
            try:
                raw = self.storage.get(snap["parquet"])
            except StorageKeyError:
                snap = None  # pruned by a concurrent compaction: the entries hold everything
        in_snap = set(snap["entries"]) if snap is not None else set()
        loose = [k for k in self.commits.committed_entries() if k not in in_snap and k not in retired]
        return Coverage(snap, frozenset(in_snap - retired), frozenset(in_snap & retired), loose), raw

    def frame(self, compact_over: int | None = None) -> pd.DataFrame:
        """One row per committed ledger row: LEDGER_COLUMNS + part + committed_at. Never reads parts.

        With `compact_over=N`, a read that had to parse more than N entries beyond the newest snapshot
        also writes a new snapshot, so the next reader pays one Parquet GET instead (planner/audit tasks).
        """
        frame, used, uncovered = self._load()
        if compact_over is not None and uncovered > compact_over:
            self._write(frame, used)
        return frame

    def _load(self) -> tuple[pd.DataFrame, list[str], int]:
        """The ledger frame, the entry keys it was built from, and how many of those the snapshot lacked."""
        view, raw = self.coverage()
        frames: list[pd.DataFrame] = []
        if view.snapshot is not None and raw is not None:
            snap = view.snapshot
            snap_frame = pd.read_parquet(io.BytesIO(raw))
            del raw
            if len(snap_frame) != snap["n_rows"]:
                raise LedgerError(
                    f"snapshot {snap['key']} says {snap['n_rows']} rows, its Parquet has {len(snap_frame)}"
                )
            if view.stale:  # retired after this snapshot was taken: its rows no longer count
                snap_frame = snap_frame[~snap_frame["part"].isin(view.stale_parts())].reset_index(drop=True)
            frames.append(_normalise(snap_frame))
        if view.loose:
            frames.append(self.entries_frame(view.loose))
        used = sorted(view.covered | set(view.loose))
        if not frames:
            return empty_frame(), used, 0
        frame = frames[0] if len(frames) == 1 else pd.concat(frames, ignore_index=True)
        return frame, used, len(view.loose)

    def entries_frame(self, keys: list[str]) -> pd.DataFrame:
        """The frame of the rows of entries `keys` (FRAME_COLUMNS), in their order."""
        cols: dict[str, list[Any]] = {c: [] for c in FRAME_COLUMNS}
        stamps: list[str] = []
        counts: list[int] = []
        for _key, entry in self.commits.read_entries(keys):
            n = entry["n_rows"]
            for c in LEDGER_COLUMNS:
                cols[c].extend(entry["columns"][c])
            cols["part"].extend([entry["part"]] * n)
            stamps.append(entry["committed_at"])
            counts.append(n)
        try:
            # One timestamp per entry: parse each once, then repeat (parsing a million strings is slow).
            when = pd.to_datetime(pd.Series(stamps, dtype=object), utc=True, format="ISO8601")
            cols["committed_at"] = when.repeat(counts).reset_index(drop=True)
            return _frame_from_columns(cols)
        except (ValueError, TypeError, OverflowError) as exc:
            # The columns are converted all at once (fast); only now look for the entry to blame.
            raise self.commits.bad_entry_error(keys, exc) from exc

    def plan_frame(self, indices: np.ndarray | Sequence[int], also: Sequence[str] = ()) -> pd.DataFrame:
        """Only what planning needs (index, status, finish_reason, max_tokens, runaway_score, which keeps a
        runaway from being continued, and the part holding the row, where a truncated row is continued from)
        for the rows of `indices`, and completion_tokens, with
        which the gates judge a row generated under a higher cap (`audit.stats.gate_counts`).

        A chunk task resumes from this instead of `frame()`: its memory then follows the chunk, not the
        dataset (the full frame of a 1M-row ledger costs hundreds of MiB per task). Entries are parsed a
        batch at a time and filtered as they are read; the snapshot is read with a column and range filter.
        `also`: more ledger columns to read (a spool's recovery needs `pivot`).
        """
        wanted = np.unique(np.asarray(indices, dtype=np.int64))
        columns = [*PLAN_COLUMNS, "completion_tokens", *also, "part"]
        if wanted.size == 0:
            return pd.DataFrame({c: pd.Series(dtype=empty_frame()[c].dtype) for c in columns})
        parts: list[pd.DataFrame] = []
        view, raw = self.coverage()
        if view.snapshot is not None and raw is not None:
            stored = set(pq.read_schema(io.BytesIO(raw)).names)
            table = pq.read_table(
                io.BytesIO(raw), columns=[c for c in columns if c in stored],
                filters=[("index", ">=", int(wanted[0])), ("index", "<=", int(wanted[-1]))],
            )
            del raw
            # A snapshot from before a column existed holds what LEDGER_DEFAULTS says of it.
            frame = table.to_pandas().assign(**{c: LEDGER_DEFAULTS.get(c) for c in columns if c not in stored})
            keep_rows = np.isin(frame["index"].to_numpy(dtype=np.int64), wanted)
            if view.stale:  # retired after this snapshot was taken: their rows no longer count
                keep_rows &= ~frame["part"].isin(view.stale_parts()).to_numpy()
            parts.append(frame.loc[keep_rows, columns])
        for start in range(0, len(view.loose), _PLAN_BATCH):
            parts.append(self._plan_rows(view.loose[start : start + _PLAN_BATCH], columns, wanted))
        frame = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=columns)
        return frame.reset_index(drop=True).astype({"index": np.int64, "max_tokens": np.int64})

    def _plan_rows(self, keys: Sequence[str], columns: list[str], wanted: np.ndarray) -> pd.DataFrame:
        """`columns` of the rows of entries `keys` whose index is in `wanted`."""
        cols: dict[str, list[Any]] = {c: [] for c in columns}
        for key, entry in self.commits.read_entries(keys):
            try:
                keep = np.flatnonzero(np.isin(np.asarray(entry["columns"]["index"], dtype=np.int64), wanted))
                np.asarray([entry["columns"]["max_tokens"][i] for i in keep], dtype=np.int64)
            except (ValueError, TypeError, OverflowError) as exc:
                where = self.storage.uri_for(key)
                raise LedgerError(f"entry {where}: index or max_tokens holds a non-integer ({exc})") from exc
            for c in columns[:-1]:
                column = entry["columns"].get(c) or [LEDGER_DEFAULTS.get(c)] * len(entry["columns"]["index"])
                cols[c].extend(column[i] for i in keep)
            cols["part"].extend([entry["part"]] * len(keep))
        return pd.DataFrame(cols)

    def compact(self, keep: int = 2) -> str | None:
        """Fold every entry into one Parquet snapshot so `frame()` costs one GET instead of thousands.

        Returns the manifest key (None when the ledger is empty or nothing changed since the last one).
        Keeps the newest `keep` snapshots, so a reader that listed an older one can still finish.
        """
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        prev = self.latest()
        frame, used, _ = self._load()
        if not used or (prev is not None and sorted(prev["entries"]) == used):
            return None
        return self._write(frame, used, keep)

    def compact_loose(self, over: int = COMPACT_OVER, keep: int = 2) -> str | None:
        """A new snapshot when more than `over` committed entries are not in the newest one: the newest
        snapshot's rows, streamed a batch at a time, followed by those entries' rows, a batch of entries at a
        time. Returns its manifest key, or None when there was nothing to do.

        Chunk tasks call this as they start, so a chunk start parses at most `over` entries whatever the
        fan-out committed before it (otherwise its cost grows with the run: quadratic over it). Memory
        here follows the compressed snapshot and one batch of entries, never the whole ledger's frame.
        """
        import pyarrow as pa

        view, _ = self.coverage(fetch=False)  # most chunk starts stop at the count: no Parquet GET for them
        if len(view.loose) <= over:
            return None
        snap = view.snapshot
        # No snapshot yet (the planner writes one for any ledger over COMPACT_OVER, so this one is small), a
        # retirement since it (its rows must go) or a snapshot from before a column existed: rewrite it whole.
        if snap is None or view.stale:
            return self.compact(keep)
        try:
            old = pq.ParquetFile(io.BytesIO(self.storage.get(snap["parquet"])))
        except StorageKeyError:
            return None  # pruned by a concurrent compaction, which covered these entries
        target = old.schema_arrow  # the new rows are cast to it: one Parquet schema for the whole file
        if target.names != list(FRAME_COLUMNS):
            return self.compact(keep)
        buf = io.BytesIO()
        n_old = n_rows = 0
        with pq.ParquetWriter(buf, target, compression="zstd") as writer:
            for batch in old.iter_batches(batch_size=65_536):
                writer.write_batch(batch)
                n_old += batch.num_rows
            for start in range(0, len(view.loose), _PLAN_BATCH):
                frame = self.entries_frame(view.loose[start : start + _PLAN_BATCH])
                writer.write_table(pa.Table.from_pandas(frame, preserve_index=False).cast(target))
                n_rows += len(frame)
        if n_old != snap["n_rows"]:
            raise LedgerError(f"snapshot {snap['key']} says {snap['n_rows']} rows, its Parquet has {n_old}")
        return self._publish(buf.getvalue(), n_old + n_rows, sorted(view.covered | set(view.loose)), keep)

    def _write(self, frame: pd.DataFrame, used: list[str], keep: int = 2) -> str:
        buf = io.BytesIO()
        frame.to_parquet(buf, index=False, compression="zstd")
        return self._publish(buf.getvalue(), len(frame), used, keep)

    def _publish(self, parquet: bytes, n_rows: int, used: list[str], keep: int) -> str:
        token = f"snap-{datetime.now(UTC).strftime('%Y%m%dT%H%M%S%fZ')}-{uuid.uuid4().hex[:12]}"
        pq_key, manifest_key = f"{SNAPSHOT_DIR}{token}.parquet", f"{SNAPSHOT_DIR}{token}.json"
        self.storage.put(pq_key, parquet)
        manifest = {"schema": SCHEMA, "parquet": pq_key, "n_rows": n_rows, "created_at": now(), "entries": used}
        self.storage.put(manifest_key, json.dumps(manifest).encode())  # the snapshot's commit point
        manifests = [k for k in self.storage.list(SNAPSHOT_DIR) if k.endswith(".json")]
        for old in manifests[:-keep]:
            self.storage.delete(old)
            self.storage.delete(old[: -len(".json")] + ".parquet")
        return manifest_key
