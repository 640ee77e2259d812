"""Continuous batching for the stand-in, as a continuous-time event model.

Every running request decodes at the same rate, `accept_length / step_time(n)` tokens per simulated
second, where n is the batch size and the step time grows with n — so throughput rises with
concurrency while per-request speed falls, as on a GPU. Instead of one wakeup per token, the model
keeps a single "virtual progress" counter V (tokens every running request has gained since time 0):
a request admitted at V0 with T tokens to produce finishes when V reaches V0 + T. Finish times only
change when the batch size changes, so the driver needs one timer for the next finish, whatever
the number of requests. `BatchEngine` is the pure core (explicit simulated times, testable without
a clock); `AsyncBatcher` drives it from the event loop with a time scale.

A request admitted to the batch first prefills the part of its prompt the server's prefix cache
(`radix_cache.RadixCache`) does not hold, as SGLang 0.5.23's scheduler does (`get_next_batch_to_run`):
prefill runs first whenever a request waits for it, in chunks of `--chunked-prefill-size` tokens, one
request after another; by default a prefill step carries no decode, so every running request waits while
prompts are computed; with `--enable-mixed-chunk` each step carries one chunk and one decode token of every
running request, and lasts a decode step plus the chunk's compute. The prompt is matched against the cache
when its prefill starts (so a request prefilled just before it, sharing its prefix, is a hit), inserted once
computed, and its output added when it ends.
"""

from __future__ import annotations

import asyncio
import heapq
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tracegen.simulator.radix_cache import Node, RadixCache

# Float slack when deciding that a request reached its target (V is a float sum).
_EPS = 1e-6


class QueueFull(Exception):
    """The waiting queue already holds --max-queued-requests requests."""


@dataclass(frozen=True, slots=True)
class StepModel:
    """Decode-step timing: `base_s + per_request_s * batch` simulated seconds per step."""

    base_s: float = 0.015
    per_request_s: float = 0.00015
    accept_length: float = 1.0  # tokens per request per step (> 1 with speculative decoding)

    def __post_init__(self) -> None:
        if self.base_s <= 0 or self.per_request_s < 0:
            raise ValueError(
                f"step timing must be base > 0, per-request >= 0; got {self.base_s}, {self.per_request_s}"
            )
        if self.accept_length < 1:
            raise ValueError(f"accept_length must be >= 1, got {self.accept_length}")

    def step_time(self, batch: int) -> float:
        return self.base_s + self.per_request_s * batch

    def rate(self, batch: int) -> float:
        """Tokens per simulated second each running request gains at this batch size."""
        return self.accept_length / self.step_time(batch)


@dataclass(frozen=True, slots=True)
class PrefillModel:
    """Prefill timing: `rate` prompt tokens a simulated second on a step of its own, `chunk` tokens a step at
    most (SGLang's --chunked-prefill-size), decodes carried along only when `mixed` (--enable-mixed-chunk)."""

    rate: float
    chunk: int = 8192
    mixed: bool = False

    def __post_init__(self) -> None:
        if self.rate <= 0 or self.chunk < 1:
            raise ValueError(f"prefill rate must be > 0 and chunk >= 1, got {self.rate}, {self.chunk}")

    def step_time(self, step: StepModel, decoding: int) -> float:
        """Simulated seconds of a step carrying one chunk (and, mixed, one token of `decoding` requests)."""
        compute = self.chunk / self.rate
        return step.step_time(decoding) + compute if self.mixed and decoding else compute


