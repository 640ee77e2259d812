"""`POST /generate`: SGLang's native route, and how a client continues a truncated row.

Input ids that end with a response this stand-in produced continue that sample (`lengths.continued_sample`
finds it from the ids alone); anything else is a fresh sample. The text is the raw model output, a closing
tool call included (the native route parses nothing), decoded as SGLang's detokenizer decodes it: after the
input's last ids.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from tracegen.simulator import protocol as p
from tracegen.simulator import sampling
from tracegen.simulator.batching import Job, QueueFull
from tracegen.simulator.jobs import (
    abort_disconnected,
    admit,
    apply_fault,
    cached_tokens_details,
    progress,
    record,
    refuse_if_draining,
    wait,
)
from tracegen.simulator.lengths import Drawn, Sample, continued_sample
from tracegen.simulator.responses import error_response, json_response, open_event_stream, sse
from tracegen.simulator.state import STATE, State
from tracegen.simulator.streaming import Detokenizer, event_ends
from tracegen.simulator.tokens import detokenize, opens_without_thinking, prompt_tool_names, text_ids


async def generate(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    if (refused := refuse_if_draining(request, state)) is not None:
        return refused
    req = p.parse_generate(p.parse_json_object(await request.read()))
    ctx = state.settings.context_length
    ids = text_ids(req.prompt) if isinstance(req.prompt, str) else req.prompt
    n_prompt = len(ids)
    try:
        p.check_context(n_prompt, req.max_new_tokens, ctx)
    except p.RequestRefused as exc:
        if not req.stream:
            raise
        # SGLang checks the context in its tokenizer manager, once the stream is open: an error event.
        return await _stream_error(request, str(exc))
    fault, replacement = await apply_fault(request, state)
    if replacement is not None:
        return replacement
    drawn = _draw(state, req, ids)
    # The prompt's tools (read from its ids, as the model reads them) let the sample end in a call.
    tool_names = prompt_tool_names(ids[: n_prompt - drawn.generated])
    plan = sampling.plan(state, drawn, req.max_new_tokens, req.ignore_eos, tool_names)
    rid = req.rid or p.new_id()
    state.active += 1
    try:
        try:
            job = admit(state, plan, rid, fault, ids)
        except QueueFull:
            return error_response(request, "The request queue is full.", 503)
        except p.BadRequest as exc:  # a rid in flight: SGLang's tokenizer manager refuses it, on a stream too
            if not req.stream:
                raise
            return await _stream_error(request, str(exc))
        if not req.stream:
            await wait(job, state)
            record(state, job, n_prompt)
            return json_response(_body(state, ids, plan, job))
        # SGLang's `sampling_params.stream_interval or --stream-interval`; below 1 it sends every step.
        interval = max(1, req.stream_interval or state.args["stream_interval"])
        return await _stream(request, state, job, ids, plan, interval)
    finally:
        state.active -= 1


def _draw(state: State, req: p.GenerateRequest, ids: list[int]) -> Drawn:
    """Ids that end with one of our responses continue its sample; anything else is a fresh sample."""
    drawn = None
    if not isinstance(req.prompt, str):

        def tool_name(prompt: Sequence[int], sample: Sample) -> str | None:
            return sampling.tool_name(state, prompt_tool_names(prompt), sample)

        drawn = continued_sample(ids, state.args["sim_seed"], state.settings.length_model, tool_name)
    if drawn is None:
        drawn = sampling.fresh(state, ids, not opens_without_thinking(ids), req.sampling_seed)
    return drawn


def _meta(state: State, ids: list[int], plan: p.Plan, job: Job, n: int, done: bool) -> dict[str, Any]:
    """The event's meta_info: SGLang's whole one, except for an abort the tokenizer manager reports on its
    own (a queued request's, the fault injector's), which has only its id, reason, version and count."""
    t0 = job.meta["t_arrival"]
    version = state.args["weight_version"] or "default"
    meta: dict[str, Any] = {"id": job.rid, "finish_reason": None}
    if done and job.aborted and job.aborted_in != "running":
        meta["finish_reason"] = p.finish_reason_native("abort", plan.cap, job.abort_message)
        meta.update({"weight_version": version, "e2e_latency": round(time.monotonic() - t0, 6),
                     "completion_tokens": n})  # fmt: skip
        return meta
    if done:
        finish = "abort" if job.aborted else plan.finish
        meta["finish_reason"] = p.finish_reason_native(finish, plan.cap, job.abort_message, running=True)
    meta.update({
        "prompt_tokens": len(ids), "completion_tokens": n, "cached_tokens": job.cached_tokens,
        "cached_tokens_details": cached_tokens_details(job),
        "reasoning_tokens": p.split(plan, n)[0] if state.args["reasoning_parser"] else 0,
        "num_retractions": 0,
        "weight_version": version,
        # The data-parallel rank is null without --dp-size > 1 (which the stand-in does not serve).
        "dp_rank": None,
    })  # fmt: skip
    if done:
        # Only a finished request's meta_info says how long it took and which weight version generated each
        # stretch of its output (one: the stand-in's version never changes mid-request).
        meta["weight_versions"] = [{"version": version, "start": 0, "end": n}]
        meta["e2e_latency"] = round(time.monotonic() - t0, 6)
    if state.args["speculative_algorithm"]:
        accept = state.settings.accept_length
        meta.update(
            {
                "spec_accept_length": accept,
                "spec_accept_rate": round((accept - 1) / accept, 4),
                "spec_verify_ct": p.ceil_div(n, accept),
            }
        )
    return meta


def _body(state: State, ids: list[int], plan: p.Plan, job: Job) -> dict[str, Any]:
    """The response of a finished request that is not streamed.

    The raw text, a sample's closing tool call included (SGLang's /generate parses nothing), as its
    detokenizer returns it: decoded after the input's last ids, so a continuation of ids cut inside a
    character does not repeat what the input's decoding already replaced."""
    n = job.tokens
    out_ids = p.output_ids(plan, n)
    text = detokenize(ids, out_ids, not job.aborted and plan.ends_with_eos and n >= plan.target)
    return {"text": text, "output_ids": out_ids, "meta_info": _meta(state, ids, plan, job, n, True)}


