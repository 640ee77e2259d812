"""Whether a dataset can be used at all, judged on a sample of its prompt rows before any GPU time.

A dataset in a form tracegen does not read, or read with the wrong field names, is invalid on every row; each
chunk would record its rows invalid and finish normally, and the run would end "successful" with nothing
generated. The run's first task reads a uniform sample instead (O(sample) blocks through the index) and stops
the run when more than `max_invalid_pct` of it cannot be used, with each reason's count and three example
rows.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

import numpy as np

from tracegen.dataset.index import DatasetIndex
from tracegen.dataset.reader import InvalidRow, read_indices
from tracegen.dataset.source import DatasetError

SAMPLE_ROWS = 1000
EXAMPLES = 3
_NUMBER = re.compile(r"\d+")
# The place a reason names (which turn of which row) is the example's, not the reason's.
_WHERE = re.compile(r"^turn \d+ of row \d+: ")
_REASON_CHARS = 240


class DatasetUnusableError(DatasetError):
    """Too many of a dataset's rows cannot be used; the message counts the reasons and shows examples."""


@dataclass(frozen=True)
class SampleVerdict:
    sampled: int
    invalid: int
    reasons: list[tuple[str, int]]  # grouped reason, count; most frequent first
    examples: list[InvalidRow]

    @property
    def invalid_pct(self) -> float:
        return 100.0 * self.invalid / self.sampled if self.sampled else 0.0


def reason_kind(reason: str) -> str:
    """A reason with the numbers that differ from row to row (indices, positions) as N, so rows failing the
    same way count together."""
    return _NUMBER.sub("N", _WHERE.sub("", reason))[:_REASON_CHARS]


def sample_verdict(index: DatasetIndex, seed: int, *, size: int = SAMPLE_ROWS,
                   aws_conn_id: str = "aws_default") -> SampleVerdict:
    n = index.n_prompt_rows
    take = min(size, n)
    picked = (np.arange(n) if take == n else np.sort(np.random.default_rng(seed).choice(n, size=take, replace=False)))
    kinds: Counter[str] = Counter()
    examples: list[InvalidRow] = []
    for row in read_indices(index, picked.tolist(), aws_conn_id=aws_conn_id):
        if isinstance(row, InvalidRow):
            kinds[reason_kind(row.reason)] += 1
            if len(examples) < EXAMPLES:
                examples.append(row)
    return SampleVerdict(take, sum(kinds.values()), kinds.most_common(), examples)


def check_usable(index: DatasetIndex, max_invalid_pct: float, seed: int, *,
                 aws_conn_id: str = "aws_default") -> SampleVerdict:
    """The sample's verdict; `DatasetUnusableError` when more than `max_invalid_pct` of it is unusable."""
    verdict = sample_verdict(index, seed, aws_conn_id=aws_conn_id)
    if max_invalid_pct >= 100.0 or verdict.invalid_pct <= max_invalid_pct:
        return verdict
    reasons = "; ".join(f"{count} x {kind}" for kind, count in verdict.reasons[:8])
    more = f"; and {len(verdict.reasons) - 8} other reasons" if len(verdict.reasons) > 8 else ""
    shown = "; ".join(f"row {r.index}: {r.reason[:_REASON_CHARS]}" for r in verdict.examples)
    raise DatasetUnusableError(
        f"dataset {index.source_uri}: {verdict.invalid} of {verdict.sampled} sampled rows "
        f"({verdict.invalid_pct:.1f}%) cannot be used, more than max_invalid_pct={max_invalid_pct:g}%, read with "
        f"{index.reading.describe()}. Reasons: {reasons}{more}. Examples: {shown}. Check dataset_format, "
        "dataset_fields and turns; to generate the usable rows anyway, set max_invalid_pct to 100"
    )
