"""The ledger's two kinds of objects and their names: parts (full rows) and entries (their summaries).

Layout under the output root (all objects written once, under unique names, never appended to):

    dataset.json                                   fingerprint of the dataset this root belongs to
    runs/<run_id>/<name>                           run config, reports, ... (beside the data)
    parts/<run_id>/c<chunk:05d>-<segment>.jsonl.gz full rows (GeneratedRow.to_json(), one JSON per line)
    ledger/<run_id>/c<chunk:05d>-<segment>.json    the entry: per-row summary (LEDGER_COLUMNS), columnar
    ledger-snapshots/snap-<time>-<token>.json      a compaction manifest: which entries the Parquet covers
    ledger-snapshots/snap-<time>-<token>.parquet   those entries' rows, folded into one file
    ledger-retired/<run_id>/c<chunk:05d>-<segment>.json  that entry's part failed verification

Which module writes what: `commits` the parts and entries, `snapshots` the snapshots, `run_files` the
dataset fingerprint and `runs/`, `repair` the retirement records; `root.OutputRoot` holds one of each.
This module is what they all share: keys, the part's encoding and the entry's parsing.
"""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import numpy as np

from tracegen.store.records import BOOL_COLS, FLOAT_COLS, LEDGER_COLUMNS, LEDGER_DEFAULTS, GeneratedRow

SCHEMA = 1

ENTRY_DIR = "ledger/"
PART_DIR = "parts/"
RETIRED_DIR = "ledger-retired/"

# Airflow run ids look like "manual__2026-11-29T19:22:10.576599+00:00": allow those, never a '/'.
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:+\-]{0,199}")
ENTRY_RE = re.compile(r"ledger/(?P<run>[^/]+)/c(?P<chunk>\d{5,})-(?P<segment>[^/]+)\.json")
_SHA256_RE = re.compile(r"[0-9a-f]{64}")

INT_COLS = ("index", "prompt_tokens", "completion_tokens", "reasoning_tokens", "max_tokens", "chunk", "attempt",
            "prefix_tokens", "loop_judge")

# The JSON types a column's values may have (`type(...) is`, so a bool never passes for an int).
_VALUE_TYPES: dict[str, tuple[type, ...]] = {
    c: (int,) if c in INT_COLS else (bool,) if c in BOOL_COLS else (int, float) if c == "latency_s"
    else (int, type(None)) if c == "cached_tokens" else (int, float, type(None)) if c in FLOAT_COLS
    else (str, type(None))
    for c in LEDGER_COLUMNS
}  # fmt: skip


class LedgerError(Exception):
    """The ledger holds something it should not (unparsable entry or part, wrong layout)."""


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


def part_for_entry(key: str) -> str:
    return PART_DIR + key[len(ENTRY_DIR) : -len(".json")] + ".jsonl.gz"


def entry_for_part(part: str) -> str:
    if not (part.startswith(PART_DIR) and part.endswith(".jsonl.gz")):
        raise ValueError(f"{part!r} is not a part key ({PART_DIR}<run>/c<chunk>-<segment>.jsonl.gz)")
    return ENTRY_DIR + part[len(PART_DIR) : -len(".jsonl.gz")] + ".json"


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


def parse_entry(raw: bytes, where: str) -> dict[str, Any]:
    """An entry's JSON, its fields and the shape of its columns checked (not each value: `check_entry_values`)."""
    try:
        entry = json.loads(raw)
    except ValueError as exc:
        raise LedgerError(f"entry {where} is not valid JSON: {exc}") from exc
    if not isinstance(entry, dict) or entry.get("schema") != SCHEMA:
        raise LedgerError(f"entry {where}: not a schema-{SCHEMA} ledger entry")
    missing = [f for f in ("run_id", "chunk", "segment", "part", "n_rows", "committed_at", "columns") if f not in entry]
    if missing:
        raise LedgerError(f"entry {where}: missing fields {missing}")
    _check_fields(entry, where)
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


def _check_fields(entry: dict[str, Any], where: str) -> None:
    """Cheap shape checks, once per entry; the values of each column are checked when they fail to load."""
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


def check_entry_values(entry: dict[str, Any], where: str) -> None:
    """Every value of a parsed entry has its column's type (one pass over all its rows)."""
    cols = entry["columns"]
    for c in LEDGER_COLUMNS:
        allowed = _VALUE_TYPES[c]
        for i, value in enumerate(cols[c]):
            if type(value) not in allowed:
                kinds = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
                raise LedgerError(f"entry {where}: row {i} column {c} holds {value!r}, not {kinds}")


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds")
