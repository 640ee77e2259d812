"""The stand-in's HTTP server: SGLang's endpoints, auth, warm-up, drain on SIGTERM, faults.

Handlers validate the request, ask the fault injector what happens to it, plan its length from the
length model, and hand it to the continuous-batching engine; they wake up only when it finishes (or
every stream interval when streaming), never once per token.

Every generation request is a fresh sample of its prompt (a fixed one only with
--enable-deterministic-inference, from the request's seed), except a /generate whose input_ids end with
a response this stand-in produced: that request finishes the same sample (see `tokens`). Texts are the
decoding of the ids, as SGLang's detokenizer returns it; `/tokenize` and `/detokenize` expose the tokenizer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import secrets
import shlex
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from tracegen.dataset.request_rules import check_tool
from tracegen.simulator import faults as fault_kinds
from tracegen.simulator import metrics as prom
from tracegen.simulator import protocol as p
from tracegen.simulator.batching import AsyncBatcher, BatchEngine, Job, QueueFull, StepModel
from tracegen.simulator.cli import SimSettings
from tracegen.simulator.faults import FaultInjector
from tracegen.simulator.lengths import Drawn, Sample, continued_sample, fresh_sample
from tracegen.simulator.reasoning import UnmodelledParser, UnsupportedParser, separate_reasoning
from tracegen.simulator.tokens import (
    TOKENIZER_MAX_LENGTH,
    chat_prompt_ids,
    detokenize,
    opens_without_thinking,
    prompt_tool_names,
    render_chat,
    text_ids,
    tokenizer,
)
from tracegen.simulator.tool_calls import (
    AdapterToolParser,
    UnmodelledToolParser,
    UnsupportedToolParser,
    chat_tool_parser,
    parse_function_call,
)

log = logging.getLogger("tracegen.simulator")
TOOL_CALL_START = "<tool_call>"
READY_LINE = "The server is fired up and ready to roll!"
# Fresh sampling: every request without deterministic inference gets its own sample number.
_FRESH_SAMPLES = random.SystemRandom()
# Paths reachable without the API key (SGLang: prefix match).
_AUTH_EXEMPT = ("/health", "/ready", "/metrics")
# SGLang's ADMIN_OPTIONAL endpoints among the stand-in's: with --admin-api-key only that key opens them.
_ADMIN_OPTIONAL = frozenset({"/abort_request"})
# Routes SGLang guards with validate_json_request: any other Content-Type is a 400.
_JSON_ONLY = frozenset({"/v1/chat/completions", "/tokenize", "/v1/tokenize", "/detokenize", "/v1/detokenize"})
# SGLang's scheduler-side metric labels for one server (no pipeline, tensor or expert parallelism).
_SCHEDULER_LABELS = {"engine_type": "unified", "tp_rank": "0", "pp_rank": "0", "moe_ep_rank": "0"}


@dataclass
class State:
    settings: SimSettings
    batcher: AsyncBatcher
    injector: FaultInjector
    metrics: prom.Metrics = field(default_factory=prom.Metrics)
    started_wall: float = field(default_factory=time.time)
    warm: bool = False
    warm_at: float | None = None  # loop time
    unready_until: float = 0.0  # loop time before which /health is 503 (slow start)
    draining: bool = False
    hung: int = 0
    active: int = 0  # generation handlers running (hung ones excluded)
    # Priorities seen since start: SGLang keeps reporting each one's series, at 0 when it has no request.
    known_priorities: set[str] = field(default_factory=set)

    @property
    def args(self) -> dict[str, Any]:
        return self.settings.args

    def healthy(self) -> bool:
        return self.warm and not self.draining and asyncio.get_running_loop().time() >= self.unready_until

    def sync_wedge(self) -> None:
        if self.batcher.engine.wedged != self.injector.config.wedged:
            self.batcher.set_wedged(self.injector.config.wedged)
            log.warning("simulated fault: server %s", "wedged" if self.injector.config.wedged else "unwedged")


STATE = web.AppKey("state", State)


def _json(body: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, text=json.dumps(body), content_type="application/json")


def _error(request: web.Request, message: str, status: int, error_type: str | None = None) -> web.Response:
    """SGLang's error shape: nested on the native /generate route, flat on OpenAI routes."""
    if request.path.startswith("/generate"):
        return _json(p.native_error(message), status)
    kind = error_type or p.ERROR_TYPES.get(status, "InternalServerError")
    return _json(p.openai_error(message, status, kind), status)


# -- middlewares ------------------------------------------------------------------------------------
def _bearer_is(header: str | None, key: str) -> bool:
    """SGLang's check: exactly "<scheme> <token>" split at the first space, scheme `bearer` in any case,
    the token equal to the key as sent (so "Bearer  key", two spaces, is refused)."""
    if not header:
        return False
    parts = header.split(" ", 1)
    return len(parts) == 2 and parts[0].lower() == "bearer" and secrets.compare_digest(parts[1], key)


