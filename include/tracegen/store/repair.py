"""Verifying an output root against what was committed, and retiring what no longer matches.

A part truncated, deleted or altered after its commit is found by comparing it with its entry's recorded
size and sha256 (`verify_parts`). Retiring such an entry writes a retirement record beside the entries
(`ledger-retired/`); every read leaves retired entries out, so their rows are work again, "done" is
still derived from the ledger alone, and nothing is deleted.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from tracegen.store.commits import Commits
from tracegen.store.entries import (
    ENTRY_DIR,
    ENTRY_RE,
    PART_DIR,
    RETIRED_DIR,
    SCHEMA,
    LedgerError,
    check_entry_values,
    decode_part,
    entry_for_part,
    now,
    parse_entry,
    part_for_entry,
)
from tracegen.store.records import LEDGER_COLUMNS, GeneratedRow, duplicate_key
from tracegen.store.run_files import RunFiles
from tracegen.store.snapshots import Snapshots
from tracegen.store.storage import StorageKeyError

_VERIFY_BATCH = 256  # entries fetched at a time by verify_parts: bounds memory whatever the ledger's size


@dataclass(frozen=True, slots=True)
class PartDamage:
    """A committed entry whose part no longer matches it (or an entry that does not parse)."""

    entry: str
    part: str
    n_rows: int | None  # None when the entry itself is unreadable
    problem: str


class PartDamageError(LedgerError):
    """A part read back is no longer what its entry committed (`Repair.read_verified_part`)."""

    def __init__(self, damage: PartDamage) -> None:
        super().__init__(f"part {damage.part} no longer matches its ledger entry {damage.entry}: {damage.problem}")
        self.damage = damage


class Repair:
    """Checks one output root's parts, entries and snapshot, and retires entries whose part is damaged."""

    def __init__(self, commits: Commits, snapshots: Snapshots, run_files: RunFiles) -> None:
        self.commits, self.snapshots, self.run_files = commits, snapshots, run_files
        self.storage = commits.storage

    def read_verified_part(self, part: str) -> list[GeneratedRow]:
        """A committed part's rows, its bytes checked against its entry first: the size and sha256 of the
        bytes read (for an entry from before those were recorded, its rows against the entry's). A part that
        is no longer what was committed raises PartDamageError naming it, and no row of it is returned."""
        key = entry_for_part(part)
        entry = parse_entry(self.storage.get(key), self.storage.uri_for(key))
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

    def orphan_parts(self) -> list[str]:
        """Parts with no entry: a crash between the two PUTs (or a commit in flight right now)."""
        # Retired entries' parts are not orphans: they stay as the record of what was damaged.
        committed = {part_for_entry(k) for k in self.commits.committed_entries()}
        return [k for k in self.storage.list(PART_DIR) if k not in committed]

    def verify_parts(self, deep: bool = True) -> list[PartDamage]:
        """Entries whose part is no longer what was committed, and entries that do not parse (empty: all good).

        `deep` reads every part: its size and sha256 must match its entry's (for an entry from before
        those were recorded, the part must decode to the entry's rows). Otherwise only sizes are compared,
        from one listing of the parts (one LIST per 1000 parts on S3): cheap enough for every final report
        and rerun; it finds deleted and truncated parts, not an alteration that keeps the size.
        """
        keys = self.commits.entries()
        sizes = None if deep else self.storage.sizes(PART_DIR)
        workers = self.commits.read_workers
        damage: list[PartDamage] = []
        for start in range(0, len(keys), _VERIFY_BATCH):
            batch = keys[start : start + _VERIFY_BATCH]
            pairs = list(zip(batch, self.commits.get_many(batch), strict=True))
            if deep and workers > 1 and len(pairs) > 1:
                with ThreadPoolExecutor(workers) as pool:
                    found = list(pool.map(lambda kv: self._verify_entry(kv[0], kv[1], sizes), pairs))
            else:
                found = [self._verify_entry(key, raw, sizes) for key, raw in pairs]
            damage.extend(d for d in found if d is not None)
        return damage

    def _verify_entry(self, key: str, raw: bytes, sizes: dict[str, int] | None) -> PartDamage | None:
        where = self.storage.uri_for(key)
        try:
            entry = parse_entry(raw, where)
            check_entry_values(entry, where)
        except LedgerError as exc:
            return PartDamage(key, part_for_entry(key), None, f"the entry does not parse: {exc}")
        part, n_rows, size = entry["part"], entry["n_rows"], entry.get("part_size")
        if part != part_for_entry(key):
            return PartDamage(key, part, n_rows, f"the entry points at {part}, not {part_for_entry(key)}")
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
            if not ENTRY_RE.fullmatch(item.entry):
                raise ValueError(f"{item.entry!r} is not a ledger entry key")
            key = RETIRED_DIR + item.entry[len(ENTRY_DIR) :]
            doc = {
                "schema": SCHEMA, "entry": item.entry, "part": item.part, "n_rows": item.n_rows,
                "problem": item.problem, "retired_at": now(),
            }  # fmt: skip
            self.storage.put(key, json.dumps(doc, indent=2).encode())
            written.append(key)
        return written

    def check_invariants(self, deep: bool = True) -> list[str]:
        """Problems found (empty = healthy). `deep` also reads every part and compares it with its entry."""
        problems: list[str] = []
        try:
            self.run_files.dataset()
        except LedgerError as exc:
            problems.append(str(exc))
        keys = self.commits.entries()
        seen: list[tuple[tuple[int, int, bool], str]] = []  # (duplicate_key, where) of non-failed rows
        for key, raw in zip(keys, self.commits.get_many(keys), strict=True):
            try:
                entry = parse_entry(raw, key)
                check_entry_values(entry, key)
            except LedgerError as exc:
                problems.append(str(exc))
                continue
            problems.extend(_naming_problems(key, entry))
            seen.extend(_keyed_rows(key, entry))
            if deep and (problem := self._part_disagrees(key, entry)) is not None:
                problems.append(problem)
        problems.extend(_duplicate_problems(seen))
        problems.extend(self._snapshot_problems())
        return problems

    def duplicates(self) -> list[str]:
        """Every index committed twice under one cap (`records.duplicate_key`), each named with its cap and
        the two entries: duplicated work that a writer without fencing could commit. Empty: none. Entries
        that do not parse are left to `verify_parts`."""
        keys = self.commits.entries()
        seen: list[tuple[tuple[int, int, bool], str]] = []
        for start in range(0, len(keys), _VERIFY_BATCH):
            batch = keys[start : start + _VERIFY_BATCH]
            for key, raw in zip(batch, self.commits.get_many(batch), strict=True):
                try:
                    entry = parse_entry(raw, key)
                    check_entry_values(entry, key)
                except LedgerError:
                    continue
                seen.extend(_keyed_rows(key, entry))
        return _duplicate_problems(seen)

    def _part_disagrees(self, key: str, entry: dict[str, Any]) -> str | None:
        """What is wrong with the part of a parsed entry, read and compared row by row; None: nothing."""
        try:
            rows = self.commits.read_part(entry["part"])
        except StorageKeyError:
            return f"entry {key}: its part {entry['part']} is missing"
        except LedgerError as exc:
            return f"entry {key}: {exc}"
        if len(rows) != entry["n_rows"]:
            return f"entry {key}: {entry['n_rows']} rows, but its part has {len(rows)}"
        cols = entry["columns"]
        for i, row in enumerate(rows):
            values = row.ledger_values()
            diff = [c for c in LEDGER_COLUMNS if values[c] != cols[c][i]]
            if diff:
                return f"entry {key} row {i} (index {row.index}): part and entry disagree on {diff}"
        return None

    def _snapshot_problems(self) -> list[str]:
        """The newest snapshot covers only entries that exist, and its Parquet is there."""
        try:
            snap = self.snapshots.latest()
        except LedgerError as exc:
            return [str(exc)]
        if snap is None:
            return []
        missing = sorted(set(snap["entries"]) - set(self.commits.committed_entries()))
        if missing:
            return [f"snapshot {snap['key']} covers {len(missing)} entries that do not exist: {missing[:3]}"]
        if not self.storage.exists(snap["parquet"]):
            return [f"snapshot {snap['key']}: its Parquet {snap['parquet']} is missing"]
        return []


