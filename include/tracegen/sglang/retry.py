"""What to do after a failed SGLang request: the failure kinds, which HTTP statuses fall in each, and
how long to back off before the next attempt.

Three kinds, because they cost differently:
- transient (5xx, dropped connections, timeouts, `abort`, malformed bodies): try again, maybe elsewhere;
- rejected (400 context overflow and other 4xx about the request itself): permanent for this row and
  cap, recorded once — retrying would only burn GPU time on a guaranteed error;
- fatal (401, 403, 404, every server gone): a configuration problem. Every row would fail the same
  way, so the chunk must stop with a message a person can act on instead of marking rows failed.
"""

from __future__ import annotations

import random

TRANSIENT = "transient"
REJECTED = "rejected"
FATAL = "fatal"

# 408 and 429 say "not now", not "never"; 401/403/404 mean the URL or key is wrong for every row.
_TRANSIENT_4XX = frozenset({408, 409, 425, 429})
_FATAL_4XX = frozenset({401, 403, 404, 405})


class FatalClientError(RuntimeError):
    """A configuration problem (bad api key, wrong URL, no reachable server): stop the chunk."""


class TransientError(Exception):
    """One attempt failed in a way another attempt (maybe on another server) can fix."""

    def __init__(self, message: str, *, server_fault: bool = True) -> None:
        super().__init__(message)
        # Whether this failure says something about the server's health (counts towards quarantine).
        self.server_fault = server_fault


def classify_status(status: int) -> str:
    """The failure kind of a non-200 HTTP status from /v1/chat/completions."""
    if status >= 500 or status in _TRANSIENT_4XX:
        return TRANSIENT
    if status in _FATAL_4XX or status < 200 or 300 <= status < 400:
        # 1xx/3xx: something that is not SGLang (a proxy, a redirect to a login page) sits at that URL.
        return FATAL
    return REJECTED


def backoff_delay(attempt: int, base_s: float, cap_s: float, rng: random.Random) -> float:
    """Seconds to wait after failed attempt number `attempt` (1-based): exponential, capped, jittered.

    Half fixed, half random ("equal jitter"): the fixed half guarantees a real pause after a burst of
    failures, the random half spreads the hundreds of requests that failed together (a crashed server)
    so they do not hit the surviving servers in one wave. Not a tenacity wait: its jitter is added to the
    exponential (`wait_exponential_jitter`) rather than half of it, and it draws from the global `random`
    where this draws from the client's seeded `rng` (`jitter_seed`); the request loop also moves to another
    server between attempts.
    """
    if attempt < 1:
        raise ValueError(f"attempt must be >= 1, got {attempt}")
    ceiling = min(cap_s, base_s * (2.0 ** min(attempt - 1, 30)))
    return ceiling / 2.0 + rng.uniform(0.0, ceiling / 2.0)
