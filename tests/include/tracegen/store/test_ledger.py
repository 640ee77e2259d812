"""Ledger: commits are atomic and idempotent, reads never need parts, corruption is reported."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import re
from pathlib import Path

import pandas as pd
import pytest

from tracegen.store.ledger import (
    FRAME_COLUMNS,
    DatasetMismatchError,
    Ledger,
    LedgerError,
    encode_part,
    entry_key,
    part_key,
)
from tracegen.store.records import (
    FAILED,
    INVALID,
    LEDGER_COLUMNS,
    OK,
    REJECTED,
    GeneratedRow,
    pack_token_ids,
    unpack_token_ids,
)
from tracegen.store.storage import LocalStorage, Storage, open_storage

RUN = "manual__2026-11-29T19:22:10.576599+00:00"


def row(index: int, status: str = OK, finish: str | None = "stop", cap: int = 4096, run: str = RUN, chunk: int = 0,
        tokens: int = 100) -> GeneratedRow:
    return GeneratedRow(
        index=index, status=status, max_tokens=cap, run_id=run, chunk=chunk,
        finish_reason=finish if status == OK else None,
        content="answer" if finish != "length" else "", reasoning_content="thinking " * 3,
        completion_tokens=tokens, prompt_tokens=50, reasoning_tokens=tokens // 2, attempt=1,
        server="http://127.0.0.1:30000", latency_s=1.23456, category="bugfix",
        error=None if status == OK else "boom",
    )


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    if request.param == "local":
        return open_storage(str(tmp_path / "out"))
    return open_storage(request.getfixturevalue("s3_uri"), retry_deadline_s=5)


def test_commit_then_frame(store: Storage) -> None:
    ledger = Ledger(store)
    assert list(ledger.frame().columns) == list(FRAME_COLUMNS) and ledger.frame().empty
    c = ledger.commit([row(0), row(1, finish="length"), row(2, status=FAILED)], RUN, 0, "seg-a")
    assert c.created and c.n_rows == 3
    ledger.commit([row(10, chunk=1), row(11, status=REJECTED, chunk=1)], RUN, 1, "seg-b")
    f = ledger.frame()
    assert sorted(f["index"]) == [0, 1, 2, 10, 11]
    assert f["index"].dtype == "int64" and f["cut_in_reasoning"].dtype == bool
    one = f[f["index"] == 1].iloc[0]
    assert one["finish_reason"] == "length" and bool(one["cut_in_reasoning"]) and one["part"] == part_key(RUN, 0, "seg-a")
    assert ledger.has_segment(RUN, 0, "seg-a") and not ledger.has_segment(RUN, 0, "seg-z")
    assert [r.index for r in ledger.read_part(c.part)] == [0, 1, 2]
    assert ledger.read_part(c.part)[0].content == "answer"
    assert ledger.check_invariants() == []


def test_recommit_is_a_noop(store: Storage) -> None:
    ledger = Ledger(store)
    first = ledger.commit([row(0), row(1)], RUN, 0, "seg")
    entry_before = store.get(first.entry)
    again = ledger.commit([row(0), row(1), row(2)], RUN, 0, "seg")
    assert not again.created
    assert store.get(first.entry) == entry_before
    assert sorted(ledger.frame()["index"]) == [0, 1]


def test_compaction_snapshot_plus_newer_entries(store: Storage) -> None:
    ledger = Ledger(store)
    for seg in range(5):
        ledger.commit([row(seg * 10 + i) for i in range(3)], RUN, 0, f"s{seg}")
    before = ledger.frame()
    assert ledger.compact() is not None
    assert ledger.compact() is None  # nothing new since
    ledger.commit([row(99)], RUN, 0, "late")
    after = ledger.frame()
    assert sorted(after["index"]) == sorted([*before["index"], 99])
    # rows from the snapshot and rows from newer entries come back with the same dtypes and values
    assert dict(after.dtypes) == dict(before.dtypes)
    old = after[after["index"] != 99].sort_values("index").reset_index(drop=True)
    pd.testing.assert_frame_equal(old, before.sort_values("index").reset_index(drop=True))
    assert ledger.check_invariants() == []
    for i in range(3):
        ledger.commit([row(200 + i)], RUN, 0, f"more{i}")
        ledger.compact(keep=2)
    assert len([k for k in store.list("ledger-snapshots/") if k.endswith(".json")]) == 2
    assert sorted(ledger.frame()["index"]) == sorted([*after["index"], 200, 201, 202])


def test_compact_loose_appends_the_loose_entries_to_the_snapshot_streamed(store: Storage) -> None:
    """A chunk task's compaction: the newest snapshot's rows, then the entries it lacks; frame() and
    plan_frame() read the same rows, dtypes and values as from the entries alone."""
    ledger = Ledger(store)
    # Every column shape: failed rows (no finish_reason), truncated ones, another run and cap.
    for seg in range(4):
        ledger.commit([row(seg * 10 + i, finish="length" if i == 0 else "stop") for i in range(3)], RUN, 0, f"a{seg}")
    ledger.commit([row(40, status=FAILED, chunk=1), row(41, chunk=1)], RUN, 1, "mixed")
    assert ledger.compact_loose(over=10) is None  # 5 loose entries: not worth it
    assert ledger.compact_loose(over=0) is not None  # no snapshot yet: the loose rows alone
    expected = ledger.frame()
    for seg in range(3):
        ledger.commit([row(100 + seg, cap=8192, run="r2", chunk=2, finish="length")], "r2", 2, f"b{seg}")
    expected = pd.concat([expected, Ledger(store)._entries_frame(
        [k for k in store.list("ledger/") if "/r2/" in k])], ignore_index=True)
    key = ledger.compact_loose(over=2)
    assert key is not None and ledger.latest_snapshot()["key"] == key
    snap = ledger.latest_snapshot()
    assert snap["n_rows"] == len(expected) == 17 and len(snap["entries"]) == 8
    got = ledger.frame()
    assert dict(got.dtypes) == dict(expected.dtypes)
    pd.testing.assert_frame_equal(got.sort_values(["index", "max_tokens"]).reset_index(drop=True),
                                  expected.sort_values(["index", "max_tokens"]).reset_index(drop=True))
    lean = ledger.plan_frame([0, 40, 101])
    assert sorted(lean["index"]) == [0, 40, 101] and set(lean.loc[lean["index"] == 101, "max_tokens"]) == {8192}
    assert ledger.check_invariants() == []
    assert ledger.compact_loose(over=0) is None  # nothing loose since


def test_frame_can_compact_on_read(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path)
    ledger = Ledger(store)
    for seg in range(4):
        ledger.commit([row(seg)], RUN, 0, f"s{seg}")
    assert len(ledger.frame(compact_over=10)) == 4 and store.list("ledger-snapshots/") == []
    assert len(ledger.frame(compact_over=3)) == 4
    snap = ledger.latest_snapshot()
    assert snap is not None and len(snap["entries"]) == 4
    # a snapshot pruned under a reader's feet: the reader falls back to the entries
    store.delete(snap["parquet"])
    assert sorted(ledger.frame()["index"]) == [0, 1, 2, 3]


def test_crash_between_part_and_entry_leaves_an_invisible_orphan(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path)
    ledger = Ledger(store)
    # Simulate the crash: the part PUT happened, the entry PUT did not.
    store.put(part_key(RUN, 0, "torn"), encode_part([row(5)]))
    assert ledger.frame().empty and not ledger.has_segment(RUN, 0, "torn")
    assert ledger.orphan_parts() == [part_key(RUN, 0, "torn")]
    assert ledger.check_invariants() == []
    # The retry (same segment id) commits normally over the orphan.
    assert ledger.commit([row(5)], RUN, 0, "torn").created
    assert ledger.orphan_parts() == [] and list(ledger.frame()["index"]) == [5]


def test_invariant_checker_catches_hand_made_corruption(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path)
    ledger = Ledger(store)
    a = ledger.commit([row(0), row(1)], RUN, 0, "a")
    b = ledger.commit([row(2)], RUN, 0, "b")
    c = ledger.commit([row(3)], RUN, 0, "c")
    d = ledger.commit([row(4)], RUN, 0, "d")
    assert ledger.check_invariants() == []

    store.put(a.part, gzip.compress(b'{"index": 0, "status": "ok"\n'))  # unparsable part
    store.delete(b.part)  # entry whose part is missing
    tampered = [row(3, tokens=999)]  # part rows disagree with the entry
    store.put(c.part, encode_part(tampered))
    ledger.commit([row(4)], RUN, 0, "e")  # a duplicate: index 4 again, same cap, another segment
    store.put("ledger/x/c00000-bad.json", b"{not json")
    problems = ledger.check_invariants()
    text = "\n".join(problems)
    assert a.entry in text and "does not parse" in text
    assert f"its part {b.part} is missing" in text
    assert "disagree on ['completion_tokens'" in text
    assert "index 4 committed twice under max_tokens=4096" in text and d.entry in text
    assert "ledger/x/c00000-bad.json is not valid JSON" in text
    # frame() refuses to silently skip a broken entry
    with pytest.raises(LedgerError, match="not valid JSON"):
        ledger.frame()


def test_failed_then_ok_and_cap_tiers_are_not_duplicates(tmp_path: Path) -> None:
    ledger = Ledger(LocalStorage(tmp_path))
    ledger.commit([row(1, status=FAILED), row(2, finish="length")], RUN, 0, "a")
    rows_b = [row(1, run="run2"), row(2, cap=8192, run="run2"), row(3, status=INVALID, run="run2")]
    ledger.commit(rows_b, "run2", 0, "b")
    assert ledger.check_invariants() == []


def test_entry_is_columnar_and_names_are_unique(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path)
    c = Ledger(store).commit([row(7, chunk=3), row(8, chunk=3)], RUN, 3, "seg1")
    assert c.entry == entry_key(RUN, 3, "seg1") == f"ledger/{RUN}/c00003-seg1.json"
    assert c.part == f"parts/{RUN}/c00003-seg1.jsonl.gz"
    doc = json.loads(store.get(c.entry))
    assert doc["schema"] == 1 and doc["run_id"] == RUN and doc["chunk"] == 3 and doc["segment"] == "seg1"
    assert set(doc["columns"]) == set(LEDGER_COLUMNS) and doc["columns"]["index"] == [7, 8]
    assert doc["columns"]["latency_s"] == [1.2346, 1.2346]


def test_commit_validation(tmp_path: Path) -> None:
    ledger = Ledger(LocalStorage(tmp_path))
    with pytest.raises(ValueError, match="nothing to commit"):
        ledger.commit([], RUN, 0, "s")
    with pytest.raises(ValueError, match="says run 'other'"):
        ledger.commit([row(1, run="other")], RUN, 0, "s")
    with pytest.raises(ValueError, match="segment 'a/b'"):
        ledger.commit([row(1)], RUN, 0, "a/b")
    with pytest.raises(ValueError, match="run_id '../x'"):
        ledger.commit([row(1, run="../x")], "../x", 0, "s")
    with pytest.raises(ValueError, match="chunk"):
        ledger.commit([row(1)], RUN, -1, "s")
    assert ledger.storage.list() == []


def test_dataset_fingerprint_is_bound_once(store: Storage) -> None:
    ledger = Ledger(store)
    assert ledger.dataset() is None
    ledger.bind_dataset("sha256:aaa", {"uri": "s3://in/data.jsonl", "n_rows": 10})
    ledger.bind_dataset("sha256:aaa")  # same dataset: fine, resumes
    with pytest.raises(DatasetMismatchError, match="already holds dataset 'sha256:aaa'.*'sha256:bbb'"):
        Ledger(store).bind_dataset("sha256:bbb")
    assert ledger.dataset()["info"]["n_rows"] == 10


def test_run_files(store: Storage) -> None:
    ledger = Ledger(store)
    uri = ledger.put_run_file(RUN, "config.json", b'{"max_tokens": 8192}')
    ledger.put_run_file("run2", "report.html", b"<html></html>")
    assert uri.endswith(f"runs/{RUN}/config.json")
    assert ledger.get_run_file(RUN, "config.json") == b'{"max_tokens": 8192}'
    assert ledger.runs() == sorted([RUN, "run2"])
    with pytest.raises(ValueError, match="run file name"):
        ledger.put_run_file(RUN, "../escape", b"x")


def test_commit_survives_s3_outage(s3, s3_uri: str) -> None:
    store = open_storage(s3_uri, retry_deadline_s=30, backoff_initial_s=0.1, backoff_max_s=0.5)
    ledger = Ledger(store)
    ledger.commit([row(0)], RUN, 0, "before")
    restored = s3.proxy.outage_for(2.0)
    c = ledger.commit([row(1), row(2)], RUN, 0, "during")
    restored.join()
    assert c.created and sorted(ledger.frame()["index"]) == [0, 1, 2]
    assert ledger.check_invariants() == []


class _DiesOnPut(LocalStorage):
    """A real local store whose process 'dies' (raises) at the PUT of a key matching `prefix`."""

    def __init__(self, root: Path, prefix: str) -> None:
        super().__init__(root)
        self.prefix = prefix

    def put(self, key: str, data: bytes) -> None:
        if key.startswith(self.prefix):
            raise KeyboardInterrupt(f"killed before writing {key}")
        super().put(key, data)


@pytest.mark.parametrize("dies_at", ["parts/", "ledger/"])
def test_a_commit_killed_at_either_put_is_invisible_then_retries_cleanly(tmp_path: Path, dies_at: str) -> None:
    with pytest.raises(KeyboardInterrupt):
        Ledger(_DiesOnPut(tmp_path, dies_at)).commit([row(1), row(2)], RUN, 0, "seg")
    ledger = Ledger(LocalStorage(tmp_path))
    assert ledger.frame().empty and not ledger.has_segment(RUN, 0, "seg")  # the entry is the commit point
    assert ledger.commit([row(1), row(2)], RUN, 0, "seg").created
    assert sorted(ledger.frame()["index"]) == [1, 2] and ledger.check_invariants() == [] and ledger.orphan_parts() == []


def test_plan_frame_holds_only_the_asked_rows_and_agrees_with_frame(tmp_path: Path) -> None:
    from tracegen import plan

    ledger = Ledger(open_storage(str(tmp_path)))
    for chunk in range(4):
        rows = [row(i, finish="length" if i % 5 == 0 else "stop", chunk=chunk) for i in range(chunk * 50, chunk * 50 + 50)]
        ledger.commit(rows, RUN, chunk, f"s{chunk}")
        if chunk == 1:
            ledger.compact()  # half from the snapshot, half from loose entries
    ledger.commit([row(i, cap=8192, chunk=9, run="r2") for i in (0, 5, 120)], "r2", 9, "late")
    wanted = list(range(90, 130)) + [0, 5]
    lean = ledger.plan_frame(wanted)
    assert sorted(lean.columns) == sorted(["index", "status", "finish_reason", "max_tokens", "completion_tokens",
                                           "part"])
    assert set(lean["index"]) == set(wanted)
    # The part of each row: where a truncated row is continued from.
    assert set(lean.loc[lean["max_tokens"] == 8192, "part"]) == {part_key("r2", 9, "late")}
    assert set(lean.loc[lean["index"] == 120, "part"]) == {part_key(RUN, 2, "s2"), part_key("r2", 9, "late")}
    assert len(lean) == len(wanted) + 2 + 1  # indices 0, 5 and 120 hold a 4096 and an 8192 row
    full = ledger.frame()
    for cap, policy in [(4096, "keep"), (8192, "regenerate"), (8192, "keep")]:
        expected = plan.remaining(full, wanted, cap, policy)
        assert plan.remaining(lean, wanted, cap, policy).tolist() == expected.tolist()
    assert ledger.plan_frame([]).empty


# ---- verification: every part checked against what its entry recorded --------------------------


def test_commit_records_the_parts_size_and_sha256(store: Storage) -> None:
    ledger = Ledger(store)
    c = ledger.commit([row(0), row(1)], RUN, 0, "seg-a")
    entry = ledger.read_entry(c.entry)
    data = store.get(c.part)
    assert (entry["part_size"], entry["part_sha256"]) == (len(data), hashlib.sha256(data).hexdigest())
    assert ledger.verify_parts() == [] and ledger.verify_parts(deep=False) == []


def _without_checksums(store: Storage, key: str) -> None:
    """Rewrite an entry as the ledger wrote it before parts were checksummed."""
    entry = json.loads(store.get(key))
    del entry["part_size"], entry["part_sha256"]
    store.put(key, json.dumps(entry).encode())


def test_entries_from_before_checksums_stay_readable_and_verifiable(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path / "out")
    ledger = Ledger(store)
    old = ledger.commit([row(0), row(1)], RUN, 0, "seg-old")
    _without_checksums(store, old.entry)
    ledger.commit([row(2)], RUN, 0, "seg-new")
    assert sorted(ledger.frame()["index"]) == [0, 1, 2] and ledger.check_invariants() == []
    assert ledger.verify_parts() == []
    # Without a checksum, the old part is judged by its rows: one edited row is found.
    rows = ledger.read_part(old.part)
    rows[1].completion_tokens += 1
    store.put(old.part, encode_part(rows))
    [damage] = ledger.verify_parts()
    assert damage.entry == old.entry and "row 1 (index 1) differs from its entry on ['completion_tokens']" in damage.problem


def test_entries_snapshots_and_parts_from_before_the_pivot_columns_read_as_no_pivot(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path / "out")
    ledger = Ledger(store)
    old = ledger.commit([row(0), row(1, finish="length", tokens=4096)], RUN, 0, "seg-old")
    # Written as the ledger wrote them before: no pivot columns in the entry, no token ids or provenance
    # in the part's rows.
    entry = json.loads(store.get(old.entry))
    for c in ("pivot", "prefix_tokens"):
        del entry["columns"][c]
    rows = [{k: v for k, v in r.to_json().items() if k not in ("prompt_token_ids", "response_token_ids",
                                                                  "provenance")} for r in ledger.read_part(old.part)]
    data = gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode(), mtime=0)
    store.put(old.part, data)
    entry.update(part_size=len(data), part_sha256=hashlib.sha256(data).hexdigest())
    store.put(old.entry, json.dumps(entry).encode())
    frame = ledger.frame()
    assert frame["pivot"].isna().all() and (frame["prefix_tokens"] == 0).all()
    assert ledger.check_invariants() == [] and ledger.verify_parts() == []
    [_, cut] = ledger.read_part(old.part)
    assert not cut.has_token_ids and cut.provenance is None and cut.pivot is None
    # A snapshot from before the columns existed reads the same.
    ledger.compact()
    snap = ledger.latest_snapshot()
    table = pd.read_parquet(io.BytesIO(store.get(snap["parquet"]))).drop(columns=["pivot", "prefix_tokens"])
    buf = io.BytesIO()
    table.to_parquet(buf, index=False)
    store.put(snap["parquet"], buf.getvalue())
    again = ledger.frame()
    assert again["pivot"].isna().all() and (again["prefix_tokens"] == 0).all() and len(again) == 2


def test_token_ids_pack_exactly_and_compactly() -> None:
    ids = [0, 1, 151_645, 2**32 - 1, 7] * 100
    assert unpack_token_ids(pack_token_ids(ids)) == ids and pack_token_ids([]) == ""
    vocabulary = list(range(100_000, 151_936, 37))  # most of a real vocabulary's ids have six digits
    assert len(pack_token_ids(vocabulary)) < 0.8 * len(json.dumps(vocabulary, separators=(",", ":")))
    with pytest.raises(ValueError, match="token ids"):
        pack_token_ids([2**32])
    with pytest.raises(ValueError, match="not base64"):
        unpack_token_ids("not base64!")


def test_damaged_parts_are_named_and_retiring_them_makes_their_rows_work_again(store: Storage) -> None:
    ledger = Ledger(store)
    intact = ledger.commit([row(0), row(1)], RUN, 0, "seg-a")
    truncated = ledger.commit([row(2), row(3)], RUN, 0, "seg-b")
    deleted = ledger.commit([row(4)], RUN, 0, "seg-c")
    flipped = ledger.commit([row(5), row(6)], RUN, 0, "seg-d")
    ledger.compact()  # the snapshot covers every entry: retirement must reach through it
    data = store.get(truncated.part)
    store.put(truncated.part, data[: len(data) // 2])
    store.delete(deleted.part)
    data = bytearray(store.get(flipped.part))
    data[len(data) // 2] ^= 0xFF  # same size, different bytes
    store.put(flipped.part, bytes(data))

    found = {d.entry: d for d in ledger.verify_parts()}
    assert set(found) == {truncated.entry, deleted.entry, flipped.entry}
    assert "bytes, its entry recorded" in found[truncated.entry].problem
    assert found[deleted.entry].problem == "the part is missing"
    assert "sha256 differs" in found[flipped.entry].problem
    assert found[truncated.entry].n_rows == 2 and found[truncated.entry].part == truncated.part
    # The cheap check (sizes from one listing) finds what changed size or vanished.
    assert {d.entry for d in ledger.verify_parts(deep=False)} == {truncated.entry, deleted.entry}

    ledger.retire(found.values())
    assert sorted(ledger.frame()["index"]) == [0, 1]
    assert sorted(ledger.plan_frame(range(10))["index"]) == [0, 1]
    assert ledger.verify_parts() == [] and ledger.check_invariants() == []
    assert ledger.orphan_parts() == []  # the damaged parts stay, accounted for, not swept as orphans
    # Nothing was deleted: entries and (what is left of) parts are still there.
    assert all(store.exists(k) for k in (intact.entry, truncated.entry, deleted.entry, flipped.entry))
    assert store.exists(truncated.part) and store.exists(flipped.part)
    # The rows are generated again under new segments and count once more.
    ledger.commit([row(i) for i in range(2, 7)], RUN, 0, "seg-e")
    assert sorted(ledger.frame()["index"]) == list(range(7)) and ledger.check_invariants() == []
    assert ledger.compact() is not None and sorted(ledger.frame()["index"]) == list(range(7))


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
    ledger = Ledger(store)
    ledger.commit([row(0), row(1)], RUN, 0, "seg-a")
    bad = ledger.commit([row(2), row(3)], RUN, 0, "seg-b")
    entry = json.loads(store.get(bad.entry))
    change(entry)
    store.put(bad.entry, json.dumps(entry).encode())
    where = store.uri_for(bad.entry)
    with pytest.raises(LedgerError) as info:
        ledger.frame()
    assert where in str(info.value) and needle in str(info.value)
    with pytest.raises(LedgerError, match=re.escape(f"entry {where}")):
        ledger.plan_frame(range(4))  # a chunk's resume reads only what planning needs, and still names it
    assert any(bad.entry in problem and needle in problem for problem in ledger.check_invariants())
    [damage] = ledger.verify_parts()
    assert damage.entry == bad.entry and "does not parse" in damage.problem