def _naming_problems(key: str, entry: dict[str, Any]) -> list[str]:
    """An entry's key names the run, chunk and segment inside it, and its part is named after it."""
    problems = []
    m = ENTRY_RE.fullmatch(key)
    if m is None or (m["run"], int(m["chunk"]), m["segment"]) != (entry["run_id"], entry["chunk"], entry["segment"]):
        problems.append(f"entry {key}: its name does not match run/chunk/segment inside it")
    if entry["part"] != part_for_entry(key):
        problems.append(f"entry {key}: points at part {entry['part']}, expected {part_for_entry(key)}")
    return problems


def _keyed_rows(key: str, entry: dict[str, Any]) -> list[tuple[tuple[int, int, bool], str]]:
    """(duplicate_key, "entry#row") of an entry's non-failed rows."""
    cols = entry["columns"]
    pivots = cols.get("pivot") or [None] * len(cols["index"])
    out = []
    for i, (idx, mt, st, pivot) in enumerate(zip(cols["index"], cols["max_tokens"], cols["status"], pivots, strict=True)):
        if (k := duplicate_key(idx, mt, st, pivot)) is not None:
            out.append((k, f"{key}#{i}"))
    return out


def _duplicate_problems(seen: list[tuple[tuple[int, int, bool], str]]) -> list[str]:
    """The same index committed twice under one cap (other than as a failure) means work was duplicated;
    runaway_policy=resample's one fresh sample per (index, cap) is keyed apart, so only a second one is."""
    if not seen:
        return []
    arr = np.array([(i, m, int(r)) for (i, m, r), _ in seen], dtype=np.int64)
    order = np.lexsort((arr[:, 2], arr[:, 1], arr[:, 0]))
    s = arr[order]
    dup = np.flatnonzero((s[1:] == s[:-1]).all(axis=1))
    out = []
    for d in dup[:10]:
        (index, cap, resampled), a = seen[order[d]]
        b = seen[order[d + 1]][1]
        what = "resampled" if resampled else "committed"
        out.append(f"index {index} {what} twice under max_tokens={cap}: {a} and {b}")
    if len(dup) > 10:
        out.append(f"... and {len(dup) - 10} more duplicate (index, max_tokens) pairs")
    return out


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
