"""The ledger: the committed record of generated rows, and the only source of "what is done".

Layout under the output root (all objects written once, under unique names, never appended to):

    dataset.json                                   fingerprint of the dataset this root belongs to
    runs/<run_id>/<name>                           run config, reports, ... (beside the data)
    parts/<run_id>/c<chunk:05d>-<segment>.jsonl.gz full rows (GeneratedRow.to_json(), one JSON per line)
    ledger/<run_id>/c<chunk:05d>-<segment>.json    the entry: per-row summary (LEDGER_COLUMNS), columnar
    ledger-snapshots/snap-<time>-<token>.json      a compaction manifest: which entries the Parquet covers
    ledger-snapshots/snap-<time>-<token>.parquet   those entries' rows, folded into one file
    ledger-retired/<run_id>/c<chunk:05d>-<segment>.json  that entry's part failed verification

A commit writes the part, then the entry. The entry's single atomic PUT is the commit point: a part
without an entry is an invisible orphan (safe to sweep), an entry always has its whole part behind it.
Committing a segment whose entry exists is a no-op, so a retried commit never duplicates rows.
Snapshots are only a cache for fast reads: entries stay the truth, and entries committed after the
newest snapshot are read on top of it.

Each entry records its part's size and sha256 (entries written before that have neither), so a part
that was truncated, deleted or altered after its commit is found (`verify_parts`). Retiring such an
entry writes a retirement record beside the entries; every read leaves retired entries out, so their
rows are work again, "done" is still derived from the ledger alone, and nothing is deleted.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import re
import uuid
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pandas as pd
import pyarrow.parquet as pq

from tracegen.store.records import (
    FAILED,
    LEDGER_COLUMNS,
    LEDGER_DEFAULTS,
    PLAN_COLUMNS,
    RESAMPLED,
    GeneratedRow,
)
from tracegen.store.storage import LocalStorage, Storage, StorageKeyError, open_storage

SCHEMA = 1
FRAME_COLUMNS = (*LEDGER_COLUMNS, "part", "committed_at")
_PLAN_BATCH = 256  # entries parsed at a time by plan_frame: bounds memory whatever the ledger's size

ENTRY_DIR = "ledger/"
PART_DIR = "parts/"
SNAPSHOT_DIR = "ledger-snapshots/"
RETIRED_DIR = "ledger-retired/"
RUNS_DIR = "runs/"
DATASET_FILE = "dataset.json"

# Airflow run ids look like "manual__2026-11-29T19:22:10.576599+00:00": allow those, never a '/'.
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:+\-]{0,199}")
_ENTRY_RE = re.compile(r"ledger/(?P<run>[^/]+)/c(?P<chunk>\d{5,})-(?P<segment>[^/]+)\.json")

_INT_COLS = ("index", "prompt_tokens", "completion_tokens", "reasoning_tokens", "max_tokens", "chunk", "attempt",
             "prefix_tokens")
_STR_COLS = ("status", "finish_reason", "run_id", "server", "category", "error", "part", "pivot")


# Planner and audit reads fold the ledger into a Parquet snapshot once this many entries are not in one
# yet, so every later read (each chunk task's resume) costs one GET instead of thousands.
COMPACT_OVER = 200


class LedgerError(Exception):
    """The ledger holds something it should not (unparsable entry or part, wrong layout)."""


class DatasetMismatchError(LedgerError):
    """The output root already belongs to a different dataset."""


@dataclass(frozen=True, slots=True)
class PartDamage:
    """A committed entry whose part no longer matches it (or an entry that does not parse)."""

    entry: str
    part: str
    n_rows: int | None  # None when the entry itself is unreadable
    problem: str


class PartDamageError(LedgerError):
    """A part read back is no longer what its entry committed (`Ledger.read_verified_part`)."""

    def __init__(self, damage: PartDamage) -> None:
        super().__init__(f"part {damage.part} no longer matches its ledger entry {damage.entry}: {damage.problem}")
        self.damage = damage


def check_name(kind: str, value: str) -> str:
    if not isinstance(value, str) or not _NAME_RE.fullmatch(value):
        raise ValueError(f"{kind} {value!r} must match {_NAME_RE.pattern} (no '/', at most 200 chars)")
    return value


def _check_chunk(chunk: int) -> int:
    if isinstance(chunk, bool) or not isinstance(chunk, int | np.integer) or chunk < 0:
        raise ValueError(f"chunk must be a non-negative int, got {chunk!r}")
    return int(chunk)


def entry_key(run_id: str, chunk: int, segment: str) -> str:
    return f"{ENTRY_DIR}{check_name('run_id', run_id)}/c{_check_chunk(chunk):05d}-{check_name('segment', segment)}.json"


def part_key(run_id: str, chunk: int, segment: str) -> str:
    return f"{PART_DIR}{check_name('run_id', run_id)}/c{_check_chunk(chunk):05d}-{check_name('segment', segment)}.jsonl.gz"


@dataclass(frozen=True, slots=True)
class Commit:
    entry: str
    part: str
    n_rows: int
    created: bool  # False: the segment was already committed and nothing was written


def encode_part(rows: Sequence[GeneratedRow]) -> bytes:
    text = "".join(json.dumps(r.to_json(), ensure_ascii=False, separators=(",", ":")) + "\n" for r in rows)
    # mtime=0: the same rows always give the same bytes, so a retried part upload is byte-identical.
    return gzip.compress(text.encode("utf-8"), compresslevel=6, mtime=0)


def decode_part(data: bytes, where: str) -> list[GeneratedRow]:
    try:
        text = gzip.decompress(data).decode("utf-8")
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise LedgerError(f"part {where} is not valid gzip/UTF-8: {exc}") from exc
    rows: list[GeneratedRow] = []
    for n, line in enumerate(text.splitlines(), 1):
        try:
            rows.append(GeneratedRow.from_json(json.loads(line)))
        except (ValueError, TypeError) as exc:
            raise LedgerError(f"part {where} line {n} does not parse as a GeneratedRow: {exc}") from exc
    return rows


def empty_frame() -> pd.DataFrame:
    return _frame_from_columns({c: [] for c in FRAME_COLUMNS})


def _frame_from_columns(cols: dict[str, list[Any]]) -> pd.DataFrame:
    data: dict[str, Any] = {}
    for c in FRAME_COLUMNS:
        v = cols[c]
        if c in _INT_COLS:
            data[c] = np.asarray(v, dtype=np.int64)
        elif c == "cut_in_reasoning":
            data[c] = np.asarray(v, dtype=bool)
        elif c == "latency_s":
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
        if c in _INT_COLS:
            out[c] = s.astype(np.int64)
        elif c == "cut_in_reasoning":
            out[c] = s.astype(bool)
        elif c == "latency_s":
            out[c] = s.astype(np.float64)
        elif c == "committed_at":
            out[c] = pd.to_datetime(s, utc=True)
        else:
            out[c] = s.astype("str") if s.dtype != "str" else s
    return pd.DataFrame(out, columns=list(FRAME_COLUMNS))


class Ledger:
    """Commits and reads generated rows under one output root."""

    def __init__(self, storage: Storage, *, read_workers: int | None = None) -> None:
        self.storage = storage
        # Many small GETs dominate reads on S3; a local disk gains nothing from threads.
        self.read_workers = read_workers or (1 if isinstance(storage, LocalStorage) else 16)

    # ---- dataset fingerprint and run files -------------------------------------------------

    def bind_dataset(self, fingerprint: str, info: dict[str, Any] | None = None) -> None:
        """Record the dataset this root holds (first run) or refuse a different one (later runs)."""
        if not isinstance(fingerprint, str) or not fingerprint:
            raise ValueError(f"dataset fingerprint must be a non-empty string, got {fingerprint!r}")
        existing = self.dataset()
        if existing is None:
            doc = {"schema": SCHEMA, "fingerprint": fingerprint, "info": info or {}, "created_at": _now()}
            self.storage.put(DATASET_FILE, json.dumps(doc, indent=2).encode())
            existing = self.dataset()  # re-read: a concurrent first run with another dataset loses here
        assert existing is not None
        if existing.get("fingerprint") != fingerprint:
            raise DatasetMismatchError(
                f"output root {self.storage.uri} already holds dataset {existing.get('fingerprint')!r} "
                f"({existing.get('info', {})}); this run's dataset is {fingerprint!r}. "
                "Two datasets never share an output root: choose a new output_uri."
            )

    def dataset(self) -> dict[str, Any] | None:
        try:
            raw = self.storage.get(DATASET_FILE)
        except StorageKeyError:
            return None
        try:
            doc = json.loads(raw)
        except ValueError as exc:
            raise LedgerError(f"{self.storage.uri_for(DATASET_FILE)} is not valid JSON: {exc}") from exc
        if not isinstance(doc, dict):
            raise LedgerError(f"{self.storage.uri_for(DATASET_FILE)} is not a JSON object")
        return doc

    def put_run_file(self, run_id: str, name: str, data: bytes) -> str:
        key = f"{RUNS_DIR}{check_name('run_id', run_id)}/{check_name('run file name', name)}"
        self.storage.put(key, data)
        return self.storage.uri_for(key)

    def get_run_file(self, run_id: str, name: str) -> bytes:
        return self.storage.get(f"{RUNS_DIR}{check_name('run_id', run_id)}/{check_name('run file name', name)}")

    def runs(self) -> list[str]:
        return sorted({k.split("/")[1] for k in self.storage.list(RUNS_DIR) if k.count("/") >= 2})

    # ---- commit --------------------------------------------------------------------------------

    def has_segment(self, run_id: str, chunk: int, segment: str) -> bool:
        return self.storage.exists(entry_key(run_id, chunk, segment))

    def commit(self, rows: Sequence[GeneratedRow], run_id: str, chunk: int, segment: str) -> Commit:
        """Make `rows` visible atomically. Re-committing a committed segment writes nothing."""
        ekey, pkey = entry_key(run_id, chunk, segment), part_key(run_id, chunk, segment)
        if not rows:
            raise ValueError(f"segment {segment!r} of run {run_id!r} chunk {chunk}: nothing to commit")
        for r in rows:
            if not isinstance(r, GeneratedRow):
                raise TypeError(f"commit expects GeneratedRow, got {type(r).__name__}")
            if r.run_id != run_id or r.chunk != chunk:
                raise ValueError(
                    f"row {r.index} says run {r.run_id!r} chunk {r.chunk}, "
                    f"but is committed as run {run_id!r} chunk {chunk}"
                )
        if self.storage.exists(ekey):
            return Commit(ekey, pkey, len(rows), created=False)
        values = [r.ledger_values() for r in rows]
        data = encode_part(rows)
        entry = {
            "schema": SCHEMA,
            "run_id": run_id,
            "chunk": chunk,
            "segment": segment,
            "part": pkey,
            "n_rows": len(rows),
            "committed_at": _now(),
            # What the part must still be when read back: `verify_parts` compares against these.
            "part_size": len(data),
            "part_sha256": hashlib.sha256(data).hexdigest(),
            "columns": {c: [v[c] for v in values] for c in LEDGER_COLUMNS},
        }
        # Order matters: the part first (invisible until the entry exists), then the entry (the commit point).
        self.storage.put(pkey, data)
        self.storage.put(ekey, json.dumps(entry, separators=(",", ":")).encode())
        return Commit(ekey, pkey, len(rows), created=True)

    # ---- reading -------------------------------------------------------------------------------

    def entries(self) -> list[str]:
        """The entries that count: every committed entry except the retired ones."""
        retired = self.retired_entries()
        committed = self._committed_entries()
        return [k for k in committed if k not in retired] if retired else committed

    def _committed_entries(self) -> list[str]:
        return [k for k in self.storage.list(ENTRY_DIR) if k.endswith(".json")]

    def retired_entries(self) -> set[str]:
        """Entries whose part failed verification and was retired (their rows are work again)."""
        return {
            ENTRY_DIR + k[len(RETIRED_DIR) :] for k in self.storage.list(RETIRED_DIR) if k.endswith(".json")
        }

    def read_entry(self, key: str) -> dict[str, Any]:
        return _parse_entry(self.storage.get(key), self.storage.uri_for(key))

    def read_part(self, part: str) -> list[GeneratedRow]:
        return decode_part(self.storage.get(part), self.storage.uri_for(part))

    def read_verified_part(self, part: str) -> list[GeneratedRow]:
        """A committed part's rows, its bytes checked against its entry first: the size and sha256 of the
        bytes read (for an entry from before those were recorded, its rows against the entry's). A part that
        is no longer what was committed raises PartDamageError naming it, and no row of it is returned."""
        key = _entry_for_part(part)
        entry = _parse_entry(self.storage.get(key), self.storage.uri_for(key))
        if entry["part"] != part:
            raise PartDamageError(PartDamage(key, part, entry["n_rows"], f"its entry points at {entry['part']}"))
        try:
            data = self.storage.get(part)
        except StorageKeyError:
            raise PartDamageError(PartDamage(key, part, entry["n_rows"], "the part is missing")) from None
        where = self.storage.uri_for(part)
        problem, rows = _part_problem(entry, data, where)
        if problem is not None:
            raise PartDamageError(PartDamage(key, part, entry["n_rows"], problem))
        return rows if rows is not None else decode_part(data, where)

    def _get_many(self, keys: Sequence[str]) -> list[bytes]:
        if self.read_workers <= 1 or len(keys) < 4:
            return [self.storage.get(k) for k in keys]
        with ThreadPoolExecutor(self.read_workers) as pool:
            return list(pool.map(self.storage.get, keys))

    def latest_snapshot(self) -> dict[str, Any] | None:
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

    def _load(self) -> tuple[pd.DataFrame, list[str], int]:
        """The ledger frame, the entry keys it was built from, and how many of those the snapshot lacked."""
        retired = self.retired_entries()
        all_entries = [k for k in self._committed_entries() if k not in retired]
        frames: list[pd.DataFrame] = []
        covered: set[str] = set()
        snap = self.latest_snapshot()
        snap_frame = None
        if snap is not None:
            try:
                snap_frame = pd.read_parquet(io.BytesIO(self.storage.get(snap["parquet"])))
            except StorageKeyError:
                # A concurrent compaction pruned it between our list and our GET: read the entries instead.
                snap = None
        if snap is not None and snap_frame is not None:
            covered = set(snap["entries"])
            if len(snap_frame) != snap["n_rows"]:
                raise LedgerError(
                    f"snapshot {snap['key']} says {snap['n_rows']} rows, its Parquet has {len(snap_frame)}"
                )
            if covered & retired:  # retired after this snapshot was taken: its rows no longer count
                gone = {_part_for_entry(k) for k in covered & retired}
                snap_frame = snap_frame[~snap_frame["part"].isin(gone)].reset_index(drop=True)
                covered -= retired
            frames.append(_normalise(snap_frame))
        todo = [k for k in all_entries if k not in covered]
        if todo:
            frames.append(self._entries_frame(todo))
        used = sorted(covered | set(todo))
        if not frames:
            return empty_frame(), used, 0
        frame = frames[0] if len(frames) == 1 else pd.concat(frames, ignore_index=True)
        return frame, used, len(todo)

    def _entries_frame(self, keys: list[str]) -> pd.DataFrame:
        """The frame of the rows of entries `keys` (FRAME_COLUMNS), in their order."""
        cols: dict[str, list[Any]] = {c: [] for c in FRAME_COLUMNS}
        stamps: list[str] = []
        counts: list[int] = []
        for key, raw in zip(keys, self._get_many(keys), strict=True):
            entry = _parse_entry(raw, self.storage.uri_for(key))
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
            raise self._bad_entry_error(keys, exc) from exc

    def compact_loose(self, over: int = COMPACT_OVER, keep: int = 2) -> str | None:
        """A new snapshot when more than `over` committed entries are not in the newest one: the newest
        snapshot's rows, streamed a batch at a time, followed by those entries' rows, a batch of entries at a
        time. Returns its manifest key, or None when there was nothing to do.

        Chunk tasks call this as they start. Before, only the planner and audit tasks compacted, so during a
        fan-out every chunk start parsed every entry committed since (twice: the continuous gate's sample
        and the chunk's own rows), and the cost of a chunk start grew with the run: quadratic over it. Memory
        here follows the compressed snapshot and one batch of entries, never the whole ledger's frame.
        """
        import pyarrow as pa

        retired = self.retired_entries()
        snap = self.latest_snapshot()
        covered = set(snap["entries"]) if snap is not None else set()
        todo = [k for k in self._committed_entries() if k not in covered and k not in retired]
        if len(todo) <= over:
            return None
        # No snapshot yet (the planner writes one for any ledger over COMPACT_OVER, so this one is small), a
        # retirement since it (its rows must go) or a snapshot from before a column existed: rewrite it whole.
        if snap is None or covered & retired:
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
            for start in range(0, len(todo), _PLAN_BATCH):
                frame = self._entries_frame(todo[start : start + _PLAN_BATCH])
                writer.write_table(pa.Table.from_pandas(frame, preserve_index=False).cast(target))
                n_rows += len(frame)
        if n_old != snap["n_rows"]:
            raise LedgerError(f"snapshot {snap['key']} says {snap['n_rows']} rows, its Parquet has {n_old}")
        return self._publish_snapshot(buf.getvalue(), n_old + n_rows, sorted(covered | set(todo)), keep)

    def plan_frame(self, indices: np.ndarray | Sequence[int]) -> pd.DataFrame:
        """Only what planning needs (index, status, finish_reason, max_tokens, and the part holding the
        row, where a truncated row is continued from) for the rows of `indices`, and completion_tokens, with
        which the gates judge a row generated under a higher cap (`audit.stats.gate_counts`).

        A chunk task resumes from this instead of `frame()`: its memory then follows the chunk, not the
        dataset (the full frame of a 1M-row ledger costs hundreds of MiB per task). Entries are parsed a
        batch at a time and filtered as they are read; the snapshot is read with a column and range filter.
        """
        wanted = np.unique(np.asarray(indices, dtype=np.int64))
        columns = [*PLAN_COLUMNS, "completion_tokens", "part"]
        if wanted.size == 0:
            return pd.DataFrame({c: pd.Series(dtype=empty_frame()[c].dtype) for c in columns})
        lo, hi = int(wanted[0]), int(wanted[-1])
        parts: list[pd.DataFrame] = []
        covered: set[str] = set()
        retired = self.retired_entries()
        snap = self.latest_snapshot()
        if snap is not None:
            try:
                raw = self.storage.get(snap["parquet"])
            except StorageKeyError:
                snap = None  # pruned by a concurrent compaction: the entries hold everything
            else:
                covered = set(snap["entries"])
                stale = covered & retired  # retired after this snapshot was taken: their rows no longer count
                table = pq.read_table(
                    io.BytesIO(raw), columns=columns, filters=[("index", ">=", lo), ("index", "<=", hi)],
                )
                del raw
                frame = table.to_pandas()
                keep_rows = np.isin(frame["index"].to_numpy(dtype=np.int64), wanted)
                if stale:
                    keep_rows &= ~frame["part"].isin({_part_for_entry(k) for k in stale}).to_numpy()
                    covered -= stale
                parts.append(frame.loc[keep_rows, columns])
        todo = [k for k in self._committed_entries() if k not in covered and k not in retired]
        for start in range(0, len(todo), _PLAN_BATCH):
            batch = todo[start : start + _PLAN_BATCH]
            cols: dict[str, list[Any]] = {c: [] for c in columns}
            for key, raw in zip(batch, self._get_many(batch), strict=True):
                where = self.storage.uri_for(key)
                entry = _parse_entry(raw, where)
                try:
                    keep = np.flatnonzero(np.isin(np.asarray(entry["columns"]["index"], dtype=np.int64), wanted))
                    np.asarray([entry["columns"]["max_tokens"][i] for i in keep], dtype=np.int64)
                except (ValueError, TypeError, OverflowError) as exc:
                    raise LedgerError(f"entry {where}: index or max_tokens holds a non-integer ({exc})") from exc
                for c in (*PLAN_COLUMNS, "completion_tokens"):
                    column = entry["columns"][c]
                    cols[c].extend(column[i] for i in keep)
                cols["part"].extend([entry["part"]] * len(keep))
            parts.append(pd.DataFrame(cols))
        frame = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=columns)
        return frame.reset_index(drop=True).astype({"index": np.int64, "max_tokens": np.int64})

    def frame(self, compact_over: int | None = None) -> pd.DataFrame:
        """One row per committed ledger row: LEDGER_COLUMNS + part + committed_at. Never reads parts.

        With `compact_over=N`, a read that had to parse more than N entries beyond the newest snapshot
        also writes a new snapshot, so the next reader pays one Parquet GET instead (planner/audit tasks).
        """
        frame, used, uncovered = self._load()
        if compact_over is not None and uncovered > compact_over:
            self._write_snapshot(frame, used)
        return frame

    def compact(self, keep: int = 2) -> str | None:
        """Fold every entry into one Parquet snapshot so `frame()` costs one GET instead of thousands.

        Returns the manifest key (None when the ledger is empty or nothing changed since the last one).
        Keeps the newest `keep` snapshots, so a reader that listed an older one can still finish.
        """
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        prev = self.latest_snapshot()
        frame, used, _ = self._load()
        if not used or (prev is not None and sorted(prev["entries"]) == used):
            return None
        return self._write_snapshot(frame, used, keep)

    def _write_snapshot(self, frame: pd.DataFrame, used: list[str], keep: int = 2) -> str:
        buf = io.BytesIO()
        frame.to_parquet(buf, index=False, compression="zstd")
        return self._publish_snapshot(buf.getvalue(), len(frame), used, keep)

    def _publish_snapshot(self, parquet: bytes, n_rows: int, used: list[str], keep: int) -> str:
        token = f"snap-{datetime.now(UTC).strftime('%Y%m%dT%H%M%S%fZ')}-{_token()}"
        pq_key, manifest_key = f"{SNAPSHOT_DIR}{token}.parquet", f"{SNAPSHOT_DIR}{token}.json"
        self.storage.put(pq_key, parquet)
        manifest = {"schema": SCHEMA, "parquet": pq_key, "n_rows": n_rows, "created_at": _now(), "entries": used}
        self.storage.put(manifest_key, json.dumps(manifest).encode())  # the snapshot's commit point
        manifests = [k for k in self.storage.list(SNAPSHOT_DIR) if k.endswith(".json")]
        for old in manifests[:-keep]:
            self.storage.delete(old)
            self.storage.delete(old[: -len(".json")] + ".parquet")
        return manifest_key

    # ---- housekeeping and invariants -----------------------------------------------------------

    def orphan_parts(self) -> list[str]:
        """Parts with no entry: a crash between the two PUTs (or a commit in flight right now)."""
        # Retired entries' parts are not orphans: they stay as the record of what was damaged.
        committed = {_part_for_entry(k) for k in self._committed_entries()}
        return [k for k in self.storage.list(PART_DIR) if k not in committed]

    def _bad_entry_error(self, keys: Sequence[str], exc: Exception) -> LedgerError:
        """A LedgerError naming the first of `keys` whose values do not fit the ledger's columns."""
        for key in keys:
            where = self.storage.uri_for(key)
            try:
                _check_entry_values(_parse_entry(self.storage.get(key), where), where)
            except LedgerError as found:
                return found
        return LedgerError(f"ledger entries under {self.storage.uri_for(ENTRY_DIR)} do not load: {exc}")

    # ---- verification --------------------------------------------------------------------------

    def verify_parts(self, deep: bool = True) -> list[PartDamage]:
        """Entries whose part is no longer what was committed, and entries that do not parse (empty: all good).

        `deep` reads every part: its size and sha256 must match its entry's (for an entry from before
        those were recorded, the part must decode to the entry's rows). Otherwise only sizes are compared,
        from one listing of the parts (one LIST per 1000 parts on S3): cheap enough for every final report
        and rerun; it finds deleted and truncated parts, not an alteration that keeps the size.
        """
        keys = self.entries()
        sizes = None if deep else self.storage.sizes(PART_DIR)
        damage: list[PartDamage] = []
        for start in range(0, len(keys), _PLAN_BATCH):
            batch = keys[start : start + _PLAN_BATCH]
            pairs = list(zip(batch, self._get_many(batch), strict=True))
            if deep and self.read_workers > 1 and len(pairs) > 1:
                with ThreadPoolExecutor(self.read_workers) as pool:
                    found = list(pool.map(lambda kv: self._verify_entry(kv[0], kv[1], sizes), pairs))
            else:
                found = [self._verify_entry(key, raw, sizes) for key, raw in pairs]
            damage.extend(d for d in found if d is not None)
        return damage

    def _verify_entry(self, key: str, raw: bytes, sizes: dict[str, int] | None) -> PartDamage | None:
        where = self.storage.uri_for(key)
        try:
            entry = _parse_entry(raw, where)
            _check_entry_values(entry, where)
        except LedgerError as exc:
            return PartDamage(key, _part_for_entry(key), None, f"the entry does not parse: {exc}")
        part, n_rows, size = entry["part"], entry["n_rows"], entry.get("part_size")
        if part != _part_for_entry(key):
            return PartDamage(key, part, n_rows, f"the entry points at {part}, not {_part_for_entry(key)}")
        if sizes is not None:
            if part not in sizes:
                return PartDamage(key, part, n_rows, "the part is missing")
            if size is not None and sizes[part] != size:
                return PartDamage(key, part, n_rows, f"the part has {sizes[part]} bytes, its entry recorded {size}")
            return None
        try:
            data = self.storage.get(part)
        except StorageKeyError:
            return PartDamage(key, part, n_rows, "the part is missing")
        problem, _rows = _part_problem(entry, data, self.storage.uri_for(part))
        return None if problem is None else PartDamage(key, part, n_rows, problem)

    def retire(self, damage: Iterable[PartDamage]) -> list[str]:
        """Retire the entries of damaged parts: their rows stop counting as committed and become work again.

        One retirement record per entry, beside the entries; the entry and its part stay where they are,
        as the record of what was lost. Retiring an entry twice rewrites the same record. Returns the keys.
        """
        written = []
        for item in damage:
            if not _ENTRY_RE.fullmatch(item.entry):
                raise ValueError(f"{item.entry!r} is not a ledger entry key")
            key = RETIRED_DIR + item.entry[len(ENTRY_DIR) :]
            doc = {
                "schema": SCHEMA, "entry": item.entry, "part": item.part, "n_rows": item.n_rows,
                "problem": item.problem, "retired_at": _now(),
            }  # fmt: skip
            self.storage.put(key, json.dumps(doc, indent=2).encode())
            written.append(key)
        return written

    def check_invariants(self, deep: bool = True) -> list[str]:
        """Problems found (empty = healthy). `deep` also reads every part and compares it with its entry."""
        problems: list[str] = []
        try:
            self.dataset()
        except LedgerError as exc:
            problems.append(str(exc))
        keys = self.entries()
        seen_rows: list[tuple[int, int, str]] = []  # (index, max_tokens, entry) for non-failed rows
        # runaway_policy=resample gives a looping row one fresh sample under the same cap, which supersedes
        # it: one such row per (index, cap) is expected beside the first, a second is duplicated work.
        seen_resampled: list[tuple[int, int, str]] = []
        n_rows_total = 0
        for key, raw in zip(keys, self._get_many(keys), strict=True):
            try:
                entry = _parse_entry(raw, key)
                _check_entry_values(entry, key)
            except LedgerError as exc:
                problems.append(str(exc))
                continue
            n_rows_total += entry["n_rows"]
            m = _ENTRY_RE.fullmatch(key)
            if m is None or (m["run"], int(m["chunk"]), m["segment"]) != (
                entry["run_id"],
                entry["chunk"],
                entry["segment"],
            ):
                problems.append(f"entry {key}: its name does not match run/chunk/segment inside it")
            if entry["part"] != _part_for_entry(key):
                problems.append(f"entry {key}: points at part {entry['part']}, expected {_part_for_entry(key)}")
            cols = entry["columns"]
            pivots = cols.get("pivot") or [None] * len(cols["index"])
            for i, (idx, mt, st, pivot) in enumerate(
                    zip(cols["index"], cols["max_tokens"], cols["status"], pivots, strict=True)):
                if st != FAILED:
                    (seen_resampled if pivot == RESAMPLED else seen_rows).append((idx, mt, f"{key}#{i}"))
            if not deep:
                continue
            try:
                rows = self.read_part(entry["part"])
            except StorageKeyError:
                problems.append(f"entry {key}: its part {entry['part']} is missing")
                continue
            except LedgerError as exc:
                problems.append(f"entry {key}: {exc}")
                continue
            if len(rows) != entry["n_rows"]:
                problems.append(f"entry {key}: {entry['n_rows']} rows, but its part has {len(rows)}")
                continue
            for i, row in enumerate(rows):
                values = row.ledger_values()
                diff = [c for c in LEDGER_COLUMNS if values[c] != cols[c][i]]
                if diff:
                    problems.append(f"entry {key} row {i} (index {row.index}): part and entry disagree on {diff}")
                    break
        problems.extend(_duplicate_problems(seen_rows))
        problems.extend(_duplicate_problems(seen_resampled, what="resampled"))
        snap = None
        try:
            snap = self.latest_snapshot()
        except LedgerError as exc:
            problems.append(str(exc))
        if snap is not None:
            missing = sorted(set(snap["entries"]) - set(self._committed_entries()))
            if missing:
                problems.append(f"snapshot {snap['key']} covers {len(missing)} entries that do not exist: {missing[:3]}")
            elif not self.storage.exists(snap["parquet"]):
                problems.append(f"snapshot {snap['key']}: its Parquet {snap['parquet']} is missing")
        return problems


def _duplicate_problems(seen: list[tuple[int, int, str]], what: str = "committed") -> list[str]:
    """The same index committed twice under one cap (other than as a failure) means work was duplicated."""
    if not seen:
        return []
    arr = np.array([(i, m) for i, m, _ in seen], dtype=np.int64)
    order = np.lexsort((arr[:, 1], arr[:, 0]))
    s = arr[order]
    dup = np.flatnonzero((s[1:, 0] == s[:-1, 0]) & (s[1:, 1] == s[:-1, 1]))
    out = []
    for d in dup[:10]:
        a, b = seen[order[d]], seen[order[d + 1]]
        out.append(f"index {a[0]} {what} twice under max_tokens={a[1]}: {a[2]} and {b[2]}")
    if len(dup) > 10:
        out.append(f"... and {len(dup) - 10} more duplicate (index, max_tokens) pairs")
    return out


def _part_for_entry(key: str) -> str:
    return PART_DIR + key[len(ENTRY_DIR) : -len(".json")] + ".jsonl.gz"


def _entry_for_part(part: str) -> str:
    if not (part.startswith(PART_DIR) and part.endswith(".jsonl.gz")):
        raise ValueError(f"{part!r} is not a part key ({PART_DIR}<run>/c<chunk>-<segment>.jsonl.gz)")
    return ENTRY_DIR + part[len(PART_DIR) : -len(".jsonl.gz")] + ".json"


def _part_problem(entry: dict[str, Any], data: bytes, where: str) -> tuple[str | None, list[GeneratedRow] | None]:
    """(what is wrong with a part's bytes against its parsed entry or None, its rows when they were decoded)."""
    size = entry.get("part_size")
    if size is not None:
        if len(data) != size:
            return f"the part has {len(data)} bytes, its entry recorded {size}", None
        if hashlib.sha256(data).hexdigest() != entry["part_sha256"]:
            return "the part's sha256 differs from the one its entry recorded", None
        return None, None
    # Committed before sizes and checksums were recorded: the part must still hold the entry's rows.
    try:
        rows = decode_part(data, where)
    except LedgerError as exc:
        return str(exc), None
    n_rows = entry["n_rows"]
    if len(rows) != n_rows:
        return f"the part has {len(rows)} rows, its entry {n_rows}", None
    cols = entry["columns"]
    for i, row in enumerate(rows):
        values = row.ledger_values()
        diff = [c for c in LEDGER_COLUMNS if values[c] != cols[c][i]]
        if diff:
            return f"row {i} (index {row.index}) differs from its entry on {diff}", None
    return None, rows


def _parse_entry(raw: bytes, where: str) -> dict[str, Any]:
    try:
        entry = json.loads(raw)
    except ValueError as exc:
        raise LedgerError(f"entry {where} is not valid JSON: {exc}") from exc
    if not isinstance(entry, dict) or entry.get("schema") != SCHEMA:
        raise LedgerError(f"entry {where}: not a schema-{SCHEMA} ledger entry")
    missing = [f for f in ("run_id", "chunk", "segment", "part", "n_rows", "committed_at", "columns") if f not in entry]
    if missing:
        raise LedgerError(f"entry {where}: missing fields {missing}")
    # Cheap shape checks, once per entry; the values of each column are checked when they fail to load.
    for name in ("run_id", "segment", "part", "committed_at"):
        if not isinstance(entry[name], str):
            raise LedgerError(f"entry {where}: {name} {entry[name]!r} is not a string")
    for name in ("chunk", "n_rows"):
        if type(entry[name]) is not int or entry[name] < 0:
            raise LedgerError(f"entry {where}: {name} {entry[name]!r} is not a non-negative integer")
    try:
        datetime.fromisoformat(entry["committed_at"])
    except ValueError:
        raise LedgerError(f"entry {where}: committed_at {entry['committed_at']!r} is not an ISO 8601 time") from None
    # Entries committed before parts were checksummed have neither field.
    size, digest = entry.get("part_size"), entry.get("part_sha256")
    if (size is None) != (digest is None) or (
        size is not None
        and (type(size) is not int or size < 0 or not isinstance(digest, str) or not _SHA256_RE.fullmatch(digest))
    ):
        raise LedgerError(f"entry {where}: part_size {size!r} / part_sha256 {digest!r} are not a size and a sha256")
    cols = entry["columns"]
    if isinstance(cols, dict):
        for c, default in LEDGER_DEFAULTS.items():  # an entry from before the column existed
            if c not in cols:
                cols[c] = [default] * entry["n_rows"]
    if not isinstance(cols, dict) or any(c not in cols for c in LEDGER_COLUMNS):
        raise LedgerError(f"entry {where}: columns must hold all of {LEDGER_COLUMNS}")
    bad = [c for c in LEDGER_COLUMNS if not isinstance(cols[c], list)]
    if bad:
        raise LedgerError(f"entry {where}: columns {bad} are not lists")
    lengths = {len(cols[c]) for c in LEDGER_COLUMNS}
    if lengths != {entry["n_rows"]}:
        raise LedgerError(f"entry {where}: column lengths {sorted(lengths)} != n_rows {entry['n_rows']}")
    return entry


# The JSON types a column's values may have (`type(...) is`, so a bool never passes for an int).
_VALUE_TYPES: dict[str, tuple[type, ...]] = {
    c: (int,) if c in _INT_COLS else (bool,) if c == "cut_in_reasoning" else (int, float) if c == "latency_s"
    else (str, type(None))
    for c in LEDGER_COLUMNS
}  # fmt: skip
_SHA256_RE = re.compile(r"[0-9a-f]{64}")


def _check_entry_values(entry: dict[str, Any], where: str) -> None:
    """Every value of a parsed entry has its column's type (one pass over all its rows)."""
    cols = entry["columns"]
    for c in LEDGER_COLUMNS:
        allowed = _VALUE_TYPES[c]
        for i, value in enumerate(cols[c]):
            if type(value) not in allowed:
                kinds = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
                raise LedgerError(f"entry {where}: row {i} column {c} holds {value!r}, not {kinds}")


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds")


def _token() -> str:
    return uuid.uuid4().hex[:12]


def rows_to_frame(rows: Iterable[GeneratedRow], part: str = "", committed_at: str | None = None) -> pd.DataFrame:
    """A ledger-shaped frame built straight from rows (for tests and tools that have rows in hand)."""
    rows = list(rows)
    values = [r.ledger_values() for r in rows]
    cols: dict[str, list[Any]] = {c: [v[c] for v in values] for c in LEDGER_COLUMNS}
    cols["part"] = [part] * len(rows)
    cols["committed_at"] = [committed_at or _now()] * len(rows)
    return _frame_from_columns(cols)


def open_ledger(output_uri: str, aws_conn_id: str = "aws_default") -> Ledger:
    """The ledger of the output root at `output_uri` (a local directory, file:// or s3://)."""
    return Ledger(open_storage(output_uri, aws_conn_id=aws_conn_id))
