"""The shapes that cross module boundaries: one generated row, and its ledger summary.

A *part* holds full rows (text included); its *ledger entry* holds only the small per-row
summary below. Audits, status, planning and resume read ledger entries only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# Row status values.
OK = "ok"  # the server returned a completion (finish_reason says whether it was cut)
FAILED = "failed"  # transient failures exhausted the retries: a later run should try again
REJECTED = "rejected"  # permanent for this cap (e.g. context overflow): recorded once, not retried
INVALID = "invalid"  # the dataset row itself is malformed: nothing to generate
STATUSES = (OK, FAILED, REJECTED, INVALID)

# finish_reason values of a completion: it ended by itself (COMPLETE), or at the cap ("length"). SGLang also
# reports `abort`, which is not a completion and never reaches the ledger: the client retries it.
COMPLETE = ("stop", "tool_calls")
FINISH_REASONS = (*COMPLETE, "length")

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
)
# The columns "done" is decided from (tracegen.plan), read without the rest by planning and resume.
PLAN_COLUMNS = ("index", "status", "finish_reason", "max_tokens")


@dataclass(slots=True)
class GeneratedRow:
    """One row of a part: the full output for one dataset index."""

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
        }

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GeneratedRow:
        return cls(**data)
