"""Per-server in-flight auto-tuning: keep each SGLang server's batch full and a small queue behind it.

A fixed client concurrency is a guess, and guesses are often several times too low (slots idle) or
far too high (a deep queue that only adds latency and loses more work on a crash). The tuner reads
what each server reports — running vs max running requests, queued requests, throughput — and sets
the client's in-flight limit for that server. `decide` is the whole policy, a pure function of one
observation; `Autotuner` polls the servers and applies it through `ServerPool.set_limit`.

The target is "every slot running, plus a queue of `headroom` x max-running waiting": the queue
covers finishes between two polls and the tails of other clients (another chunk task) sharing the
server, so the GPU never waits for a client round-trip.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tracegen.sglang.http import HttpFailure

if TYPE_CHECKING:
    from tracegen.sglang.routing import ServerPool, ServerState

log = logging.getLogger(__name__)
SUMMARY_INTERVAL_S = 60.0  # at most one info line per server this often; every change is at debug level


@dataclass(frozen=True, slots=True)
class TunePolicy:
    """Bounds and aggressiveness of the tuner."""

    floor: int = 1
    ceiling: int = 1024
    # Queue kept behind a full batch, as a fraction of max running requests. A queue costs the GPU nothing
    # and covers other chunk tasks starting up or draining, so it is a whole batch deep.
    headroom: float = 1.0
    # Shrink only when the queue exceeds `shrink_at` x the target queue: hysteresis against flapping.
    shrink_at: float = 2.0
    # Seconds between polls of one server.
    interval_s: float = 1.0

    def __post_init__(self) -> None:
        if type(self.floor) is not int or self.floor < 1:
            raise ValueError(f"floor must be an integer >= 1, got {self.floor!r}")
        if type(self.ceiling) is not int or self.ceiling < self.floor:
            raise ValueError(f"ceiling must be an integer >= floor ({self.floor}), got {self.ceiling!r}")
        if not (isinstance(self.headroom, int | float) and 0 <= self.headroom <= 10):
            raise ValueError(f"headroom must be a number in [0, 10], got {self.headroom!r}")
        if not (isinstance(self.shrink_at, int | float) and self.shrink_at > 1):
            raise ValueError(f"shrink_at must be a number > 1, got {self.shrink_at!r}")
        if not (isinstance(self.interval_s, int | float) and self.interval_s > 0):
            raise ValueError(f"interval_s must be a positive number, got {self.interval_s!r}")


@dataclass(frozen=True, slots=True)
class Observation:
    """One poll of one server, from this client's point of view."""

    running: int  # sglang:num_running_reqs (all clients)
    queued: int  # sglang:num_queue_reqs (all clients)
    max_running: int | None  # --max-running-requests from /server_info; None when the server does not say
    own_in_flight: int  # this client's requests outstanding on the server now
    limit: int  # this client's current in-flight limit for the server
    throughput: float | None = None  # sglang:gen_throughput, tokens/s (logged, not used for decisions)

    def __post_init__(self) -> None:
        for name in ("running", "queued", "own_in_flight", "limit"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if self.max_running is not None and (type(self.max_running) is not int or self.max_running < 1):
            raise ValueError(f"max_running must be an integer >= 1 or None, got {self.max_running!r}")


def next_limit(obs: Observation, policy: TunePolicy = TunePolicy()) -> int:
    """The new in-flight limit for one server after observation `obs`.

    - Queue empty and batch not full while this client uses its whole limit: the server is under-fed
      by us. Jump to what would fill it (max running minus running, plus the target queue), at least
      doubling, so a bad default is fixed in one or two polls.
    - Queue far above the target: the server is over-fed; give back this client's share of the excess
      (several clients on one server each shrink in proportion to what they hold), once: while the
      client still holds more than its limit the cut has not taken effect, and it holds.
    - Otherwise hold. In particular a client in its tail (fewer requests than its limit) never grows:
      it has nothing more to send.
    A queue with a batch below max running means the server is limited by KV memory, not slots; the
    queue rule handles it the same way (the server is saturated).
    """
    limit = min(max(obs.limit, policy.floor), policy.ceiling)
    # Target queue: a fraction of the batch; without a known batch size, of what is running.
    basis = obs.max_running if obs.max_running is not None else max(obs.running, 1)
    target_queue = math.ceil(policy.headroom * basis)
    limit_bound = obs.own_in_flight >= limit
    batch_full = obs.max_running is not None and obs.running >= obs.max_running
    if obs.queued == 0 and not batch_full:
        if not limit_bound:
            return limit
        if obs.max_running is not None:
            deficit = obs.max_running - obs.running
            wanted = limit + deficit + target_queue
        else:
            wanted = limit * 2
        return min(policy.ceiling, max(wanted, limit * 2))
    if obs.queued < target_queue and limit_bound:
        # Batch full but the queue is thinner than the target: top it up (other clients' tails).
        return min(policy.ceiling, limit + (target_queue - obs.queued))
    if obs.queued > policy.shrink_at * max(target_queue, 1):
        if obs.own_in_flight > limit:
            # An earlier cut has not drained yet: the queue still holds requests sent before it, and
            # cutting again on every poll would drive every client sharing the server to the floor.
            return limit
        outstanding = max(obs.running + obs.queued, 1)
        share = min(1.0, obs.own_in_flight / outstanding)
        excess = obs.queued - target_queue
        return max(policy.floor, obs.own_in_flight - math.ceil(excess * share))
    return limit


# ---- applying the policy to live servers ---------------------------------------------------------


_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> dict[str, float]:
    """SGLang's Prometheus text → {metric name: value} for its gauges and counters.

    Series of one name are summed over their labels (one server reports one model; a dp-size > 1 server
    reports one series per data-parallel rank, whose running requests add up). With
    --enable-priority-scheduling SGLang reports each gauge twice over: the total under priority="" and one
    series per priority beside it; only the totals count, or the tuner would see every request twice.
    """
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        name, _, labels = name_part.partition("{")
        name = name.strip()
        if not name or name.endswith(("_bucket", "_sum", "_count")):
            continue
        if labels and dict(_LABEL.findall(labels)).get("priority", "") != "":
            continue
        try:
            values[name] = values.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return values


class Autotuner:
    """Polls every server of a pool and sets its in-flight limit with `decide`. One task per server."""

    def __init__(
        self,
        pool: ServerPool,
        policy: TunePolicy,
        *,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.pool = pool
        self.policy = policy
        self.on_change = on_change
        self.history: list[dict[str, Any]] = []  # (bounded) decisions, for logs, tests and the benchmark
        self._tasks: list[asyncio.Task[None]] = []
        self._summary: dict[str, dict[str, float]] = {}  # per server: last summary line, changes since

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._loop(s), name=f"autotune {s.shown_url}") for s in self.pool.servers]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    async def observe(self, server: ServerState, max_running: int | None) -> Observation | None:
        """One poll: /metrics gauges (SGLang names). None when the server has no /metrics."""
        reply = await server.http.get("/metrics", timeout=10.0)
        if reply.status_code != 200:
            return None
        m = parse_metrics(reply.text)
        if "sglang:num_running_reqs" not in m:
            return None
        return Observation(
            running=int(m["sglang:num_running_reqs"]),
            queued=int(m.get("sglang:num_queue_reqs", 0)),
            max_running=max_running,
            own_in_flight=server.in_flight,
            limit=server.limit,
            throughput=m.get("sglang:gen_throughput"),
        )

    async def _max_running(self, server: ServerState) -> int | None:
        """The server's batch size: --max-running-requests as its start-up resolved it (null when SGLang
        sizes the batch from KV memory), else the size its scheduler settled on, per data-parallel rank."""
        try:
            info = (await server.http.get("/server_info", timeout=10.0)).json()
        except (HttpFailure, ValueError):
            return None
        if not isinstance(info, dict):
            return None
        value = info.get("max_running_requests")
        states = info.get("internal_states")
        if value is None and isinstance(states, list) and states and isinstance(states[0], dict):
            per_rank = [s.get("effective_max_running_requests_per_dp") for s in states if isinstance(s, dict)]
            if all(type(v) is int for v in per_rank):
                value = sum(per_rank)
        return value if type(value) is int and value >= 1 else None

    def _summarise(self, server: ServerState, new: int, obs: Observation) -> None:
        """The task log leads with generation progress: each limit change is a debug line (one a second
        while the limit settles), and at most one info line per server per SUMMARY_INTERVAL_S sums them up."""
        now = time.monotonic()
        state = self._summary.setdefault(server.url, {"at": float("-inf"), "changes": 0})
        state["changes"] += 1
        if now - state["at"] >= SUMMARY_INTERVAL_S:
            log.info("autotune %s: in-flight limit now %d (%d changes since the last summary; running %d/%s, "
                     "queued %d)", server.shown_url, new, state["changes"], obs.running, obs.max_running, obs.queued)
            state["at"], state["changes"] = now, 0

    async def _loop(self, server: ServerState) -> None:
        max_running = await self._max_running(server)
        while True:
            try:
                obs = await self.observe(server, max_running)
            except (HttpFailure, ValueError) as exc:
                obs = None
                log.debug("autotune %s: poll failed: %s", server.shown_url, exc)
            else:
                if obs is None:
                    log.warning(
                        "autotune %s: no /metrics (start SGLang with --enable-metrics); keeping "
                        "the fixed limit %d",
                        server.shown_url,
                        server.limit,
                    )
                    return
            pause = self.policy.interval_s
            if obs is not None and not server.quarantined:
                new = next_limit(obs, self.policy)
                if new != server.limit:
                    self._summarise(server, new, obs)
                    log.debug(
                        "autotune %s: in-flight limit %d -> %d (running %d/%s, queued %d)",
                        server.shown_url,
                        server.limit,
                        new,
                        obs.running,
                        obs.max_running,
                        obs.queued,
                    )
                    self.pool.set_limit(server, new)
                    if self.on_change is not None:
                        self.on_change()
                    # Look again soon after a change: a bad start converges in a fraction of an interval.
                    pause = self.policy.interval_s / 4
                if len(self.history) < 10_000:
                    self.history.append(
                        {
                            "t": time.monotonic(),
                            "url": server.shown_url,
                            "running": obs.running,
                            "queued": obs.queued,
                            "limit": new,
                            "throughput": obs.throughput,
                        }
                    )
            await asyncio.sleep(pause)


class InFlightLimit:
    """An asyncio semaphore whose size can change while tasks wait on it (the chunk engine's row gate).

    Shrinking never cancels anything: holders above the new limit finish, and new acquirers wait until
    the count is below it again.
    """

    def __init__(self, limit: int) -> None:
        if type(limit) is not int or limit < 1:
            raise ValueError(f"limit must be an integer >= 1, got {limit!r}")
        self.limit = limit
        self.used = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    async def acquire(self) -> None:
        while self.used >= self.limit:
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    self._wake()  # pass on a wake-up this cancelled waiter received
                raise
        self.used += 1

    def release(self) -> None:
        self.used -= 1
        self._wake()

    def set_limit(self, limit: int) -> None:
        self.limit = max(1, int(limit))
        self._wake()

    def _wake(self) -> None:
        free = self.limit - self.used
        while free > 0 and self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                free -= 1
