"""Under `turns=chain` a conversation's turns are one unit of work: no chunk and no pilot splits one, a
conversation longer than a chunk makes its chunk larger, and the layout keeps its cuts in the run's record."""

from __future__ import annotations

import numpy as np

from tracegen.run.plan import ChunkLayout, pilot_indices, whole_conversations


class _Config:
    def __init__(self, pilot_size: int) -> None:
        self.pilot_size, self.pilot_seed = pilot_size, 3


def _starts(turns: list[int]) -> np.ndarray:
    return np.concatenate(([0], np.cumsum(turns)[:-1])).astype(np.int64)


def test_no_chunk_and_no_pilot_splits_a_conversation():
    rng = np.random.default_rng(0)
    turns = rng.integers(1, 9, size=300).tolist()
    turns[40] = 57  # longer than a chunk: its chunk grows
    starts, n = _starts(turns), int(sum(turns))
    for layout in (ChunkLayout(20), ChunkLayout(20, stagger=3, first_size=50)):
        chained = whole_conversations(layout, n, starts, pilot_size=100, pilot_seed=3)
        cut = chained.chunks(n)
        assert cut[0].start == 0 and cut[-1].stop == n
        assert all(a.stop == b.start for a, b in zip(cut, cut[1:], strict=False))
        assert {c.start for c in cut} <= set(starts.tolist())  # every chunk starts a conversation
        assert any(c.size >= 57 for c in cut)
        # Sizes stay close to the layout's: each chunk at most one conversation past its planned end.
        assert len(cut) >= len(layout.chunks(n)) * 0.7
        again = ChunkLayout.from_json(chained.to_json())
        assert again == chained and again.chunks(n) == cut
        pilot = pilot_indices(_Config(100), n, chained)
        conv = np.searchsorted(starts, pilot, side="right") - 1
        for c in np.unique(conv):  # every pilot conversation whole
            assert np.sum(conv == c) == turns[c]
        assert 100 <= pilot.size < 100 + 57
        assert pilot_indices(_Config(0), n, chained).size == 0


def test_a_layout_without_conversations_is_cut_by_size_as_before():
    layout = ChunkLayout(20)
    assert layout.to_json() == {"chunk_size": 20, "chunk_stagger": 0, "first_chunk_size": None}
    assert [c.size for c in layout.chunks(50)] == [20, 20, 10]


def _row(i: int, finish: str | None, cap: int = 60, status: str = "ok"):
    from tracegen.store.records import GeneratedRow

    return GeneratedRow(index=i, status=status, max_tokens=cap, run_id="r", chunk=0, finish_reason=finish,
                        content="a", completion_tokens=cap if finish == "length" else 5)


def test_turns_held_by_an_earlier_turn_done_without_completing_are_no_work_for_a_chunk():
    from tracegen.run.plan import held_turns
    from tracegen.store.records import INVALID
    from tracegen.store.snapshots import rows_to_frame

    # Conversations [0, 3), [3, 5), [5, 7), [7, 9): turn 1 cut at 60, turn 3 still to do; turn 3 left; a
    # stopped loop (a runaway); an invalid first turn.
    starts = np.asarray([0, 3, 5, 7])
    frame = rows_to_frame([_row(0, "stop"), _row(1, "length"), _row(3, "stop"), _row(5, "loop"),
                           _row(7, None, status=INVALID)], committed_at="2026-01-01T00:00:00+00:00")
    kept = held_turns(frame, 9, starts, 60, "keep")
    assert np.flatnonzero(kept).tolist() == [2, 6, 8]
    # A raised cap makes the cut turn work again: what follows it is no longer held.
    assert np.flatnonzero(held_turns(frame, 9, starts, 4096, "extend")).tolist() == [6, 8]
    layout = ChunkLayout(2, stops=(3, 5, 7, 9))

    class Config:
        max_tokens, truncated_policy = 60, "keep"

    from tracegen.run.plan import chunks_with_work

    assert [(w.chunk, w.remaining) for w in chunks_with_work(frame, 9, layout, Config(), starts)] == [(1, 1)]
    # Without the turn table every pending turn counts, held or not.
    assert [w.chunk for w in chunks_with_work(frame, 9, layout, Config())] == [0, 1, 2, 3]