@dataclass(eq=False, slots=True)
class Job:
    """One generation request inside the engine."""

    rid: str
    target: int  # tokens it will produce before finishing (natural length, cap or fault cut)
    arrival: float = 0.0
    admitted: float | None = None
    finished: float | None = None
    v0: float = 0.0
    state: str = "new"  # new -> waiting -> running -> done
    tokens: int = 0  # final token count once done
    aborted: bool = False
    abort_message: str | None = None
    # Where an abort found it: "running" (SGLang's running-batch abort, reported with the full meta_info)
    # or "waiting" (popped from the queue, reported by the tokenizer manager's short abort output).
    aborted_in: str | None = None
    future: Any = None  # asyncio.Future set by the driver, resolved when done
    meta: dict[str, Any] = field(default_factory=dict)
    prompt_ids: Sequence[int] = ()
    # The output's ids given how many were generated: what the cache keeps of a finished request.
    output_ids_of: Callable[[int], Sequence[int]] | None = None
    cached_tokens: int = 0  # prompt tokens the cache held when its prefill started
    prefill_left: float = 0.0  # prompt tokens still to compute
    prefill_started: bool = False
    cache_node: Node | None = None  # the cache path this request holds locked

    def __post_init__(self) -> None:
        if self.target < 0:
            raise ValueError(f"job {self.rid!r}: target {self.target} must be >= 0")


