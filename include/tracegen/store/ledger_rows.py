"""The ledger's rows with the columns a reader names, read in bounded memory: the one lean read of the whole
ledger, for export, `status` (and the review pages' progress) and the audit reports.

`Snapshots.frame()` builds every column of every ledger row as one pandas frame, strings as Python strings:
at the reference job's 913,786 rows that alone took most of an export's 1.3 GiB, and 917 MiB of an audit's.
Each of these readers needs some of the columns, and most string columns hold a few distinct values (status,
finish reason, run, part, server). Here the newest snapshot is read a column at a time with only the
columns asked for, the entries committed after it a batch of entries at a time (which rows come from where
is `Snapshots.coverage`'s, as for every other read), and every string column is kept as integer codes into
one dictionary (pandas Categorical), whatever the text of the error messages or the server URLs.

Each column keeps its meaning in the whole frame: counts as int32 (the index as int64), booleans as bool,
floats as float64 (None as NaN), strings as Categoricals (None as missing), committed_at as UTC datetimes.
The supersession rule is `tracegen.store.current`'s, applied to this frame as to any other.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
import pyarrow.parquet as pq

from tracegen.store.entries import INT_COLS
from tracegen.store.records import BOOL_COLS, FLOAT_COLS, LEDGER_DEFAULTS
from tracegen.store.root import OutputRoot
from tracegen.store.snapshots import FRAME_COLUMNS

STAMP = "committed_at"
# Loose entries parsed at a time: their rows are Python objects until encoded (32 x 500 rows: a few MiB).
_ENTRY_BATCH = 32


def _kind(column: str) -> str:
    if column in INT_COLS:
        return "int"
    if column in BOOL_COLS:
        return "bool"
    if column in FLOAT_COLS:
        return "float"
    return "time" if column == STAMP else "str"


def _dtype(column: str) -> Any:
    # Counts fit in 32 bits (a cap is at most 2**20, a chunk number 99,998); the index stays 64-bit.
    return {"int": np.int64 if column == "index" else np.int32, "bool": bool, "float": np.float64,
            "str": np.int32, "time": np.int64}[_kind(column)]


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


def ledger_rows(root: OutputRoot, columns: Sequence[str]) -> pd.DataFrame:
    """Every committed, unretired ledger row with `columns` (of `Snapshots.frame()`'s), in that order and with
    the dtypes above. Never reads parts; reads the snapshot a column at a time."""
    columns = tuple(columns)
    unknown = [c for c in columns if c not in FRAME_COLUMNS]
    if unknown:
        raise ValueError(f"no ledger column {unknown}; a ledger frame has {FRAME_COLUMNS}")
    strings = [c for c in columns if _kind(c) == "str"]
    dictionaries = {c: _Codes() for c in strings}
    batches: dict[str, list[np.ndarray]] = {c: [] for c in columns}

    def add(batch: dict[str, Any]) -> None:
        for c in columns:
            column = batch[c]
            if c in dictionaries and not (isinstance(column, np.ndarray) and column.dtype == np.int32):
                column = dictionaries[c].encode(column)  # a batch of values, not yet a snapshot's codes
            batches[c].append(np.asarray(column, dtype=_dtype(c)))

    view, raw = root.snapshots.coverage()
    if view.snapshot is not None and raw is not None:
        names = set(pq.ParquetFile(io.BytesIO(raw)).schema_arrow.names)
        # Strings read as Arrow dictionaries: codes and a few distinct values, never a string per row.
        parquet = pq.ParquetFile(io.BytesIO(raw), read_dictionary=[c for c in strings if c in names])
        del raw
        add(_snapshot_columns(parquet, columns, dictionaries, view.stale_parts()))
        del parquet
        import pyarrow as pa

        pa.default_memory_pool().release_unused()  # what decoding the columns took, back to the system
    for start in range(0, len(view.loose), _ENTRY_BATCH):
        keys = view.loose[start : start + _ENTRY_BATCH]
        cols: dict[str, list[Any]] = {c: [] for c in columns}
        for _key, entry in root.commits.read_entries(keys):
            n = entry["n_rows"]
            for c in columns:
                if c == "part":
                    cols[c].extend([entry["part"]] * n)
                elif c == STAMP:
                    cols[c].extend([pd.Timestamp(entry[STAMP]).as_unit("ns").value] * n)
                else:
                    cols[c].extend(entry["columns"][c])
        try:
            add(cols)
        except (ValueError, TypeError, OverflowError) as exc:
            # Converted a batch at a time (fast); only now look for the entry to blame, by name.
            raise root.commits.bad_entry_error(keys, exc) from exc

    data: dict[str, Any] = {}
    for c in columns:  # one column at a time: never every batch of every column and the whole columns at once
        parts = batches.pop(c)
        out = np.concatenate(parts) if len(parts) > 1 else parts[0] if parts else np.zeros(0, dtype=_dtype(c))
        del parts
        if c in dictionaries:
            data[c] = dictionaries[c].categorical(out)
        elif c == STAMP:
            data[c] = pd.to_datetime(out, utc=True)
        else:
            data[c] = out
    # copy=False: the columns stay the arrays built above (pandas would otherwise copy them into blocks).
    return pd.DataFrame(data, columns=list(columns), copy=False)


def _default(column: str, n: int, dictionaries: dict[str, _Codes]) -> np.ndarray:
    """A column a snapshot from before it existed lacks, as the value older rows mean (LEDGER_DEFAULTS)."""
    value = LEDGER_DEFAULTS.get(column)
    if column in dictionaries:
        return dictionaries[column].encode(np.full(n, value, object))
    return np.full(n, np.nan if value is None else value, dtype=_dtype(column))


def _snapshot_columns(parquet: pq.ParquetFile, columns: tuple[str, ...], dictionaries: dict[str, _Codes],
                      gone: set[str]) -> dict[str, Any]:
    """A snapshot's `columns`, one column at a time (a snapshot is one row group: batches would decode every
    column of it at once). Strings come as Arrow dictionaries (`read_dictionary`), so no Python string is
    made per row; rows of parts retired after the snapshot was taken are dropped."""
    import pyarrow as pa
    import pyarrow.compute as pc

    present = set(parquet.schema_arrow.names)
    n = parquet.metadata.num_rows
    cols: dict[str, Any] = {}
    gone_rows = None
    # The part column is read whatever the reader asked for when retired parts' rows are to be dropped.
    wanted = (*columns, "part") if gone and "part" not in columns else columns
    for c in wanted:
        if c not in present:  # a snapshot from before the column existed
            cols[c] = _default(c, n, dictionaries)
            continue
        column = parquet.read(columns=[c]).column(0)
        kind = _kind(c)
        if kind == "time":
            cols[c] = pd.to_datetime(column.to_numpy(), utc=True).as_unit("ns").asi8
        elif kind == "bool":
            cols[c] = column.fill_null(False).to_numpy()  # a null flag reads False, as the whole frame reads it
        elif kind != "str":
            cols[c] = column.to_numpy().astype(_dtype(c), copy=False)  # a null float reads NaN
        else:
            if pa.types.is_dictionary(column.type):
                encoded = column.unify_dictionaries().combine_chunks() if column.num_chunks > 1 else column.chunk(0)
            else:
                encoded = pc.dictionary_encode(column.cast(pa.string())).combine_chunks()
            values = encoded.dictionary.to_pylist()
            idx = encoded.indices.fill_null(len(values)).to_numpy().astype(np.int64)
            if c == "part" and gone:
                gone_rows = np.isin(idx, [i for i, v in enumerate(values) if v in gone])
            if c in dictionaries:
                codes = dictionaries[c].encode(np.asarray([*values, None], dtype=object))  # the last: null
                cols[c] = codes[idx]
            del encoded, idx
        del column
    cols = {c: cols[c] for c in columns}
    if gone_rows is not None:
        cols = {k: v[~gone_rows] for k, v in cols.items()}
    return cols
