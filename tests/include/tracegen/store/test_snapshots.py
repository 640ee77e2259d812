"""Snapshots: reads never need parts; a snapshot plus newer entries reads as the entries alone; a corrupt
entry is named by every reader."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from engine_support.store_rows import RUN, row

from tracegen.store.entries import LedgerError, part_key
from tracegen.store.records import FAILED
from tracegen.store.root import OutputRoot
from tracegen.store.storage import LocalStorage, Storage, open_storage


def test_compaction_snapshot_plus_newer_entries(store: Storage) -> None:
    root = OutputRoot(store)
    for seg in range(5):
        root.commits.commit([row(seg * 10 + i) for i in range(3)], RUN, 0, f"s{seg}")
    before = root.snapshots.frame()
    assert root.snapshots.compact() is not None
    assert root.snapshots.compact() is None  # nothing new since
    root.commits.commit([row(99)], RUN, 0, "late")
    after = root.snapshots.frame()
    assert sorted(after["index"]) == sorted([*before["index"], 99])
    # rows from the snapshot and rows from newer entries come back with the same dtypes and values
    assert dict(after.dtypes) == dict(before.dtypes)
    old = after[after["index"] != 99].sort_values("index").reset_index(drop=True)
    pd.testing.assert_frame_equal(old, before.sort_values("index").reset_index(drop=True))
    assert root.repair.check_invariants() == []
    for i in range(3):
        root.commits.commit([row(200 + i)], RUN, 0, f"more{i}")
        root.snapshots.compact(keep=2)
    assert len([k for k in store.list("ledger-snapshots/") if k.endswith(".json")]) == 2
    assert sorted(root.snapshots.frame()["index"]) == sorted([*after["index"], 200, 201, 202])


def test_compact_loose_appends_the_loose_entries_to_the_snapshot_streamed(store: Storage) -> None:
    """A chunk task's compaction: the newest snapshot's rows, then the entries it lacks; frame() and
    plan_frame() read the same rows, dtypes and values as from the entries alone."""
    root = OutputRoot(store)
    # Every column shape: failed rows (no finish_reason), truncated ones, another run and cap.
    for seg in range(4):
        root.commits.commit([row(seg * 10 + i, finish="length" if i == 0 else "stop") for i in range(3)], RUN, 0, f"a{seg}")
    root.commits.commit([row(40, status=FAILED, chunk=1), row(41, chunk=1)], RUN, 1, "mixed")
    assert root.snapshots.compact_loose(over=10) is None  # 5 loose entries: not worth it
    assert root.snapshots.compact_loose(over=0) is not None  # no snapshot yet: the loose rows alone
    expected = root.snapshots.frame()
    for seg in range(3):
        root.commits.commit([row(100 + seg, cap=8192, run="r2", chunk=2, finish="length")], "r2", 2, f"b{seg}")
    expected = pd.concat([expected, OutputRoot(store).snapshots.entries_frame(
        [k for k in store.list("ledger/") if "/r2/" in k])], ignore_index=True)
    key = root.snapshots.compact_loose(over=2)
    assert key is not None and root.snapshots.latest()["key"] == key
    snap = root.snapshots.latest()
    assert snap["n_rows"] == len(expected) == 17 and len(snap["entries"]) == 8
    got = root.snapshots.frame()
    assert dict(got.dtypes) == dict(expected.dtypes)
    pd.testing.assert_frame_equal(got.sort_values(["index", "max_tokens"]).reset_index(drop=True),
                                  expected.sort_values(["index", "max_tokens"]).reset_index(drop=True))
    lean = root.snapshots.plan_frame([0, 40, 101])
    assert sorted(lean["index"]) == [0, 40, 101] and set(lean.loc[lean["index"] == 101, "max_tokens"]) == {8192}
    assert root.repair.check_invariants() == []
    assert root.snapshots.compact_loose(over=0) is None  # nothing loose since


def test_frame_can_compact_on_read(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path)
    root = OutputRoot(store)
    for seg in range(4):
        root.commits.commit([row(seg)], RUN, 0, f"s{seg}")
    assert len(root.snapshots.frame(compact_over=10)) == 4 and store.list("ledger-snapshots/") == []
    assert len(root.snapshots.frame(compact_over=3)) == 4
    snap = root.snapshots.latest()
    assert snap is not None and len(snap["entries"]) == 4
    # a snapshot pruned under a reader's feet: the reader falls back to the entries
    store.delete(snap["parquet"])
    assert sorted(root.snapshots.frame()["index"]) == [0, 1, 2, 3]


def test_plan_frame_holds_only_the_asked_rows_and_agrees_with_frame(tmp_path: Path) -> None:
    from tracegen.run import plan

    root = OutputRoot(open_storage(str(tmp_path)))
    for chunk in range(4):
        rows = [row(i, finish="length" if i % 5 == 0 else "stop", chunk=chunk) for i in range(chunk * 50, chunk * 50 + 50)]
        root.commits.commit(rows, RUN, chunk, f"s{chunk}")
        if chunk == 1:
            root.snapshots.compact()  # half from the snapshot, half from loose entries
    root.commits.commit([row(i, cap=8192, chunk=9, run="r2") for i in (0, 5, 120)], "r2", 9, "late")
    wanted = list(range(90, 130)) + [0, 5]
    lean = root.snapshots.plan_frame(wanted)
    assert sorted(lean.columns) == sorted(["index", "status", "finish_reason", "max_tokens", "runaway_score", "loop_judge",
                                           "completion_tokens", "part"])
    assert set(lean["index"]) == set(wanted)
    # The part of each row: where a truncated row is continued from.
    assert set(lean.loc[lean["max_tokens"] == 8192, "part"]) == {part_key("r2", 9, "late")}
    assert set(lean.loc[lean["index"] == 120, "part"]) == {part_key(RUN, 2, "s2"), part_key("r2", 9, "late")}
    assert len(lean) == len(wanted) + 2 + 1  # indices 0, 5 and 120 hold a 4096 and an 8192 row
    full = root.snapshots.frame()
    for cap, policy in [(4096, "keep"), (8192, "regenerate"), (8192, "keep")]:
        expected = plan.remaining(full, wanted, cap, policy)
        assert plan.remaining(lean, wanted, cap, policy).tolist() == expected.tolist()
    assert root.snapshots.plan_frame([]).empty


def test_entries_snapshots_and_parts_from_before_the_pivot_columns_read_as_no_pivot(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path / "out")
    root = OutputRoot(store)
    old = root.commits.commit([row(0), row(1, finish="length", tokens=4096)], RUN, 0, "seg-old")
    # Written as the ledger wrote them before: no pivot columns in the entry, no token ids or provenance
    # in the part's rows.
    entry = json.loads(store.get(old.entry))
    for c in ("pivot", "prefix_tokens"):
        del entry["columns"][c]
    rows = [{k: v for k, v in r.to_json().items() if k not in ("prompt_token_ids", "response_token_ids",
                                                                  "provenance")} for r in root.commits.read_part(old.part)]
    data = gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode(), mtime=0)
    store.put(old.part, data)
    entry.update(part_size=len(data), part_sha256=hashlib.sha256(data).hexdigest())
    store.put(old.entry, json.dumps(entry).encode())
    frame = root.snapshots.frame()
    assert frame["pivot"].isna().all() and (frame["prefix_tokens"] == 0).all()
    assert root.repair.check_invariants() == [] and root.repair.verify_parts() == []
    [_, cut] = root.commits.read_part(old.part)
    assert not cut.has_token_ids and cut.provenance is None and cut.pivot is None
    # A snapshot from before the columns existed reads the same.
    root.snapshots.compact()
    snap = root.snapshots.latest()
    table = pd.read_parquet(io.BytesIO(store.get(snap["parquet"]))).drop(columns=["pivot", "prefix_tokens"])
    buf = io.BytesIO()
    table.to_parquet(buf, index=False)
    store.put(snap["parquet"], buf.getvalue())
    again = root.snapshots.frame()
    assert again["pivot"].isna().all() and (again["prefix_tokens"] == 0).all() and len(again) == 2


def test_rows_from_before_the_cached_tokens_column_read_as_unknown(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path / "out")
    root = OutputRoot(store)
    known = row(2)
    known.cached_tokens = 49
    root.commits.commit([known], RUN, 0, "seg-new")
    old = root.commits.commit([row(0), row(1)], RUN, 0, "seg-old")
    # Written as the ledger wrote them before: no cached_tokens in the entry's columns nor in the part's rows.
    entry = json.loads(store.get(old.entry))
    del entry["columns"]["cached_tokens"]
    rows = [{k: v for k, v in r.to_json().items() if k != "cached_tokens"} for r in root.commits.read_part(old.part)]
    data = gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode(), mtime=0)
    store.put(old.part, data)
    entry.update(part_size=len(data), part_sha256=hashlib.sha256(data).hexdigest())
    store.put(old.entry, json.dumps(entry).encode())

    def cached(frame: pd.DataFrame) -> dict[int, float | None]:
        return {int(i): None if np.isnan(c) else c for i, c in zip(frame["index"], frame["cached_tokens"], strict=True)}

    assert cached(root.snapshots.frame()) == {0: None, 1: None, 2: 49}
    assert root.repair.check_invariants() == [] and root.repair.verify_parts() == []
    assert [r.cached_tokens for r in root.commits.read_part(old.part)] == [None, None]
    # A snapshot from before the column existed reads the same.
    root.snapshots.compact()
    snap = root.snapshots.latest()
    table = pd.read_parquet(io.BytesIO(store.get(snap["parquet"]))).drop(columns=["cached_tokens"])
    buf = io.BytesIO()
    table.to_parquet(buf, index=False)
    store.put(snap["parquet"], buf.getvalue())
    assert cached(root.snapshots.frame()) == {0: None, 1: None, 2: None}


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (lambda e: e["columns"].update(index=["x", 1]), "row 0 column index holds 'x', not int"),
        (lambda e: e["columns"].update(max_tokens=[4096, None]), "row 1 column max_tokens holds None"),
        (lambda e: e["columns"].update(status="ab"), "columns ['status'] are not lists"),
        (lambda e: e.update(n_rows="2"), "n_rows '2' is not a non-negative integer"),
        (lambda e: e.update(committed_at="yesterday"), "committed_at 'yesterday' is not an ISO 8601 time"),
        (lambda e: e.update(part_size="12"), "part_size '12'"),
    ],
)
def test_a_corrupt_entry_is_named_by_every_reader(tmp_path: Path, change, needle) -> None:
    store = LocalStorage(tmp_path / "out")
    root = OutputRoot(store)
    root.commits.commit([row(0), row(1)], RUN, 0, "seg-a")
    bad = root.commits.commit([row(2), row(3)], RUN, 0, "seg-b")
    entry = json.loads(store.get(bad.entry))
    change(entry)
    store.put(bad.entry, json.dumps(entry).encode())
    where = store.uri_for(bad.entry)
    with pytest.raises(LedgerError) as info:
        root.snapshots.frame()
    assert where in str(info.value) and needle in str(info.value)
    with pytest.raises(LedgerError, match=re.escape(f"entry {where}")):
        root.snapshots.plan_frame(range(4))  # a chunk's resume reads only what planning needs, and still names it
    assert any(bad.entry in problem and needle in problem for problem in root.repair.check_invariants())
    [damage] = root.repair.verify_parts()
    assert damage.entry == bad.entry and "does not parse" in damage.problem
