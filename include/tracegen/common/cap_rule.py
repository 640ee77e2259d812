"""The one rule for a completion cap (`max_tokens`), wherever the number comes from.

A cap reaches a run from people and from Airflow's metadata: the trigger form (`RunConfig`, `params`), the
servers' context length once they are up (`RunConfig.check_context_length`), the reviewer's answer to the
gate's question (`audit.cap_question`, `review_gate`), an operator's raise of a running run and a raise read
back from its Variable (`run.cap_raise`, `steps.raise_cap`). Every one of them is checked here, by
`check_cap`, and refused with the wording written here, once:

- a cap is an integer (a bool is not), compared as an integer: 10**400 is too large, not an
  OverflowError from a float conversion;
- at least 1, and at most the largest max_tokens a run accepts (`HIGHEST`);
- below the servers' context length: a prompt needs at least one token of it;
- above the run's current cap, when the run has one: a lower cap would cut rows already done at the
  current one, and staying at it is not a new cap (the question has its own option for that, and stop).

`whole_number` reads a number a person typed (a JSON number of either kind, or digits in a string) into
that integer first; the rule itself takes integers only.

Imports nothing from the package: every layer may use it (`config` is built on it).
"""

from __future__ import annotations

from typing import Any

LOWEST = 1
HIGHEST = 1_048_576  # the largest max_tokens a run accepts (the trigger form's maximum)
_MAX_TYPED_CHARS = 64  # a typed cap longer than this is not read as a number


class CapRefused(ValueError):
    """A cap the run cannot take; the message names the value, why, and what would be accepted."""


def highest_cap(context_length: int | None) -> int:
    """The highest cap a run may take: below the servers' context length (when known), within `HIGHEST`."""
    return min(HIGHEST, context_length - 1) if context_length else HIGHEST


def lowest_cap(current: int | None) -> int:
    """The lowest cap a run at `current` may take: above it (1 without a current cap)."""
    return LOWEST if current is None else max(LOWEST, current + 1)


def shown(value: Any) -> str:
    """A value as a refusal shows it: integers with thousands separators (a huge one by its size, as its
    digits would drown the message), anything else as its short repr."""
    if isinstance(value, int) and not isinstance(value, bool):
        if abs(value).bit_length() > 64:
            return f"of about {int(abs(value).bit_length() * 0.30103) + 1:,} digits"
        return f"{value:,}"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def whole_number(value: Any, *, name: str = "max_tokens") -> int:
    """A typed cap as an integer: an int, an integral float, or a string of one; `CapRefused` otherwise.
    No float is ever compared: an integral float becomes its exact integer, digits are read as an int."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise CapRefused(f"{name} {shown(value)} is not a whole number of tokens")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        text = value.strip()
        if len(text) > _MAX_TYPED_CHARS:
            raise CapRefused(f"{name} {shown(value)} is not a whole number of tokens")
        try:
            return int(text)
        except ValueError:
            pass
        try:
            number = float(text)
        except ValueError:
            raise CapRefused(f"{name} {shown(value)} is not a whole number of tokens") from None
    else:
        number = value
    if number != number or number in (float("inf"), float("-inf")) or not number.is_integer():
        raise CapRefused(f"{name} {shown(value)} is not a whole number of tokens")
    return int(number)


def check_cap(
    value: Any,
    *,
    name: str = "max_tokens",
    current: int | None = None,
    current_is: str | None = None,
    context_length: int | None = None,
    hint: str = "",
) -> int:
    """`value` as a cap a run may take, or `CapRefused` saying why and what fits.

    `current`: the run's cap, when a new one must go above it (`current_is` says how it got there, e.g.
    "raised to 8,192 by alice"); `context_length`: the servers', when known. `hint` is what the caller
    offers instead of going above the current cap (the question's options, a new run)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise CapRefused(f"{name} {shown(value)} is not a whole number of tokens")
    if value < LOWEST:
        raise CapRefused(f"{name} {shown(value)} is below {LOWEST} token")
    highest = highest_cap(context_length)
    if value > highest:
        why = (f"the servers' context length is {context_length:,} tokens (prompt + completion must fit)"
               if highest < HIGHEST else f"{HIGHEST:,} is the largest max_tokens a run accepts")
        raise CapRefused(f"{name} {shown(value)} is too large: {why}; enter at most {highest:,}")
    if current is not None and value <= current:
        raise CapRefused(f"{name} {shown(value)} is refused: the run's cap is already {current_is or shown(current)}; "
                         "a new cap must go above it (a lower one would cut rows already done at that cap)"
                         + (f"; {hint}" if hint else ""))
    return value
