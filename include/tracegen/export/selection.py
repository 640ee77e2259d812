"""The ledger's rows an export chooses from, read in bounded memory.

`Ledger.frame()` builds every column of every ledger row as one pandas frame: at the seed's 913,786 rows
that alone took most of an export's 1.3 GiB. An export needs a dozen columns, and most of them are a few
distinct strings (status, finish reason, run, part). Here the newest snapshot is read a Parquet batch at a
time with only those columns, the entries committed after it a batch of entries at a time, and every string
column is kept as integer codes into one shared dictionary (pandas Categorical), so the whole ledger costs
about 40 bytes a row, whatever the text of the error messages or the server URLs.

The supersession rule is `tracegen.store.current`'s, applied to this frame as to any other.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pandas as pd
import pyarrow.parquet as pq

from tracegen.store.ledger import _PLAN_BATCH, Ledger, _parse_entry, _part_for_entry
from tracegen.store.storage import StorageKeyError

# What an export reads of each ledger row.
INT_COLUMNS = ("index", "max_tokens", "prompt_tokens", "completion_tokens", "chunk", "prefix_tokens")
STR_COLUMNS = ("status", "finish_reason", "run_id", "pivot", "part")
COLUMNS = (*INT_COLUMNS, *STR_COLUMNS, "committed_at")
_BATCH_ROWS = 65_536


class _Codes:
    """One growing dictionary per string column: values become int32 codes as batches arrive."""

    def __init__(self) -> None:
        self.values: list[Any] = []
        self.code: dict[Any, int] = {}

    def encode(self, column: Any) -> np.ndarray:
        # Factorise the batch first: a lookup per distinct value, not per row.
        codes, uniques = pd.factorize(pd.Series(column, dtype=object), use_na_sentinel=True)
        mapping = np.empty(len(uniques) + 1, dtype=np.int32)
        for i, value in enumerate(uniques):
            mapping[i] = self._code(value)
        mapping[-1] = self._code(None)
        return mapping[codes]  # -1 (missing) indexes the last slot: None

    def _code(self, value: Any) -> int:
        if value is not None and not isinstance(value, str):
            value = None if pd.isna(value) else str(value)
        found = self.code.get(value)
        if found is None:
            found = self.code[value] = len(self.values)
            self.values.append(value)
        return found

    def categorical(self, codes: np.ndarray) -> pd.Categorical:
        """The column as a Categorical; None (missing) becomes NaN, as in a ledger frame."""
        cats = [v for v in self.values if v is not None]
        where = {v: i for i, v in enumerate(cats)}
        remap = np.asarray([where[v] if v is not None else -1 for v in self.values], dtype=np.int32)
        return pd.Categorical.from_codes(remap[codes] if len(remap) else codes, categories=cats)


def ledger_rows(ledger: Ledger) -> pd.DataFrame:
    """Every committed, unretired ledger row with the export's columns (COLUMNS): ints as int64, strings as
    Categoricals, committed_at as UTC datetimes. Never reads parts; reads the snapshot a batch at a time."""
    dictionaries = {c: _Codes() for c in STR_COLUMNS}
    ints: dict[str, list[np.ndarray]] = {c: [] for c in INT_COLUMNS}
    strs: dict[str, list[np.ndarray]] = {c: [] for c in STR_COLUMNS}
    stamps: list[np.ndarray] = []

    def add(batch: dict[str, Any], when: np.ndarray) -> None:
        for c in INT_COLUMNS:
            ints[c].append(np.asarray(batch[c], dtype=np.int64))
        for c in STR_COLUMNS:
            strs[c].append(dictionaries[c].encode(batch[c]))
        stamps.append(when)

    retired = ledger.retired_entries()
    snap = ledger.latest_snapshot()
    covered: set[str] = set()
    if snap is not None:
        try:
            raw = ledger.storage.get(snap["parquet"])
        except StorageKeyError:
            snap = None  # pruned by a concurrent compaction: the entries hold everything
        else:
            covered = set(snap["entries"])
            gone = {_part_for_entry(k) for k in covered & retired}  # retired after the snapshot was taken
            covered -= retired
            parquet = pq.ParquetFile(io.BytesIO(raw))
            present = set(parquet.schema_arrow.names)
            for batch in parquet.iter_batches(batch_size=_BATCH_ROWS, columns=[c for c in COLUMNS if c in present]):
                cols = {name: batch.column(name).to_numpy(zero_copy_only=False) for name in batch.schema.names}
                n = batch.num_rows
                cols.setdefault("pivot", np.full(n, None, dtype=object))  # snapshots from before the column
                cols.setdefault("prefix_tokens", np.zeros(n, dtype=np.int64))
                when = pd.to_datetime(cols["committed_at"], utc=True).as_unit("ns").asi8
                if gone:
                    keep = ~np.isin(cols["part"].astype(object), list(gone))
                    cols = {k: v[keep] for k, v in cols.items()}
                    when = when[keep]
                add(cols, when)
            del raw, parquet
    todo = [k for k in ledger._committed_entries() if k not in covered and k not in retired]
    for start in range(0, len(todo), _PLAN_BATCH):
        keys = todo[start : start + _PLAN_BATCH]
        cols: dict[str, list[Any]] = {c: [] for c in (*INT_COLUMNS, *STR_COLUMNS)}
        when: list[int] = []
        for key, raw in zip(keys, ledger._get_many(keys), strict=True):
            entry = _parse_entry(raw, ledger.storage.uri_for(key))
            n = entry["n_rows"]
            for c in (*INT_COLUMNS, *STR_COLUMNS):
                if c == "part":
                    cols[c].extend([entry["part"]] * n)
                else:
                    cols[c].extend(entry["columns"][c])
            when.extend([pd.Timestamp(entry["committed_at"]).as_unit("ns").value] * n)
        try:
            add(cols, np.asarray(when, dtype=np.int64))
        except (ValueError, TypeError, OverflowError) as exc:
            # Converted a batch at a time (fast); only now look for the entry to blame, by name.
            raise ledger._bad_entry_error(keys, exc) from exc

    def joined(parts: list[np.ndarray], dtype: Any) -> np.ndarray:
        return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)

    data: dict[str, Any] = {c: joined(ints[c], np.int64) for c in INT_COLUMNS}
    for c in STR_COLUMNS:
        data[c] = dictionaries[c].categorical(joined(strs[c], np.int32))
    data["committed_at"] = pd.to_datetime(joined(stamps, np.int64), utc=True)
    return pd.DataFrame(data, columns=list(COLUMNS))
