"""Committing generated rows, and reading back what is committed: the only source of "what is done".

A commit writes the part, then the entry. The entry's single atomic PUT is the commit point: a part
without an entry is an invisible orphan (safe to sweep), an entry always has its whole part behind it.
Committing a segment whose entry exists is a no-op, so a retried commit never duplicates rows.

Each entry records its part's size and sha256 (entries written before that have neither), so a part
that was truncated, deleted or altered after its commit can be found (`repair`). A retired entry stays
where it is, but every read here leaves it out, so its rows are work again and nothing is deleted.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from tracegen.store.entries import (
    ENTRY_DIR,
    RETIRED_DIR,
    SCHEMA,
    LedgerError,
    check_entry_values,
    decode_part,
    encode_part,
    entry_key,
    now,
    parse_entry,
    part_key,
)
from tracegen.store.records import LEDGER_COLUMNS, GeneratedRow
from tracegen.store.storage import LocalStorage, Storage

# What a fenced commit's entry is written under, held for the write: the guard objects' versions and a
# time.monotonic() deadline.
Fence = Callable[[], AbstractContextManager[tuple[dict[str, str], float]]]


@dataclass(frozen=True, slots=True)
class Commit:
    entry: str
    part: str
    n_rows: int
    created: bool  # False: the segment was already committed and nothing was written


class Commits:
    """The parts and entries of one output root: commits them, lists and reads them."""

    def __init__(self, storage: Storage, *, read_workers: int | None = None) -> None:
        self.storage = storage
        # Many small GETs dominate reads on S3; a local disk gains nothing from threads.
        self.read_workers = read_workers or (1 if isinstance(storage, LocalStorage) else 16)

    def has_segment(self, run_id: str, chunk: int, segment: str) -> bool:
        return self.storage.exists(entry_key(run_id, chunk, segment))

    def commit(self, rows: Sequence[GeneratedRow], run_id: str, chunk: int, segment: str,
               fence: Fence | None = None) -> Commit:
        """Make `rows` visible atomically. Re-committing a committed segment writes nothing.

        `fence`, called right before the entry is written, gives the guards and deadline the entry is
        written under (`Storage.put_guarded`): a writer whose lease or chunk claim is gone commits nothing
        (`Fenced`), and leaves at most an orphan part."""
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
            "committed_at": now(),
            # What the part must still be when read back: `Repair.verify_parts` compares against these.
            "part_size": len(data),
            "part_sha256": hashlib.sha256(data).hexdigest(),
            "columns": {c: [v[c] for v in values] for c in LEDGER_COLUMNS},
        }
        # Order matters: the part first (invisible until the entry exists), then the entry (the commit point).
        self.storage.put(pkey, data)
        doc = json.dumps(entry, separators=(",", ":")).encode()
        if fence is None:
            self.storage.put(ekey, doc)
        else:
            with fence() as (guards, deadline):
                self.storage.put_guarded(ekey, doc, guards, deadline)
        return Commit(ekey, pkey, len(rows), created=True)

    def entries(self) -> list[str]:
        """The entries that count: every committed entry except the retired ones."""
        retired = self.retired_entries()
        committed = self.committed_entries()
        return [k for k in committed if k not in retired] if retired else committed

    def committed_entries(self) -> list[str]:
        """Every committed entry, retired or not."""
        return [k for k in self.storage.list(ENTRY_DIR) if k.endswith(".json")]

    def retired_entries(self) -> set[str]:
        """Entries whose part failed verification and was retired (their rows are work again)."""
        return {
            ENTRY_DIR + k[len(RETIRED_DIR) :] for k in self.storage.list(RETIRED_DIR) if k.endswith(".json")
        }

    def read_entry(self, key: str) -> dict[str, Any]:
        return parse_entry(self.storage.get(key), self.storage.uri_for(key))

    def read_entries(self, keys: Sequence[str]) -> Iterator[tuple[str, dict[str, Any]]]:
        """(key, parsed entry) for each of `keys`, in their order, fetched together (`get_many`)."""
        for key, raw in zip(keys, self.get_many(keys), strict=True):
            yield key, parse_entry(raw, self.storage.uri_for(key))

    def read_part(self, part: str) -> list[GeneratedRow]:
        return decode_part(self.storage.get(part), self.storage.uri_for(part))

    def get_many(self, keys: Sequence[str]) -> list[bytes]:
        if self.read_workers <= 1 or len(keys) < 4:
            return [self.storage.get(k) for k in keys]
        with ThreadPoolExecutor(self.read_workers) as pool:
            return list(pool.map(self.storage.get, keys))

    def bad_entry_error(self, keys: Sequence[str], exc: Exception) -> LedgerError:
        """A LedgerError naming the first of `keys` whose values do not fit the ledger's columns."""
        for key in keys:
            where = self.storage.uri_for(key)
            try:
                check_entry_values(parse_entry(self.storage.get(key), where), where)
            except LedgerError as found:
                return found
        return LedgerError(f"ledger entries under {self.storage.uri_for(ENTRY_DIR)} do not load: {exc}")
