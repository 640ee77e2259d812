"""The stand-in's length model: how long a completion would naturally be, per prompt, without a cap.

Pure and deterministic: the same prompt and seed always give the same natural length and the same
thinking/answer split, whatever `max_tokens` the client asks for — so a prompt cut at 4096 finishes
at the same length under 8192, exactly as the 4096→8192 pivot in the seed story needs. The audit
helper imports `natural_length` to check its cap predictions against ground truth.

The default calibration ("seed") is a log-normal with median 2300 and sigma 0.63: at cap 4096 it
truncates 18.0% (seed: 269/1500 = 17.9%), the capped mean is ≈2,455 and the capped median ≈2,300
(seed: 2,417 and 2,326); at 8192, 2.2% remain truncated.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

_STANDARD_NORMAL = NormalDist()
# Tokens the chat template adds around each message (role markers, separators).
TEMPLATE_TOKENS_PER_MESSAGE = 4
CHARS_PER_TOKEN = 4

Prompt = Sequence[Mapping[str, Any]] | str | Sequence[int]


@dataclass(frozen=True, slots=True)
class LengthModel:
    """A natural-length distribution: log-normal (median, sigma) or a fixed length.

    `reasoning_share` bounds the fraction of the completion spent thinking; the actual share is
    drawn per prompt, uniformly in [low, high].
    """

    kind: str = "lognormal"
    median: float = 2300.0
    sigma: float = 0.63
    fixed: int = 0
    max_length: int = 1_000_000
    reasoning_share: tuple[float, float] = (0.55, 0.92)

    def __post_init__(self) -> None:
        if self.kind not in ("lognormal", "fixed"):
            raise ValueError(f"length model kind {self.kind!r} is not 'lognormal' or 'fixed'")
        if self.kind == "lognormal" and not (self.median >= 1 and self.sigma >= 0):
            raise ValueError(f"log-normal needs median >= 1 and sigma >= 0, got {self.median}, {self.sigma}")
        if self.kind == "fixed" and self.fixed < 1:
            raise ValueError(f"fixed length must be >= 1, got {self.fixed}")
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


# Named calibrations selectable with --sim-length-model.
CALIBRATIONS: dict[str, LengthModel] = {
    # The seed run: Qwen3 on agentic-coding prompts, 18% truncated at 4096.
    "seed": LengthModel(),
    # Same shape, 1/40 the size: fast tests and demos that still see ~18% truncated at cap 100.
    "short": LengthModel(median=56.0, sigma=0.63),
    # A model that thinks longer: ~45% truncated at 4096, ~12% at 8192.
    "long": LengthModel(median=3800.0, sigma=0.7),
}
DEFAULT_MODEL = CALIBRATIONS["seed"]


@dataclass(frozen=True, slots=True)
class LengthDraw:
    """One prompt's natural completion: `total` tokens, the first `reasoning` of them thinking."""

    total: int
    reasoning: int
    digest: int  # 64-bit prompt hash: also seeds the pseudo-text

    @property
    def answer(self) -> int:
        return self.total - self.reasoning


def prompt_digest(prompt: Prompt, seed: int = 0) -> bytes:
    """A stable 16-byte hash of a prompt (chat messages, raw text or token ids) and the seed."""
    if isinstance(prompt, str):
        payload = prompt.encode("utf-8", "surrogatepass")
    else:
        # Canonical JSON so key order or whitespace in the request never changes the length.
        payload = json.dumps(prompt, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode(
            "utf-8", "surrogatepass"
        )
    return hashlib.blake2b(
        payload, digest_size=16, salt=int(seed & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "little")
    ).digest()


def _unit(value: int) -> float:
    # Map 64 bits to the open interval (0, 1): inv_cdf rejects 0 and 1.
    return (value + 0.5) / 2.0**64


def draw(prompt: Prompt, seed: int = 0, model: LengthModel = DEFAULT_MODEL) -> LengthDraw:
    """The natural length and thinking/answer split of `prompt` under `model`."""
    digest = prompt_digest(prompt, seed)
    a = int.from_bytes(digest[:8], "little")
    b = int.from_bytes(digest[8:], "little")
    if model.kind == "fixed":
        total = model.fixed
    else:
        z = _STANDARD_NORMAL.inv_cdf(_unit(a))
        total = int(round(model.median * math.exp(model.sigma * z)))
    total = max(1, min(total, model.max_length))
    low, high = model.reasoning_share
    share = low + (high - low) * _unit(b)
    # At least one answer token, so every complete generation has a non-empty answer.
    reasoning = min(int(total * share), total - 1)
    return LengthDraw(total=total, reasoning=max(0, reasoning), digest=a)


def natural_length(prompt: Prompt, seed: int = 0, model: LengthModel | str = DEFAULT_MODEL) -> int:
    """Completion tokens `prompt` would produce with no cap (thinking + answer)."""
    if isinstance(model, str):
        model = LengthModel.parse(model)
    return draw(prompt, seed, model).total


def _content_chars(content: Any) -> int:
    if content is None:
        return 0
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):  # OpenAI content parts: count the text ones
        return sum(len(p.get("text") or "") for p in content if isinstance(p, Mapping))
    return len(str(content))


def prompt_tokens(messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None = None) -> int:
    """Approximate prompt tokens: ~4 characters per token over contents and tools, plus template overhead."""
    chars = sum(_content_chars(m.get("content")) for m in messages)
    tokens = math.ceil(chars / CHARS_PER_TOKEN) + TEMPLATE_TOKENS_PER_MESSAGE * len(messages)
    if tools:
        tokens += math.ceil(len(json.dumps(tools, separators=(",", ":"))) / CHARS_PER_TOKEN)
    return tokens


def text_tokens(text: str) -> int:
    """Approximate tokens of a raw prompt string (native /generate)."""
    return math.ceil(len(text) / CHARS_PER_TOKEN)
