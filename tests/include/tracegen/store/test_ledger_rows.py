"""The lean read of the ledger (`store.ledger_rows`): every column it is asked for holds, row for row, what
the whole frame (`Snapshots.frame()`) holds, whether the rows come from a snapshot, from entries committed
after it, or from a snapshot written before a column existed; rows of retired entries are left out."""

from __future__ import annotations

import io

import numpy as np
import pandas as pd
import pytest
from engine_support.store_rows import RUN, row

from tracegen.store.ledger_rows import ledger_rows
from tracegen.store.records import FAILED, INVALID, REJECTED
from tracegen.store.root import OutputRoot
from tracegen.store.snapshots import FRAME_COLUMNS
from tracegen.store.storage import Storage


def _varied(start: int, run: str = RUN, cap: int = 4096) -> list:
    """Rows with every kind of value each column holds: missing strings, "" and URLs, flags, NaN scores."""
    rows = []
    for k in range(12):
        i = start + k
        status = (FAILED, REJECTED, INVALID)[k % 3] if k in (3, 7, 11) else "ok"
        r = row(i, status=status, finish="length" if k in (1, 5, 9) else "stop", cap=cap, run=run, chunk=start // 100,
                tokens=cap if k in (1, 5, 9) else 100 + 7 * k)
        r.server = "" if k == 4 else f"http://10.0.0.{k % 3}:30000"
        r.category = None if k % 4 == 0 else f"cat-{k % 3}"
        r.error = None if status == "ok" else f"error {i} on port {30000 + k}"
        r.latency_s = 0.5 + k / 8
        r.while_asking = k % 5 == 0
        r.cached_tokens = None if k % 3 == 0 else 7 * k
        if k in (1, 5, 9):
            r.content, r.reasoning_content = ("" if k != 9 else "partial answer"), "thinking " * 4
            r.runaway_score = 0.25 * (k % 4) if k != 5 else None
        if k == 2:
            r.provenance = {"action": "extended", "tokens_before": 60, "text": "joined"}
        rows.append(r)
    return rows


def _same(lean: pd.DataFrame, whole: pd.DataFrame, columns) -> None:
    assert list(lean.columns) == list(columns) and len(lean) == len(whole)
    for c in columns:
        got, want = lean[c], whole[c]
        if isinstance(got.dtype, pd.CategoricalDtype):
            assert [None if pd.isna(v) else v for v in got.astype(object)] == \
                [None if pd.isna(v) else v for v in want.astype(object)], c
        elif c == "committed_at":
            assert (got.dt.as_unit("ns") == want.dt.as_unit("ns")).all(), c
        else:
            np.testing.assert_array_equal(got.to_numpy(), want.to_numpy().astype(got.dtype), err_msg=c)


def test_every_column_reads_as_the_whole_frame_reads_it(store: Storage) -> None:
    root = OutputRoot(store)
    commits = [root.commits.commit(_varied(100 * s), RUN, s, f"s{s}") for s in range(3)]
    root.snapshots.compact()
    # Retired after the snapshot was taken: its rows are in the snapshot and must not be read.
    store.delete(commits[1].part)
    assert root.repair.retire(root.repair.verify_parts(deep=False))
    for s in range(3, 5):  # loose entries on top of the snapshot, another run and cap
        root.commits.commit(_varied(100 * s, run="r2", cap=8192), "r2", s, f"t{s}")
    whole = root.snapshots.frame()
    lean = ledger_rows(root, FRAME_COLUMNS)
    assert len(lean) == 4 * 12 and not set(range(100, 112)) & set(lean["index"])
    _same(lean, whole, FRAME_COLUMNS)
    # Strings as codes, counts in 32 bits, flags and scores as the whole frame holds them.
    assert isinstance(lean["error"].dtype, pd.CategoricalDtype) and lean["error"].isna().sum() == 4 * 9
    assert lean["prompt_tokens"].dtype == np.int32 and lean["index"].dtype == np.int64
    assert lean["text_joined"].dtype == bool and lean["text_joined"].sum() == 4
    assert lean["runaway_score"].isna().sum() == len(lean) - 4 * 2
    assert lean["cached_tokens"].isna().sum() == 4 * 4 and lean["cached_tokens"].max() == 7 * 11
    # A reader names its columns: only those, in its order.
    some = ("part", "index", "server", "while_asking")
    _same(ledger_rows(root, some), whole, some)
    with pytest.raises(ValueError, match="no ledger column"):
        ledger_rows(root, ("index", "text"))


def test_a_snapshot_from_before_a_column_reads_its_default(store: Storage) -> None:
    root = OutputRoot(store)
    root.commits.commit(_varied(0), RUN, 0, "s0")
    root.snapshots.compact()
    snap = root.snapshots.latest()
    table = pd.read_parquet(io.BytesIO(store.get(snap["parquet"])))
    buf = io.BytesIO()
    table.drop(columns=["pivot", "text_joined", "while_asking", "runaway_score", "cached_tokens"]).to_parquet(
        buf, index=False)
    store.put(snap["parquet"], buf.getvalue())
    lean = ledger_rows(root, ("index", "pivot", "text_joined", "while_asking", "runaway_score", "cached_tokens"))
    assert len(lean) == 12 and lean["pivot"].isna().all() and not lean["text_joined"].any()
    assert not lean["while_asking"].any() and lean["runaway_score"].isna().all()
    assert lean["cached_tokens"].isna().all()  # unknown, never 0
    _same(lean, root.snapshots.frame(), lean.columns)


def test_an_empty_ledger_reads_as_no_rows_with_the_columns(store: Storage) -> None:
    lean = ledger_rows(OutputRoot(store), FRAME_COLUMNS)
    assert lean.empty and list(lean.columns) == list(FRAME_COLUMNS)
