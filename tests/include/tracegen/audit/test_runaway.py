"""Runaway detection on the stand-in's own text: looping samples are flagged, natural long rows are not.

Rows come from the stand-in's length model and text generator (`fresh_sample`, `plan_request`, `raw_text`), the
same functions the server uses, with 30% runaway samples so a few hundred prompts give both kinds; each row is
cut at a cap as the server cuts it, and the detector reads its text as the stand-in tokenizes text.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tracegen.audit.runaway import (
    NGRAM,
    RUNAWAY_THRESHOLD,
    TAIL_WINDOW,
    is_runaway,
    is_runaway_text,
    runaway_score,
    text_token_ids,
)
from tracegen.simulator.lengths import LAWS, LengthModel, fresh_sample
from tracegen.simulator.protocol import output_ids, plan_request, raw_text
from tracegen.simulator.tokens import text_ids


def truncated_rows(kind: str, cap: int, n: int = 300, seed: int = 3):
    """(text, response ids, runaway flag) of the rows among n prompts that the stand-in cuts at `cap`."""
    model = LengthModel(kind=kind, runaway_rate=0.3).calibrated(0.5, 4096)
    out = []
    for i in range(n):
        drawn = fresh_sample([seed, i, 99], 5, model, 0, True)
        plan = plan_request(drawn, cap, False)
        if plan.finish == "length":
            out.append((raw_text(plan, 0, plan.target), plan, drawn.sample.runaway))
    return out


@pytest.mark.parametrize("kind", [k for k in LAWS if k != "fixed"])
@pytest.mark.parametrize("cap", [4096, 16384])
def test_stand_in_runaways_are_flagged_and_natural_rows_are_not(kind, cap):
    rows = truncated_rows(kind, cap)
    loops = [t for t, _, r in rows if r]
    natural = [t for t, _, r in rows if not r]
    assert len(loops) >= 50 and len(natural) >= (1 if cap > 4096 else 50)
    assert all(is_runaway_text(t) for t in loops)
    assert not any(is_runaway_text(t) for t in natural)
    # The score is the share of repeated n-grams: a loop of at most 63 words fills the window but its first period.
    assert min(runaway_score(text_token_ids(t)) for t in loops) > 0.7
    assert max(runaway_score(text_token_ids(t)) for t in natural) < 0.05


def test_the_stand_ins_response_ids_do_not_carry_the_loop():
    # Why the stand-in's rows are judged on their text: its response ids name the sample (an arithmetic
    # sequence), so they never repeat. A real server's ids are its text's tokens and loop with it.
    rows = [(t, p) for t, p, r in truncated_rows("lognormal", 4096, n=60) if r]
    assert rows
    for text, plan in rows:
        assert runaway_score(output_ids(plan, plan.target)) == 0.0
        assert is_runaway(text_token_ids(text))


def test_text_token_ids_are_the_stand_ins_tokenization():
    text, _, _ = truncated_rows("lognormal", 4096, n=20)[0]
    for cut in (0, 1, 2, 3, 4097):  # every alignment of the text against the 4-character grid
        t = text[cut:]
        full = text_ids(t)
        assert text_token_ids(t, last=None).tolist() == full
        assert text_token_ids(t).tolist() == full[-TAIL_WINDOW:]
    assert text_token_ids("").size == 0 and text_token_ids("a\u00e9\U0001f600").tolist() == text_ids("a\u00e9\U0001f600")


def test_loop_period_bounds():
    rng = np.random.default_rng(0)
    fresh = rng.integers(0, 150_000, 20_000)
    for period in (1, 8, 300, 900):
        ids = np.concatenate([fresh[:5000], np.tile(fresh[5000 : 5000 + period], 16_384 // period + 1)])
        score = runaway_score(ids)
        assert score == pytest.approx(1 - (period - 1 + NGRAM - 1) / (TAIL_WINDOW - NGRAM + 1), abs=0.01) or period < NGRAM
        assert is_runaway(ids)
    # Two copies no longer fit the window: not a loop this detector can see.
    ids = np.concatenate([fresh[:5000], np.tile(fresh[5000 : 5000 + 1500], 12)])
    assert runaway_score(ids) < RUNAWAY_THRESHOLD and not is_runaway(ids)
    # Random ids and a loop that started only in the last few hundred tokens.
    assert runaway_score(fresh) == 0.0
    late = np.concatenate([fresh[:15_000], np.tile(fresh[15_000:15_040], 20)])
    assert not is_runaway(late)


def test_natural_text_is_not_a_loop():
    # Real, repetitive technical prose and code (this repository's docs and sources), 2,048-id windows.
    root = Path(__file__).resolve().parents[4]
    files = sorted((root / "docs").glob("*.md")) + sorted((root / "include" / "tracegen" / "audit").glob("*.py"))
    scores = []
    for f in files:
        ids = text_token_ids(f.read_text(), last=None)
        scores += [runaway_score(ids[s : s + TAIL_WINDOW]) for s in range(0, max(ids.size - TAIL_WINDOW, 1), 1024)]
    assert len(scores) >= 20
    assert max(scores) < 0.2


def test_short_and_bad_input():
    assert runaway_score([]) == 0.0 and not is_runaway([1, 2, 3] * 5)
    assert is_runaway([1, 2, 3] * 100)
    with pytest.raises(ValueError, match="1-D"):
        runaway_score(np.zeros((3, 100), dtype=np.int64))
    with pytest.raises(ValueError, match="ngram"):
        runaway_score([1] * 100, ngram=0)
    with pytest.raises(ValueError, match="window"):
        runaway_score([1] * 100, window=4)
