"""A generation request's life on the server: the fault it meets, its admission to the batch, waiting for
it (a client that goes away aborts it, as in SGLang), and what it adds to the metrics when it ends.

A client that disconnects is aborted at once: in SGLang 0.5.23 the cancelled handler's cleanup
(`TokenizerManager.generate_request`, `_release_req_states_on_failure`) sends the abort for the dispatched
request; the stream's background task that aborts it again after 2 s (`create_abort_task`) finds it gone.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Sequence
from functools import partial

from aiohttp import web

from tracegen.simulator import faults as fault_kinds
from tracegen.simulator import protocol as p
from tracegen.simulator.batching import Job
from tracegen.simulator.responses import error_response
from tracegen.simulator.state import State

log = logging.getLogger("tracegen.simulator")


def refuse_if_draining(request: web.Request, state: State) -> web.Response | None:
    if state.draining:
        return error_response(request, "The server is shutting down.", 503)
    return None


async def apply_fault(request: web.Request, state: State) -> tuple[str, web.StreamResponse | None]:
    """Apply the injected fault for this request; returns (fault, response to send instead or None)."""
    fault = state.injector.decide()
    state.sync_wedge()
    if fault == fault_kinds.CRASH:
        log.error("simulated fault: crashing after %d requests", state.injector.requests_seen - 1)
        logging.shutdown()
        os._exit(1)
    if fault == fault_kinds.ERROR:
        status = state.injector.config.error_status
        return fault, error_response(request, f"simulated fault: HTTP {status}", status)
    if fault in (fault_kinds.DROP, fault_kinds.HANG):
        if fault == fault_kinds.DROP and request.transport is not None:
            request.transport.close()
        state.hung += 1
        try:
            # Never answer. The handler is cancelled when the connection goes away.
            await asyncio.Event().wait()
        finally:
            state.hung -= 1
    return fault, None


def _priority(state: State, requested: int | None) -> str:
    """A request's priority label: its own, else --default-priority-value ("None" without either)."""
    return str(requested if requested is not None else state.args["default_priority_value"])


def admit(
    state: State, plan: p.Plan, rid: str, fault: str, prompt_ids: Sequence[int], priority: int | None = None
) -> Job:
    """The request's job, queued in the batch; raises `batching.QueueFull` when the queue is full. Its prompt
    is prefilled, less what the server's prefix cache holds, and its prompt and output are cached after."""
    job = Job(rid=rid, target=plan.target, prompt_ids=prompt_ids, output_ids_of=partial(p.output_ids, plan))
    job.meta["priority"] = _priority(state, priority)
    job.meta["prompt_tokens"] = len(prompt_ids)
    if fault == fault_kinds.ABORT:
        job.target = int(plan.target * state.injector.abort_fraction())
        job.aborted = True
        job.abort_message = "Abort request"
    job.meta["t_arrival"] = time.monotonic()
    try:
        return state.batcher.submit(job)
    except ValueError as exc:
        raise p.BadRequest(str(exc)) from None


def record(state: State, job: Job, prompt_toks: int) -> None:
    """What a finished request adds to the metrics, as SGLang counts it: a request that finished, a running
    one aborted too (its abort ends in the scheduler's normal output, which the tokenizer manager counts as a
    finished request), is in `num_requests_total` and `prompt_tokens_total`; an abort is in
    `num_aborted_requests_total` as well."""
    m = state.metrics
    now = time.monotonic()
    t0 = job.meta["t_arrival"]
    e2e = now - t0
    m.e2e.observe(e2e)
    if job.admitted is not None:
        queue_wall = state.batcher.wall_seconds(job.admitted - job.arrival)
        m.queue_time.observe(queue_wall)
        m.ttft.observe(queue_wall + state.batcher.wall_seconds(state.batcher.engine.step.step_time(1)))
    if job.aborted:
        m.num_aborted_requests_total += 1
    if not job.aborted or job.aborted_in == "running":
        m.num_requests_total += 1
        m.prompt_tokens_total += prompt_toks


def cached_tokens_details(job: Job) -> dict[str, int] | None:
    """SGLang's `meta_info.cached_tokens_details` (`OutputStreamer.get_cached_tokens_details`): null without a
    hit, else where the hit was found; the stand-in's cache is all on the device (no hierarchical cache)."""
    return {"device": job.cached_tokens, "host": 0} if job.cached_tokens > 0 else None


def abort_disconnected(state: State, job: Job) -> None:
    """The client went away: abort the request, which frees its slot, and record it here (its cancelled
    handler never gets to)."""
    if state.batcher.abort(job.rid, "Abort: client disconnected") is not None:
        record(state, job, job.meta["prompt_tokens"])


async def wait(job: Job, state: State) -> None:
    """Wait for the job; a client disconnect cancels us and aborts it server-side, as SGLang does."""
    try:
        await job.future
    except asyncio.CancelledError:
        abort_disconnected(state, job)
        raise


# The shortest wall wait between two looks at a stream: below it, many streams' wake-ups cost the event loop
# more than they are worth, and the events due meanwhile are written together.
_MIN_LOOK_S = 0.001


async def progress(state: State, job: Job, due: int) -> int:
    """Wait until the job has produced `due` tokens (at the current rate, looking again at least every
    --sim-stream-interval-ms in case the batch changes) or is done; returns the tokens produced so far."""
    look = state.args["sim_stream_interval_ms"] / 1000.0
    until = state.batcher.wall_until(job, due)
    if until is not None:
        look = max(_MIN_LOOK_S, min(look, until))
    try:
        await asyncio.wait_for(asyncio.shield(job.future), look)
    except TimeoutError:
        pass
    except asyncio.CancelledError:
        abort_disconnected(state, job)
        raise
    return state.batcher.produced(job)
