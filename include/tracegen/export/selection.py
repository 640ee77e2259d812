"""The ledger's rows an export chooses from, read in bounded memory.

`Snapshots.frame()` builds every column of every ledger row as one pandas frame: at the reference job's 913,786 rows
that alone took most of an export's 1.3 GiB. An export needs a dozen columns, and most of them are a few
distinct strings (status, finish reason, run, part). Here the newest snapshot is read a Parquet batch at a
time with only those columns, the entries committed after it a batch of entries at a time (which rows come
from where is `Snapshots.coverage`'s, as for every other read), and every string column is kept as integer
codes into one shared dictionary (pandas Categorical), so the whole ledger costs about 40 bytes a row,
whatever the text of the error messages or the server URLs.

The supersession rule is `tracegen.store.current`'s, applied to this frame as to any other.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pandas as pd
import pyarrow.parquet as pq

from tracegen.store.root import OutputRoot

# What an export and `status` read of each ledger row.
# `text_joined` (a bool in the ledger) is kept as 0/1, so the pivot's count of joined seams reads right here too.
INT_COLUMNS = ("index", "max_tokens", "prompt_tokens", "completion_tokens", "chunk", "prefix_tokens", "text_joined")
STR_COLUMNS = ("status", "finish_reason", "run_id", "pivot", "part")
COLUMNS = (*INT_COLUMNS, *STR_COLUMNS, "committed_at")
# Loose entries parsed at a time: their rows are Python objects until encoded (32 x 500 rows: a few MiB).
_ENTRY_BATCH = 32


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


def ledger_rows(root: OutputRoot) -> pd.DataFrame:
    """Every committed, unretired ledger row with the export's columns (COLUMNS): ints as int64, strings as
    Categoricals, committed_at as UTC datetimes. Never reads parts; reads the snapshot a batch at a time."""
    dictionaries = {c: _Codes() for c in STR_COLUMNS}
    ints: dict[str, list[np.ndarray]] = {c: [] for c in INT_COLUMNS}
    strs: dict[str, list[np.ndarray]] = {c: [] for c in STR_COLUMNS}
    stamps: list[np.ndarray] = []

    def add(batch: dict[str, Any], when: np.ndarray) -> None:
        for c in INT_COLUMNS:
            ints[c].append(np.asarray(batch[c], dtype=np.int64 if c == "index" else np.int32))
        for c in STR_COLUMNS:
            # Already codes (a snapshot's columns), or a batch of values to encode.
            column = batch[c]
            strs[c].append(column if isinstance(column, np.ndarray) and column.dtype == np.int32
                           else dictionaries[c].encode(column))
        stamps.append(when)

    view, raw = root.snapshots.coverage()
    if view.snapshot is not None and raw is not None:
        names = set(pq.ParquetFile(io.BytesIO(raw)).schema_arrow.names)
        # Strings read as Arrow dictionaries: codes and a few distinct values, never a string per row.
        parquet = pq.ParquetFile(io.BytesIO(raw), read_dictionary=[c for c in STR_COLUMNS if c in names])
        del raw
        add(*_snapshot_columns(parquet, dictionaries, view.stale_parts()))
        del parquet
        import pyarrow as pa

        pa.default_memory_pool().release_unused()  # what decoding the columns took, back to the system
    for start in range(0, len(view.loose), _ENTRY_BATCH):
        keys = view.loose[start : start + _ENTRY_BATCH]
        cols: dict[str, list[Any]] = {c: [] for c in (*INT_COLUMNS, *STR_COLUMNS)}
        when: list[int] = []
        for _key, entry in root.commits.read_entries(keys):
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
            raise root.commits.bad_entry_error(keys, exc) from exc

    def joined(parts: list[np.ndarray], dtype: Any) -> np.ndarray:
        out = np.concatenate(parts) if len(parts) > 1 else parts[0] if parts else np.zeros(0, dtype=dtype)
        parts.clear()  # one column at a time: never every batch and the whole column at once
        return out

    # Counts fit in 32 bits (a cap is at most 2**20, a chunk number 99,998); the index stays 64-bit.
    data: dict[str, Any] = {c: joined(ints[c], np.int64 if c == "index" else np.int32) for c in INT_COLUMNS}
    for c in STR_COLUMNS:
        data[c] = dictionaries[c].categorical(joined(strs[c], np.int32))
    data["committed_at"] = pd.to_datetime(joined(stamps, np.int64), utc=True)
    # copy=False: the columns stay the arrays built above (pandas would otherwise copy them into blocks).
    return pd.DataFrame(data, columns=list(COLUMNS), copy=False)


def _snapshot_columns(parquet: pq.ParquetFile, dictionaries: dict[str, _Codes],
                      gone: set[str]) -> tuple[dict[str, Any], np.ndarray]:
    """A snapshot's columns, one column at a time (a snapshot is one row group: batches would decode every
    column of it at once). Strings come as Arrow dictionaries (`read_dictionary`), so no Python string is
    made per row; rows of parts retired after the snapshot was taken are dropped."""
    import pyarrow as pa
    import pyarrow.compute as pc

    present = set(parquet.schema_arrow.names)
    n = parquet.metadata.num_rows
    cols: dict[str, Any] = {}
    gone_rows = None
    for c in (*STR_COLUMNS, *INT_COLUMNS):
        if c not in present:  # a snapshot from before the column existed
            cols[c] = np.zeros(n, np.int64) if c in INT_COLUMNS else dictionaries[c].encode(np.full(n, None, object))
            continue
        column = parquet.read(columns=[c]).column(0)
        if c in INT_COLUMNS:
            cols[c] = column.to_numpy().astype(np.int64 if c == "index" else np.int32, copy=False)
            continue
        if pa.types.is_dictionary(column.type):
            encoded = column.unify_dictionaries().combine_chunks() if column.num_chunks > 1 else column.chunk(0)
        else:
            encoded = pc.dictionary_encode(column.cast(pa.string())).combine_chunks()
        values = encoded.dictionary.to_pylist()
        codes = dictionaries[c].encode(np.asarray([*values, None], dtype=object))  # the last: null
        idx = encoded.indices.fill_null(len(values)).to_numpy().astype(np.int64)
        cols[c] = codes[idx]
        if c == "part" and gone:
            gone_rows = np.isin(idx, [i for i, v in enumerate(values) if v in gone])
        del column, encoded, idx
    when = pd.to_datetime(parquet.read(columns=["committed_at"]).column(0).to_numpy(), utc=True).as_unit("ns").asi8
    if gone_rows is not None:
        cols = {k: v[~gone_rows] for k, v in cols.items()}
        when = when[~gone_rows]
    return cols, when
