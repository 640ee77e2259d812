"""The shapes that cross module boundaries: one generated row, and its ledger summary.

A *part* holds full rows (text and token ids included); its *ledger entry* holds only the small
per-row summary below. Audits, status, planning and resume read ledger entries only.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

# Row status values.
OK = "ok"  # the server returned a completion (finish_reason says whether it was cut)
FAILED = "failed"  # transient failures exhausted the retries: a later run should try again
REJECTED = "rejected"  # permanent for this cap (e.g. context overflow): recorded once, not retried
INVALID = "invalid"  # the dataset row itself is malformed: nothing to generate
STATUSES = (OK, FAILED, REJECTED, INVALID)

# finish_reason values of a completion: it ended by itself (COMPLETE), or at the cap ("length"). SGLang also
# reports `abort`, which is not a completion and never reaches the ledger: the client retries it.
COMPLETE = ("stop", "tool_calls")
# A row the client stopped while it generated, because its tail looped (`audit.loop_stop`): a runaway, kept
# with what it generated until then; not cut by the cap, and never continued.
LOOP = "loop"
# The finishes that are not an ending: cut at the cap, or stopped in a loop.
CUT = ("length", LOOP)
FINISH_REASONS = (*COMPLETE, *CUT)

# How a row replaced a committed row truncated under a lower cap (its `pivot`; None: a first generation).
EXTENDED = "extended"  # continued from the truncated row's token prefix (truncated_policy=extend)
REGENERATED = "regenerated"  # generated again from scratch (truncated_policy=regenerate)
FALLBACK_REGENERATED = "fallback-regenerated"  # extend asked for, but the truncated row had no token ids
PIVOT_ACTIONS = (EXTENDED, REGENERATED, FALLBACK_REGENERATED)
# Not a pivot, but recorded the same way (`pivot`, provenance `action`): a fresh sample of a runaway row
# (a truncated row whose tail loops), generated once under the same cap (runaway_policy=resample).
RESAMPLED = "resampled"

# Columns of the ledger, in order. Every ledger entry stores these for each of its rows.
LEDGER_COLUMNS = (
    "index",  # int: stable row index in the dataset
    "status",  # str: one of STATUSES
    "finish_reason",  # str | None
    "prompt_tokens",  # int (0 when unknown)
    "completion_tokens",  # int
    "reasoning_tokens",  # int
    "cut_in_reasoning",  # bool: finish_reason == length and the cap fell inside the thinking trace
    "max_tokens",  # int: the cap this row was generated under
    "run_id",  # str
    "chunk",  # int
    "attempt",  # int: HTTP attempts spent on this row
    "server",  # str: base URL of the server that produced it ("" when none)
    "latency_s",  # float: wall time of the successful request
    "category",  # str | None: dataset metadata (source/category) for breakdowns
    "error",  # str | None: last error message for failed/rejected/invalid rows
    "pivot",  # str | None: one of PIVOT_ACTIONS when the row replaced a row truncated under a lower cap; RESAMPLED
    "prefix_tokens",  # int: tokens reused from the truncated row it extends (0 unless `extended`)
    "text_joined",  # bool: an extended row whose text joins two decodings (the server had no /detokenize)
    "while_asking",  # bool: generated while the gate's question waited, at the cap it recommended (`run.while_asking`)
    "runaway_score",  # float | None: how much a truncated row's tail loops (`audit.runaway`), when it was generated
    "loop_judge",  # int: the loop judge that scored it (`audit.loop_stop.LOOP_JUDGE`); 0: an earlier rule, not trusted
    "cached_tokens",  # int | None: prompt tokens its requests found in the server's prefix cache; None: not reported
)
# Columns added after the first ledger entries were written, with the value those older entries (and
# snapshots) mean: they hold no pivot rows.
LEDGER_DEFAULTS: dict[str, Any] = {"pivot": None, "prefix_tokens": 0, "text_joined": False, "while_asking": False,
                                   "runaway_score": None, "loop_judge": 0, "cached_tokens": None}
# Columns of booleans.
BOOL_COLS = ("cut_in_reasoning", "text_joined", "while_asking")
# Columns read as floats; None (a row not judged, a count the server did not report, or an entry from before
# the column) reads as NaN. `cached_tokens` is a count: an entry holds it as an int or null.
FLOAT_COLS = ("latency_s", "runaway_score", "cached_tokens")


# Under `turns=chain`, the finish of a turn a later turn can follow: it ended on its own (a runaway never does).
CHAIN_COMPLETE = "stop"


def completes_chain_turn(status: str, finish_reason: str | None) -> bool:
    """Whether a row lets its conversation's next turn go under `turns=chain`: the one rule the plan
    (`run.plan.chain_complete`, over a ledger frame), the chunk (`generate.chain`) and the export apply."""
    return status == OK and finish_reason == CHAIN_COMPLETE


def duplicate_key(index: int, max_tokens: int, status: str, pivot: str | None) -> tuple[int, int, bool] | None:
    """The one rule for "an index committed twice under one cap": two non-failed rows with the same key are
    duplicated work. Failed rows have none (a retry after a failure is expected); a fresh sample of a
    runaway row (`RESAMPLED`) is keyed apart from the row it resamples, so one of each is expected beside
    the other, and a row at a higher cap (an extension, a measured row) has another key."""
    if status == FAILED:
        return None
    return int(index), int(max_tokens), pivot == RESAMPLED


# The columns "done" is decided from (tracegen.run.plan), read without the rest by planning and resume.
PLAN_COLUMNS = ("index", "status", "finish_reason", "max_tokens", "runaway_score", "loop_judge")


def prompt_sent(prompt_tokens: Any, prefix_tokens: Any) -> Any:
    """The prompt tokens a row's own requests sent the server to prefill, from two ledger columns (ints or
    arrays alike): its prompt, and for an extended row the response ids it kept, which its continuation sends
    after the prompt (`prefix_tokens`; 0 for any other row). What a row's requests found cached
    (`cached_tokens`) is a part of this, so sent - cached is what the server computed for it."""
    return prompt_tokens + prefix_tokens


def pack_token_ids(ids: Sequence[int]) -> str:
    """Token ids as base64 of little-endian uint32: one string, 5.3 characters an id (JSON takes about 7
    for a real vocabulary's ids, and a list per id to parse)."""
    arr = np.asarray(ids, dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() >= 1 << 32):
        raise ValueError(f"token ids must be in [0, 2**32), got one of {int(arr.min())}..{int(arr.max())}")
    return base64.b64encode(arr.astype("<u4").tobytes()).decode("ascii")


def unpack_token_ids(packed: str) -> list[int]:
    """The ids `pack_token_ids` packed."""
    try:
        raw = base64.b64decode(packed, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"packed token ids are not base64: {exc}") from None
    if len(raw) % 4:
        raise ValueError(f"packed token ids hold {len(raw)} bytes, not a multiple of 4")
    return np.frombuffer(raw, dtype="<u4").astype(np.int64).tolist()


@dataclass(slots=True)
class GeneratedRow:
    """One row of a part: the full output for one dataset index.

    `prompt_token_ids` / `response_token_ids` are what the server generated from and generated, packed
    (`pack_token_ids`; None when the server did not return them): a row truncated under a lower cap is
    continued from them (truncated_policy=extend). `provenance` says which committed row this one
    replaced and how (see `tracegen.generate.extend`); None for a first generation.
    """

    index: int
    status: str
    max_tokens: int
    run_id: str
    chunk: int
    id: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    attempt: int = 0
    server: str = ""
    latency_s: float = 0.0
    category: str | None = None
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    prompt_token_ids: str | None = None
    response_token_ids: str | None = None
    provenance: dict[str, Any] | None = None
    # Generated while the gate's question waited for its answer (`tracegen.run.while_asking`).
    while_asking: bool = False
    # A truncated row's loop score, judged once when it was generated (`audit.runaway_rows.score_of`), so
    # the reports, the resample and the export need not read its part to know; None: not judged.
    runaway_score: float | None = None
    # Which loop judge gave `runaway_score` (`audit.loop_stop.LOOP_JUDGE`): a score of an earlier rule (0) is
    # judged again, never trusted.
    loop_judge: int = 0
    # Of the `prompt_sent` tokens, those the server found in its prefix cache and did not compute again, as it
    # reported them: counted per request and summed over the row's own requests (a first generation's one; an
    # extended row's continuation, whose prompt is the original prompt plus the kept ids, so what it finds
    # cached is exactly what the prefix cache saves it; the row it extends keeps its own count). None where a
    # server did not say (`sglang.wire.cached_count`): unknown, never 0.
    cached_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"row {self.index}: status {self.status!r} is not one of {STATUSES}")
        if self.status == OK and self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"row {self.index}: ok row needs finish_reason in {FINISH_REASONS}")

    @property
    def cut_in_reasoning(self) -> bool:
        # SGLang puts everything in reasoning_content and leaves content "" when the cap
        # falls before </think>.
        return self.finish_reason == "length" and not self.content and bool(self.reasoning_content)

    @property
    def pivot(self) -> str | None:
        return self.provenance.get("action") if self.provenance else None

    @property
    def prefix_tokens(self) -> int:
        """Tokens of this row that an earlier, truncated row already generated (0 unless extended)."""
        return int(self.provenance.get("tokens_before", 0)) if self.pivot == EXTENDED else 0

    @property
    def text_joined(self) -> bool:
        """An extended row whose text was joined from two decodings, not decoded whole: where the cut fell
        inside a character, its seam holds U+FFFD (`generate.extend`)."""
        return bool(self.provenance) and self.provenance.get("text") == "joined"

    @property
    def new_tokens(self) -> int:
        """Completion tokens this row's own requests generated."""
        return self.completion_tokens - self.prefix_tokens

    @property
    def prompt_sent(self) -> int:
        """Prompt tokens this row's own requests sent the server to prefill (`prompt_sent`)."""
        return prompt_sent(self.prompt_tokens, self.prefix_tokens)

    @property
    def has_token_ids(self) -> bool:
        return self.prompt_token_ids is not None and self.response_token_ids is not None

    def ledger_values(self) -> dict[str, Any]:
        """This row's summary, keyed by LEDGER_COLUMNS."""
        return {
            "index": self.index,
            "status": self.status,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "reasoning_tokens": self.reasoning_tokens,
            "cut_in_reasoning": self.cut_in_reasoning,
            "max_tokens": self.max_tokens,
            "run_id": self.run_id,
            "chunk": self.chunk,
            "attempt": self.attempt,
            "server": self.server,
            "latency_s": round(self.latency_s, 4),
            "category": self.category,
            "error": self.error,
            "pivot": self.pivot,
            "prefix_tokens": self.prefix_tokens,
            "text_joined": self.text_joined,
            "while_asking": self.while_asking,
            "runaway_score": self.runaway_score,
            "loop_judge": self.loop_judge,
            "cached_tokens": self.cached_tokens,
        }

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GeneratedRow:
        return cls(**data)
