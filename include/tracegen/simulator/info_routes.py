"""What the server reports about itself: health, the model and server info, the model list, /metrics.

Each is SGLang's route with SGLang's keys; the stand-in's own figures (occupancy, faults, the resolved length
law) sit beside them under `sim_` names so a client reading SGLang's keys sees only SGLang's.
"""

from __future__ import annotations

import shlex
import sys
from typing import Any

from aiohttp import web

from tracegen.simulator import metrics as prom
from tracegen.simulator import protocol as p
from tracegen.simulator.launch_args import SimSettings
from tracegen.simulator.responses import json_response
from tracegen.simulator.state import STATE, State

# SGLang's scheduler-side metric labels for one server (no pipeline, tensor or expert parallelism).
_SCHEDULER_LABELS = {"engine_type": "unified", "tp_rank": "0", "pp_rank": "0", "moe_ep_rank": "0"}


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
    return json_response({
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
        "busy_sim_s": round(e.busy_s, 6),
        "available_slot_sim_s": round(available, 6),
        "occupancy": round(e.busy_slot_s / available, 6) if available > 0 else 0.0,
        "tokens_generated": e.tokens_generated(),
        "sim_seconds_since_warm": round(e.now - e.accounting_since, 6)
        if e.accounting_since is not None
        else 0.0,
        "time_scale": b.time_scale,
        "max_running_requests": e.max_running,
        "num_running_reqs": e.slots_used(),
        "num_queue_reqs": len(e.waiting),
        "prompt_tokens_cached": e.prompt_tokens_cached,
        "prefill_tokens_computed": e.prompt_tokens_computed,
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
    # --config is read into the other args by the parser; SGLang's ServerArgs has no field of that name.
    info.pop("config", None)
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
            k: getattr(model, k)
            for k in ("kind", "median", "sigma", "prompt_share", "runaway_rate", "loop_shape", "fixed")
        },
        "truncated_share_at_4096": round(model.survival(4096), 6),
        "truncated_share_at_8192": round(model.survival(8192), 6),
    }
    return json_response(info)


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    name = state.args["served_model_name"]
    return json_response({"object": "list", "data": [{
        "id": name, "object": "model", "created": int(state.started_wall), "owned_by": "sglang",
        "root": name, "parent": None, "max_model_len": state.settings.context_length,
    }]})  # fmt: skip


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
        breakdown = {"num_running_reqs": _by_priority(state, [*e.running.values(), *e.prefilling]),
                     "num_queue_reqs": _by_priority(state, e.waiting)}  # fmt: skip
        state.known_priorities.update(*breakdown.values())
    gauges = {
        "num_running_reqs": occ["num_running_reqs"],
        "num_queue_reqs": occ["num_queue_reqs"],
        "gen_throughput": round(_gen_throughput(state), 3),
        "token_usage": round(e.slots_used() / e.max_running, 6),
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
        "busy_seconds_total": occ["busy_sim_s"],
        "available_slot_seconds_total": occ["available_slot_sim_s"],
        "occupancy": occ["occupancy"],
        "generated_tokens_total": occ["tokens_generated"],
        # What prompts cost: tokens the prefix cache held when a prefill started, and tokens computed.
        "prompt_tokens_cached_total": occ["prompt_tokens_cached"],
        "prefill_tokens_computed_total": occ["prefill_tokens_computed"],
    }
    body = prom.render(scheduler, tokenizer, m, gauges, counters, sim, breakdown)
    return web.Response(text=body, content_type="text/plain", charset="utf-8")
