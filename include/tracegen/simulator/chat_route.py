"""`POST /v1/chat/completions`: SGLang's OpenAI chat route, whole or streamed.

The prompt is rendered with the chat template and tokenized; the completion is a fresh sample of it. The
text is split as SGLang's chat route splits it: thinking by the reasoning parser (`--reasoning-parser`, unless
the request asks for the raw text), then tool calls out of the answer (`--tool-call-parser`, unless
`tool_choice` is "none"). The deltas of a stream add up to the message of the same request unstreamed. The
ids a request asks for in `sglext` come at the response's level, streamed in a chunk after the last delta.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from tracegen.simulator import protocol as p
from tracegen.simulator import sampling
from tracegen.simulator.batching import Job, QueueFull
from tracegen.simulator.jobs import (
    abort_disconnected,
    admit,
    apply_fault,
    progress,
    record,
    refuse_if_draining,
    wait,
)
from tracegen.simulator.responses import error_response, json_response, open_event_stream, send_event, sse
from tracegen.simulator.state import STATE, State
from tracegen.simulator.streaming import Detokenizer, event_ends
from tracegen.simulator.tokens import chat_prompt_ids, prompt_tool_names
from tracegen.simulator.tool_calls import chat_tool_parser, parse_function_call

TOOL_CALL_START = "<tool_call>"


@dataclass(frozen=True, slots=True)
class _Reply:
    """An admitted chat request and how its answer is written, whole or streamed."""

    state: State
    req: p.ChatRequest
    ids: list[int]  # the templated prompt's
    plan: p.Plan
    job: Job
    model: str
    parser: str | None  # the reasoning parser that splits the text (None: thinking stays inline)
    count_reasoning: bool  # usage counts reasoning tokens (the server has a reasoning parser)
    parse_tools: bool  # tool calls are parsed out of the answer

    def texts(self, n: int, final: bool = True) -> tuple[str, str]:
        return p.chat_texts(self.plan, n, self.parser, self.req.enable_thinking, final=final)

    def parse_calls(self, content: str) -> tuple[str, list[dict[str, Any]]]:
        assert self.req.tools is not None
        parser = chat_tool_parser(self.state.args["tool_call_parser"])
        return parse_function_call(content, self.req.tools, parser)

    def cached_report(self) -> int | None:
        """The prompt's cached tokens, reported in usage only with --enable-cache-report."""
        return self.job.cached_tokens if self.state.args["enable_cache_report"] else None

    def reasoning_tokens(self, n: int) -> int:
        return p.split(self.plan, n)[0] if self.count_reasoning else 0


def _reasoning_parser(state: State, separate: bool) -> str | None:
    parser = state.args["reasoning_parser"]
    return parser if parser and separate else None


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    if (refused := refuse_if_draining(request, state)) is not None:
        return refused
    req = p.sglext_asked(p.parse_chat(p.parse_json_object(await request.read())), request.headers)
    ctx = state.settings.context_length
    ids = chat_prompt_ids(req.messages, req.tools, req.enable_thinking, req.tool_choice, req.continue_final_message)
    n_prompt = len(ids)
    p.check_context(n_prompt, req.max_tokens, ctx)
    cap = req.max_tokens if req.max_tokens is not None else ctx - n_prompt
    fault, replacement = await apply_fault(request, state)
    if replacement is not None:
        return replacement
    drawn = sampling.fresh(state, ids, req.enable_thinking, req.seed)
    plan = sampling.plan(state, drawn, cap, req.ignore_eos, prompt_tool_names(ids) if req.tools else None)
    rid = req.rid or p.new_id()
    parser = _reasoning_parser(state, req.separate_reasoning)
    count_reasoning = bool(state.args["reasoning_parser"])
    # SGLang parses tool calls out of the text only with --tool-call-parser (and tool_choice not "none").
    parse_tools = bool(state.args["tool_call_parser"] and req.tools and req.tool_choice != "none")
    state.active += 1
    try:
        try:
            job = admit(state, plan, rid, fault, ids, req.priority)
        except QueueFull:
            return error_response(request, "The request queue is full.", 503)
        model = req.model if req.model is not None else state.args["served_model_name"]
        reply = _Reply(state, req, ids, plan, job, model, parser, count_reasoning, parse_tools)
        if req.stream:
            return await _stream_chat(request, reply)
        return await _complete(reply)
    finally:
        state.active -= 1


