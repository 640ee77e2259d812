"""`POST /generate`: SGLang's native route, and how a client continues a truncated row.

Input ids that end with a response this stand-in produced continue that sample (`lengths.continued_sample`
finds it from the ids alone); anything else is a fresh sample. The text is the raw model output, a closing
tool call included (the native route parses nothing), decoded as SGLang's detokenizer decodes it: after the
input's last ids.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from aiohttp import web

from tracegen.simulator import protocol as p
from tracegen.simulator import sampling
from tracegen.simulator.batching import Job, QueueFull
from tracegen.simulator.jobs import admit, apply_fault, progress, record, refuse_if_draining, wait
from tracegen.simulator.lengths import Drawn, Sample, continued_sample
from tracegen.simulator.responses import error_response, json_response, open_event_stream, send_event
from tracegen.simulator.state import STATE, State
from tracegen.simulator.tokens import detokenize, opens_without_thinking, prompt_tool_names, text_ids

# The response for the first n tokens a request produced; `done`: the request has finished.
_Body = Callable[[int, bool], dict[str, Any]]


async def generate(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    if (refused := refuse_if_draining(request, state)) is not None:
        return refused
    req = p.parse_generate(p.parse_json_object(await request.read()))
    ctx = state.settings.context_length
    ids = text_ids(req.prompt) if isinstance(req.prompt, str) else req.prompt
    n_prompt = len(ids)
    p.check_context(n_prompt, req.max_new_tokens, ctx)
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
            job = admit(state, plan, rid, fault)
        except QueueFull:
            return error_response(request, "The request queue is full.", 503)
        body = partial(_body, state, ids, plan, job)
        if not req.stream:
            await wait(job, state)
            record(state, job, n_prompt)
            return json_response(body(job.tokens, True))
        return await _stream(request, state, job, n_prompt, body)
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


def _body(state: State, ids: list[int], plan: p.Plan, job: Job, n: int, done: bool) -> dict[str, Any]:
    # The raw text, a sample's closing tool call included (SGLang's /generate parses nothing), as
    # its detokenizer returns it: decoded after the input's last ids, so a continuation of ids cut
    # inside a character does not repeat what the input's decoding already replaced.
    out_ids = p.output_ids(plan, n)
    text = detokenize(ids, out_ids, done and not job.aborted and plan.ends_with_eos and n >= plan.target)
    if not done:
        text = text.rstrip("\ufffd")
    t0 = job.meta["t_arrival"]
    meta: dict[str, Any] = {"id": job.rid, "finish_reason": None}
    if done and job.aborted:
        meta["finish_reason"] = p.finish_reason_native("abort", plan.cap, job.abort_message)
        meta["e2e_latency"] = round(time.monotonic() - t0, 6)
        return {"text": text, "output_ids": out_ids, "meta_info": meta}
    if done:
        meta["finish_reason"] = p.finish_reason_native(plan.finish, plan.cap, None)
    meta.update({
        "prompt_tokens": len(ids), "completion_tokens": n, "cached_tokens": 0,
        "reasoning_tokens": p.split(plan, n)[0] if state.args["reasoning_parser"] else 0,
        "num_retractions": 0,
        "weight_version": state.args["weight_version"] or "default",
        "e2e_latency": round(time.monotonic() - t0, 6),
    })  # fmt: skip
    if state.args["speculative_algorithm"]:
        accept = state.settings.accept_length
        meta.update(
            {
                "spec_accept_length": accept,
                "spec_accept_rate": round((accept - 1) / accept, 4),
                "spec_verify_ct": p.ceil_div(n, accept),
            }
        )
    return {"text": text, "output_ids": out_ids, "meta_info": meta}


async def _stream(
    request: web.Request, state: State, job: Job, n_prompt: int, body: _Body
) -> web.StreamResponse:
    resp = await open_event_stream(request)
    sent = 0
    try:
        while not job.future.done():
            n = await progress(state, job)
            if n > sent and not job.future.done():
                # Native streaming sends the cumulative text each time, like SGLang.
                await send_event(resp, body(n, False))
                sent = n
    except (ConnectionResetError, asyncio.CancelledError):
        state.batcher.abort(job.rid, "Abort: client disconnected")
        raise
    record(state, job, n_prompt)
    await send_event(resp, body(job.tokens, True))
    await send_event(resp, "[DONE]")
    await resp.write_eof()
    return resp
