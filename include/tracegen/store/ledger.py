"""The ledger: the committed record of generated rows, and the only source of "what is done".

Layout under the output root (all objects written once, under unique names, never appended to):

    dataset.json                                   fingerprint of the dataset this root belongs to
    runs/<run_id>/<name>                           run config, reports, ... (beside the data)
    parts/<run_id>/c<chunk:05d>-<segment>.jsonl.gz full rows (GeneratedRow.to_json(), one JSON per line)
    ledger/<run_id>/c<chunk:05d>-<segment>.json    the entry: per-row summary (LEDGER_COLUMNS), columnar
    ledger-snapshots/snap-<time>-<token>.json      a compaction manifest: which entries the Parquet covers
    ledger-snapshots/snap-<time>-<token>.parquet   those entries' rows, folded into one file

A commit writes the part, then the entry. The entry's single atomic PUT is the commit point: a part
without an entry is an invisible orphan (safe to sweep), an entry always has its whole part behind it.
Committing a segment whose entry exists is a no-op, so a retried commit never duplicates rows.
Snapshots are only a cache for fast reads: entries stay the truth, and entries committed after the
newest snapshot are read on top of it.
"""

from __future__ import annotations

import gzip
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

from tracegen.store.records import FAILED, LEDGER_COLUMNS, GeneratedRow
from tracegen.store.storage import LocalStorage, Storage, StorageKeyError

SCHEMA = 1
FRAME_COLUMNS = (*LEDGER_COLUMNS, "part", "committed_at")
PLAN_COLUMNS = ("index", "status", "finish_reason", "max_tokens")  # what "done" is decided from
_PLAN_BATCH = 256  # entries parsed at a time by plan_frame: bounds memory whatever the ledger's size

ENTRY_DIR = "ledger/"
PART_DIR = "parts/"
SNAPSHOT_DIR = "ledger-snapshots/"
RUNS_DIR = "runs/"
DATASET_FILE = "dataset.json"

# Airflow run ids look like "manual__2026-11-29T19:22:10.576599+00:00": allow those, never a '/'.
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:+\-]{0,199}")
_ENTRY_RE = re.compile(r"ledger/(?P<run>[^/]+)/c(?P<chunk>\d{5,})-(?P<segment>[^/]+)\.json")

_INT_COLS = ("index", "prompt_tokens", "completion_tokens", "reasoning_tokens", "max_tokens", "chunk", "attempt")
_STR_COLS = ("status", "finish_reason", "run_id", "server", "category", "error", "part")


class LedgerError(Exception):
    """The ledger holds something it should not (unparsable entry or part, wrong layout)."""