def _finish(job: Job, plan: p.Plan, parsed_calls: bool) -> str:
    """The finish reason SGLang reports: a natural stop is `tool_calls` only when its parser found a call."""
    if job.aborted:
        return "abort"
    if plan.finish == "length":
        return "length"
    return "tool_calls" if parsed_calls else "stop"


async def _complete(r: _Reply) -> web.Response:
    """The whole chat completion, once the request has finished."""
    await wait(r.job, r.state)
    record(r.state, r.job, len(r.ids))
    n = r.job.tokens
    reasoning_text, content = r.texts(n)
    calls: list[dict[str, Any]] = []
    if r.parse_tools:  # SGLang's order: reasoning split off first, then calls parsed out of the rest
        content, calls = r.parse_calls(content)
    finish = _finish(r.job, r.plan, bool(calls))
    # SGLang's ChatMessage leaves `tool_calls` out when there are none.
    message: dict[str, Any] = {
        "role": "assistant",
        "content": content,
        "reasoning_content": reasoning_text or None,
    }
    if calls:
        message["tool_calls"] = p.tool_calls(r.plan, calls)
    choice: dict[str, Any] = {
        "index": 0, "message": message, "logprobs": None, "finish_reason": finish,
        "matched_stop": p.EOS_TOKEN_ID if finish == "stop" else None,
    }  # fmt: skip
    if r.req.return_token_ids or r.req.return_prompt_token_ids:
        choice["prompt_token_ids"] = r.ids
    if r.req.return_token_ids:
        choice["response_token_ids"] = p.output_ids(r.plan, n)
    version = r.state.args["weight_version"] or "default"
    body: dict[str, Any] = {
        "id": r.job.rid, "object": "chat.completion", "created": p.now(), "model": r.model,
        "choices": [choice],
        "usage": p.usage(len(r.ids), n, r.reasoning_tokens(n), r.cached_report()),
        "metadata": {"weight_version": version, "weight_versions": [{"version": version, "start": 0, "end": n}]},
    }  # fmt: skip
    if r.req.asks_sglext_ids and (ext := p.sglext_ids(r.req, r.ids, p.output_ids(r.plan, n))):
        body["sglext"] = ext
    return json_response(body)


def _chunk(r: _Reply, created: int, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"id": r.job.rid, "object": "chat.completion.chunk", "created": created, "model": r.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish,
                         "matched_stop": p.EOS_TOKEN_ID if finish == "stop" else None}],
            "usage": None}  # fmt: skip


