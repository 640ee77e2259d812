"""The stand-in's length model: how long one sampled completion would be if nothing cut it.

A sampling server draws a new completion on every request, so the natural length is drawn afresh too:
on the log scale it is the sum of a per-prompt difficulty and a per-sample noise,

    log L = log(median) + prompt part + sample part

The prompt part is a pure function of the prompt's token ids and --sim-seed; the sample part comes from
a sample key, fresh per request (SGLang samples afresh unless it runs in deterministic mode, where
its seed fixes the key). `prompt_share` splits the log-variance between the two (half and half by
default): a prompt that was long once is likely long again, but a regenerated row is a new sample.
A sample is a window of a tokenized text stream (`tokens.Stream`): its key is a function of the prompt and
of where the window starts (its origin), so a continuation of a response the stand-in generated finds
the sample from the response's own ids (`continued_sample`), on any server of a fleet.

Laws (`kind`), each with an optional share of runaway samples that never stop (`runaway_rate`): they
loop in their thinking until the cap, as reasoning models do, with periods from one token to a thousand,
early and late, exactly or with a word changed now and then (`loop_shape`).
- lognormal: both parts normal; sigma is the total log-sd.
- logt: the sample part is a Student t (`tail_dof` degrees of freedom) scaled by sigma·sqrt(1 - share):
  a power-law-like tail of very long samples.
- bimodal: the sample part is normal plus, for a `long_share` of samples, log(`long_ratio`): a model
  that sometimes deliberates at length.
- fixed: every sample is `fixed` tokens (capacity and fault tests).

The default ("reference", the reference job's law) is a log-normal with median 2300 and sigma 0.63: at cap 4096 it truncates 18.0%
(reference job: 269/1500 = 17.9%), the capped mean is ≈2,455 and the capped median ≈2,300 (seed: 2,417 and
2,326); at 8192, 2.2% remain truncated. `LengthModel.calibrated` re-solves the median of any law so
that a given share passes a given cap, which is how the launch flags keep 18% at 4096 whatever the law.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from statistics import NormalDist
from typing import Any

from tracegen.simulator.tokens import (
    SURROGATE_TOKENS,
    Response,
    chat_prompt_ids,
    chat_prompt_tokens,
    find_origins,
    layout,
    origin_key,
    prompt_digest,
    register_of,
    stream,
    text_ids,
)

_STANDARD_NORMAL = NormalDist()
LAWS = ("lognormal", "logt", "bimodal", "fixed")
# The prompt part is integrated on this grid of standard-normal points (trapezoid rule: spectrally
# accurate for a Gaussian weight and a smooth integrand; the tails beyond 8 sd weigh < 1e-15).
_Z_STEP = 0.2
_Z_GRID = [i * _Z_STEP for i in range(-40, 41)]
_Z_WEIGHTS = [math.exp(-z * z / 2) / math.sqrt(2 * math.pi) * _Z_STEP for z in _Z_GRID]

Prompt = Sequence[Mapping[str, Any]] | str | Sequence[int]


def student_t_sf(t: float, dof: float) -> float:
    """P(T > t) for Student's t with `dof` degrees of freedom."""
    x = dof / (dof + t * t)
    tail = 0.5 * _betainc(dof / 2, 0.5, x)
    return tail if t >= 0 else 1.0 - tail


