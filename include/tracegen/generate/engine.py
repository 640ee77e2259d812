"""Runs one chunk of work end to end: resume, keep the servers full, spool, commit, report progress.

The loop that makes a chunk crash-safe:
1. commit-or-discard whatever a previous attempt left in this chunk's spool (nothing finished is lost);
2. compute what is left from the ledger (rows done for this cap are never generated again);
3. keep `client.capacity` requests in flight; every finished row goes to the spool (fsynced) first;
4. every `part_rows` rows or `part_seconds` seconds, seal the spool segment and commit it as one part;
5. on SIGTERM, a fatal client error or a `stop_check` saying so (the pilot gate closing while this chunk
   runs beside the pilot), stop sending, commit what finished, and say so.

Rows known to be long (truncated under a lower cap, so regenerated now) are sent first: a chunk's
stragglers then start early instead of holding its end, and the servers stay full around them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from tracegen import plan
from tracegen.config import RunConfig
from tracegen.dataset.reader import DatasetIndex, InvalidRow, PromptRow, read_indices
from tracegen.sglang.autotune import InFlightLimit
from tracegen.sglang.client import ClientConfig, FatalClientError, Sampling, ServerEndpoint, SGLangClient
from tracegen.store.ledger import Ledger
from tracegen.store.records import FAILED, INVALID, OK, REJECTED, GeneratedRow
from tracegen.store.spool import Spool, recover

log = logging.getLogger(__name__)

# Pilot rows are scattered over the dataset, so they get a chunk number of their own that sorts last
# and can never collide with a real chunk (mapped task counts stay far below it).
PILOT_CHUNK = 99_999


class InvalidRowError(ValueError):
    """A malformed dataset row under `invalid_rows=fail`; the message names the row and the reason."""


class ChunkInterrupted(RuntimeError):
    """The chunk stopped early (SIGTERM, a fatal client error, a stop check) after committing what had
    finished. `reason` says which."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class ChunkSummary:
    """What one chunk task did; small enough for an XCom."""

    run_id: str
    chunk: int
    considered: int = 0
    already_done: int = 0
    recovered_rows: int = 0
    generated: int = 0
    committed_rows: int = 0
    parts: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    finish_reasons: dict[str, int] = field(default_factory=dict)
    completion_tokens: int = 0
    elapsed_s: float = 0.0
    interrupted: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class Progress:
    """Counts finished rows and writes a progress line a person reads at a glance."""

    def __init__(self, label: str, total: int, interval_s: float = 15.0) -> None:
        self.label, self.total, self.interval_s = label, total, interval_s
        self.started = self._last = time.monotonic()
        self.done = 0
        self.tokens = 0
        self.statuses: Counter[str] = Counter()
        self.finish: Counter[str] = Counter()

    def add(self, row: GeneratedRow) -> None:
        self.done += 1
        self.tokens += row.completion_tokens
        self.statuses[row.status] += 1
        if row.finish_reason:
            self.finish[row.finish_reason] += 1

    def maybe_log(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last >= self.interval_s:
            self._last = now
            log.info("%s", self.line(now))

    def line(self, now: float | None = None) -> str:
        elapsed = max((now or time.monotonic()) - self.started, 1e-9)
        rate = self.done / elapsed
        left = self.total - self.done
        eta = f"{left / rate:,.0f}s" if rate > 0 and left > 0 else ("0s" if left <= 0 else "?")
        ok = self.statuses[OK]
        truncated = self.finish["length"] / ok if ok else 0.0
        finishes = " ".join(f"{k} {v}" for k, v in sorted(self.finish.items())) or "-"
        return (
            f"{self.label}: {self.done:,}/{self.total:,} ({100 * self.done / max(self.total, 1):.1f}%) | "
            f"{rate:.2f} rows/s | {self.tokens / elapsed:,.0f} out tok/s | {finishes} | "
            f"truncated {100 * truncated:.1f}% | failed {self.statuses[FAILED]} "
            f"rejected {self.statuses[REJECTED]} invalid {self.statuses[INVALID]} | ETA {eta}"
        )


class ChunkEngine:
    """Generates and commits the rows of one chunk (or the pilot sample) that are not done yet."""

    def __init__(
        self,
        *,
        config: RunConfig,
        run_id: str,
        chunk: int,
        label: str,
        ledger: Ledger,
        dataset: DatasetIndex,
        servers: Sequence[ServerEndpoint],
        model: str,
        spool_dir: str | None = None,
        client_config: ClientConfig | None = None,
        progress_interval_s: float = 15.0,
        stop_check: Callable[[int, int], str | None] | None = None,
        stop_check_interval_s: float = 5.0,
    ) -> None:
        self.config, self.run_id, self.chunk, self.label = config, run_id, chunk, label
        self.ledger, self.dataset, self.servers, self.model = ledger, dataset, list(servers), model
        self.spool_dir = spool_dir  # None: the default local state dir (TRACEGEN_SPOOL_DIR overrides)
        self.client_config = client_config or ClientConfig(
            request_deadline_s=config.request_deadline_s, max_attempts=config.max_attempts,
            autotune=config.autotune_in_flight,  # autotune hook: per-server limits follow the servers
        )
        self.sampling = Sampling(max_tokens=config.max_tokens, temperature=config.temperature, top_p=config.top_p)
        self.progress_interval_s = progress_interval_s
        # Polled from a thread while generating (it may read storage) with (truncated, ok) rows so far; a
        # reason it returns stops the chunk.
        self.stop_check, self.stop_check_interval_s = stop_check, stop_check_interval_s
        self.stop_requested: str | None = None
        self.summary = ChunkSummary(run_id=run_id, chunk=chunk)
        self._pending_rows = 0
        self._segment_started = time.monotonic()
        self._commit_lock = asyncio.Lock()
        self.spool: Spool | None = None
        self._generating = False
        self._known_long = np.empty(0, dtype=np.int64)  # rows of this chunk truncated under a lower cap

    # ---- public ---------------------------------------------------------------------------------

    def run(self, indices: Iterable[int] | np.ndarray) -> ChunkSummary:
        """Synchronous entry point for a task: runs the event loop and turns SIGTERM into a clean stop."""
        return asyncio.run(self.arun(np.asarray(indices, dtype=np.int64), handle_sigterm=True))

    async def arun(self, indices: np.ndarray, *, handle_sigterm: bool = False) -> ChunkSummary:
        started = time.monotonic()
        loop = asyncio.get_running_loop()
        if handle_sigterm:
            with contextlib.suppress(ValueError, RuntimeError):  # not the main thread: no signal handler
                loop.add_signal_handler(signal.SIGTERM, self.request_stop, "SIGTERM received")
        # Opening the spool takes its lock: a second live attempt at this chunk fails fast here.
        self.spool = Spool(self.config.output_uri, self.run_id, self.chunk, base_dir=self.spool_dir)
        try:
            self.summary.recovered_rows = await asyncio.to_thread(recover, self.spool, self.ledger)
            if self.summary.recovered_rows:
                log.info("%s: committed %d rows an earlier attempt left in the spool", self.label,
                         self.summary.recovered_rows)
            todo = self._remaining(indices)
            self.summary.considered = int(indices.size)
            self.summary.already_done = int(indices.size - todo.size)
            log.info(
                "%s: %d rows in scope, %d already done for max_tokens=%d (%s), %d to generate",
                self.label, indices.size, self.summary.already_done, self.config.max_tokens,
                self.config.truncated_policy, todo.size,
            )
            if todo.size:
                await self._generate(todo)
        finally:
            self.spool.close()
            if handle_sigterm:
                with contextlib.suppress(ValueError, RuntimeError):
                    loop.remove_signal_handler(signal.SIGTERM)
            self.summary.elapsed_s = round(time.monotonic() - started, 3)
        if self.summary.interrupted:
            raise ChunkInterrupted(
                f"{self.label} stopped early ({self.summary.interrupted}) after committing "
                f"{self.summary.committed_rows} rows; a retry resumes from there",
                self.summary.interrupted,
            )
        return self.summary

    def request_stop(self, reason: str) -> None:
        if not self.stop_requested:
            log.warning("%s: %s: committing finished rows and stopping", self.label, reason)
            self.stop_requested = reason
            self.summary.interrupted = self.summary.interrupted or reason

    # ---- steps ----------------------------------------------------------------------------------

    def _remaining(self, indices: np.ndarray) -> np.ndarray:
        # Only this chunk's rows and the columns "done" needs: memory follows the chunk, not the dataset.
        frame = self.ledger.plan_frame(indices)
        todo = plan.remaining(frame, indices, self.config.max_tokens, self.config.truncated_policy)
        self._known_long = plan.known_long(frame, todo)
        return todo

    async def _generate(self, todo: np.ndarray) -> None:
        progress = Progress(self.label, int(todo.size), self.progress_interval_s)
        self._segment_started = time.monotonic()
        async with SGLangClient(self.servers, self.client_config) as client:
            # Autotune hook: a resizable semaphore, so rows read ahead follow the tuned in-flight limits.
            slots = InFlightLimit(client.capacity)
            client.on_capacity_change(slots.set_limit)
            in_flight: set[asyncio.Task[GeneratedRow]] = set()
            ticker = asyncio.create_task(self._tick(progress))
            self._generating = True
            try:
                for item in self._rows_longest_first(todo):
                    if self.stop_requested:
                        break
                    if isinstance(item, InvalidRow):
                        await self._finish(self._invalid_row(item), progress)
                        continue
                    await slots.acquire()
                    if self.stop_requested:
                        slots.release()
                        break
                    task = asyncio.create_task(self._complete(client, item))
                    in_flight.add(task)
                    task.add_done_callback(lambda t: (in_flight.discard(t), slots.release()))
                    task.add_done_callback(lambda t: self._on_done(t, progress))
                    await asyncio.sleep(0)  # let finished rows reach the spool as we go
                while in_flight and not self.stop_requested:
                    await asyncio.wait(set(in_flight), timeout=0.5)
            finally:
                ticker.cancel()
                self._generating = False
                for task in list(in_flight):
                    task.cancel()
                if in_flight:
                    await asyncio.gather(*in_flight, return_exceptions=True)
                await self._commit_segment(final=True)
                progress.maybe_log(force=True)
                self.summary.statuses = dict(progress.statuses)
                self.summary.finish_reasons = dict(progress.finish)
                self.summary.completion_tokens = progress.tokens
                self.summary.generated = progress.done

    def _rows_longest_first(self, todo: np.ndarray) -> Iterable[PromptRow | InvalidRow]:
        """The rows of `todo`, those known to be long first (each read is in dataset order)."""
        long = self._known_long
        if long.size:
            log.info("%s: %d rows truncated under a lower cap go first", self.label, long.size)
            yield from read_indices(self.dataset, long.tolist(), aws_conn_id=self.config.aws_conn_id)
            todo = np.setdiff1d(todo, long, assume_unique=True)
        yield from read_indices(self.dataset, todo.tolist(), aws_conn_id=self.config.aws_conn_id)

    def _invalid_row(self, item: InvalidRow) -> GeneratedRow:
        if self.config.invalid_rows == "fail":
            raise InvalidRowError(f"dataset {self.dataset.source_uri}: row {item.index}: {item.reason}")
        return GeneratedRow(
            index=item.index, status=INVALID, max_tokens=self.config.max_tokens, run_id=self.run_id,
            chunk=self.chunk, error=item.reason,
        )

    async def _complete(self, client: SGLangClient, row: PromptRow) -> GeneratedRow:
        result = await client.complete(
            row.index, row.messages, sampling=self.sampling, model=self.model, tools=row.tools,
            run_id=self.run_id, chunk=self.chunk, category=row.category,
        )
        result.id = row.id
        return result

    def _on_done(self, task: asyncio.Task[GeneratedRow], progress: Progress) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if isinstance(exc, FatalClientError):
            self.request_stop(f"fatal client error: {exc}")
            return
        if exc is not None:
            self.request_stop(f"unexpected error: {exc!r}")
            log.error("%s: request task failed", self.label, exc_info=exc)
            return
        self._append(task.result(), progress)

    async def _finish(self, row: GeneratedRow, progress: Progress) -> None:
        self._append(row, progress)
        await self._maybe_commit()

    def _append(self, row: GeneratedRow, progress: Progress) -> None:
        self.spool.append(row)  # fsynced: from here a SIGKILL cannot lose this row
        self._pending_rows += 1
        progress.add(row)

    async def _tick(self, progress: Progress) -> None:
        checked = time.monotonic()
        while True:
            await asyncio.sleep(0.2)
            await self._maybe_commit()
            progress.maybe_log()
            if self.stop_check is not None and time.monotonic() - checked >= self.stop_check_interval_s:
                checked = time.monotonic()
                reason = await self._run_stop_check(progress)
                if reason:
                    self.request_stop(reason)

    async def _run_stop_check(self, progress: Progress) -> str | None:
        try:
            return await asyncio.to_thread(self.stop_check, progress.finish["length"], progress.statuses[OK])
        except Exception as exc:  # a storage hiccup must not stop generation; the next poll tries again
            log.warning("%s: stop check failed, will try again: %s", self.label, exc)
            return None

    async def _maybe_commit(self) -> None:
        due = self._pending_rows >= self.config.part_rows or (
            self._pending_rows and time.monotonic() - self._segment_started >= self.config.part_seconds
        )
        if due:
            await self._commit_segment()

    async def _commit_segment(self, final: bool = False) -> None:
        async with self._commit_lock:
            # The final flush runs even with no new rows: a segment stranded by an earlier failed commit
            # must be committed (or the chunk must fail) before the chunk can report success.
            if not self._pending_rows and not final:
                return
            self._pending_rows = 0
            self._segment_started = time.monotonic()
            # Seal here on the loop thread (appends happen here too); commit in a worker thread because
            # storage calls block (S3 PUTs with retries) and the loop must keep the servers fed meanwhile.
            self.spool.seal()
            try:
                await asyncio.to_thread(recover, self.spool, self.ledger, self._count_commit)
            except Exception as exc:
                if not self.stop_requested and self._generating:
                    # The sealed segment stays in the spool; the next flush commits it with the newer rows.
                    log.warning("%s: commit failed, will retry with the next part: %s", self.label, exc)
                    return
                raise

    def _count_commit(self, rows: int) -> None:
        # Called from the commit thread; the commit lock keeps it the only writer of these counters.
        self.summary.committed_rows += rows
        self.summary.parts += 1