def auth_allows(
    method: str, path: str, header: str | None, api_key: str | None, admin_key: str | None
) -> bool:
    """SGLang's `decide_request_auth` for the stand-in's endpoints (the normal and admin-optional levels)."""
    if method == "OPTIONS" or path.startswith(_AUTH_EXEMPT):
        return True
    if path in _ADMIN_OPTIONAL and admin_key:
        return _bearer_is(header, admin_key)
    if api_key:
        return _bearer_is(header, api_key)
    return True


@web.middleware
async def auth_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    a = request.app[STATE].args
    header = request.headers.get("Authorization")
    if not auth_allows(request.method, request.path, header, a["api_key"], a["admin_api_key"]):
        return _json({"error": "Unauthorized"}, 401)
    return await handler(request)


def _refuse_unless_json(request: web.Request) -> None:
    """SGLang's validate_json_request: a FastAPI validation error, so its "Bad Request" 400."""
    media_type = request.headers.get("Content-Type", "").lower().split(";", 1)[0]
    if media_type != "application/json":
        error = {
            "loc": ["header", "content-type"],
            "msg": "Unsupported Media Type: Only 'application/json' is allowed",
            "type": "value_error",
        }
        raise p.BadRequest(f"1 validation error:\n  {error} {[error]}")


@web.middleware
async def error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        if request.method == "POST" and request.path in _JSON_ONLY:
            _refuse_unless_json(request)
        return await handler(request)
    except p.BadRequest as exc:
        return _error(request, str(exc), 400, exc.error_type)
    except web.HTTPNotFound:
        return _json({"detail": "Not Found"}, 404)
    except web.HTTPMethodNotAllowed:
        return _json({"detail": "Method Not Allowed"}, 405)
    except web.HTTPException:
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as exc:  # never a traceback page: log it, answer a JSON 500
        log.exception("unhandled error on %s %s", request.method, request.path)
        return _error(request, f"Internal server error: {type(exc).__name__}: {exc}", 500)


# -- health and info --------------------------------------------------------------------------------
async def health(request: web.Request) -> web.Response:
    return web.Response(status=200 if request.app[STATE].healthy() else 503)


async def model_info(request: web.Request) -> web.Response:
    a = request.app[STATE].args
    lower = a["model_path"].lower()
    moe = "a3b" in lower or "a22b" in lower or "moe" in lower
    model_type = ("qwen3_moe" if moe else "qwen3") if "qwen3" in lower else "llama"
    arch = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen3": "Qwen3ForCausalLM"}.get(
        model_type, "LlamaForCausalLM"
    )
    # SGLang 0.5.23's /model_info keys, in its order (a text-only model, not disaggregated).
    return _json({
        "model_path": a["model_path"], "served_model_name": a["served_model_name"],
        "tokenizer_path": a["tokenizer_path"], "is_generation": True,
        "preferred_sampling_params": a["preferred_sampling_params"], "weight_version": a["weight_version"],
        "load_format": a["load_format"], "reasoning_parser": a["reasoning_parser"],
        "tool_call_parser": a["tool_call_parser"], "disaggregation_mode": a["disaggregation_mode"],
        "has_image_understanding": False, "has_audio_understanding": False,
        "model_type": model_type, "architectures": [arch],
    })  # fmt: skip


def occupancy(state: State) -> dict[str, Any]:
    b = state.batcher
    b.sync()
    e = b.engine
    available = e.available_slot_s()
    return {
        "busy_slot_sim_s": round(e.busy_slot_s, 6),
        "available_slot_sim_s": round(available, 6),
        "occupancy": round(e.busy_slot_s / available, 6) if available > 0 else 0.0,
        "tokens_generated": e.tokens_generated(),
        "sim_seconds_since_warm": round(e.now - e.accounting_since, 6)
        if e.accounting_since is not None
        else 0.0,
        "time_scale": b.time_scale,
        "max_running_requests": e.max_running,
        "num_running_reqs": len(e.running),
        "num_queue_reqs": len(e.waiting),
        "finished_requests": e.finished_count,
        "aborted_requests": e.aborted_count,
    }


def _gen_throughput(state: State) -> float:
    """Current decode throughput in tokens per wall second (what a client of the stand-in sees)."""
    e = state.batcher.engine
    return len(e.running) * e.rate() * state.batcher.time_scale


def kv_capacity(settings: SimSettings) -> int:
    """Tokens the simulated KV cache holds (`max_total_num_tokens`): --max-total-tokens, else a full
    context for every running request (the stand-in never runs out of KV memory)."""
    return settings.args["max_total_tokens"] or settings.max_running * settings.context_length


