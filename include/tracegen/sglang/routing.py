"""Which SGLang server gets the next request.

Each server has an in-flight limit; a request goes to a healthy server with room: with `routing="prefix"`
(a chunk of a conversation's turns) and a prefix key, the server its prefix prefers within the load bound (`affinity.PrefixRing`),
else the one with the fewest outstanding requests. A server that keeps failing (connect errors, timeouts, 5xx) or that stops producing
completions while `/health` still says 200 (wedged) is quarantined: it gets no new requests, and a
background probe brings it back only once `/health` answers 200 AND a 1-token completion finishes —
health alone lies both ways on SGLang. When every server has been quarantined for too long the pool
raises `FatalClientError`, so a chunk stops instead of waiting forever on a dead fleet.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from tracegen.common.locations import shown_location
from tracegen.common.tls import tls_for
from tracegen.sglang.affinity import PrefixRing
from tracegen.sglang.http import HttpFailure, HttpTimeout, ServerHttp
from tracegen.sglang.retry import FatalClientError
from tracegen.sglang.settings import ClientConfig
from tracegen.sglang.wire import PATH, MalformedResponse, parse_completion

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ServerEndpoint:
    """One SGLang server as the client sees it (one per GPU, possibly through an SSH tunnel)."""

    url: str
    api_key: str | None = field(default=None, repr=False)
    # Sized like SGLang's --max-running-requests (plus a little queue): more only waits in SGLang's queue,
    # fewer leaves GPU slots idle.
    max_in_flight: int = 64
    # What the ledger records as the row's server: a stable identity such as "gpu-host-3:gpu5". The URL
    # alone can be a per-task SSH tunnel port that means nothing after the task ends.
    name: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url.startswith(("http://", "https://")):
            raise ValueError(f"server url must start with http:// or https://, got {shown_location(self.url)!r}")
        if "?" in self.url or "#" in self.url:
            raise ValueError(f"server url must be a base URL without query or fragment, got "
                             f"{shown_location(self.url)!r}")
        object.__setattr__(self, "url", self.url.rstrip("/"))
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key.strip()):
            raise ValueError(f"api_key for {shown_location(self.url)} must be a non-empty string or None")
        if type(self.max_in_flight) is not int or self.max_in_flight < 1:
            raise ValueError(f"max_in_flight for {shown_location(self.url)} must be an integer >= 1, got "
                             f"{self.max_in_flight!r}")


def _headers(endpoint: ServerEndpoint) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    if endpoint.api_key:
        headers["Authorization"] = f"Bearer {endpoint.api_key}"
    return headers


class ServerState:
    """Live routing state of one server. Mutated only from the event loop thread."""

    __slots__ = (
        "endpoint",
        "url",
        "shown_url",
        "name",
        "http",
        "headers",
        "max_in_flight",
        "limit",
        "in_flight",
        "consecutive_failures",
        "quarantined",
        "quarantined_since",
        "reason",
        "last_completion",
        "tasks",
        "probe_task",
        "sent",
        "completed",
        "failures",
        "quarantines",
    )

    def __init__(self, endpoint: ServerEndpoint, config: ClientConfig) -> None:
        self.endpoint = endpoint
        self.url = endpoint.url
        # What logs, errors and the ledger's `server` column show: the URL without any credentials in it.
        self.shown_url = shown_location(endpoint.url)
        self.name = endpoint.name or self.shown_url
        self.headers = _headers(endpoint)
        # Every request to this server: a row's generation, probes, aborts, /metrics.
        self.http = ServerHttp(
            endpoint.url, headers=self.headers, tls=tls_for(endpoint.url), connect_timeout_s=config.connect_timeout_s,
            read_timeout_s=config.request_deadline_s, attempt_deadline_s=config.attempt_deadline)
        self.max_in_flight = endpoint.max_in_flight
        # Autotune hook (tracegen.sglang.autotune): the in-flight limit routing obeys. Starts at max_in_flight;
        # ServerPool.set_limit moves it.
        self.limit = endpoint.max_in_flight
        self.in_flight = 0
        self.consecutive_failures = 0
        self.quarantined = False
        self.quarantined_since = 0.0
        self.reason = ""
        # Monotonic time of the last finished completion: the progress signal behind wedge detection.
        self.last_completion = time.monotonic()
        # Request tasks in flight on this server, cancelled (and re-routed) if the server is found wedged.
        self.tasks: set[asyncio.Task[Any]] = set()
        self.probe_task: asyncio.Task[None] | None = None
        self.sent = 0
        self.completed = 0
        self.failures = 0
        self.quarantines = 0


class ServerPool:
    """Least-outstanding routing with per-server limits, quarantine and background probes."""

    def __init__(self, endpoints: list[ServerEndpoint], config: ClientConfig) -> None:
        if not endpoints:
            raise ValueError("at least one server endpoint is required")
        urls = [e.url for e in endpoints]
        duplicates = sorted({u for u in urls if urls.count(u) > 1})
        if duplicates:
            raise ValueError(f"server urls must be distinct, repeated: {[shown_location(u) for u in duplicates]}")
        self.config = config
        self.servers = [ServerState(e, config) for e in endpoints]
        self._ring = PrefixRing(urls, config.routing_load_factor) if config.routing == "prefix" else None
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._rotate = 0
        self._all_down_since: float | None = None
        self._closed = False
        # The model name probes send (SGLang echoes it, but keep it what real requests use).
        self.probe_model = "default"

    @property
    def capacity(self) -> int:
        """Total in-flight limit over all servers: the concurrency worth offering the client."""
        return sum(s.limit for s in self.servers)

    def set_limit(self, server: ServerState, limit: int) -> None:
        """Autotune hook: change one server's in-flight limit. Raising it lets that many requests run at once (each
        on a connection of its own); lowering it lets requests in flight finish and sends no new ones past it."""
        if type(limit) is not int or limit < 1:
            raise ValueError(f"in-flight limit for {server.shown_url} must be an integer >= 1, got {limit!r}")
        if limit > server.max_in_flight:
            server.max_in_flight = limit
        grew = limit > server.limit
        server.limit = limit
        if grew:
            self._wake_all()

    # -- routing --------------------------------------------------------------------------------

    def _pick(self, avoid: ServerState | None, key: str | None = None) -> ServerState | None:
        if key is not None and self._ring is not None:
            # A prefix's server may queue up to the slack past its limit (the limit is a batch and a queue: a
            # deeper queue there keeps the prefix cached, and the load bound keeps every other server's batch
            # within the slack of the busiest): waiting there costs less than computing the prefix elsewhere.
            slack = math.ceil(self.config.routing_load_slack * sum(s.limit for s in self.servers) / len(self.servers))
            preferred = self._ring.choose(
                key, self.servers, lambda s: s.in_flight,
                lambda s: not s.quarantined and s.in_flight < s.limit + slack and s is not avoid, slack)
            if preferred is not None:
                return preferred
        best: ServerState | None = None
        fallback: ServerState | None = None
        n = len(self.servers)
        # Rotating the scan start spreads ties (an idle fleet) instead of always favouring server 0.
        self._rotate = (self._rotate + 1) % n
        for i in range(n):
            s = self.servers[(self._rotate + i) % n]
            if s.quarantined or s.in_flight >= s.limit:
                continue
            if s is avoid:
                fallback = s
            elif best is None or s.in_flight < best.in_flight:
                best = s
        return best or fallback

    async def acquire(self, avoid: ServerState | None = None, key: str | None = None) -> ServerState:
        """Reserve a slot on the best server, waiting while every server is full or quarantined; hand it back
        with `release`.

        `avoid` (the server the previous attempt failed on) is used only when no other server has room. `key`
        names the prompt's prefix (`affinity.prefix_key`): the server that prefix prefers, if it has room.
        """
        loop = asyncio.get_running_loop()
        while True:
            if self._closed:
                raise RuntimeError("the client is closed")
            server = self._pick(avoid, key)
            if server is not None:
                server.in_flight += 1
                server.sent += 1
                return server
            timeout = None
            if self._all_down_since is not None:
                timeout = self._all_down_since + self.config.all_down_fatal_s - time.monotonic()
                if timeout <= 0:
                    raise FatalClientError(self._all_down_message())
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiters.append(waiter)
            try:
                if timeout is None:
                    await waiter
                else:
                    await asyncio.wait_for(waiter, timeout)
            except TimeoutError:
                pass  # the loop re-checks: fatal if still all down
            except asyncio.CancelledError:
                # A wake-up handed to a cancelled waiter must not be lost.
                if waiter.done() and not waiter.cancelled():
                    self._wake_one()
                raise
            finally:
                if not waiter.done():
                    waiter.cancel()

    def release(self, server: ServerState) -> None:
        server.in_flight -= 1
        if self._waiters:
            self._wake_one()

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def _wake_all(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)

    def _all_down_message(self) -> str:
        details = "; ".join(f"{s.shown_url}: {s.reason or 'quarantined'}" for s in self.servers)
        return (
            f"every server has been unusable for more than {self.config.all_down_fatal_s:g} s "
            f"(check the fleet, URLs, tunnels and api keys): {details}"
        )

    # -- health bookkeeping -----------------------------------------------------------------------

    def record_success(self, server: ServerState) -> None:
        server.consecutive_failures = 0
        server.completed += 1
        server.last_completion = time.monotonic()

    def record_failure(self, server: ServerState, reason: str) -> None:
        server.failures += 1
        if server.quarantined:
            # Stragglers failing after the verdict: keep the reason that put the server in quarantine.
            return
        server.consecutive_failures += 1
        server.reason = reason
        if server.consecutive_failures >= self.config.quarantine_after:
            self.quarantine(server, f"{server.consecutive_failures} consecutive failures, last: {reason}")

    def record_timeout(self, server: ServerState, started: float, reason: str, deadline: str) -> bool:
        """A request hit `deadline` (the idle read timeout, or the attempt's total deadline: a server trickling
        bytes is as stuck as a silent one). If the server finished nothing at all since that request was sent,
        it is wedged (or hopelessly stuck): quarantine it now and re-route everything it holds. Returns
        whether the server was declared wedged."""
        if server.last_completion < started:
            server.failures += 1
            if server.quarantined:
                return True
            self.quarantine(server, f"no completion within the {deadline} (wedged?)")
            # Its other requests were sent later and would just wait out their own deadlines.
            for task in list(server.tasks):
                task.cancel()
            return True
        self.record_failure(server, reason)
        return False

    def quarantine(self, server: ServerState, reason: str) -> None:
        if server.quarantined:
            return
        server.quarantined = True
        server.quarantined_since = time.monotonic()
        server.quarantines += 1
        server.reason = reason
        log.warning("quarantining %s: %s", server.shown_url, reason)
        if all(s.quarantined for s in self.servers) and self._all_down_since is None:
            self._all_down_since = time.monotonic()
            # Waiters blocked on "all full" must now wait with the fatal deadline instead of forever.
            self._wake_all()
        if not self._closed:
            server.probe_task = asyncio.get_running_loop().create_task(
                self._probe_loop(server), name=f"probe {server.shown_url}"
            )

    def _restore(self, server: ServerState) -> None:
        down_for = time.monotonic() - server.quarantined_since
        log.warning("%s is back after %.1f s in quarantine", server.shown_url, down_for)
        server.quarantined = False
        server.consecutive_failures = 0
        server.last_completion = time.monotonic()
        server.reason = ""
        self._all_down_since = None
        self._wake_all()

    async def _probe_loop(self, server: ServerState) -> None:
        while not self._closed and server.quarantined:
            await asyncio.sleep(self.config.probe_interval_s)
            problem = await self.probe(server)
            if problem is None:
                self._restore(server)
                return
            server.reason = f"{server.reason.split(' | probe: ')[0]} | probe: {problem}"

    async def probe(self, server: ServerState) -> str | None:
        """None if the server is usable: /health answers 200 and a 1-token completion finishes.
        Otherwise, what is wrong."""
        timeout = self.config.probe_timeout_s
        try:
            health = await server.http.get("/health", timeout=timeout)
            if health.status_code != 200:
                return f"/health answered {health.status_code}"
            body = json.dumps(
                {
                    "model": self.probe_model,
                    "messages": [{"role": "user", "content": "ping"}],
                    "max_tokens": 1,
                    "temperature": 0.0,
                }
            ).encode()
            reply = await server.http.post(PATH, body, timeout=timeout)
        except HttpTimeout as exc:
            return f"no answer within {timeout:g} s ({exc})"
        except (HttpFailure, MalformedResponse) as exc:  # a body past its limit included
            return f"{type(exc).__name__}: {exc}"
        if reply.status_code != 200:
            return f"probe completion answered HTTP {reply.status_code}"
        try:
            completion = parse_completion(reply.content)
        except MalformedResponse as exc:
            return f"probe completion malformed: {exc}"
        if completion.finish_reason == "abort":
            return "probe completion was aborted"
        return None

    def snapshot(self) -> list[dict[str, Any]]:
        """Per-server counters, for progress logs and tests."""
        return [
            {
                "url": s.shown_url,
                "in_flight": s.in_flight,
                "limit": s.limit,
                "sent": s.sent,
                "completed": s.completed,
                "failures": s.failures,
                "quarantined": s.quarantined,
                "quarantines": s.quarantines,
                "reason": s.reason,
            }
            for s in self.servers
        ]

    async def aclose(self) -> None:
        self._closed = True
        probes = [s.probe_task for s in self.servers if s.probe_task is not None and not s.probe_task.done()]
        for task in probes:
            task.cancel()
        await asyncio.gather(*probes, return_exceptions=True)
        self._wake_all()
        await asyncio.gather(*(s.http.aclose() for s in self.servers), return_exceptions=True)
