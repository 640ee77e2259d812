"""A run's rate and ETA count generating time only: the wait for a reviewer's answer is not generating."""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import pytest

from tracegen.status import RATE_WINDOW_S, _generating_since, _recent_rates

T0 = 1_800_000_000.0  # seconds since the epoch


def _commits(*batches: tuple[float, int]) -> pd.DataFrame:
    """Rows committed in batches: (seconds after T0, rows), each row 100 completion tokens."""
    stamps = [pd.Timestamp(T0 + at, unit="s", tz="UTC") for at, rows in batches for _ in range(rows)]
    return pd.DataFrame({"committed_at": stamps, "completion_tokens": [100] * len(stamps)})


@dataclass
class Decision:
    responded_at: str


@dataclass
class Record:
    decisions: list


def _iso(at: float) -> str:
    return pd.Timestamp(T0 + at, unit="s", tz="UTC").isoformat()


def test_the_wait_for_an_answer_is_not_generating_time() -> None:
    # 500 rows in the first 100 s, a question waits 300 s, the answer at 400 s, then 200 rows in 20 s.
    mine = _commits((50, 250), (100, 250), (410, 100), (420, 100))
    now = 420.0
    answered = Record([Decision(_iso(400.0))])
    rows_s, tokens_s, _ = _recent_rates(mine, T0 + now, _generating_since(answered, T0 + now))
    assert rows_s == pytest.approx(200 / 20) and tokens_s == pytest.approx(200 * 100 / 20)
    # Counted over the window instead, the wait drags the rate to a third of it.
    unanswered = Record([])
    window_rate, _, _ = _recent_rates(mine, T0 + now, _generating_since(unanswered, T0 + now))
    assert window_rate == pytest.approx(700 / (now - 50)) and window_rate < rows_s / 2


def test_an_old_decision_leaves_the_window_as_it_is() -> None:
    now = T0 + 5 * RATE_WINDOW_S
    old = Record([Decision(_iso(0.0)), Decision("not a time"), Decision(None)])
    assert _generating_since(old, now) == now - RATE_WINDOW_S


def test_no_commit_since_the_answer_has_no_rate() -> None:
    mine = _commits((50, 250))
    assert _recent_rates(mine, T0 + 120, _generating_since(Record([Decision(_iso(100.0))]), T0 + 120)) == (None, None, None)


def test_the_eta_range_spans_the_slowest_and_the_fastest_slice_of_a_full_window() -> None:
    # A full window: 100 rows in each of its five 2-minute slices but one, which has 400.
    at = [T0 + 120 * k for k in range(5)]
    mine = _commits(*[(a - T0, 400 if k == 2 else 100) for k, a in enumerate(at)])
    now = T0 + 600
    rows_s, _, spread = _recent_rates(mine, now, now - RATE_WINDOW_S)
    assert spread == (pytest.approx(100 / 120), pytest.approx(400 / 120))
    assert spread[0] < rows_s < spread[1]
    # Two minutes of generating say nothing about the spread.
    assert _recent_rates(_commits((550, 100), (590, 100)), now, now - RATE_WINDOW_S)[2] is None