async def server_info(request: web.Request) -> web.Response:
    """SGLang's resolved server args (`context_length` is the flag: null without it), then what its
    scheduler reports at start-up and per data-parallel rank."""
    state = request.app[STATE]
    a = state.args
    info = dict(a)
    info["launch_command"] = shlex.join([sys.executable, "-m", "tracegen.simulator", *state.settings.argv])
    info["max_total_num_tokens"] = kv_capacity(state.settings)
    # SGLang's scheduler: one token short of the context (or of the KV cache), less 5 reserved.
    info["max_req_input_len"] = min(state.settings.context_length - 1, info["max_total_num_tokens"] - 1) - 5
    occ = occupancy(state)
    info["internal_states"] = [{
        "last_gen_throughput": round(_gen_throughput(state), 3),
        "avg_spec_accept_length": state.settings.accept_length if a["speculative_algorithm"] else None,
        "effective_max_running_requests_per_dp": state.settings.max_running,
        "num_running_reqs": occ["num_running_reqs"], "num_queue_reqs": occ["num_queue_reqs"],
    }]  # fmt: skip
    info["version"] = p.SGLANG_VERSION
    info["sim_occupancy"] = occ
    info["sim_faults"] = state.injector.config.to_json()
    model = state.settings.length_model
    info["sim_length_model_resolved"] = {
        **{
            k: getattr(model, k) for k in ("kind", "median", "sigma", "prompt_share", "runaway_rate", "fixed")
        },
        "truncated_share_at_4096": round(model.survival(4096), 6),
        "truncated_share_at_8192": round(model.survival(8192), 6),
    }
    return _json(info)


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    name = state.args["served_model_name"]
    return _json({"object": "list", "data": [{
        "id": name, "object": "model", "created": int(state.started_wall), "owned_by": "sglang",
        "root": name, "parent": None, "max_model_len": state.settings.context_length,
    }]})  # fmt: skip


def _priority(state: State, requested: int | None) -> str:
    """A request's priority label: its own, else --default-priority-value ("None" without either)."""
    return str(requested if requested is not None else state.args["default_priority_value"])


def _by_priority(state: State, jobs: Any) -> dict[str, int]:
    """Requests per priority label, every priority seen so far included (at 0 when it has none now)."""
    counts = dict.fromkeys(state.known_priorities, 0)
    for job in jobs:
        priority = job.meta.get("priority", "None")
        counts[priority] = counts.get(priority, 0) + 1
    return counts


async def metrics_endpoint(request: web.Request) -> web.Response:
    state = request.app[STATE]
    occ = occupancy(state)
    e = state.batcher.engine
    m = state.metrics
    scheduler = {"model_name": state.args["served_model_name"], **_SCHEDULER_LABELS}
    tokenizer = {
        "model_name": state.args["served_model_name"],
        "engine_type": _SCHEDULER_LABELS["engine_type"],
    }
    breakdown: dict[str, dict[str, int]] = {}
    if state.args["enable_priority_scheduling"]:
        # SGLang: the totals under priority="", one series per priority beside them.
        scheduler["priority"] = tokenizer["priority"] = ""
        breakdown = {"num_running_reqs": _by_priority(state, e.running.values()),
                     "num_queue_reqs": _by_priority(state, e.waiting)}  # fmt: skip
        state.known_priorities.update(*breakdown.values())
    gauges = {
        "num_running_reqs": occ["num_running_reqs"],
        "num_queue_reqs": occ["num_queue_reqs"],
        "gen_throughput": round(_gen_throughput(state), 3),
        "token_usage": round(len(e.running) / e.max_running, 6),
        "spec_accept_length": state.settings.accept_length,
    }
    counters = {
        "prompt_tokens_total": m.prompt_tokens_total,
        "generation_tokens_total": occ["tokens_generated"],
        "num_requests_total": m.num_requests_total,
        "num_aborted_requests_total": m.num_aborted_requests_total,
    }
    sim = {
        "busy_slot_seconds_total": occ["busy_slot_sim_s"],
        "available_slot_seconds_total": occ["available_slot_sim_s"],
        "occupancy": occ["occupancy"],
        "generated_tokens_total": occ["tokens_generated"],
    }
    body = prom.render(scheduler, tokenizer, m, gauges, counters, sim, breakdown)
    return web.Response(text=body, content_type="text/plain", charset="utf-8")


# -- faults control ---------------------------------------------------------------------------------
async def get_faults(request: web.Request) -> web.Response:
    return _json(request.app[STATE].injector.config.to_json())


