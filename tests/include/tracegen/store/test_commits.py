"""Commits: atomic and idempotent, each entry columnar and checksummed, a crash at either PUT invisible."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from engine_support.store_rows import RUN, row

from tracegen.store.entries import encode_part, entry_key, part_key
from tracegen.store.records import FAILED, LEDGER_COLUMNS, REJECTED, pack_token_ids, unpack_token_ids
from tracegen.store.root import OutputRoot
from tracegen.store.snapshots import FRAME_COLUMNS
from tracegen.store.storage import LocalStorage, Storage, open_storage


def test_commit_then_frame(store: Storage) -> None:
    root = OutputRoot(store)
    assert list(root.snapshots.frame().columns) == list(FRAME_COLUMNS) and root.snapshots.frame().empty
    c = root.commits.commit([row(0), row(1, finish="length"), row(2, status=FAILED)], RUN, 0, "seg-a")
    assert c.created and c.n_rows == 3
    root.commits.commit([row(10, chunk=1), row(11, status=REJECTED, chunk=1)], RUN, 1, "seg-b")
    f = root.snapshots.frame()
    assert sorted(f["index"]) == [0, 1, 2, 10, 11]
    assert f["index"].dtype == "int64" and f["cut_in_reasoning"].dtype == bool
    one = f[f["index"] == 1].iloc[0]
    assert one["finish_reason"] == "length" and bool(one["cut_in_reasoning"]) and one["part"] == part_key(RUN, 0, "seg-a")
    assert root.commits.has_segment(RUN, 0, "seg-a") and not root.commits.has_segment(RUN, 0, "seg-z")
    assert [r.index for r in root.commits.read_part(c.part)] == [0, 1, 2]
    assert root.commits.read_part(c.part)[0].content == "answer"
    assert root.repair.check_invariants() == []


def test_recommit_is_a_noop(store: Storage) -> None:
    root = OutputRoot(store)
    first = root.commits.commit([row(0), row(1)], RUN, 0, "seg")
    entry_before = store.get(first.entry)
    again = root.commits.commit([row(0), row(1), row(2)], RUN, 0, "seg")
    assert not again.created
    assert store.get(first.entry) == entry_before
    assert sorted(root.snapshots.frame()["index"]) == [0, 1]


def test_crash_between_part_and_entry_leaves_an_invisible_orphan(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path)
    root = OutputRoot(store)
    # Simulate the crash: the part PUT happened, the entry PUT did not.
    store.put(part_key(RUN, 0, "torn"), encode_part([row(5)]))
    assert root.snapshots.frame().empty and not root.commits.has_segment(RUN, 0, "torn")
    assert root.repair.orphan_parts() == [part_key(RUN, 0, "torn")]
    assert root.repair.check_invariants() == []
    # The retry (same segment id) commits normally over the orphan.
    assert root.commits.commit([row(5)], RUN, 0, "torn").created
    assert root.repair.orphan_parts() == [] and list(root.snapshots.frame()["index"]) == [5]


def test_entry_is_columnar_and_names_are_unique(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path)
    c = OutputRoot(store).commits.commit([row(7, chunk=3), row(8, chunk=3)], RUN, 3, "seg1")
    assert c.entry == entry_key(RUN, 3, "seg1") == f"ledger/{RUN}/c00003-seg1.json"
    assert c.part == f"parts/{RUN}/c00003-seg1.jsonl.gz"
    doc = json.loads(store.get(c.entry))
    assert doc["schema"] == 1 and doc["run_id"] == RUN and doc["chunk"] == 3 and doc["segment"] == "seg1"
    assert set(doc["columns"]) == set(LEDGER_COLUMNS) and doc["columns"]["index"] == [7, 8]
    assert doc["columns"]["latency_s"] == [1.2346, 1.2346]


def test_commit_validation(tmp_path: Path) -> None:
    root = OutputRoot(LocalStorage(tmp_path))
    with pytest.raises(ValueError, match="nothing to commit"):
        root.commits.commit([], RUN, 0, "s")
    with pytest.raises(ValueError, match="says run 'other'"):
        root.commits.commit([row(1, run="other")], RUN, 0, "s")
    with pytest.raises(ValueError, match="segment 'a/b'"):
        root.commits.commit([row(1)], RUN, 0, "a/b")
    with pytest.raises(ValueError, match="run_id '../x'"):
        root.commits.commit([row(1, run="../x")], "../x", 0, "s")
    with pytest.raises(ValueError, match="chunk"):
        root.commits.commit([row(1)], RUN, -1, "s")
    assert root.storage.list() == []


def test_commit_survives_s3_outage(s3, s3_uri: str) -> None:
    store = open_storage(s3_uri, retry_deadline_s=30, backoff_initial_s=0.1, backoff_max_s=0.5)
    root = OutputRoot(store)
    root.commits.commit([row(0)], RUN, 0, "before")
    restored = s3.proxy.outage_for(2.0)
    c = root.commits.commit([row(1), row(2)], RUN, 0, "during")
    restored.join()
    assert c.created and sorted(root.snapshots.frame()["index"]) == [0, 1, 2]
    assert root.repair.check_invariants() == []


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
        OutputRoot(_DiesOnPut(tmp_path, dies_at)).commits.commit([row(1), row(2)], RUN, 0, "seg")
    root = OutputRoot(LocalStorage(tmp_path))
    assert root.snapshots.frame().empty and not root.commits.has_segment(RUN, 0, "seg")  # the entry is the commit point
    assert root.commits.commit([row(1), row(2)], RUN, 0, "seg").created
    assert sorted(root.snapshots.frame()["index"]) == [1, 2] and root.repair.check_invariants() == [] and root.repair.orphan_parts() == []


def test_commit_records_the_parts_size_and_sha256(store: Storage) -> None:
    root = OutputRoot(store)
    c = root.commits.commit([row(0), row(1)], RUN, 0, "seg-a")
    entry = root.commits.read_entry(c.entry)
    data = store.get(c.part)
    assert (entry["part_size"], entry["part_sha256"]) == (len(data), hashlib.sha256(data).hexdigest())
    assert root.repair.verify_parts() == [] and root.repair.verify_parts(deep=False) == []


def test_token_ids_pack_exactly_and_compactly() -> None:
    ids = [0, 1, 151_645, 2**32 - 1, 7] * 100
    assert unpack_token_ids(pack_token_ids(ids)) == ids and pack_token_ids([]) == ""
    vocabulary = list(range(100_000, 151_936, 37))  # most of a real vocabulary's ids have six digits
    assert len(pack_token_ids(vocabulary)) < 0.8 * len(json.dumps(vocabulary, separators=(",", ":")))
    with pytest.raises(ValueError, match="token ids"):
        pack_token_ids([2**32])
    with pytest.raises(ValueError, match="not base64"):
        unpack_token_ids("not base64!")