class DatasetMismatchError(LedgerError):
    """The output root already belongs to a different dataset."""


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
        entry = {
            "schema": SCHEMA,
            "run_id": run_id,
            "chunk": chunk,
            "segment": segment,
            "part": pkey,
            "n_rows": len(rows),
            "committed_at": _now(),
            "columns": {c: [v[c] for v in values] for c in LEDGER_COLUMNS},
        }
        # Order matters: the part first (invisible until the entry exists), then the entry (the commit point).
        self.storage.put(pkey, encode_part(rows))
        self.storage.put(ekey, json.dumps(entry, separators=(",", ":")).encode())
        return Commit(ekey, pkey, len(rows), created=True)

    # ---- reading -------------------------------------------------------------------------------

    def entries(self) -> list[str]:
        return [k for k in self.storage.list(ENTRY_DIR) if k.endswith(".json")]

    def read_entry(self, key: str) -> dict[str, Any]:
        return _parse_entry(self.storage.get(key), self.storage.uri_for(key))

    def read_part(self, part: str) -> list[GeneratedRow]:
        return decode_part(self.storage.get(part), self.storage.uri_for(part))

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
        all_entries = self.entries()
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
            frames.append(_normalise(snap_frame))
        todo = [k for k in all_entries if k not in covered]
        if todo:
            cols: dict[str, list[Any]] = {c: [] for c in FRAME_COLUMNS}
            stamps: list[str] = []
            counts: list[int] = []
            for key, raw in zip(todo, self._get_many(todo), strict=True):
                entry = _parse_entry(raw, self.storage.uri_for(key))
                n = entry["n_rows"]
                for c in LEDGER_COLUMNS:
                    cols[c].extend(entry["columns"][c])
                cols["part"].extend([entry["part"]] * n)
                stamps.append(entry["committed_at"])
                counts.append(n)
            # One timestamp per entry: parse each once, then repeat (parsing a million strings is slow).
            when = pd.to_datetime(pd.Series(stamps, dtype=object), utc=True, format="ISO8601")
            cols["committed_at"] = when.repeat(counts).reset_index(drop=True)
            frames.append(_frame_from_columns(cols))
        used = sorted(covered | set(todo))
        if not frames:
            return empty_frame(), used, 0
        frame = frames[0] if len(frames) == 1 else pd.concat(frames, ignore_index=True)
        return frame, used, len(todo)

    def plan_frame(self, indices: np.ndarray | Sequence[int]) -> pd.DataFrame:
        """Only what planning needs (index, status, finish_reason, max_tokens) for the rows of `indices`.

        A chunk task resumes from this instead of `frame()`: its memory then follows the chunk, not the
        dataset (the full frame of a 1M-row ledger costs hundreds of MiB per task). Entries are parsed a
        batch at a time and filtered as they are read; the snapshot is read with a column and range filter.
        """
        wanted = np.unique(np.asarray(indices, dtype=np.int64))
        if wanted.size == 0:
            return pd.DataFrame({c: pd.Series(dtype=empty_frame()[c].dtype) for c in PLAN_COLUMNS})
        lo, hi = int(wanted[0]), int(wanted[-1])
        parts: list[pd.DataFrame] = []
        covered: set[str] = set()
        snap = self.latest_snapshot()
        if snap is not None:
            try:
                raw = self.storage.get(snap["parquet"])
            except StorageKeyError:
                snap = None  # pruned by a concurrent compaction: the entries hold everything
            else:
                table = pq.read_table(
                    io.BytesIO(raw), columns=list(PLAN_COLUMNS),
                    filters=[("index", ">=", lo), ("index", "<=", hi)],
                )
                del raw
                frame = table.to_pandas()
                parts.append(frame[np.isin(frame["index"].to_numpy(dtype=np.int64), wanted)])
                covered = set(snap["entries"])
        todo = [k for k in self.entries() if k not in covered]
        for start in range(0, len(todo), _PLAN_BATCH):
            batch = todo[start : start + _PLAN_BATCH]
            cols: dict[str, list[Any]] = {c: [] for c in PLAN_COLUMNS}
            for key, raw in zip(batch, self._get_many(batch), strict=True):
                entry = _parse_entry(raw, self.storage.uri_for(key))
                keep = np.flatnonzero(np.isin(np.asarray(entry["columns"]["index"], dtype=np.int64), wanted))
                for c in PLAN_COLUMNS:
                    column = entry["columns"][c]
                    cols[c].extend(column[i] for i in keep)
            parts.append(pd.DataFrame(cols))
        frame = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=list(PLAN_COLUMNS))
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
        token = f"snap-{datetime.now(UTC).strftime('%Y%m%dT%H%M%S%fZ')}-{_token()}"
        buf = io.BytesIO()
        frame.to_parquet(buf, index=False, compression="zstd")
        pq_key, manifest_key = f"{SNAPSHOT_DIR}{token}.parquet", f"{SNAPSHOT_DIR}{token}.json"
        self.storage.put(pq_key, buf.getvalue())
        manifest = {"schema": SCHEMA, "parquet": pq_key, "n_rows": len(frame), "created_at": _now(), "entries": used}
        self.storage.put(manifest_key, json.dumps(manifest).encode())  # the snapshot's commit point
        manifests = [k for k in self.storage.list(SNAPSHOT_DIR) if k.endswith(".json")]
        for old in manifests[:-keep]:
            self.storage.delete(old)
            self.storage.delete(old[: -len(".json")] + ".parquet")
        return manifest_key

    # ---- housekeeping and invariants -----------------------------------------------------------

    def orphan_parts(self) -> list[str]:
        """Parts with no entry: a crash between the two PUTs (or a commit in flight right now)."""
        committed = {_part_for_entry(k) for k in self.entries()}
        return [k for k in self.storage.list(PART_DIR) if k not in committed]

    def check_invariants(self, deep: bool = True) -> list[str]:
        """Problems found (empty = healthy). `deep` also reads every part and compares it with its entry."""
        problems: list[str] = []
        try:
            self.dataset()
        except LedgerError as exc:
            problems.append(str(exc))
        keys = self.entries()
        seen_rows: list[tuple[int, int, str]] = []  # (index, max_tokens, entry) for non-failed rows
        n_rows_total = 0
        for key, raw in zip(keys, self._get_many(keys), strict=True):
            try:
                entry = _parse_entry(raw, key)
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
            for i, (idx, mt, st) in enumerate(zip(cols["index"], cols["max_tokens"], cols["status"], strict=True)):
                if st != FAILED:
                    seen_rows.append((idx, mt, f"{key}#{i}"))
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
        snap = None
        try:
            snap = self.latest_snapshot()
        except LedgerError as exc:
            problems.append(str(exc))
        if snap is not None:
            missing = sorted(set(snap["entries"]) - set(keys))
            if missing:
                problems.append(f"snapshot {snap['key']} covers {len(missing)} entries that do not exist: {missing[:3]}")
            elif not self.storage.exists(snap["parquet"]):
                problems.append(f"snapshot {snap['key']}: its Parquet {snap['parquet']} is missing")
        return problems


def _duplicate_problems(seen: list[tuple[int, int, str]]) -> list[str]:
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
        out.append(f"index {a[0]} committed twice under max_tokens={a[1]}: {a[2]} and {b[2]}")
    if len(dup) > 10:
        out.append(f"... and {len(dup) - 10} more duplicate (index, max_tokens) pairs")
    return out


def _part_for_entry(key: str) -> str:
    return PART_DIR + key[len(ENTRY_DIR) : -len(".json")] + ".jsonl.gz"


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
    cols = entry["columns"]
    if not isinstance(cols, dict) or any(c not in cols for c in LEDGER_COLUMNS):
        raise LedgerError(f"entry {where}: columns must hold all of {LEDGER_COLUMNS}")
    lengths = {len(cols[c]) for c in LEDGER_COLUMNS}
    if lengths != {entry["n_rows"]}:
        raise LedgerError(f"entry {where}: column lengths {sorted(lengths)} != n_rows {entry['n_rows']}")
    return entry


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