async def set_faults(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = p.parse_json_object(await request.read())
    try:
        config = state.injector.update(body)
    except (TypeError, ValueError) as exc:
        raise p.BadRequest(str(exc)) from None
    if "slow_start_s" in body:
        state.unready_until = asyncio.get_running_loop().time() + config.slow_start_s
    state.sync_wedge()
    log.info("fault settings updated: %s", body)
    return _json(config.to_json())


async def abort_request(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = p.parse_json_object(await request.read())
    rid = body.get("rid")
    if body.get("abort_all") is True:
        n = state.batcher.abort_all()
        log.info("aborted all %d requests", n)
    elif isinstance(rid, str) and rid:
        state.batcher.abort(rid)
    else:
        raise p.BadRequest("abort_request needs a non-empty string rid or abort_all: true")
    return web.Response(status=200)


# -- generation -------------------------------------------------------------------------------------
async def _apply_fault(request: web.Request, state: State) -> tuple[str, web.StreamResponse | None]:
    """Apply the injected fault for this request; returns (fault, response to send instead or None)."""
    fault = state.injector.decide()
    state.sync_wedge()
    if fault == fault_kinds.CRASH:
        log.error("simulated fault: crashing after %d requests", state.injector.requests_seen - 1)
        logging.shutdown()
        os._exit(1)
    if fault == fault_kinds.ERROR:
        status = state.injector.config.error_status
        return fault, _error(request, f"simulated fault: HTTP {status}", status)
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


def _admit(state: State, plan: p.Plan, rid: str, fault: str, priority: int | None = None) -> Job:
    job = Job(rid=rid, target=plan.target)
    job.meta["priority"] = _priority(state, priority)
    if fault == fault_kinds.ABORT:
        job.target = int(plan.target * state.injector.abort_fraction())
        job.aborted = True
        job.abort_message = "Abort request"
    job.meta["t_arrival"] = time.monotonic()
    try:
        return state.batcher.submit(job)
    except QueueFull:
        raise _QueueFullResponse() from None
    except ValueError as exc:
        raise p.BadRequest(str(exc)) from None


class _QueueFullResponse(Exception):
    pass


def _record(state: State, job: Job, prompt_toks: int) -> None:
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
    else:
        m.num_requests_total += 1
        m.prompt_tokens_total += prompt_toks


def _sample_number(state: State, seed: int | None) -> int:
    """Which sample of the prompt this request draws: its seed in deterministic mode, else a fresh one."""
    if state.args["enable_deterministic_inference"]:
        return seed if seed is not None else p.DEFAULT_SAMPLING_SEED
    return _FRESH_SAMPLES.getrandbits(64)


def _fresh(state: State, ids: list[int], thinking: bool, seed: int | None) -> Drawn:
    number = _sample_number(state, seed)
    return fresh_sample(ids, state.args["sim_seed"], state.settings.length_model, number, thinking)


def _tool_name(state: State, tool_names: list[str] | None, sample: Sample) -> str | None:
    """The tool a sample of a prompt offering tools (`tool_names`, read from its ids, so chat and /generate
    decide alike) calls at the end of its answer, if it calls one."""
    if tool_names and sample.tool_roll < state.args["sim_tool_call_rate"]:
        return tool_names[sample.key % len(tool_names)]
    return None


def _plan(state: State, drawn: Drawn, cap: int, ignore_eos: bool, tool_names: list[str] | None) -> p.Plan:
    """The request's plan; a sample of a prompt offering tools may end in a call to one of them."""
    return p.plan_request(drawn, cap, ignore_eos, _tool_name(state, tool_names, drawn.sample))


async def _wait(job: Job, state: State) -> None:
    """Wait for the job; a client disconnect cancels us and aborts it server-side, as SGLang does."""
    try:
        await job.future
    except asyncio.CancelledError:
        state.batcher.abort(job.rid, "Abort: client disconnected")
        raise


def _refuse_if_draining(request: web.Request, state: State) -> web.Response | None:
    if state.draining:
        return _error(request, "The server is shutting down.", 503)
    return None


def _reasoning_parser(state: State, separate: bool) -> str | None:
    parser = state.args["reasoning_parser"]
    return parser if parser and separate else None


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    if (refused := _refuse_if_draining(request, state)) is not None:
        return refused
    req = p.parse_chat(p.parse_json_object(await request.read()))
    ctx = state.settings.context_length
    ids = chat_prompt_ids(req.messages, req.tools, req.enable_thinking)
    n_prompt = len(ids)
    p.check_context(n_prompt, req.max_tokens, ctx)
    cap = req.max_tokens if req.max_tokens is not None else ctx - n_prompt
    fault, replacement = await _apply_fault(request, state)
    if replacement is not None:
        return replacement
    drawn = _fresh(state, ids, req.enable_thinking, req.seed)
    plan = _plan(state, drawn, cap, req.ignore_eos, prompt_tool_names(ids) if req.tools else None)
    rid = req.rid or p.new_id()
    parser = _reasoning_parser(state, req.separate_reasoning)
    count_reasoning = bool(state.args["reasoning_parser"])
    # SGLang parses tool calls out of the text only with --tool-call-parser (and tool_choice not "none").
    parse_tools = bool(state.args["tool_call_parser"] and req.tools and req.tool_choice != "none")
    state.active += 1
    try:
        try:
            job = _admit(state, plan, rid, fault, req.priority)
        except _QueueFullResponse:
            return _error(request, "The request queue is full.", 503)
        model = req.model if req.model is not None else state.args["served_model_name"]
        if req.stream:
            return await _stream_chat(
                request, state, req, plan, job, n_prompt, model, parser, count_reasoning, parse_tools
            )
        await _wait(job, state)
        _record(state, job, n_prompt)
        n = job.tokens
        reasoning_text, content = p.chat_texts(plan, n, parser, req.enable_thinking)
        calls: list[dict[str, Any]] = []
        if parse_tools:  # SGLang's order: reasoning split off first, then calls parsed out of the rest
            assert req.tools is not None
            content, calls = parse_function_call(
                content, req.tools, chat_tool_parser(state.args["tool_call_parser"])
            )
        finish = _finish(job, plan, bool(calls))
        r_tokens = p.split(plan, n)[0] if count_reasoning else 0
        # SGLang's ChatMessage leaves `tool_calls` out when there are none.
        message: dict[str, Any] = {
            "role": "assistant",
            "content": content,
            "reasoning_content": reasoning_text or None,
        }
        if calls:
            message["tool_calls"] = p.tool_calls(plan, calls)
        choice: dict[str, Any] = {
            "index": 0, "message": message, "logprobs": None, "finish_reason": finish,
            "matched_stop": p.EOS_TOKEN_ID if finish == "stop" else None,
        }  # fmt: skip
        if req.return_token_ids or req.return_prompt_token_ids:
            choice["prompt_token_ids"] = ids
        if req.return_token_ids:
            choice["response_token_ids"] = p.output_ids(plan, n)
        return _json({
            "id": rid, "object": "chat.completion", "created": p.now(), "model": model, "choices": [choice],
            "usage": p.usage(n_prompt, n, r_tokens),
            "metadata": {"weight_version": state.args["weight_version"] or "default"},
        })  # fmt: skip
    finally:
        state.active -= 1


def _finish(job: Job, plan: p.Plan, parsed_calls: bool) -> str:
    """The finish reason SGLang reports: a natural stop is `tool_calls` only when its parser found a call."""
    if job.aborted:
        return "abort"
    if plan.finish == "length":
        return "length"
    return "tool_calls" if parsed_calls else "stop"


async def _sse(resp: web.StreamResponse, payload: Any) -> None:
    data = payload if isinstance(payload, str) else json.dumps(payload)
    await resp.write(f"data: {data}\n\n".encode())


async def _progress(state: State, job: Job) -> int:
    """Wait one stream interval (or until done), then return tokens produced so far."""
    interval = state.args["sim_stream_interval_ms"] / 1000.0
    try:
        await asyncio.wait_for(asyncio.shield(job.future), interval)
    except TimeoutError:
        pass
    except asyncio.CancelledError:
        state.batcher.abort(job.rid, "Abort: client disconnected")
        raise
    return state.batcher.produced(job)


async def _stream_chat(
    request: web.Request,
    state: State,
    req: p.ChatRequest,
    plan: p.Plan,
    job: Job,
    n_prompt: int,
    model: str,
    parser: str | None,
    count_reasoning: bool,
    parse_tools: bool,
) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    created = p.now()

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"id": job.rid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish,
                             "matched_stop": p.EOS_TOKEN_ID if finish == "stop" else None}],
                "usage": None}  # fmt: skip

    await _sse(resp, chunk({"role": "assistant", "content": ""}))
    sent = 0
    sent_reasoning, sent_content = "", ""
    try:
        while True:
            n = await _progress(state, job)
            if n > sent:
                # Deltas of the split of everything so far: they add up to the non-streamed message.
                thinking, content = p.chat_texts(plan, n, parser, req.enable_thinking, final=False)
                if parse_tools:  # SGLang's streaming parser holds a call back from the content
                    content = content.split(TOOL_CALL_START, 1)[0]
                delta: dict[str, Any] = {}
                if len(thinking) > len(sent_reasoning):
                    delta["reasoning_content"] = thinking[len(sent_reasoning) :]
                if len(content) > len(sent_content):
                    delta["content"] = content[len(sent_content) :]
                if delta:
                    await _sse(resp, chunk(delta))
                sent, sent_reasoning, sent_content = n, thinking, content
            if job.future.done():
                break
    except (ConnectionResetError, asyncio.CancelledError):
        state.batcher.abort(job.rid, "Abort: client disconnected")
        raise
    _record(state, job, n_prompt)
    thinking, content = p.chat_texts(plan, job.tokens, parser, req.enable_thinking)
    calls: list[dict[str, Any]] = []
    if parse_tools:
        assert req.tools is not None
        calls = parse_function_call(content, req.tools, chat_tool_parser(state.args["tool_call_parser"]))[1]
        if calls:
            content = content.split(TOOL_CALL_START, 1)[0]
    finish = _finish(job, plan, bool(calls))
    final_delta: dict[str, Any] = {}
    if thinking.startswith(sent_reasoning) and len(thinking) > len(sent_reasoning):
        final_delta["reasoning_content"] = thinking[len(sent_reasoning) :]
    if content.startswith(sent_content) and len(content) > len(sent_content):
        final_delta["content"] = content[len(sent_content) :]
    if calls:
        final_delta["tool_calls"] = p.tool_calls(plan, calls)
    await _sse(resp, chunk(final_delta, finish))
    if req.include_usage:
        r_tokens = p.split(plan, job.tokens)[0] if count_reasoning else 0
        await _sse(
            resp,
            {
                "id": job.rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [],
                "usage": p.usage(n_prompt, job.tokens, r_tokens),
            },
        )
    await _sse(resp, "[DONE]")
    await resp.write_eof()
    return resp


