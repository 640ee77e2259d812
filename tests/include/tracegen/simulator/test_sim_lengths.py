"""The length model: a fresh sample per request around a per-prompt difficulty, calibrated to the reference job.

Statistical claims are checked on fixed seeds with tolerances of about 4 standard errors of the
sample size used, so a correct model fails them with probability well under 1e-4.
"""

import math
import random
from statistics import NormalDist

import numpy as np
import pytest
from scipy import stats

from tracegen.simulator.lengths import (
    CALIBRATIONS,
    DEFAULT_MODEL,
    LengthModel,
    build_model,
    draw,
    fresh_sample,
    natural_length,
    prompt_tokens,
    student_t_sf,
    text_tokens,
)
from tracegen.simulator.protocol import plan_request, raw_text
from tracegen.simulator.tokens import chat_prompt_ids, text_ids


def _prompt(i: int) -> list[dict]:
    return [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": f"task {i}: fix the bug"},
    ]


def fresh_lengths(model: LengthModel, n: int, rng_seed: int, start: int = 0) -> np.ndarray:
    """One fresh sample for each of n prompts, as n first requests to a server would draw them."""
    rng = random.Random(rng_seed)
    return np.array([
        fresh_sample(chat_prompt_ids(_prompt(i)), 0, model, rng.getrandbits(64), True).sample.total
        for i in range(start, start + n)
    ])  # fmt: skip


def se_share(p: float, n: int) -> float:
    return math.sqrt(p * (1 - p) / n)


@pytest.fixture(scope="module")
def seed_lengths() -> np.ndarray:
    return np.array([natural_length(_prompt(i), seed=0) for i in range(20_000)])


# -- fresh sampling -------------------------------------------------------------------------------------
def test_a_sample_is_a_pure_function_of_prompt_seed_and_sample_number():
    a = [{"role": "user", "content": "hello"}]
    b = [{"content": "hello", "role": "user"}]
    assert natural_length(a, 7) == natural_length(a, 7) == natural_length(b, 7)
    assert draw(a, 7, sample=3) == draw(b, 7, sample=3)


def test_two_samples_of_one_prompt_differ():
    # The sample part has log-sd 0.63*sqrt(0.5) = 0.45: two samples share a length only by rare chance.
    differ = sum(draw(_prompt(i), sample=1).total != draw(_prompt(i), sample=2).total for i in range(300))
    assert differ >= 290


def test_sim_seed_changes_the_prompts_difficulty():
    same = sum(natural_length(_prompt(i), 0) == natural_length(_prompt(i), 1) for i in range(200))
    assert same < 20


def test_default_law_matches_the_seed_run_over_fresh_draws():
    """The reference job: 17.9% truncated at 4096, capped mean 2,417 (n = 1,500: its own SE of the mean is ~29)."""
    n = 4000
    lengths = fresh_lengths(DEFAULT_MODEL, n, rng_seed=11)
    share, capped = (lengths > 4096).mean(), np.minimum(lengths, 4096)
    # The model's own values: 18.0% and E[min(L, 4096)] in closed form for the log-normal.
    mu, sigma, cap = math.log(DEFAULT_MODEL.median), DEFAULT_MODEL.sigma, 4096
    p_cut = DEFAULT_MODEL.survival(cap)
    below = math.exp(mu + sigma**2 / 2) * NormalDist().cdf((math.log(cap) - mu - sigma**2) / sigma)
    model_mean = below + cap * p_cut
    assert abs(p_cut - 0.18) < 0.002 and abs(model_mean - 2417) < 2 * 29, (p_cut, model_mean)
    # 4 standard errors at n = 4,000: 0.024 for the share, 4 x sd / sqrt(n) ~ 71 tokens for the mean.
    assert abs(share - p_cut) < 4 * se_share(p_cut, n), share
    assert abs(capped.mean() - model_mean) < 4 * capped.std() / math.sqrt(n), (capped.mean(), model_mean)


def test_log_variance_is_split_half_prompt_half_sample():
    n = 2000
    rng = random.Random(5)
    pairs = np.array([
        [math.log(fresh_sample(chat_prompt_ids(_prompt(i)), 0, DEFAULT_MODEL, rng.getrandbits(64), True).sample.total)
         for _ in range(2)]
        for i in range(n)
    ])  # fmt: skip
    # Two samples of one prompt share only its difficulty: their correlation is the prompt's share.
    r = np.corrcoef(pairs[:, 0], pairs[:, 1])[0, 1]
    assert abs(r - 0.5) < 4 * (1 - 0.25) / math.sqrt(n), r  # SE of r near 0.5: (1 - r^2)/sqrt(n)
    var = pairs.var()
    assert abs(var - 0.63**2) < 4 * 0.63**2 * math.sqrt(2 / (2 * n)), var


