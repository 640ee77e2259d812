"""How a dataset's rows become prompt rows: which input form a row is in, which of its fields hold what, and
which assistant turns of a conversation are generated (`turns`).

A `Reading` is part of what an output root's row indices mean: under `turns=each` (or `chain`) row 7 may be the second
turn of conversation 3, under `last` it is conversation 7. So it is recorded in the stored index, and a run
that would read the same file another way is refused by the root (`dataset.stored.bind_index`) instead of
pairing committed completions with other prompts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from tracegen.config import (
    DATASET_FORMATS,
    TURN_MODES,
    ConfigError,
    RunConfig,
    check_field_map,
    parse_field_map,
)

# The input forms a row may be in. `auto` tells them apart per row by the field it holds.
MESSAGES, SHAREGPT, PROMPT = "messages", "sharegpt", "prompt"
AUTO = "auto"
FORMS = tuple(f for f in DATASET_FORMATS if f != AUTO)

# Which assistant turns of a conversation are generated.
LAST, FIRST, EACH, CHAIN = TURN_MODES

# The field each form is known by.
FORM_FIELD = {MESSAGES: "messages", SHAREGPT: "conversations", PROMPT: "prompt"}


class ReadingError(ValueError):
    """A reading that cannot be applied (an unknown form, turn mode or field); the message names it."""


@dataclass(frozen=True)
class Reading:
    """One way of reading a dataset's rows: its form (`auto` per row), the field mapping, the turn mode."""

    form: str = AUTO
    fields: dict[str, str] = field(default_factory=dict)
    turns: str = LAST

    def __post_init__(self) -> None:
        if self.form not in DATASET_FORMATS:
            raise ReadingError(f"dataset_format {self.form!r} is not one of {list(DATASET_FORMATS)}")
        if self.turns not in TURN_MODES:
            raise ReadingError(f"turns {self.turns!r} is not one of {list(TURN_MODES)}")
        try:
            check_field_map(self.fields)
        except ConfigError as exc:
            raise ReadingError(str(exc)) from None

    @classmethod
    def of(cls, config: RunConfig) -> Reading:
        """The reading a run's params name (checked there already, by `RunConfig`)."""
        return cls(form=config.dataset_format, fields=parse_field_map(config.dataset_fields), turns=config.turns)

    @property
    def expands(self) -> bool:
        """Whether one conversation may become several prompt rows (then the index holds each one's turns)."""
        return self.turns in (EACH, CHAIN)

    @property
    def chained(self) -> bool:
        """Whether a conversation's turns are generated in order, each after the model's own earlier answers
        (`dataset.turns`): its prompt rows are one unit for the plan and the chunk."""
        return self.turns == CHAIN

    def to_json(self) -> dict[str, Any]:
        return {"form": self.form, "fields": dict(sorted(self.fields.items())), "turns": self.turns}

    @classmethod
    def from_json(cls, data: Any) -> Reading:
        """A stored reading; an index stored before readings were recorded (None) was read as the default."""
        if data is None:
            return cls()
        if not isinstance(data, dict):
            raise ReadingError(f"a reading must be an object, got {type(data).__name__}")
        return cls(form=data.get("form", AUTO), fields=dict(data.get("fields") or {}), turns=data.get("turns", LAST))

    def describe(self) -> str:
        mapped = f", fields {json.dumps(self.fields, sort_keys=True)}" if self.fields else ""
        return f"dataset_format={self.form}, turns={self.turns}{mapped}"
