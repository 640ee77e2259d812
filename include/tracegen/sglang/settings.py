"""What an SGLang client is configured with: the sampling params of a run's requests, and the timeouts,
retry budget and quarantine policy of the client itself. Routing and the client both read these."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")


@dataclass(frozen=True, slots=True)
class Sampling:
    """Sampling parameters sent with every row of a run: the run's validated `RunConfig` values, so not
    checked again here."""

    max_tokens: int
    temperature: float = 0.6
    top_p: float = 0.95
    seed: int | None = None
    top_k: int = 20  # 0: no top-k (SGLang's -1)
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    def params(self) -> dict[str, Any]:
        """The sampling params both routes take under these names, every one explicit (see RunConfig.top_k)."""
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k or -1,
                "min_p": self.min_p, "repetition_penalty": self.repetition_penalty}

    @classmethod
    def of_config(cls, config: Any, max_tokens: int | None = None) -> Sampling:
        """A run's sampling (`RunConfig` or anything with its fields), under its cap unless told another."""
        from tracegen.config import SAMPLING_FIELDS

        return cls(max_tokens=config.max_tokens if max_tokens is None else max_tokens,
                   **{name: getattr(config, name) for name in SAMPLING_FIELDS})


ROUTINGS = ("prefix", "least_outstanding")


@dataclass(frozen=True, slots=True)
class ClientConfig:
    """Timeouts, retry budget and quarantine policy. Defaults are for 8K-token generations on a busy GPU."""

    # A client timeout makes SGLang abort the request and throw the GPU work away, so this is sized for an
    # 8192-token completion at a slow ~10 tok/s under a full batch, plus queueing: generous on purpose.
    # The idle read timeout: an attempt fails once the server has sent nothing for this long.
    request_deadline_s: float = 1800.0
    # The total deadline of one attempt, however the server keeps the connection busy (a body trickled a byte at a
    # time, endless `100 Continue` heads, keep-alive comments, a body never ended): None, twice the idle timeout,
    # the longest a whole answer (nothing sent until it is done) may take and still finish.
    attempt_deadline_s: float | None = None
    connect_timeout_s: float = 10.0
    # HTTP attempts per row before it is recorded `failed` (a later run retries it).
    max_attempts: int = 6
    backoff_base_s: float = 1.0
    backoff_max_s: float = 60.0
    # Consecutive failures (connect errors, timeouts, 5xx, aborts, malformed bodies) before quarantine.
    quarantine_after: int = 3
    probe_interval_s: float = 5.0
    probe_timeout_s: float = 60.0
    # Every server quarantined for this long -> FatalClientError: the fleet is gone, stop the chunk.
    all_down_fatal_s: float = 900.0
    # Seed for the backoff jitter (tests); None = fresh randomness.
    jitter_seed: int | None = None
    # Autotune hook (tracegen.sglang.autotune): adjust each server's in-flight limit from its /metrics, starting
    # from the endpoint's max_in_flight and staying within [1, autotune_ceiling]. False: the limit is fixed.
    autotune: bool = False
    autotune_interval_s: float = 1.0
    autotune_ceiling: int = 1024
    # Which server a request goes to (tracegen.sglang.routing): "prefix" sends a conversation's prompts where
    # its earlier ones went, so the server's radix cache holds their shared prefix, within `routing_load_factor`
    # times the fleet's average load (tracegen.sglang.affinity); "least_outstanding" to the server with the
    # fewest requests in flight, wherever the prompt's prefix is cached. A chunk chooses by its dataset's reading
    # (`generate.engine`): prompts that share a conversation's prefix (turns=each) go by prefix.
    routing: str = "least_outstanding"
    routing_load_factor: float = 1.25
    # Requests a prefix's server may carry past the least loaded server, and past its own in-flight limit, as a
    # share of the fleet's mean limit (the limit is a batch and a queue: 1.5 lets a server queue half a batch more).
    routing_load_slack: float = 1.5

    def __post_init__(self) -> None:
        for name in (
            "request_deadline_s",
            "connect_timeout_s",
            "backoff_base_s",
            "backoff_max_s",
            "probe_interval_s",
            "probe_timeout_s",
            "all_down_fatal_s",
            "autotune_interval_s",
        ):
            _positive(name, getattr(self, name))
        if self.attempt_deadline_s is not None:
            _positive("attempt_deadline_s", self.attempt_deadline_s)
        for name in ("max_attempts", "quarantine_after", "autotune_ceiling"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, got {self.routing!r}")
        if not self.routing_load_factor >= 1:
            raise ValueError(f"routing_load_factor must be >= 1, got {self.routing_load_factor!r}")
        if not self.routing_load_slack >= 0:
            raise ValueError(f"routing_load_slack must be >= 0, got {self.routing_load_slack!r}")
        if self.backoff_max_s < self.backoff_base_s:
            raise ValueError(
                f"backoff_max_s ({self.backoff_max_s}) must be >= backoff_base_s ({self.backoff_base_s})"
            )

    @property
    def attempt_deadline(self) -> float:
        """Seconds one attempt may take in all (`attempt_deadline_s`, or twice the idle read timeout)."""
        return 2.0 * self.request_deadline_s if self.attempt_deadline_s is None else self.attempt_deadline_s