def _sse_content_chunk(r: _Reply, created: int, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    """A chunk as SGLang's `sse_utils.build_sse_content` writes it (the first chunk, the reasoning deltas and the
    finish): `reasoning_content` always in the delta (null or text), role and content only when set, and no
    `usage` key at all (msgspec omits it)."""
    chunk = _chunk(r, created, {"reasoning_content": None, **delta}, finish)
    del chunk["usage"]
    return chunk


def _chunk_without_choices(r: _Reply, created: int, **fields: Any) -> dict[str, Any]:
    """A chunk about the whole response (its ids, its usage), after the last delta."""
    return {"id": r.job.rid, "object": "chat.completion.chunk", "created": created, "model": r.model,
            "choices": [], **fields}


async def _stream_chat(request: web.Request, r: _Reply) -> web.StreamResponse:
    resp = await open_event_stream(request)
    created = p.now()
    job = r.job
    await send_event(resp, _sse_content_chunk(r, created, {"role": "assistant", "content": ""}))
    sent_reasoning, sent_content = await _stream_deltas(resp, r, created)
    record(r.state, job, len(r.ids))
    thinking, content = r.texts(job.tokens)
    calls: list[dict[str, Any]] = []
    if r.parse_tools:
        calls = r.parse_calls(content)[1]
        if calls:
            content = content.split(TOOL_CALL_START, 1)[0]
    finish = _finish(job, r.plan, bool(calls))
    final_delta: dict[str, Any] = {}
    if thinking.startswith(sent_reasoning) and len(thinking) > len(sent_reasoning):
        final_delta["reasoning_content"] = thinking[len(sent_reasoning) :]
    if content.startswith(sent_content) and len(content) > len(sent_content):
        final_delta["content"] = content[len(sent_content) :]
    if calls:
        final_delta["tool_calls"] = p.tool_calls(r.plan, calls)
    if final_delta:
        await send_event(resp, _chunk(r, created, final_delta))
    # SGLang ends the deltas with a chunk of its own that holds only the finish.
    await send_event(resp, _sse_content_chunk(r, created, {}, finish))
    # The ids come after the last delta, as SGLang sends them: the whole output so far, also when the request
    # was aborted by /abort_request (an abort without an error status).
    if r.req.asks_sglext_ids and (ext := p.sglext_ids(r.req, r.ids, p.output_ids(r.plan, job.tokens))):
        ids_chunk = _chunk_without_choices(r, created, usage=None, sglext=ext)
        if r.req.sglext_ids_framed:
            await resp.write(b"event: sglext_ids\n" + sse(ids_chunk))
        else:
            await send_event(resp, ids_chunk)
    if r.req.include_usage:
        usage = p.usage(len(r.ids), job.tokens, r.reasoning_tokens(job.tokens), r.cached_report())
        await send_event(resp, _chunk_without_choices(r, created, usage=usage))
    await send_event(resp, "[DONE]")
    await resp.write_eof()
    return resp


async def _stream_deltas(resp: web.StreamResponse, r: _Reply, created: int) -> tuple[str, str]:
    """Send the text as it grows until the request finishes, a chunk for each event SGLang's scheduler
    sends (`streaming.event_ends`, at --stream-interval); returns the (reasoning, content) sent."""
    interval = max(1, r.state.args["stream_interval"])
    per_step = r.state.settings.accept_length
    detok = Detokenizer(r.plan.context)
    produced = 0  # tokens whose text the detokenizer has seen
    raw = ""
    sent_reasoning, sent_content = "", ""

    def chunk(end: int) -> bytes:
        # Deltas of the split of everything so far: they add up to the non-streamed message.
        nonlocal produced, raw, sent_reasoning, sent_content
        raw += detok.step(p.output_ids_between(r.plan, produced, end, final=False), False)
        produced = end
        thinking, content = p.split_reasoning(raw, r.parser, r.req.enable_thinking)
        if r.parse_tools:  # SGLang's streaming parser holds a call back from the content
            content = content.split(TOOL_CALL_START, 1)[0]
        delta: dict[str, Any] = {}
        if len(thinking) > len(sent_reasoning):
            delta["reasoning_content"] = thinking[len(sent_reasoning) :]
        if len(content) > len(sent_content):
            delta["content"] = content[len(sent_content) :]
        sent_reasoning, sent_content = thinking, content
        if set(delta) == {"reasoning_content"}:  # SGLang sends reasoning through build_sse_content
            return sse(_sse_content_chunk(r, created, delta))
        return sse(_chunk(r, created, delta)) if delta else b""

    try:
        while not r.job.future.done():
            n = await progress(r.state, r.job, 1 if produced == 0 else produced + interval)
            if r.job.future.done():
                break
            ends = event_ends(produced, min(n, r.plan.target - 1), interval, per_step)
            payload = b"".join(chunk(end) for end in ends)
            if payload:
                await resp.write(payload)
    except (ConnectionResetError, asyncio.CancelledError):
        abort_disconnected(r.state, r.job)
        raise
    # Events due before the finish that the last look did not reach.
    ends = event_ends(produced, r.job.tokens - 1, interval, per_step)
    payload = b"".join(chunk(end) for end in ends)
    if payload:
        await resp.write(payload)
    return sent_reasoning, sent_content