class BatchEngine:
    """The pure scheduler state: running batch, waiting queue, progress and occupancy accounting."""

    def __init__(
        self,
        max_running: int,
        step: StepModel,
        max_queued: int | None = None,
        prefill: PrefillModel | None = None,
        cache: RadixCache | None = None,
    ) -> None:
        if max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {max_running}")
        if max_queued is not None and max_queued < 0:
            raise ValueError(f"max_queued must be >= 0 or None, got {max_queued}")
        self.max_running = max_running
        self.max_queued = max_queued
        self.step = step
        self.prefill = prefill  # None: prompts cost nothing
        self.cache = cache  # None: no prefix is ever cached
        self.prefilling: deque[Job] = deque()  # admitted, prompt being computed (the head) or waiting to be
        self.prompt_tokens_cached = 0
        self.prompt_tokens_computed = 0
        self.now = 0.0
        self.v = 0.0
        self.wedged = False
        self.running: dict[str, Job] = {}
        self.waiting: deque[Job] = deque()
        self._heap: list[tuple[float, int, Job]] = []
        self._seq = 0
        self._sum_v0 = 0.0
        # Occupancy accounting starts when the server is warm (start_accounting).
        self.accounting_since: float | None = None
        self.busy_slot_s = 0.0
        # Simulated seconds with a request running: the GPU's time, which a step costs whatever the batch. Slot-
        # seconds are not: a step costs each running request its step time, which grows with the batch.
        self.busy_s = 0.0
        self.tokens_done = 0
        self.finished_count = 0
        self.aborted_count = 0

    # -- queries --------------------------------------------------------------------------------
    def rate(self) -> float:
        """Tokens per simulated second each running request gains now."""
        if self.wedged or not self.running:
            return 0.0
        if self.prefilling and self.prefill is not None:
            if not self.prefill.mixed:
                return 0.0
            return self.step.accept_length / self.prefill.step_time(self.step, len(self.running))
        return self.step.rate(len(self.running))

    def prefill_rate(self) -> float:
        """Prompt tokens per simulated second the head of the prefill queue gains now."""
        if self.wedged or not self.prefilling or self.prefill is None:
            return 0.0
        return self.prefill.chunk / self.prefill.step_time(self.step, len(self.running))

    def slots_used(self) -> int:
        return len(self.running) + len(self.prefilling)

    def produced(self, job: Job) -> int:
        """Tokens `job` has produced so far (as of the last advance)."""
        if job.state == "running":
            return min(job.target, int(self.v - job.v0 + _EPS))
        if job.state == "done":
            return job.tokens
        return 0

    def time_until(self, job: Job, tokens: int) -> float | None:
        """Simulated seconds until `job` has produced `tokens` at the current rate (None: not decoding)."""
        rate = self.rate()
        if job.state != "running" or rate <= 0:
            return None
        return max(0.0, job.v0 + tokens - self.v) / rate

    def tokens_generated(self) -> int:
        return self.tokens_done + int(len(self.running) * self.v - self._sum_v0 + _EPS)

    def next_event_time(self) -> float | None:
        """Simulated time of the next finish or end of a prefill, or None when nothing will happen without new
        input."""
        dt = self._next_dt()
        return None if dt is None else self.now + dt[0]

    def _next_dt(self) -> tuple[float, bool] | None:
        """Simulated seconds to the next event, and whether it is a prefill's end (else a finish)."""
        best: tuple[float, bool] | None = None
        rate = self.rate()
        head = self._head()
        if head is not None and rate > 0:
            best = (max(0.0, head[0] - self.v) / rate, False)
        prefill_rate = self.prefill_rate()
        if prefill_rate > 0:
            dt = max(0.0, self.prefilling[0].prefill_left) / prefill_rate
            if best is None or dt < best[0]:
                best = (dt, True)
        return best

    def available_slot_s(self) -> float:
        if self.accounting_since is None:
            return 0.0
        return self.max_running * (self.now - self.accounting_since)

    # -- transitions ----------------------------------------------------------------------------
    def start_accounting(self, t: float) -> None:
        self.advance(t)
        self.accounting_since = self.now
        self.busy_slot_s = 0.0
        self.busy_s = 0.0

    def submit(self, job: Job, t: float) -> list[Job]:
        """Add `job` at simulated time t; returns jobs that finished while advancing to t."""
        done = self.advance(t)
        if self.slots_used() >= self.max_running and self.max_queued is not None:
            if len(self.waiting) >= self.max_queued:
                raise QueueFull("The request queue is full.")
        job.arrival = self.now
        job.state = "waiting"
        self.waiting.append(job)
        done.extend(self._admit())
        return done

    def abort(self, rid: str, t: float, message: str | None = None) -> tuple[Job | None, list[Job]]:
        """Abort request `rid`; returns (the aborted job or None, other jobs finished meanwhile).

        A running request keeps what it produced plus the one token of the decode step SGLang still runs
        for it (its scheduler sets `to_finish`, and the request finishes after the next forward pass); its
        slot goes to the queue's head at once. A queued one ends with no token."""
        done = self.advance(t)
        job = self.running.get(rid)
        if job is not None:
            tokens = min(job.target, self.produced(job) + 1)
            self._remove_running(job)
            job.aborted_in = "running"
            self._finish(job, tokens, aborted=True, message=message or "Aborted")
            done.extend(self._admit())
            return job, done
        for prefilling in self.prefilling:
            if prefilling.rid == rid:
                self.prefilling.remove(prefilling)
                prefilling.aborted_in = "running"
                self._finish(prefilling, 0, aborted=True, message=message or "Aborted")
                self._begin_prefill()
                done.extend(self._admit())
                return prefilling, done
        for queued in self.waiting:
            if queued.rid == rid:
                self.waiting.remove(queued)
                queued.aborted_in = "waiting"
                self._finish(queued, 0, aborted=True, message=message or "Abort in waiting queue")
                return queued, done
        return None, done

    def advance(self, t: float) -> list[Job]:
        """Move simulated time to t, finishing (and admitting) requests in order. Returns finished jobs."""
        finished: list[Job] = []
        t = max(t, self.now)
        while True:
            next_dt = self._next_dt()
            if next_dt is None or self.now + next_dt[0] > t:
                self._elapse(t - self.now)
                return finished
            dt, prefill_ends = next_dt
            head = self._head()
            self._elapse(dt)
            if prefill_ends:
                self._start_decoding(self.prefilling.popleft())
                self._begin_prefill()
                finished.extend(self._admit())
                continue
            assert head is not None
            self.v = max(self.v, head[0])  # land exactly on the finish, not a rounding error short of it
            while (head := self._head()) is not None and head[0] <= self.v + _EPS:
                job = head[2]
                self._remove_running(job)
                self._finish(job, job.target, aborted=False, message=None)
                finished.append(job)
            finished.extend(self._admit())

    # -- internals ------------------------------------------------------------------------------
    def _elapse(self, dt: float) -> None:
        if dt <= 0:
            return
        if self.accounting_since is not None:
            self.busy_slot_s += self.slots_used() * dt
            if self.running or self.prefilling:
                self.busy_s += dt
        prefill_rate = self.prefill_rate()
        if prefill_rate > 0:
            self.prefilling[0].prefill_left -= prefill_rate * dt
        self.v += self.rate() * dt
        self.now += dt

    def _head(self) -> tuple[float, int, Job] | None:
        # Lazy deletion: aborted jobs stay in the heap until they surface.
        while self._heap and self._heap[0][2].state != "running":
            heapq.heappop(self._heap)
        return self._heap[0] if self._heap else None

    def _admit(self) -> list[Job]:
        finished = []
        while self.waiting and self.slots_used() < self.max_running:
            job = self.waiting.popleft()
            job.admitted = self.now
            if job.target == 0:  # nothing to decode (e.g. max_tokens reached by a fault cut at 0)
                self._finish(job, 0, aborted=job.aborted, message=job.abort_message)
                finished.append(job)
                continue
            job.state = "prefilling"
            self.prefilling.append(job)
            self._begin_prefill()
        return finished

    def _begin_prefill(self) -> None:
        """Match the prompt at the head of the prefill queue against the cache: what it holds is not computed.
        Without a prefill model the prompt costs nothing and the request decodes at once."""
        while self.prefilling and not self.prefilling[0].prefill_started:
            job = self.prefilling[0]
            job.prefill_started = True
            if self.cache is not None and job.prompt_ids:
                # The last prompt token is always computed: its logits are the first output token's.
                job.cached_tokens, job.cache_node = self.cache.match(job.prompt_ids, len(job.prompt_ids) - 1)
                self.cache.lock(job.cache_node)
            job.prefill_left = len(job.prompt_ids) - job.cached_tokens
            self.prompt_tokens_cached += job.cached_tokens
            self.prompt_tokens_computed += len(job.prompt_ids) - job.cached_tokens
            if self.prefill is None or job.prefill_left <= 0:
                self._start_decoding(self.prefilling.popleft())

    def _start_decoding(self, job: Job) -> None:
        """The prompt is computed: it joins the cache, and the request the decoding batch."""
        if self.cache is not None and job.prompt_ids:
            self._hold(job, self.cache.insert(job.prompt_ids, self._kv_outside_cache()))
        job.prefill_left = 0.0
        job.state = "running"
        job.v0 = self.v
        self._sum_v0 += job.v0
        self.running[job.rid] = job
        self._seq += 1
        heapq.heappush(self._heap, (job.v0 + job.target, self._seq, job))

    def _hold(self, job: Job, node: Node | None) -> None:
        """`job` holds `node`'s path locked instead of the one it held."""
        assert self.cache is not None
        if node is not None:
            self.cache.lock(node)
        if job.cache_node is not None:
            self.cache.unlock(job.cache_node)
        job.cache_node = node

    def _kv_outside_cache(self) -> int:
        """KV tokens the running requests' outputs hold outside the tree: the cache's capacity less them."""
        return max(0, int(len(self.running) * self.v - self._sum_v0))

    def _release(self, job: Job, tokens: int) -> None:
        """A request ends: what it computed stays cached (prompt and output, as SGLang's
        `cache_finished_req` keeps them), and its path is no longer held."""
        if self.cache is None or job.cache_node is None:
            return
        if job.output_ids_of is not None and tokens > 1 and job.state != "prefilling":
            # The last output token's KV was never computed: it is the step's output, not its input.
            ids = [*job.prompt_ids, *list(job.output_ids_of(tokens))[: tokens - 1]]
            self.cache.insert(ids, self._kv_outside_cache())
        self._hold(job, None)

    def _remove_running(self, job: Job) -> None:
        del self.running[job.rid]
        self._sum_v0 -= job.v0
        job.state = "removed"
        if not self.running:
            self._sum_v0 = 0.0  # drop accumulated float error whenever the batch empties

    def _finish(self, job: Job, tokens: int, aborted: bool, message: str | None) -> None:
        self._release(job, tokens)
        job.state = "done"
        job.tokens = tokens
        job.finished = self.now
        job.aborted = job.aborted or aborted
        if message is not None:
            job.abort_message = message
        self.tokens_done += tokens
        if job.aborted:
            self.aborted_count += 1
        else:
            self.finished_count += 1


