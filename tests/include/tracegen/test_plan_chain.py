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