def test_sample_zero_per_prompt_is_calibrated_too(seed_lengths):
    # Ground-truth users (the audit's cap fit) draw one fixed sample per prompt: the same law.
    capped = np.minimum(seed_lengths, 4096)
    assert 0.165 <= (seed_lengths > 4096).mean() <= 0.195
    assert 2300 <= capped.mean() <= 2550 and 2200 <= np.median(capped) <= 2400
    assert 0.01 <= (seed_lengths > 8192).mean() <= 0.04
    assert seed_lengths.min() >= 1
    assert np.percentile(seed_lengths, 99) > 2 * np.median(seed_lengths)


def test_short_calibration_truncates_like_the_seed_at_cap_100():
    lengths = fresh_lengths(CALIBRATIONS["short"], 4000, rng_seed=3)
    assert abs((lengths > 100).mean() - 0.18) < 4 * se_share(0.18, 4000)


# -- other laws -----------------------------------------------------------------------------------------
LAW_CASES = {
    "logt": dict(kind="logt"),
    "logt-dof-1.5": dict(kind="logt", tail_dof=1.5),
    "bimodal": dict(kind="bimodal"),
    "runaway": dict(runaway_rate=0.03),
    "logt+runaway": dict(kind="logt", runaway_rate=0.05),
}


@pytest.mark.parametrize("case", LAW_CASES)
def test_each_law_keeps_18_percent_past_4096_and_samples_its_own_survival(case):
    model = build_model("reference", **LAW_CASES[case])
    assert abs(model.survival(4096) - DEFAULT_MODEL.survival(4096)) < 1e-6
    n = 4000
    lengths = fresh_lengths(model, n, rng_seed=17)
    # The sampler draws the law the calibration solved: empirical survival within 4 SE everywhere.
    for x in (1024, 2048, 4096, 8192, 16384):
        p = model.survival(x)
        assert abs((lengths > x).mean() - p) < 4 * se_share(p, n) + 1e-3, (x, (lengths > x).mean(), p)


def test_heavy_tail_and_runaway_laws_leave_more_past_8192():
    base = DEFAULT_MODEL.survival(8192)
    assert build_model("reference", kind="logt").survival(8192) > 1.8 * base
    assert build_model("reference", kind="logt").survival(32768) > 5 * DEFAULT_MODEL.survival(32768)
    assert build_model("reference", runaway_rate=0.03).survival(1e5) == pytest.approx(0.03)


def log_density_peaks(model: LengthModel) -> list[float]:
    """Local maxima of the density of log L, from differences of the exact survival function."""
    ys = [math.log(model.median) + k / 50 for k in range(-250, 400)]
    density = [
        model.survival(math.exp(a)) - model.survival(math.exp(b)) for a, b in zip(ys, ys[1:], strict=False)
    ]
    floor = 1e-3 * max(density)  # ignore the float noise of the far tails
    return [
        ys[i]
        for i in range(1, len(density) - 1)
        if density[i] > floor and density[i - 1] < density[i] >= density[i + 1]
    ]


def test_bimodal_law_has_two_modes():
    assert len(log_density_peaks(build_model("reference", kind="bimodal"))) == 2
    assert len(log_density_peaks(DEFAULT_MODEL)) == 1
    # Sampled: well-separated modes show a clear dip between them.
    model = build_model("lognormal:1000:0.4", kind="bimodal", long_ratio=10.0, long_share=0.4)
    logs = np.log(fresh_lengths(model, 4000, rng_seed=23))
    short_mode, long_mode = math.log(model.median), math.log(model.median * 10.0)

    def near(x: float) -> int:
        return int((abs(logs - x) < 0.15).sum())

    dip = near((short_mode + long_mode) / 2)
    assert dip < 0.5 * min(near(short_mode), near(long_mode)), (near(short_mode), dip, near(long_mode))


def test_runaways_never_stop_and_their_tail_repeats():
    model = build_model("reference", runaway_rate=0.05)
    rng = random.Random(29)
    runaway_tails, normal_tails = [], []
    for i in range(600):
        drawn = fresh_sample(chat_prompt_ids(_prompt(i)), 0, model, rng.getrandbits(64), True)
        plan = plan_request(drawn, 4096, False)
        if plan.finish != "length":
            continue
        tail = raw_text(plan, 4096 - 300, 4096).split()
        (runaway_tails if drawn.sample.runaway else normal_tails).append(repeated_ngram_share(tail, 4))
        if drawn.sample.runaway:  # cut inside the thinking, however high the cap
            assert plan_request(drawn, 40_000, False).finish == "length"
            assert "</think>" not in raw_text(plan, 0, 4096)
    assert len(runaway_tails) >= 10 and len(normal_tails) >= 50
    assert min(runaway_tails) > 0.7 and max(normal_tails) < 0.05, (min(runaway_tails), max(normal_tails))


