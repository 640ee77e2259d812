"""Planning: chunks, pilot sample, done/remaining semantics (incl. the 4096→8192 pivot), best rows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from tracegen.run.plan import (
    Chunk,
    choose_chunk_size,
    chunks,
    done_mask,
    known_long,
    pilot_sample,
    remaining,
    remaining_per_chunk,
    superseded_rows,
)
from tracegen.store.current import current_rows
from tracegen.store.records import FAILED, INVALID, OK, REJECTED, GeneratedRow
from tracegen.store.root import OutputRoot
from tracegen.store.snapshots import empty_frame, rows_to_frame
from tracegen.store.storage import LocalStorage


def r(index: int, status: str = OK, finish: str | None = "stop", cap: int = 4096, run: str = "r1",
      tokens: int = 100) -> GeneratedRow:
    return GeneratedRow(index=index, status=status, max_tokens=cap, run_id=run, chunk=0,
                        finish_reason=finish if status == OK else None, completion_tokens=tokens)


def frame(*rows: GeneratedRow, at: str = "2026-01-01T00:00:00+00:00") -> pd.DataFrame:
    return rows_to_frame(rows, committed_at=at)


def test_chunks_cover_the_dataset_exactly() -> None:
    plan = chunks(10, 4)
    assert plan == [Chunk(0, 0, 4), Chunk(1, 4, 8), Chunk(2, 8, 10)]
    assert chunks(0, 4) == [] and chunks(3, 100) == [Chunk(0, 0, 3)]
    assert sum(c.size for c in chunks(913_786, 2000)) == 913_786
    assert plan[2].label == "chunk 0002 [8, 10)"
    for bad in ((10, 0), (-1, 5), (10, 2.5), (True, 3)):
        with pytest.raises(ValueError):
            chunks(*bad)
    with pytest.raises(ValueError, match="start < stop"):
        Chunk(0, 5, 5)


def test_staggered_chunks_end_a_stagger_apart_and_cover_the_dataset() -> None:
    # Three tasks at once: three first chunks (beside the pilot) of 1,000, then a third, two thirds and
    # all of 512, then 512 each; a task taking the next chunk when one ends keeps the thirds' offsets.
    plan = chunks(16_000, 512, stagger=3, first_size=1000)
    sizes = [c.size for c in plan]
    assert sizes[:7] == [1000, 1000, 1000, 171, 342, 512, 512]
    assert set(sizes[5:-1]) == {512} and 0 < sizes[-1] <= 512
    assert [c.index for c in plan] == list(range(len(plan)))
    assert all(a.stop == b.start for a, b in zip(plan, plan[1:], strict=False))
    assert plan[0].start == 0 and plan[-1].stop == 16_000
    # Without a stagger, or with one, the dataset is covered; a small dataset ends mid-pattern.
    assert chunks(240, 50, stagger=3) == [Chunk(0, 0, 50), Chunk(1, 50, 100), Chunk(2, 100, 150),
                                          Chunk(3, 150, 167), Chunk(4, 167, 201), Chunk(5, 201, 240)]
    assert chunks(100, 50, stagger=3, first_size=80) == [Chunk(0, 0, 80), Chunk(1, 80, 100)]
    assert chunks(10, 4, stagger=0) == chunks(10, 4)
    for bad in ({"stagger": -1}, {"stagger": 1.5}, {"first_size": 0}):
        with pytest.raises(ValueError):
            chunks(10, 4, **bad)


def test_choose_chunk_size_keeps_mapped_tasks_well_under_1024() -> None:
    assert choose_chunk_size(913_786, 2000) == 2000  # 457 chunks
    size = choose_chunk_size(10_000_000, 2000)
    assert len(chunks(10_000_000, size)) <= 512
    assert len(chunks(10_000_000, choose_chunk_size(10_000_000, 1, max_chunks=1000))) <= 1000
    assert choose_chunk_size(0, 500) == 500 and choose_chunk_size(100, 500) == 500
    with pytest.raises(ValueError, match="max_map_length"):
        choose_chunk_size(10, 1, max_chunks=1024)


def test_pilot_sample_is_reproducible_sorted_and_distinct() -> None:
    a = pilot_sample(913_786, 1500, seed=7)
    assert a == pilot_sample(913_786, 1500, seed=7)
    assert a != pilot_sample(913_786, 1500, seed=8)
    assert a == sorted(set(a)) and len(a) == 1500 and 0 <= a[0] and a[-1] < 913_786
    assert pilot_sample(5, 1500, seed=1) == [0, 1, 2, 3, 4]
    assert pilot_sample(5, 0, seed=1) == []


def test_done_semantics_per_status() -> None:
    f = frame(
        r(0, finish="stop"),
        r(1, finish="tool_calls"),
        r(2, finish="length"),
        r(3, status=FAILED),
        r(4, status=INVALID),
        r(5, status=REJECTED, cap=4096),
        r(6, status=REJECTED, cap=8192),
        # 7: nothing committed
    )
    assert done_mask(f, 8, 4096, "regenerate").tolist() == [1, 1, 1, 0, 1, 1, 0, 0]
    # cap 2048: the 4096 truncation is done (it ran longer than this cap allows);
    # overflow at 4096/8192 may fit under 2048, so those are tried again
    assert done_mask(f, 8, 2048, "regenerate").tolist() == [1, 1, 1, 0, 1, 0, 0, 0]
    assert done_mask(f, 8, 8192, "regenerate").tolist() == [1, 1, 0, 0, 1, 1, 1, 0]
    assert done_mask(f, 8, 8192, "keep").tolist() == [1, 1, 1, 0, 1, 1, 1, 0]
    # extend: a row truncated under a lower cap is not done (it is continued), like regenerate.
    for cap in (2048, 4096, 8192):
        assert done_mask(f, 8, cap, "extend").tolist() == done_mask(f, 8, cap, "regenerate").tolist()


def test_superseded_rows_are_the_highest_truncation_below_the_cap() -> None:
    f = rows_to_frame([r(0, finish="length", cap=4096)], part="p1")
    f = pd.concat([f, rows_to_frame([r(0, finish="length", cap=8192), r(1, finish="length", cap=4096),
                                     r(2, finish="stop", cap=4096), r(3, status=FAILED, cap=4096)], part="p2")],
                  ignore_index=True)
    got = superseded_rows(f, np.array([0, 1, 2, 3]), 16384)
    assert got.to_dict("list") == {"index": [0, 1], "max_tokens": [8192, 4096], "part": ["p2", "p2"]}
    # Under 8192 the 8192 cut is done, so index 0 continues from its 4096 cut.
    assert superseded_rows(f, np.array([0, 1]), 8192).to_dict("list") == {
        "index": [0, 1], "max_tokens": [4096, 4096], "part": ["p1", "p2"]}
    assert superseded_rows(f, np.array([], dtype=np.int64), 8192).empty
    assert superseded_rows(empty_frame(), np.array([0]), 8192).empty


def test_known_long_are_the_todo_rows_once_cut_off_by_a_cap() -> None:
    f = frame(
        r(0, finish="length", cap=4096),
        r(1, finish="stop"),
        r(2, finish="length", cap=2048),
        r(2, finish="length", cap=4096),  # cut twice: listed once
        r(3, status=FAILED),
        r(5, finish="length", cap=4096),  # long, but not in this chunk's todo
    )
    assert known_long(f, np.array([4, 3, 2, 0])).tolist() == [0, 2]
    assert known_long(f, np.array([], dtype=np.int64)).tolist() == []
    assert known_long(empty_frame(), np.array([0, 1])).tolist() == []


def test_the_4096_to_8192_pivot(tmp_path: Path) -> None:
    """Run 1 under 4096 truncates some rows; run 2 under 8192 regenerates exactly those (or keeps them)."""
    root = OutputRoot(LocalStorage(tmp_path))
    run1 = [r(i, finish="length" if i % 5 == 0 else "stop", tokens=4096 if i % 5 == 0 else 900, run="run1")
            for i in range(20)]
    run1[3] = r(3, status=FAILED, run="run1")
    root.commits.commit(run1, "run1", 0, "a")
    f1 = root.snapshots.frame()
    truncated = [0, 5, 10, 15]
    everything = np.arange(30)

    # Still on 4096: only the failed row and the never-started ones are left.
    assert remaining(f1, everything, 4096, "regenerate").tolist() == [3, *range(20, 30)]
    # Pivot to 8192 + regenerate: the truncated rows come back too; kept otherwise.
    assert remaining(f1, everything, 8192, "regenerate").tolist() == sorted([3, *truncated, *range(20, 30)])
    assert remaining(f1, everything, 8192, "keep").tolist() == [3, *range(20, 30)]
    assert remaining(f1, Chunk(0, 0, 10), 8192, "regenerate").tolist() == [0, 3, 5]
    assert remaining(f1, range(10, 20), 8192, "regenerate").tolist() == [10, 15]

    # Run 2 regenerates under 8192: 0 and 5 finish, 10 is truncated again at 8192, 15 fails.
    root.commits.commit(
        [r(0, tokens=5000, cap=8192, run="run2"), r(5, tokens=6000, cap=8192, run="run2"),
         r(3, tokens=800, cap=8192, run="run2"),
         r(10, finish="length", cap=8192, tokens=8192, run="run2"), r(15, status=FAILED, cap=8192, run="run2")],
        "run2", 0, "b",
    )
    f2 = root.snapshots.frame()
    assert remaining(f2, np.arange(20), 8192, "regenerate").tolist() == [15]
    assert remaining(f2, np.arange(20), 16384, "regenerate").tolist() == [10, 15]
    # Nothing old is lost: both generations of index 0 are in the ledger, the newer supersedes at export.
    assert (f2["index"] == 0).sum() == 2
    best = current_rows(f2).set_index("index")
    assert best.loc[0, "max_tokens"] == 8192 and best.loc[0, "finish_reason"] == "stop"
    assert best.loc[10, "max_tokens"] == 8192  # truncated twice: the higher cap wins
    assert best.loc[15, "finish_reason"] == "length" and best.loc[15, "max_tokens"] == 4096  # failure never wins
    assert best.loc[3, "status"] == OK
    assert len(best) == 20


def test_current_rows_preferences() -> None:
    old, new = "2026-01-01T00:00:00+00:00", "2026-01-02T00:00:00+00:00"
    f = pd.concat([
        frame(r(0, finish="stop", cap=4096), at=old),
        frame(r(0, finish="length", cap=8192), at=new),  # incomplete, even at a higher cap
        frame(r(1, finish="stop", tokens=1), at=old),
        frame(r(1, finish="stop", tokens=2), at=new),  # same tier: newest wins
        frame(r(2, status=FAILED, cap=8192), at=new),
        frame(r(2, status=REJECTED, cap=4096), at=old),
        frame(r(3, status=FAILED), at=old),
        frame(r(3, status=FAILED, tokens=7), at=new),
    ], ignore_index=True)
    best = current_rows(f).set_index("index")
    assert best.loc[0, "finish_reason"] == "stop" and best.loc[0, "max_tokens"] == 4096
    assert best.loc[1, "completion_tokens"] == 2
    assert best.loc[2, "status"] == REJECTED
    assert best.loc[3, "completion_tokens"] == 7
    assert current_rows(frame()).empty


def test_remaining_per_chunk_and_validation() -> None:
    f = frame(r(0), r(1), r(5))
    mask = done_mask(f, 8, 4096, "keep")
    assert remaining_per_chunk(mask, chunks(8, 3)).tolist() == [1, 2, 2]
    with pytest.raises(ValueError, match="outside the dataset's 4 rows"):
        done_mask(frame(r(9)), 4, 4096, "keep")
    with pytest.raises(ValueError, match="lacks columns"):
        remaining(pd.DataFrame({"index": [1]}), [1], 4096, "keep")
    assert remaining(empty_frame(), np.arange(3), 4096, "keep").tolist() == [0, 1, 2]
    assert done_mask(empty_frame(), 3, 4096, "keep").tolist() == [False] * 3
