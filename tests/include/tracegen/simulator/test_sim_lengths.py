"""The length model: deterministic per prompt, independent of the cap, calibrated to the seed run."""

import numpy as np
import pytest

from tracegen.simulator.lengths import (
    CALIBRATIONS,
    LengthModel,
    draw,
    natural_length,
    prompt_tokens,
)


def _prompt(i: int) -> list[dict]:
    return [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": f"task {i}: fix the bug"},
    ]


@pytest.fixture(scope="module")
def seed_lengths() -> np.ndarray:
    return np.array([natural_length(_prompt(i), seed=0) for i in range(20_000)])


def test_same_prompt_same_length_and_key_order_does_not_matter():
    a = [{"role": "user", "content": "hello"}]
    b = [{"content": "hello", "role": "user"}]
    assert natural_length(a, 7) == natural_length(a, 7) == natural_length(b, 7)
    assert draw(a, 7) == draw(b, 7)


def test_seed_changes_lengths():
    same = sum(natural_length(_prompt(i), 0) == natural_length(_prompt(i), 1) for i in range(200))
    assert same < 20


def test_seed_calibration_matches_the_seed_run(seed_lengths):
    # Seed run: 269/1500 = 17.9% truncated at 4096, capped mean 2,417, capped median 2,326.
    capped = np.minimum(seed_lengths, 4096)
    truncated_4096 = (seed_lengths > 4096).mean()
    assert 0.165 <= truncated_4096 <= 0.195, truncated_4096
    assert 2300 <= capped.mean() <= 2550, capped.mean()
    assert 2200 <= np.median(capped) <= 2400, np.median(capped)
    truncated_8192 = (seed_lengths > 8192).mean()
    assert 0.01 <= truncated_8192 <= 0.04, truncated_8192
    assert seed_lengths.min() >= 1


def test_heavy_tail(seed_lengths):
    # Log-normal: P99 well above twice the median.
    assert np.percentile(seed_lengths, 99) > 2 * np.median(seed_lengths)


def test_short_calibration_truncates_like_the_seed_at_cap_100():
    lengths = np.array([natural_length(_prompt(i), 0, "short") for i in range(5000)])
    assert 0.15 <= (lengths > 100).mean() <= 0.21


def test_reasoning_split_is_deterministic_and_leaves_an_answer():
    for i in range(500):
        d = draw(_prompt(i), 3)
        assert 0 <= d.reasoning < d.total
        assert d.answer >= 1
        assert draw(_prompt(i), 3) == d
    shares = [draw(_prompt(i), 3).reasoning / draw(_prompt(i), 3).total for i in range(500)]
    assert 0.5 < min(shares) and max(shares) < 0.93


def test_parse_models():
    assert LengthModel.parse("seed") is CALIBRATIONS["seed"]
    assert LengthModel.parse("fixed:42") == LengthModel(kind="fixed", fixed=42)
    assert natural_length([{"role": "user", "content": "x"}], 0, "fixed:42") == 42
    assert LengthModel.parse("lognormal:100:0.5").median == 100
    for bad in ("nope", "fixed:x", "fixed:0", "lognormal:1", "lognormal:-3:1"):
        with pytest.raises(ValueError, match="length model|fixed length|log-normal"):
            LengthModel.parse(bad)


def test_prompt_tokens_approximation():
    msgs = [{"role": "user", "content": "x" * 400}]
    assert prompt_tokens(msgs) == 100 + 4
    parts = [{"role": "user", "content": [{"type": "text", "text": "y" * 40}]}]
    assert prompt_tokens(parts) == 10 + 4
    assert prompt_tokens(msgs, tools=[{"type": "function", "function": {"name": "f"}}]) > 104