def repeated_ngram_share(tokens: list[str], n: int) -> float:
    """Share of the n-grams of a window that already occurred earlier in it: a simple loop detector."""
    seen, repeated = set(), 0
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    for g in grams:
        repeated += g in seen
        seen.add(g)
    return repeated / max(1, len(grams))


def test_student_t_survival_matches_scipy():
    for dof in (1.0, 1.5, 3.0, 7.5, 40.0):
        for t in (-30.0, -2.0, -0.1, 0.0, 0.5, 1.7, 12.0, 400.0):
            assert student_t_sf(t, dof) == pytest.approx(stats.t.sf(t, dof), rel=1e-9, abs=1e-15)


def test_reasoning_split_is_per_sample_and_leaves_an_answer():
    for i in range(500):
        d = draw(_prompt(i), 3)
        assert 0 <= d.reasoning < d.total and d.answer >= 1
        assert draw(_prompt(i), 3) == d
    shares = [draw(_prompt(i), 3).reasoning / draw(_prompt(i), 3).total for i in range(500)]
    assert 0.5 < min(shares) and max(shares) < 0.93


def test_parse_and_build_models():
    assert LengthModel.parse("reference") is CALIBRATIONS["reference"]
    assert build_model("reference") is CALIBRATIONS["reference"]
    assert LengthModel.parse("fixed:42") == LengthModel(kind="fixed", fixed=42)
    assert natural_length([{"role": "user", "content": "x"}], 0, "fixed:42") == 42
    assert LengthModel.parse("lognormal:100:0.5").median == 100
    assert build_model("short", kind="logt").survival(100) == pytest.approx(
        CALIBRATIONS["short"].survival(100)
    )
    assert build_model("reference", truncated_share=0.3).survival(4096) == pytest.approx(0.3)
    assert build_model("reference", truncated_share=0.05, truncated_at=8192).survival(8192) == pytest.approx(0.05)
    assert build_model("fixed:7", runaway_rate=0.5).runaway_rate == 0.5
    for bad in ("nope", "fixed:x", "fixed:0", "lognormal:1", "lognormal:-3:1"):
        with pytest.raises(ValueError, match="length model|fixed length|log-normal"):
            LengthModel.parse(bad)
    with pytest.raises(ValueError, match="runaways alone"):
        build_model("reference", runaway_rate=0.2)
    with pytest.raises(ValueError, match="no median"):
        build_model("fixed:10", kind="logt")
    with pytest.raises(ValueError, match="bimodal"):
        build_model("reference", kind="bimodal", long_ratio=0.5)


def test_prompt_token_counts_are_the_lengths_of_the_prompt_ids():
    msgs = [{"role": "user", "content": "fix the failing test " * 20}]
    # The templated prompt's tokens: <|im_start|>user\n ... <|im_end|>\n<|im_start|>assistant\n.
    assert prompt_tokens(msgs) == len(chat_prompt_ids(msgs)) == len(text_ids("fix the failing test " * 20)) + 8
    parts = [{"role": "user", "content": [{"type": "text", "text": "fix the failing test " * 20}]}]
    assert prompt_tokens(parts) == prompt_tokens(msgs)
    tools = [{"type": "function", "function": {"name": "f"}}]
    mixed = [
        {"role": "system", "content": "s" * 13},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": {"name": "f"}}]},
        {"role": "tool", "content": "ok"},
    ]
    assert prompt_tokens(msgs, tools=tools) > prompt_tokens(msgs) + 40
    assert prompt_tokens(mixed, tools) == len(chat_prompt_ids(mixed, tools))
    for text in ("", "a", "abcd", "abcde", "é" * 9, "🙂" * 5):
        assert text_tokens(text) == len(text_ids(text))
    assert all(0 <= t < 151_643 for t in text_ids("some prompt text " * 20))
    # A real byte-level BPE: CJK and emoji cost more tokens a character than English words.
    assert len(text_ids("修复失败的测试" * 10)) > len("修复失败的测试" * 10) / 2
    assert len(text_ids("fix the failing test " * 10)) < len("fix the failing test " * 10) / 3