async def _stream(
    request: web.Request, state: State, job: Job, ids: list[int], plan: p.Plan, interval: int
) -> web.StreamResponse:
    """SGLang's /generate stream: an event when one is due (`streaming.event_ends`), the finish, `[DONE]`.
    With --incremental-streaming-output an event carries the new ids and text only; without it, every
    event repeats all the ids and the whole text so far."""
    incremental = bool(state.args["incremental_streaming_output"])
    resp = await open_event_stream(request)
    detok = Detokenizer(ids)
    all_ids: list[int] = []
    text = ""

    def event(end: int, done: bool) -> dict[str, Any]:
        nonlocal text
        new = p.output_ids_between(plan, len(all_ids), end, final=done and not job.aborted)
        all_ids.extend(new)
        delta = detok.step(new, done)
        text += delta
        meta = _meta(state, ids, plan, job, end, done)
        if done and job.aborted and job.aborted_in != "running":
            # The tokenizer manager's own abort output: the whole text, and only the last id when incremental.
            return {"text": text, "output_ids": all_ids[-1:] if incremental else list(all_ids), "meta_info": meta}
        if incremental:
            return {"text": delta, "output_ids": new, "meta_info": meta}
        return {"text": text, "output_ids": list(all_ids), "meta_info": meta}

    per_step = state.settings.accept_length
    sent = 0
    try:
        while not job.future.done():
            n = await progress(state, job, 1 if sent == 0 else sent + interval)
            if job.future.done():
                break
            # Every event due by now, each its own SSE event (the tokens of the finish excepted).
            ends = event_ends(sent, min(n, plan.target - 1), interval, per_step)
            payload = b"".join(sse(event(end, False)) for end in ends)
            if payload:
                await resp.write(payload)
                sent = len(all_ids)
    except (ConnectionResetError, asyncio.CancelledError):
        abort_disconnected(state, job)
        raise
    record(state, job, len(ids))
    final = job.tokens
    # Events due before the finish that the last look did not reach: SGLang sent them as the tokens came.
    ends = event_ends(sent, final - 1, interval, per_step)
    payload = b"".join(sse(event(end, False)) for end in ends)
    await resp.write(payload + sse(event(final, True)) + sse("[DONE]"))
    await resp.write_eof()
    return resp


async def _stream_error(request: web.Request, message: str) -> web.StreamResponse:
    resp = await open_event_stream(request)
    await resp.write(sse(p.stream_error(message)) + sse("[DONE]"))
    await resp.write_eof()
    return resp