async def generate(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    if (refused := _refuse_if_draining(request, state)) is not None:
        return refused
    req = p.parse_generate(p.parse_json_object(await request.read()))
    ctx = state.settings.context_length
    ids = text_ids(req.prompt) if isinstance(req.prompt, str) else req.prompt
    n_prompt = len(ids)
    p.check_context(n_prompt, req.max_new_tokens, ctx)
    fault, replacement = await _apply_fault(request, state)
    if replacement is not None:
        return replacement
    # Ids that end with one of our responses continue its sample; anything else is a fresh sample.
    drawn = None
    if not isinstance(req.prompt, str):
        drawn = continued_sample(ids, state.args["sim_seed"], state.settings.length_model,
                                 lambda prompt, sample: _tool_name(state, prompt_tool_names(prompt), sample))
    if drawn is None:
        drawn = _fresh(state, ids, not opens_without_thinking(ids), req.sampling_seed)
    # The prompt's tools (read from its ids, as the model reads them) let the sample end in a call.
    tool_names = prompt_tool_names(ids[: n_prompt - drawn.generated])
    plan = _plan(state, drawn, req.max_new_tokens, req.ignore_eos, tool_names)
    rid = req.rid or p.new_id()
    count_reasoning = bool(state.args["reasoning_parser"])
    accept = state.settings.accept_length
    spec = bool(state.args["speculative_algorithm"])
    state.active += 1
    try:
        try:
            job = _admit(state, plan, rid, fault)
        except _QueueFullResponse:
            return _error(request, "The request queue is full.", 503)
        t0 = job.meta["t_arrival"]

        def body(n: int, done: bool) -> dict[str, Any]:
            # The raw text, a sample's closing tool call included (SGLang's /generate parses nothing), as
            # its detokenizer returns it: decoded after the input's last ids, so a continuation of ids cut
            # inside a character does not repeat what the input's decoding already replaced.
            out_ids = p.output_ids(plan, n)
            text = detokenize(ids, out_ids, done and not job.aborted and plan.ends_with_eos and n >= plan.target)
            if not done:
                text = text.rstrip("\ufffd")
            meta: dict[str, Any] = {"id": rid, "finish_reason": None}
            if done and job.aborted:
                meta["finish_reason"] = p.finish_reason_native("abort", plan.cap, job.abort_message)
                meta["e2e_latency"] = round(time.monotonic() - t0, 6)
                return {"text": text, "output_ids": out_ids, "meta_info": meta}
            if done:
                meta["finish_reason"] = p.finish_reason_native(plan.finish, plan.cap, None)
            meta.update({
                "prompt_tokens": n_prompt, "completion_tokens": n, "cached_tokens": 0,
                "reasoning_tokens": p.split(plan, n)[0] if count_reasoning else 0, "num_retractions": 0,
                "weight_version": state.args["weight_version"] or "default",
                "e2e_latency": round(time.monotonic() - t0, 6),
            })  # fmt: skip
            if spec:
                meta.update(
                    {
                        "spec_accept_length": accept,
                        "spec_accept_rate": round((accept - 1) / accept, 4),
                        "spec_verify_ct": p.ceil_div(n, accept),
                    }
                )
            return {"text": text, "output_ids": out_ids, "meta_info": meta}

        if not req.stream:
            await _wait(job, state)
            _record(state, job, n_prompt)
            return _json(body(job.tokens, True))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        sent = 0
        try:
            while not job.future.done():
                n = await _progress(state, job)
                if n > sent and not job.future.done():
                    # Native streaming sends the cumulative text each time, like SGLang.
                    await _sse(resp, body(n, False))
                    sent = n
        except (ConnectionResetError, asyncio.CancelledError):
            state.batcher.abort(job.rid, "Abort: client disconnected")
            raise
        _record(state, job, n_prompt)
        await _sse(resp, body(job.tokens, True))
        await _sse(resp, "[DONE]")
        await resp.write_eof()
        return resp
    finally:
        state.active -= 1


async def tokenize_endpoint(request: web.Request) -> web.Response:
    """POST /tokenize (/v1/tokenize): SGLang's TokenizeRequest -> TokenizeResponse, with the stand-in's
    tokenizer and chat template."""
    req = p.parse_tokenize(p.parse_json_object(await request.read()))
    if req.messages is not None:
        tokens: Any = text_ids(render_chat(req.messages, req.tools, thinking=req.enable_thinking,
                                           add_generation_prompt=req.add_generation_prompt))
        count: Any = len(tokens)
    elif isinstance(req.prompt, str):
        tokens = text_ids(req.prompt)
        count = len(tokens)
    else:
        tokens = [text_ids(t) for t in req.prompt]
        count = [len(t) for t in tokens]
    return _json({"tokens": tokens, "count": count, "max_model_len": TOKENIZER_MAX_LENGTH})


async def detokenize_endpoint(request: web.Request) -> web.Response:
    """POST /detokenize (/v1/detokenize): SGLang's DetokenizeRequest -> DetokenizeResponse: the tokenizer's
    decode of the ids as they are (special tokens skipped unless told otherwise; unknown ids decode to
    nothing; U+FFFD where the bytes are not whole characters)."""
    req = p.parse_detokenize(p.parse_json_object(await request.read()))
    tok = tokenizer()
    if req.tokens and isinstance(req.tokens[0], list):
        text: Any = [tok.decode(t, req.skip_special_tokens) for t in req.tokens]
    else:
        text = tok.decode(req.tokens, req.skip_special_tokens)  # type: ignore[arg-type]
    return _json({"text": text})


async def separate_reasoning_endpoint(request: web.Request) -> web.Response:
    """POST /separate_reasoning: split raw text exactly as the chat route would."""
    body = p.parse_json_object(await request.read())
    text, parser, blocks = body.get("text"), body.get("reasoning_parser"), body.get("return_blocks", False)
    if not isinstance(text, str) or not isinstance(parser, str) or not isinstance(blocks, bool):
        raise p.BadRequest(
            "separate_reasoning needs text (string), reasoning_parser (string), return_blocks (bool)"
        )
    try:
        reasoning_text, normal_text = separate_reasoning(text, parser)
    except UnsupportedParser:
        # SGLang raises ValueError outside any handler here: the server's plain 500.
        return web.Response(status=500, text="Internal Server Error")
    except UnmodelledParser as exc:
        return _json({"detail": str(exc)}, 501)
    out: dict[str, Any] = {"reasoning_text": reasoning_text, "text": normal_text}
    if blocks:
        parts = ([{"type": "reasoning", "text": reasoning_text}] if reasoning_text else []) + [
            {"type": "text", "text": normal_text}
        ]
        out["reasoning_blocks"] = [b["text"] for b in parts if b["type"] == "reasoning"]
        out["text_blocks"] = [b["text"] for b in parts if b["type"] == "text"]
        out["blocks"] = parts
    return _json(out)


async def parse_function_call_endpoint(request: web.Request) -> web.Response:
    """POST /parse_function_call: SGLang's tool-call parsing of a text, the chat route's own."""
    body = p.parse_json_object(await request.read())
    text, tools, parser = body.get("text"), body.get("tools", []), body.get("tool_call_parser")
    if not isinstance(text, str):
        raise p.BadRequest("parse_function_call needs text (string)")
    if not isinstance(tools, list):
        raise p.BadRequest("tools must be a list of objects")
    for i, tool in enumerate(tools):
        try:
            check_tool(tool, f"tools[{i}]")
        except ValueError as exc:
            raise p.BadRequest(str(exc)) from None
    for key in ("tool_call_parser", "rid", "http_worker_ipc"):
        if body.get(key) is not None and not isinstance(body[key], str):
            raise p.BadRequest(f"{key} must be a string or null")
    try:
        normal_text, calls = parse_function_call(text, tools, parser)
    except AdapterToolParser as exc:
        # An HTTPException(400): SGLang's handler answers it as an ErrorResponse typed by the status code.
        return _json(p.openai_error(str(exc), 400, "400"), 400)
    except UnsupportedToolParser:
        # SGLang raises ValueError outside any handler here: the server's plain 500.
        return web.Response(status=500, text="Internal Server Error")
    except UnmodelledToolParser as exc:
        return _json({"detail": str(exc)}, 501)
    return _json({"normal_text": normal_text, "calls": calls})


# -- lifecycle --------------------------------------------------------------------------------------
def build_app(state: State) -> web.Application:
    app = web.Application(middlewares=[error_middleware, auth_middleware], client_max_size=64 * 1024**2)
    app[STATE] = state
    r = app.router
    for path in ("/health", "/health_generate", "/ready"):
        r.add_get(path, health)
    r.add_get("/model_info", model_info)
    r.add_get("/get_model_info", model_info)
    r.add_get("/server_info", server_info)
    r.add_get("/get_server_info", server_info)
    r.add_get("/v1/models", models)
    r.add_post("/v1/chat/completions", chat_completions)
    r.add_post("/generate", generate)
    r.add_post("/separate_reasoning", separate_reasoning_endpoint)
    for prefix in ("", "/v1"):
        r.add_post(f"{prefix}/tokenize", tokenize_endpoint)
        r.add_post(f"{prefix}/detokenize", detokenize_endpoint)
    r.add_post("/parse_function_call", parse_function_call_endpoint)
    r.add_post("/abort_request", abort_request)
    r.add_get("/sim/faults", get_faults)
    r.add_post("/sim/faults", set_faults)
    if state.args["enable_metrics"]:
        r.add_get("/metrics", metrics_endpoint)
    return app


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        stream=sys.stderr,
        format="[%(asctime)s] %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S",
        force=True,
    )
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING if level != "debug" else logging.DEBUG)


