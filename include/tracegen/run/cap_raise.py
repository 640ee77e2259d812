"""A mid-run pivot: an operator raises the cap of a running run from the UI, and the same run goes on.

The seed's team bumped 4096 to 8192 by killing the job, checking, and relaunching. Here the operator
triggers `tracegen_raise_cap` with the run's id and the new cap, and nothing is killed:

1. The raise is checked against the run as its first task described it (the `RunSpec` in Airflow's
   XCom, never a record read back from the output root) and against the servers' context length, then
   kept as an Airflow Variable named after the run. Airflow's metadata, not the bucket: who may raise a
   cap is who may trigger a DAG and write Variables, not whoever can write to the output root.
2. Each chunk task of the run reads it when it starts and generates at the raised cap; chunks already
   running finish at the cap they started with.
3. After the first fan-out, `ask_about_cap` turns it into the run's decision (a `CapDecision` with trigger
   `raise`), recorded in `run.json` and the report like a reviewer's answer. The second fan-out then
   generates what is left at the new cap: the rows truncated under the old cap, extended from their
   token ids (`truncated_policy=extend`; no prefix is paid for twice), and any chunk held back.

A raise is taken until the run decides (`ask_about_cap` runs); after that the raise task refuses it and
says to start a new run, which resumes from the ledger.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import asdict, dataclass, replace
from typing import Any

from tracegen.audit.review import OTHER, RAISE, CapDecision
from tracegen.config import ConfigError, rule_of
from tracegen.run.decision import max_cap
from tracegen.run.spec import RunSpec

VARIABLE_PREFIX = "tracegen_cap_raise__"


class RaiseRefused(ValueError):
    """A raise the run cannot take; the message says why and what would be accepted."""


@dataclass(frozen=True)
class CapRaise:
    """One raise of a running run's cap: by whom, when, from which cap to which."""

    run_id: str  # the tracegen run id (`RunSpec.run_id`)
    cap: int
    from_cap: int
    requested_by: str | None
    requested_at: str  # ISO 8601, UTC
    raised_in: str  # the tracegen_raise_cap run that made it, to find its log

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: Any, where: str) -> CapRaise:
        """Decode a stored raise; anything else is refused, naming `where`. Variables can be edited by
        hand, so the cap is checked by the same rule as the trigger form's."""
        if not isinstance(doc, dict):
            raise RaiseRefused(f"{where}: expected a JSON object, got {type(doc).__name__}")
        try:
            raised = cls(**doc)
        except TypeError as exc:
            raise RaiseRefused(f"{where}: {exc}") from None
        for name in ("cap", "from_cap"):
            value = getattr(raised, name)
            try:
                rule_of("max_tokens").check(name, value)
            except ConfigError as exc:
                raise RaiseRefused(f"{where}: {exc}") from None
        if not isinstance(raised.run_id, str) or not isinstance(raised.requested_at, str):
            raise RaiseRefused(f"{where}: run_id and requested_at must be strings")
        return raised

    def summary(self) -> str:
        return (f"{self.requested_by or 'unknown'} raised max_tokens {self.from_cap:,} -> {self.cap:,} at "
                f"{self.requested_at} ({self.raised_in})")


def variable_key(run_id: str) -> str:
    """The Airflow Variable holding `run_id`'s raise (run ids are already safe for keys)."""
    return VARIABLE_PREFIX + run_id


def check_raise(spec: RunSpec, cap: Any, *, context_length: int | None, earlier: CapRaise | None) -> tuple[int, int]:
    """(from_cap, cap) for a raise of `spec`'s run to `cap`, or `RaiseRefused` saying what fits.

    Only up: a lower cap is not a pivot (the rows done at the higher cap would have to be cut, and their
    real endings are what the dataset is for). A second raise goes up from the first."""
    if isinstance(cap, bool) or not isinstance(cap, int):
        raise RaiseRefused(f"max_tokens {cap!r} is not a whole number of tokens")
    current = earlier.cap if earlier is not None else spec.config.max_tokens
    if cap <= current:
        why = f"raised to {current:,} by {earlier.summary()}" if earlier else f"{current:,}"
        raise RaiseRefused(f"the run's cap is already {why}; a raise must go above it (to lower a cap, start "
                           "a new run)")
    highest = max_cap(context_length)
    if cap > highest:
        why = (f"the servers' context length is {context_length:,} tokens (prompt + completion must fit)"
               if context_length else "that is the largest max_tokens a run accepts")
        raise RaiseRefused(f"max_tokens {cap:,} is too large: {why}; enter at most {highest:,}")
    return current, cap


def encode(raised: CapRaise) -> str:
    return json.dumps(raised.to_json())


def decode(text: str | None, run_id: str) -> CapRaise | None:
    """The raise stored for `run_id`, or None; a malformed one is refused, naming the Variable."""
    if text in (None, ""):
        return None
    where = f"Airflow Variable {variable_key(run_id)}"
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RaiseRefused(f"{where}: not JSON ({exc})") from None
    raised = CapRaise.from_json(doc, where)
    if raised.run_id != run_id:
        raise RaiseRefused(f"{where}: names run {raised.run_id!r}, not {run_id!r}")
    return raised


def at_raised_cap(spec: RunSpec, raised: CapRaise | None) -> RunSpec:
    """The run a chunk task generates for: at the raised cap when a raise above the run's cap is in.

    Not recorded: the run's record takes the raise once, as a decision, when the run decides. The gate
    stays as configured: the continuous gate judges the raised cap like any other."""
    if raised is None or raised.cap <= spec.config.max_tokens:
        return spec
    return replace(spec, config=replace(spec.config, max_tokens=raised.cap))


def as_decision(spec: RunSpec, raised: CapRaise) -> CapDecision:
    """The raise as the run's decision: recorded in `run.json` and the report like a reviewer's answer."""
    return CapDecision(
        trigger=RAISE, option=f"Raised to {raised.cap:,} while running", kind=OTHER, from_cap=spec.config.max_tokens,
        cap=raised.cap, responded_by=raised.requested_by, responded_at=raised.requested_at, timed_out=False,
        verdict={}, cap_rows=[], report_uri="",
    )


def now_iso() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