def _betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta I_x(a, b) (continued fraction, modified Lentz)."""
    if x <= 0:
        return 0.0
    if x >= 1:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x > (a + 1) / (a + b + 2):  # the fraction converges fast only on this side: use the symmetry
        return 1.0 - _betainc(b, a, 1.0 - x)
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    f = d
    for m in range(1, 500):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            f *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return math.exp(log_front) * f / a


@dataclass(frozen=True, slots=True)
class LengthModel:
    """A natural-length law (see the module docstring). `reasoning_share` bounds the thinking fraction,
    drawn per sample uniformly in [low, high]."""

    kind: str = "lognormal"
    median: float = 2300.0  # median of the body of the law before runaways (the location)
    sigma: float = 0.63  # log-scale spread: the sd of the normal parts, the scale of the t part
    prompt_share: float = 0.5  # share of sigma^2 that belongs to the prompt, the rest to the sample
    tail_dof: float = 3.0  # logt
    long_share: float = 0.3  # bimodal: share of samples in the long mode
    long_ratio: float = 8.0  # bimodal: how many times longer the long mode is (3.3 sigma apart by default)
    runaway_rate: float = 0.0  # share of samples that never stop
    loop_shape: str = "phrase"  # how runaways loop: one of LOOP_SHAPES (see `loop_shape`)
    fixed: int = 0
    max_length: int = 1_000_000  # "never stops": longer than any context
    reasoning_share: tuple[float, float] = (0.55, 0.92)

    def __post_init__(self) -> None:
        if self.kind not in LAWS:
            raise ValueError(f"length law {self.kind!r} is not one of {', '.join(LAWS)}")
        if self.kind != "fixed" and not (self.median >= 1 and self.sigma >= 0):
            raise ValueError(f"log-normal needs median >= 1 and sigma >= 0, got {self.median}, {self.sigma}")
        if self.kind == "fixed" and self.fixed < 1:
            raise ValueError(f"fixed length must be >= 1, got {self.fixed}")
        if not 0.0 <= self.prompt_share <= 1.0:
            raise ValueError(f"prompt_share must be in [0, 1], got {self.prompt_share}")
        if not self.tail_dof > 0:
            raise ValueError(f"tail_dof must be > 0, got {self.tail_dof}")
        if not (0.0 < self.long_share < 1.0 and self.long_ratio > 1.0):
            raise ValueError(
                f"bimodal needs 0 < long_share < 1 and long_ratio > 1, got {self.long_share}, {self.long_ratio}"
            )
        if not 0.0 <= self.runaway_rate < 1.0:
            raise ValueError(f"runaway_rate must be in [0, 1), got {self.runaway_rate}")
        if self.loop_shape not in LOOP_SHAPES:
            raise ValueError(f"loop shape {self.loop_shape!r} is not one of {', '.join(LOOP_SHAPES)}")
        low, high = self.reasoning_share
        if not 0.0 <= low <= high <= 1.0:
            raise ValueError(f"reasoning_share {self.reasoning_share} must satisfy 0 <= low <= high <= 1")

    @classmethod
    def parse(cls, spec: str) -> LengthModel:
        """Build a model from a flag value: a named calibration, `lognormal:MEDIAN:SIGMA` or `fixed:N`."""
        if spec in CALIBRATIONS:
            return CALIBRATIONS[spec]
        name, _, rest = spec.partition(":")
        try:
            if name == "lognormal":
                median, sigma = (float(x) for x in rest.split(":"))
                return cls(kind="lognormal", median=median, sigma=sigma)
            if name == "fixed":
                return cls(kind="fixed", fixed=int(rest))
        except ValueError as exc:
            raise ValueError(f"bad length model {spec!r}: {exc}") from None
        raise ValueError(
            f"unknown length model {spec!r}: use one of {sorted(CALIBRATIONS)}, 'lognormal:MEDIAN:SIGMA' or 'fixed:N'"
        )

    # -- the law ------------------------------------------------------------------------------------
    @property
    def prompt_sd(self) -> float:
        return self.sigma * math.sqrt(self.prompt_share)

    @property
    def sample_scale(self) -> float:
        return self.sigma * math.sqrt(1.0 - self.prompt_share)

    def _body_sf(self, y: float) -> float:
        """P(log L - log median > y) for a sample that is not a runaway."""
        if self.kind == "lognormal":
            return _normal_sf(y, self.sigma)
        if self.kind == "bimodal":
            shift = math.log(self.long_ratio)
            return (1 - self.long_share) * _normal_sf(y, self.sigma) + self.long_share * _normal_sf(
                y - shift, self.sigma
            )
        # logt: average the t tail over the normal prompt part.
        scale, sd = self.sample_scale, self.prompt_sd
        if scale == 0:
            return _normal_sf(y, sd)
        if sd == 0:
            return student_t_sf(y / scale, self.tail_dof)
        return sum(
            w * student_t_sf((y - sd * z) / scale, self.tail_dof)
            for z, w in zip(_Z_GRID, _Z_WEIGHTS, strict=True)
        )

    def survival(self, length: float) -> float:
        """P(natural length > length) over prompts and samples (continuous approximation)."""
        if self.kind == "fixed":
            body = 1.0 if self.fixed > length else 0.0
        else:
            body = (
                self._body_sf(math.log(length) - math.log(self.median)) if length < self.max_length else 0.0
            )
        return self.runaway_rate + (1.0 - self.runaway_rate) * body

    def calibrated(self, share: float, at: float) -> LengthModel:
        """The same law with the median re-solved so that `share` of samples pass `at` tokens."""
        if self.kind == "fixed":
            raise ValueError("a fixed length cannot be calibrated to a truncated share")
        if not self.runaway_rate < share < 1.0:
            raise ValueError(
                f"truncated share {share} must be in (runaway rate {self.runaway_rate}, 1): runaways alone pass any cap"
            )
        target = (share - self.runaway_rate) / (1.0 - self.runaway_rate)
        low, high = math.log(at) - 60.0 * max(self.sigma, 0.1), math.log(at) + 60.0 * max(self.sigma, 0.1)
        for _ in range(48):  # bisection on log(median), to ~1e-12 relative: the survival rises with it
            mid = (low + high) / 2
            if self._body_sf(math.log(at) - mid) < target:
                low = mid
            else:
                high = mid
        return replace(self, median=math.exp((low + high) / 2))

    # -- one sample -----------------------------------------------------------------------------------
    def sample(self, digest: bytes, key: int) -> Sample:
        """The sample `key` of the prompt with `digest` (see `prompt_digest`)."""
        rng = random.Random(key)
        # Always the same draws in the same order, whatever the law: a key names one sample.
        u_runaway, u_noise, u_mode, u_share, u_tool, u_onset, u_period = (
            _unit(rng.getrandbits(64)) for _ in range(7)
        )
        chi2 = 2.0 * rng.gammavariate(self.tail_dof / 2, 1.0)  # last: it consumes a variable count
        runaway = u_runaway < self.runaway_rate
        if self.kind == "fixed":
            total = self.fixed
        else:
            z_prompt = _STANDARD_NORMAL.inv_cdf(_unit(int.from_bytes(digest[:8], "little")))
            z_sample = _STANDARD_NORMAL.inv_cdf(u_noise)
            if self.kind == "logt":
                noise = self.sample_scale * z_sample / math.sqrt(max(chi2, 1e-300) / self.tail_dof)
            else:
                noise = self.sample_scale * z_sample
                if self.kind == "bimodal" and u_mode < self.long_share:
                    noise += math.log(self.long_ratio)
            log_total = math.log(self.median) + self.prompt_sd * z_prompt + noise
            total = int(round(math.exp(min(log_total, 50.0))))
        low, high = self.reasoning_share
        share = low + (high - low) * u_share
        base = self.fixed if self.kind == "fixed" else self.median
        if runaway:
            total = self.max_length
            reasoning = total - 1  # the loop never leaves the thinking
        else:
            total = max(1, min(total, self.max_length))
            # At least one answer token, so every complete generation has a non-empty answer.
            reasoning = max(0, min(int(total * share), total - 1))
        onset, period, variants = loop_shape(self.loop_shape, base, u_onset, u_period, key)
        return Sample(
            total=total,
            reasoning=reasoning,
            key=key,
            runaway=runaway,
            loop_onset=onset,
            loop_period=period,
            loop_variants=variants,
            tool_roll=u_tool,
        )


# How runaway samples loop (`--sim-loop-shape`), at the law's scale (its median; at the reference job's,
# 2,300 tokens). "phrase": an exact loop of a phrase of 8-63 tokens from 10-60% of the median on, which every
# detector sees at a 4,096 cap. "varied", loops as models make them:
# - the period (tokens repeated) is log-uniform from 1 (a token repeated) to half the median, at most
#   LOOP_PERIOD_MAX: a word, a sentence, a paragraph, a block of a thousand tokens are all common;
# - the onset is log-uniform from 1% of the median to twice it: most loops start early, some late (at the
#   reference scale from about 20 tokens to 4,600, past a 4,096 cap for a few);
# - half the loops are near-exact: each copy after the first swaps one token of the loop for another
#   (a word changed), as real loops drift, with probability LOOP_VARIANT_RATE for a loop of
#   LOOP_VARIANT_PERIOD tokens or more and proportionally less for a shorter one (a loop of a few tokens
#   that changed a word every other copy would be no loop); the other half repeat exactly.
LOOP_SHAPES = ("phrase", "varied")
LOOP_PERIOD_MAX = 1000
LOOP_ONSET_RANGE = (0.01, 2.0)
LOOP_NEAR_SHARE = 0.5
LOOP_VARIANT_RATE = 0.5
LOOP_VARIANT_PERIOD = 64


def loop_shape(shape: str, base: float, u_onset: float, u_period: float, key: int) -> tuple[int, int, float]:
    """(onset, period, per-copy swap probability) of the loop of sample `key` of a law of scale `base`."""
    if shape == "phrase":
        return max(1, int(base * (0.1 + 0.5 * u_onset))), 8 + int(56 * u_period), 0.0
    top = max(1.0, min(LOOP_PERIOD_MAX, base / 2))
    period = max(1, min(int(top), int(top**u_period)))
    low, high = LOOP_ONSET_RANGE
    onset = max(1, int(base * low * (high / low) ** u_onset))
    # From the key's bits, not one more draw: the draws of a sample stay what they were.
    near = _unit((key * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF) < LOOP_NEAR_SHARE
    return onset, period, LOOP_VARIANT_RATE * min(1.0, period / LOOP_VARIANT_PERIOD) if near else 0.0


def _normal_sf(y: float, sd: float) -> float:
    if sd == 0:
        return 1.0 if y < 0 else 0.0
    return _STANDARD_NORMAL.cdf(-y / sd)


# Named calibrations selectable with --sim-length-model, and the cap each one's truncated share refers
# to (the launch flags keep that share when they change the law).
CALIBRATIONS: dict[str, LengthModel] = {
    # The reference job: Qwen3 on agentic-coding prompts, 18% truncated at 4096.
    "reference": LengthModel(),
    # Same shape, 1/40 the size: fast tests and demos that still see ~18% truncated at cap 100.
    "short": LengthModel(median=56.0, sigma=0.63),
    # A model that thinks longer: ~45% truncated at 4096, ~12% at 8192.
    "long": LengthModel(median=3800.0, sigma=0.7),
}
REFERENCE_CAPS: dict[str, int] = {"reference": 4096, "short": 100, "long": 4096}
DEFAULT_REFERENCE_CAP = 4096
DEFAULT_MODEL = CALIBRATIONS["reference"]


def build_model(
    spec: str = "reference",
    kind: str | None = None,
    truncated_share: float | None = None,
    truncated_at: int | None = None,
    **shape: Any,
) -> LengthModel:
    """A model from the launch flags: `spec` picks the scale, `kind` and `shape` the law.

    Unless `truncated_share` says otherwise, the result truncates the same share at `truncated_at` (by
    default the calibration's reference cap) as `spec` does: changing the law or adding runaways moves
    the median, not the share of rows the pipeline sees cut.
    """
    loops = shape.pop("loop_shape", None)
    model = _law(spec, kind, truncated_share, truncated_at, **shape)
    # How runaways loop is no part of the law: it leaves the calibration alone.
    return model if loops is None else replace(model, loop_shape=loops)


def _law(
    spec: str, kind: str | None, truncated_share: float | None, truncated_at: int | None, **shape: Any
) -> LengthModel:
    base = LengthModel.parse(spec)
    model = replace(base, **({"kind": kind} if kind else {}), **shape)
    if base.kind == "fixed":
        if model.kind != "fixed":
            raise ValueError(
                f"fixed:N has no median to calibrate: pick a named or lognormal model for {kind}"
            )
        if truncated_share is not None:
            raise ValueError("a fixed length cannot be calibrated to a truncated share")
        return model
    if model.kind == "fixed":
        raise ValueError("use --sim-length-model fixed:N for a fixed length")
    if model == base and truncated_share is None:
        return base
    at = truncated_at or REFERENCE_CAPS.get(spec, DEFAULT_REFERENCE_CAP)
    share = truncated_share if truncated_share is not None else base.survival(at)
    return model.calibrated(share, at)


@dataclass(frozen=True, slots=True)
class Sample:
    """One sampled completion: `total` tokens until it stops, the first `reasoning` of them thinking.

    A runaway never stops (`total` is the model's max_length): from `loop_onset` on, its text repeats a
    stretch of `loop_period` tokens, each copy after the first swapping one token for a variant with
    probability `loop_variants` (0: an exact loop; see `loop_shape`). `key` seeds its text and token ids.
    """

    total: int
    reasoning: int
    key: int
    runaway: bool = False
    loop_onset: int = 0
    loop_period: int = 0
    loop_variants: float = 0.0
    tool_roll: float = 1.0  # uniform in [0, 1): below the tool-call rate, a prompt with tools calls one

    @property
    def answer(self) -> int:
        return self.total - self.reasoning


def _unit(value: int) -> float:
    # Map 64 bits to the open interval (0, 1): inv_cdf rejects 0 and 1.
    return (value + 0.5) / 2.0**64


def sample_key(digest: bytes, sample: int) -> int:
    """Where sample number `sample` of a prompt starts looking for its origin (a request's seed, or fresh
    randomness, picks it)."""
    payload = digest + int(sample & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "little")
    return int.from_bytes(hashlib.blake2b(payload, digest_size=8, person=b"sample").digest(), "little")


@dataclass(frozen=True, slots=True)
class Drawn:
    """A sample as a request sees it: the sample, where its text starts in its register's stream, and how
    much of it the request's input already holds (0 for a fresh request, the prefix length for a
    continuation). `context` is the input's last ids, which SGLang's detokenizer decodes the output after."""

    sample: Sample
    register: str
    origin: int
    thinking: bool
    generated: int = 0
    context: tuple[int, ...] = ()

    def response(self, tool_name: str | None = None, ignore_eos: bool = False) -> Response:
        return layout(self.sample, self.register, self.origin, self.thinking, tool_name, ignore_eos)


def _at(digest: bytes, register: str, origin: int, model: LengthModel) -> Sample:
    return model.sample(digest, origin_key(digest, register, origin))


def fresh_sample(ids: Sequence[int], seed: int, model: LengthModel, number: int, thinking: bool) -> Drawn:
    """Sample number `number` of the prompt with token ids `ids` (what the server draws per request)."""
    digest = prompt_digest(ids, seed)
    register = register_of(ids)
    s = stream(register)
    origin = s.next_start(sample_key(digest, number) % s.size)
    return Drawn(_at(digest, register, origin, model), register, origin, thinking, 0,
                 tuple(ids[-SURROGATE_TOKENS:]))


def continued_sample(
    input_ids: Sequence[int],
    seed: int,
    model: LengthModel,
    tool_for: Callable[[Sequence[int], Sample], str | None] | None = None,
) -> Drawn | None:
    """The sample whose response `input_ids` ends with, if the stand-in generated it after that prompt
    (every id of the response so far is the sample's). `tool_for(prompt_ids, sample)`: the tool the sample
    calls, as the server decides it (the ids of a call are part of the response)."""
    found = find_origins(input_ids)
    if found is None:
        return None
    prompt = list(input_ids[: found.prompt_len])
    response = list(input_ids[found.prompt_len :])
    digest = prompt_digest(prompt, seed)
    for origin in found.origins:
        sample = _at(digest, found.register, origin, model)
        tool = tool_for(prompt, sample) if tool_for is not None else None
        drawn = Drawn(sample, found.register, origin, found.thinking, len(response),
                      tuple(input_ids[-SURROGATE_TOKENS:]))
        whole = drawn.response(tool)
        if whole.total is not None and len(response) >= whole.total:
            continue  # it had stopped: not a prefix
        if whole.ids(0, len(response)) == response:
            return drawn
    return None


def prompt_ids(prompt: Prompt, tools: Sequence[Any] | None = None) -> list[int]:
    """The stand-in's token ids of chat messages, raw text, or ids (returned as they are)."""
    if isinstance(prompt, str):
        return text_ids(prompt)
    if prompt and isinstance(prompt[0], Mapping):
        return chat_prompt_ids(prompt, tools)  # type: ignore[arg-type]
    return list(prompt)  # type: ignore[arg-type]


def draw(
    prompt: Prompt,
    seed: int = 0,
    model: LengthModel = DEFAULT_MODEL,
    sample: int = 0,
    tools: Sequence[Any] | None = None,
) -> Sample:
    """Sample number `sample` of `prompt` under --sim-seed `seed` and `model`.

    The server uses a fresh `sample` per request, or the request's seed in deterministic mode (so this
    predicts its output exactly there); `sample=0` is one fixed draw per prompt, for ground truth.
    """
    return fresh_sample(prompt_ids(prompt, tools), seed, model, sample, thinking=True).sample


def natural_length(
    prompt: Prompt, seed: int = 0, model: LengthModel | str = DEFAULT_MODEL, sample: int = 0
) -> int:
    """Completion tokens of sample `sample` of `prompt` with no cap (thinking + answer)."""
    if isinstance(model, str):
        model = LengthModel.parse(model)
    return draw(prompt, seed, model, sample).total


def prompt_tokens(messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None = None) -> int:
    """Prompt tokens of a chat request: its templated text, tokenized (the generation prompt included)."""
    return chat_prompt_tokens(messages, tools)


def text_tokens(text: str) -> int:
    """Prompt tokens of a raw prompt string (native /generate)."""
    return len(text_ids(text))
