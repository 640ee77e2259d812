"""Runaway detection on the stand-in's own completions: looping samples are flagged, natural long rows are not.

Rows come from the stand-in's length model and token streams (`fresh_sample`, `plan_request`, `output_ids`), the
same functions the server uses, with 30% runaway samples so a few hundred prompts give both kinds; each row is
cut at a cap as the server cuts it. The detector reads its response ids (a real BPE tokenization, as a real
server's) and, for rows without ids, its text (one id per word).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tracegen.audit.loop_stop import MARGIN, MAX_PERIOD
from tracegen.audit.runaway import (
    RUNAWAY_THRESHOLD,
    TAIL_WINDOW,
    is_runaway,
    is_runaway_text,
    runaway_score,
    text_token_ids,
)
from tracegen.simulator.lengths import LAWS, LengthModel, fresh_sample
from tracegen.simulator.protocol import output_ids, plan_request, raw_text
from tracegen.simulator.tokens import chat_prompt_ids, decode, text_ids


def truncated_rows(kind: str, cap: int, n: int = 300, seed: int = 3, prompt=None):
    """(text, plan, runaway flag) of the rows among n prompts that the stand-in cuts at `cap`."""
    model = LengthModel(kind=kind, runaway_rate=0.3).calibrated(0.5, 4096)
    out = []
    for i in range(n):
        ids = prompt(i) if prompt else [seed, i, 99]
        drawn = fresh_sample(ids, 5, model, 0, True)
        plan = plan_request(drawn, cap, False)
        if plan.finish == "length":
            out.append((raw_text(plan, 0, plan.target), plan, drawn.sample.runaway))
    return out


@pytest.mark.parametrize("kind", [k for k in LAWS if k != "fixed"])
@pytest.mark.parametrize("cap", [4096, 16384])
def test_stand_in_runaways_are_flagged_and_natural_rows_are_not(kind, cap):
    rows = truncated_rows(kind, cap)
    loops = [p for _, p, r in rows if r]
    natural = [p for _, p, r in rows if not r]
    assert len(loops) >= 50 and len(natural) >= (1 if cap > 4096 else 50)
    # The id view, what a row with token ids is judged on: every loop, no natural row.
    assert all(is_runaway(output_ids(p, p.target)) for p in loops)
    assert not any(is_runaway(output_ids(p, p.target)) for p in natural)
    # The score is the share of repeated n-grams: a loop of a short phrase fills the window but its first period.
    assert min(runaway_score(output_ids(p, p.target)) for p in loops) > 0.7
    assert max(runaway_score(output_ids(p, p.target)) for p in natural) < 0.1
    # The text view agrees.
    assert all(is_runaway_text(t) for t, _, r in rows if r)
    assert not any(is_runaway_text(t) for t, _, r in rows if not r)


def test_the_stand_ins_response_ids_are_its_texts_tokens_and_loop_with_it():
    # The stand-in's ids are a byte-level BPE tokenization of its text, so its loops are loops of ids, as a
    # real server's are; rows rich in CJK and emoji (the intl register) too.
    def rich(i):
        return chat_prompt_ids([{"role": "user", "content": f"请修复模块 {i} 中失败的测试 🙏"}])

    for prompt in (None, rich):
        rows = [(t, p) for t, p, r in truncated_rows("lognormal", 4096, n=80, prompt=prompt) if r]
        assert rows
        for text, plan in rows:
            ids = output_ids(plan, plan.target)
            assert decode(ids) == text and is_runaway(ids) and is_runaway_text(text)


def test_the_text_view_is_one_id_per_word_whatever_the_tokenizer():
    text, _, _ = truncated_rows("lognormal", 4096, n=20)[0]
    ids = text_token_ids(text, last=None)
    assert text_token_ids(text).tolist() == ids[-TAIL_WINDOW:].tolist()
    a, b = text_token_ids("run the tests → 修复 🙂"), text_token_ids("run  the\ntests → 修复 🙂")
    assert a.tolist() == b.tolist() and a.size == 7  # whitespace separates, and is not a unit
    assert text_token_ids("").size == 0
    # A loop in text is a loop in the view, whatever the period in characters.
    phrase = "let me check the parser again, maybe the cache — 缓存 — is stale 🤔 "
    assert is_runaway_text("some ordinary start of a thought. " * 3 + phrase * 80)


def test_loop_period_bounds():
    rng = np.random.default_rng(0)
    fresh = rng.integers(0, 150_000, 40_000)
    # Any period up to MAX_PERIOD, once it has run two periods and the margin.
    for period in (1, 8, 300, 900, 1_500, 4_000, MAX_PERIOD):
        loop = np.tile(fresh[5000 : 5000 + period], 3 + (MARGIN + 128) // period)[: 2 * period + MARGIN + 128]
        ids = np.concatenate([fresh[:5000], loop])
        assert runaway_score(ids) >= RUNAWAY_THRESHOLD and is_runaway(ids), period
        # Two copies and a little: a block written twice is not yet a loop.
        assert not is_runaway(np.concatenate([fresh[:5000], loop[: 2 * period + 16]])), period
    # Past the longest period judged: not a loop this judge looks for.
    ids = np.concatenate([fresh[:5000], np.tile(fresh[5000 : 5000 + MAX_PERIOD + 100], 3)])
    assert not is_runaway(ids)
    # Random ids, and a loop that started only in the last few hundred tokens.
    assert runaway_score(fresh) == 0.0
    late = np.concatenate([fresh[:15_000], np.tile(fresh[15_000:15_040], 8)])
    assert not is_runaway(late)


def test_natural_text_is_not_a_loop():
    # Real, repetitive technical prose and code (this repository's docs and sources), 2,048-id windows.
    root = Path(__file__).resolve().parents[4]
    files = sorted((root / "docs").glob("*.md")) + sorted((root / "include" / "tracegen" / "audit").glob("*.py"))
    scores = []
    ids_scores = []
    for f in files:
        ids = text_token_ids(f.read_text(), last=None)
        scores += [runaway_score(ids[s : s + TAIL_WINDOW]) for s in range(0, max(ids.size - TAIL_WINDOW, 1), 4096)]
        tokens = np.asarray(text_ids(f.read_text()))  # the same text as a BPE tokenizer's ids
        ids_scores += [runaway_score(tokens[s : s + TAIL_WINDOW])
                       for s in range(0, max(tokens.size - TAIL_WINDOW, 1), 4096)]
    assert len(scores) >= 20 and len(ids_scores) >= 20
    assert max(scores) == 0.0 and max(ids_scores) == 0.0, (max(scores), max(ids_scores))


def test_short_and_bad_input():
    assert runaway_score([]) == 0.0 and not is_runaway([1, 2, 3] * 5)
    assert not is_runaway([1, 2, 3] * 100)  # 300 ids: shorter than two periods and the margin
    assert is_runaway([1, 2, 3] * 200)
    with pytest.raises(ValueError, match="1-D"):
        runaway_score(np.zeros((3, 100), dtype=np.int64))
    with pytest.raises(ValueError):
        runaway_score([-1] * 200)