async def serve(settings: SimSettings) -> int:
    """Run the server until drained after SIGTERM/SIGINT. Returns the process exit code."""
    loop = asyncio.get_running_loop()
    a = settings.args
    step = StepModel(
        a["sim_step_base_ms"] / 1000.0, a["sim_step_per_req_ms"] / 1000.0, settings.accept_length
    )
    engine = BatchEngine(settings.max_running, step, a["max_queued_requests"])
    state = State(
        settings=settings,
        batcher=AsyncBatcher(engine, a["sim_time_scale"]),
        injector=FaultInjector(settings.faults),
    )
    state.sync_wedge()
    # Hung (fault-injected) handlers never finish: do not let them hold shutdown for a minute.
    runner = web.AppRunner(build_app(state), handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, a["host"], a["port"])
    try:
        await site.start()
    except OSError as exc:
        log.error("cannot bind %s:%s: %s", a["host"], a["port"], exc)
        await runner.cleanup()
        return 1
    log.info(
        "Uvicorn running on http://%s:%s (stand-in for sglang %s)", a["host"], a["port"], p.SGLANG_VERSION
    )

    stop = asyncio.Event()
    signals = 0

    def on_signal(signum: int) -> None:
        nonlocal signals
        signals += 1
        if signals > 1:  # a second signal: stop draining, exit now
            log.warning("second signal %d: exiting without draining", signum)
            os._exit(1)
        log.info("received signal %d: draining %d in-flight requests", signum, state.batcher.in_flight())
        state.draining = True
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)

    warmup = 0.0 if a["skip_server_warmup"] else a["sim_warmup_s"]
    state.unready_until = loop.time() + warmup + settings.faults.slow_start_s

    async def warm_up() -> None:
        await asyncio.sleep(warmup)
        state.warm = True
        state.warm_at = loop.time()
        state.batcher.start_accounting()
        log.info(READY_LINE)

    warm_task = asyncio.create_task(warm_up())
    await stop.wait()
    warm_task.cancel()
    deadline = loop.time() + a["sim_drain_timeout_s"]
    while (state.batcher.in_flight() or state.active > 0) and loop.time() < deadline:
        await asyncio.sleep(0.02)
    if state.batcher.in_flight():
        log.warning("drain timeout: %d requests still in flight", state.batcher.in_flight())
    log.info("drained; shutting down")
    await runner.cleanup()
    return 0


def main(argv: list[str] | None = None) -> None:
    from tracegen.simulator.cli import parse_args

    settings = parse_args(sys.argv[1:] if argv is None else argv)
    _configure_logging(settings.args["log_level"])
    sys.exit(asyncio.run(serve(settings)))
