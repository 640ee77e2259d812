"""Fault injection for the stand-in: what can go wrong with a real SGLang server, on demand.

Settings come from `--sim-*` flags at launch and can be changed at run time through
`POST /sim/faults`. Every random decision uses one seeded RNG, so a test that sends the same
requests in the same order sees the same faults.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, fields
from typing import Any

# What happens to one generation request, decided when it arrives.
PASS = "pass"
ERROR = "error"  # answer at once with `error_status`
DROP = "drop"  # close the socket without a response
HANG = "hang"  # never answer
ABORT = "abort"  # generate part of it, then finish with finish_reason "abort"
CRASH = "crash"  # the process exits


@dataclass(slots=True)
class FaultConfig:
    """Fault settings. Rates are per generation request, in [0, 1]; counts are requests."""

    error_rate: float = 0.0
    error_status: int = 500
    drop_rate: float = 0.0
    hang_rate: float = 0.0
    abort_rate: float = 0.0
    crash_after: int | None = None  # exit when this many more generation requests have arrived
    wedge_after: int | None = None  # wedge when this many more generation requests have arrived
    wedged: bool = False  # no more tokens are produced; /health still answers 200
    slow_start_s: float = (
        0.0  # /health answers 503 for this many (wall) seconds from start or from the update
    )
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("error_rate", "drop_rate", "hang_rate", "abort_rate"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
        total = self.error_rate + self.drop_rate + self.hang_rate + self.abort_rate
        if total > 1.0 + 1e-9:
            raise ValueError(f"error_rate + drop_rate + hang_rate + abort_rate must be <= 1, got {total:g}")
        if (
            isinstance(self.error_status, bool)
            or not isinstance(self.error_status, int)
            or not (500 <= self.error_status <= 599)
        ):
            raise ValueError(f"error_status must be a 5xx status code, got {self.error_status!r}")
        for name in ("crash_after", "wedge_after"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be a non-negative integer or null, got {value!r}")
        if not isinstance(self.wedged, bool):
            raise ValueError(f"wedged must be true or false, got {self.wedged!r}")
        if (
            isinstance(self.slow_start_s, bool)
            or not isinstance(self.slow_start_s, int | float)
            or self.slow_start_s < 0
        ):
            raise ValueError(f"slow_start_s must be a number >= 0, got {self.slow_start_s!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")

    def updated(self, changes: dict[str, Any]) -> FaultConfig:
        """A copy with `changes` applied; unknown keys are an error naming them."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ValueError(f"unknown fault setting(s) {unknown}; known: {sorted(known)}")
        return FaultConfig(**{**asdict(self), **changes})

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class FaultInjector:
    """Decides the fate of each generation request from the current FaultConfig."""

    def __init__(self, config: FaultConfig) -> None:
        self.config = config
        self.rng = random.Random(config.seed)
        self.requests_seen = 0
        self._crash_at: int | None = None
        self._wedge_at: int | None = None
        self._arm_counters()

    def update(self, changes: dict[str, Any]) -> FaultConfig:
        new = self.config.updated(changes)
        if "seed" in changes:
            self.rng = random.Random(new.seed)
        self.config = new
        self._arm_counters(only=set(changes))
        return new

    def _arm_counters(self, only: set[str] | None = None) -> None:
        # Counts are "from now": set at launch they count from the first request, set at run time
        # they count from the update.
        if only is None or "crash_after" in only:
            c = self.config.crash_after
            self._crash_at = None if c is None else self.requests_seen + c
        if only is None or "wedge_after" in only:
            w = self.config.wedge_after
            self._wedge_at = None if w is None else self.requests_seen + w

    def decide(self) -> str:
        """The fault (or PASS) for the next generation request. Also applies wedge_after."""
        self.requests_seen += 1
        if self._crash_at is not None and self.requests_seen > self._crash_at:
            return CRASH
        if self._wedge_at is not None and self.requests_seen > self._wedge_at and not self.config.wedged:
            self.config = self.config.updated({"wedged": True})
        c = self.config
        if not (c.error_rate or c.drop_rate or c.hang_rate or c.abort_rate):
            return PASS
        u = self.rng.random()
        for outcome, rate in (
            (ERROR, c.error_rate),
            (DROP, c.drop_rate),
            (HANG, c.hang_rate),
            (ABORT, c.abort_rate),
        ):
            if u < rate:
                return outcome
            u -= rate
        return PASS

    def abort_fraction(self) -> float:
        """How far an ABORT-fated request gets before it is aborted (share of its tokens)."""
        return self.rng.random()
