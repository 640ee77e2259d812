"""Repair: every part checked against what its entry recorded, corruption reported, damaged entries retired."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from engine_support.store_rows import RUN, row

from tracegen.store.entries import LedgerError, encode_part
from tracegen.store.records import FAILED, INVALID
from tracegen.store.root import OutputRoot
from tracegen.store.storage import LocalStorage, Storage


def test_invariant_checker_catches_hand_made_corruption(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path)
    root = OutputRoot(store)
    a = root.commits.commit([row(0), row(1)], RUN, 0, "a")
    b = root.commits.commit([row(2)], RUN, 0, "b")
    c = root.commits.commit([row(3)], RUN, 0, "c")
    d = root.commits.commit([row(4)], RUN, 0, "d")
    assert root.repair.check_invariants() == []

    store.put(a.part, gzip.compress(b'{"index": 0, "status": "ok"\n'))  # unparsable part
    store.delete(b.part)  # entry whose part is missing
    tampered = [row(3, tokens=999)]  # part rows disagree with the entry
    store.put(c.part, encode_part(tampered))
    root.commits.commit([row(4)], RUN, 0, "e")  # a duplicate: index 4 again, same cap, another segment
    store.put("ledger/x/c00000-bad.json", b"{not json")
    problems = root.repair.check_invariants()
    text = "\n".join(problems)
    assert a.entry in text and "does not parse" in text
    assert f"its part {b.part} is missing" in text
    assert "disagree on ['completion_tokens'" in text
    assert "index 4 committed twice under max_tokens=4096" in text and d.entry in text
    assert "ledger/x/c00000-bad.json is not valid JSON" in text
    # frame() refuses to silently skip a broken entry
    with pytest.raises(LedgerError, match="not valid JSON"):
        root.snapshots.frame()


def test_failed_then_ok_and_cap_tiers_are_not_duplicates(tmp_path: Path) -> None:
    root = OutputRoot(LocalStorage(tmp_path))
    root.commits.commit([row(1, status=FAILED), row(2, finish="length")], RUN, 0, "a")
    rows_b = [row(1, run="run2"), row(2, cap=8192, run="run2"), row(3, status=INVALID, run="run2")]
    root.commits.commit(rows_b, "run2", 0, "b")
    assert root.repair.check_invariants() == []


# ---- verification: every part checked against what its entry recorded --------------------------


def _without_checksums(store: Storage, key: str) -> None:
    """Rewrite an entry as the ledger wrote it before parts were checksummed."""
    entry = json.loads(store.get(key))
    del entry["part_size"], entry["part_sha256"]
    store.put(key, json.dumps(entry).encode())


def test_entries_from_before_checksums_stay_readable_and_verifiable(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path / "out")
    root = OutputRoot(store)
    old = root.commits.commit([row(0), row(1)], RUN, 0, "seg-old")
    _without_checksums(store, old.entry)
    root.commits.commit([row(2)], RUN, 0, "seg-new")
    assert sorted(root.snapshots.frame()["index"]) == [0, 1, 2] and root.repair.check_invariants() == []
    assert root.repair.verify_parts() == []
    # Without a checksum, the old part is judged by its rows: one edited row is found.
    rows = root.commits.read_part(old.part)
    rows[1].completion_tokens += 1
    store.put(old.part, encode_part(rows))
    [damage] = root.repair.verify_parts()
    assert damage.entry == old.entry and "row 1 (index 1) differs from its entry on ['completion_tokens']" in damage.problem


def test_damaged_parts_are_named_and_retiring_them_makes_their_rows_work_again(store: Storage) -> None:
    root = OutputRoot(store)
    intact = root.commits.commit([row(0), row(1)], RUN, 0, "seg-a")
    truncated = root.commits.commit([row(2), row(3)], RUN, 0, "seg-b")
    deleted = root.commits.commit([row(4)], RUN, 0, "seg-c")
    flipped = root.commits.commit([row(5), row(6)], RUN, 0, "seg-d")
    root.snapshots.compact()  # the snapshot covers every entry: retirement must reach through it
    data = store.get(truncated.part)
    store.put(truncated.part, data[: len(data) // 2])
    store.delete(deleted.part)
    data = bytearray(store.get(flipped.part))
    data[len(data) // 2] ^= 0xFF  # same size, different bytes
    store.put(flipped.part, bytes(data))

    found = {d.entry: d for d in root.repair.verify_parts()}
    assert set(found) == {truncated.entry, deleted.entry, flipped.entry}
    assert "bytes, its entry recorded" in found[truncated.entry].problem
    assert found[deleted.entry].problem == "the part is missing"
    assert "sha256 differs" in found[flipped.entry].problem
    assert found[truncated.entry].n_rows == 2 and found[truncated.entry].part == truncated.part
    # The cheap check (sizes from one listing) finds what changed size or vanished.
    assert {d.entry for d in root.repair.verify_parts(deep=False)} == {truncated.entry, deleted.entry}

    root.repair.retire(found.values())
    assert sorted(root.snapshots.frame()["index"]) == [0, 1]
    assert sorted(root.snapshots.plan_frame(range(10))["index"]) == [0, 1]
    assert root.repair.verify_parts() == [] and root.repair.check_invariants() == []
    assert root.repair.orphan_parts() == []  # the damaged parts stay, accounted for, not swept as orphans
    # Nothing was deleted: entries and (what is left of) parts are still there.
    assert all(store.exists(k) for k in (intact.entry, truncated.entry, deleted.entry, flipped.entry))
    assert store.exists(truncated.part) and store.exists(flipped.part)
    # The rows are generated again under new segments and count once more.
    root.commits.commit([row(i) for i in range(2, 7)], RUN, 0, "seg-e")
    assert sorted(root.snapshots.frame()["index"]) == list(range(7)) and root.repair.check_invariants() == []
    assert root.snapshots.compact() is not None and sorted(root.snapshots.frame()["index"]) == list(range(7))