class AsyncBatcher:
    """Runs a BatchEngine on the event loop: simulated time = wall time x time_scale."""

    def __init__(self, engine: BatchEngine, time_scale: float = 1.0) -> None:
        if time_scale <= 0:
            raise ValueError(f"time_scale must be > 0, got {time_scale}")
        self.engine = engine
        self.time_scale = time_scale
        self._loop = asyncio.get_running_loop()
        self._t0 = self._loop.time()
        self._timer: asyncio.TimerHandle | None = None
        self._rid_seq = 0

    def sim_now(self) -> float:
        return (self._loop.time() - self._t0) * self.time_scale

    def wall_seconds(self, sim_seconds: float) -> float:
        return sim_seconds / self.time_scale

    def sync(self) -> None:
        """Bring the engine up to now, resolve finished requests and re-arm the timer."""
        self._resolve(self.engine.advance(self.sim_now()))
        self._rearm()

    def submit(self, job: Job) -> Job:
        """Queue `job`; its `future` resolves when it finishes. Raises QueueFull."""
        if job.rid in self.engine.running or any(j.rid == job.rid for j in (*self.engine.prefilling, *self.engine.waiting)):
            raise ValueError(f"Duplicate request ID detected: {job.rid}")  # SGLang's words
        job.future = self._loop.create_future()
        self._resolve(self.engine.submit(job, self.sim_now()))
        self._rearm()
        return job

    def abort(self, rid: str, message: str | None = None) -> Job | None:
        job, done = self.engine.abort(rid, self.sim_now(), message)
        if job is not None:
            done.append(job)
        self._resolve(done)
        self._rearm()
        return job

    def abort_matching(self, rid: str) -> int:
        """SGLang's `/abort_request {"rid"}`: nothing unless `rid` itself is in flight (its tokenizer manager
        knows only exact ids), and then every request whose id starts with it (its scheduler matches by
        prefix, so aborting "row-1" also aborts "row-10"). Returns how many were aborted."""
        in_flight = self._rids()
        if rid not in in_flight:
            return 0
        matching = [r for r in in_flight if r.startswith(rid)]
        for r in matching:
            self.abort(r)
        return len(matching)

    def abort_all(self) -> int:
        rids = self._rids()
        for rid in rids:
            self.abort(rid)
        return len(rids)

    def set_wedged(self, wedged: bool) -> None:
        self.sync()
        self.engine.wedged = wedged
        self._rearm()

    def produced(self, job: Job) -> int:
        self.sync()
        return self.engine.produced(job)

    def wall_until(self, job: Job, tokens: int) -> float | None:
        """Wall seconds until `job` has produced `tokens` at the current rate (None: not decoding)."""
        self.sync()
        sim = self.engine.time_until(job, tokens)
        return None if sim is None else self.wall_seconds(sim)

    def start_accounting(self) -> None:
        self.engine.start_accounting(self.sim_now())
        self._rearm()

    def in_flight(self) -> int:
        return self.engine.slots_used() + len(self.engine.waiting)

    def _rids(self) -> list[str]:
        e = self.engine
        return [*e.running, *(j.rid for j in e.prefilling), *(j.rid for j in e.waiting)]

    def _tick(self, when: float) -> None:
        self._timer = None
        # The loop may fire a hair early: advance at least to the scheduled finish.
        self._resolve(self.engine.advance(max(self.sim_now(), when)))
        self._rearm()

    def _rearm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        when = self.engine.next_event_time()
        if when is None:
            return
        wall = self._t0 + when / self.time_scale
        self._timer = self._loop.call_at(wall, self._tick, when)

    @staticmethod
    def _resolve(jobs: list[Job]) -> None:
        for job in jobs:
            if job.future is not None and not job.future.done():
                job.future.set_result(job)
