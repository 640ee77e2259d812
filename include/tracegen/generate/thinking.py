"""The chat template arguments a row is generated with: the run's `chat_template_kwargs`, with thinking turned
off for `thinking_off_pct` of the rows, chosen by their ids. A row's choice depends on its id alone, so every run,
chunk and retry of the dataset gives a row the same mode, and a drafter that serves both modes sees each prompt
in one of them."""

from __future__ import annotations

import hashlib
from typing import Any

from tracegen.config import parse_template_kwargs

# The provenance key a row's template arguments are kept under.
TEMPLATE_KWARGS = "chat_template_kwargs"


def row_unit(row_id: str) -> float:
    """A number in [0, 1) fixed by the row's id, uniform over ids."""
    digest = hashlib.blake2b(row_id.encode("utf-8", "surrogatepass"), digest_size=8, person=b"thinking").digest()
    return int.from_bytes(digest, "big") / 2.0**64


class TemplateChoice:
    """`for_row(row_id)`: the chat template arguments of that row (None: the template's defaults)."""

    def __init__(self, kwargs: dict[str, Any], thinking_off_pct: float) -> None:
        self.kwargs = dict(kwargs)
        self.off_share = thinking_off_pct / 100.0

    @classmethod
    def of_config(cls, config: Any) -> TemplateChoice:
        return cls(parse_template_kwargs(config.chat_template_kwargs), config.thinking_off_pct)

    def for_row(self, row_id: str) -> dict[str, Any] | None:
        """`row_id`: the id the row is named by (`dataset.row_ids.row_id`: its own, or index-<n>)."""
        if self.off_share > 0 and row_unit(row_id) < self.off_share:
            return {**self.kwargs, "enable_thinking": False}
        return dict(self.kwargs) or None
