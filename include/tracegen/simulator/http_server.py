"""The stand-in's HTTP server: SGLang's routes assembled, warm-up, and a drain on SIGTERM.

Handlers validate the request, ask the fault injector what happens to it, plan its length from the
length model, and hand it to the continuous-batching engine; they wake up only when it finishes (or
every stream interval when streaming), never once per token.

Every generation request is a fresh sample of its prompt (a fixed one only with
--enable-deterministic-inference, from the request's seed), except a /generate whose input_ids end with
a response this stand-in produced: that request finishes the same sample (see `tokens`). Texts are the
decoding of the ids, as SGLang's detokenizer returns it; `/tokenize` and `/detokenize` expose the tokenizer.

The routes, by family: `chat_route` (OpenAI chat), `generate_route` (native, continuation), `text_routes`
(tokenizer and parsers), `info_routes` (health, info, metrics), `control_routes` (faults, abort).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys

from aiohttp import web

from tracegen.simulator import protocol as p
from tracegen.simulator.batching import AsyncBatcher, BatchEngine, PrefillModel, StepModel
from tracegen.simulator.chat_route import chat_completions
from tracegen.simulator.control_routes import abort_request, get_faults, set_faults
from tracegen.simulator.faults import FaultInjector
from tracegen.simulator.generate_route import generate
from tracegen.simulator.info_routes import (
    health,
    kv_capacity,
    metrics_endpoint,
    model_info,
    models,
    server_info,
)
from tracegen.simulator.launch_args import SimSettings
from tracegen.simulator.middleware import auth_middleware, error_middleware
from tracegen.simulator.radix_cache import RadixCache
from tracegen.simulator.state import STATE, State
from tracegen.simulator.text_routes import (
    detokenize_endpoint,
    parse_function_call_endpoint,
    separate_reasoning_endpoint,
    tokenize_endpoint,
)

log = logging.getLogger("tracegen.simulator")
READY_LINE = "The server is fired up and ready to roll!"


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


# SGLang's --chunked-prefill-size when not given, for an 80 GB GPU (its `_handle_gpu_memory_settings`).
DEFAULT_CHUNKED_PREFILL_SIZE = 8192


def prefill_model(settings: SimSettings) -> PrefillModel:
    """The prefill rate per GPU, chunked as SGLang chunks (-1: a prompt in one step, as unchunked SGLang)."""
    a = settings.args
    chunk = a["chunked_prefill_size"] or DEFAULT_CHUNKED_PREFILL_SIZE
    if chunk < 0:
        chunk = settings.context_length
    return PrefillModel(a["sim_prefill_tokens_per_s"], chunk, bool(a["enable_mixed_chunk"]))


def prefix_cache(settings: SimSettings) -> RadixCache | None:
    """The server's radix cache over its KV budget, pages of --page-size (1, SGLang's default), none with
    --disable-radix-cache."""
    if settings.args["disable_radix_cache"]:
        return None
    return RadixCache(kv_capacity(settings), settings.args["page_size"] or 1)


def build_state(settings: SimSettings) -> State:
    """A server's state on the running event loop: its engine (steps, prefill, prefix cache), faults, metrics."""
    a = settings.args
    step = StepModel(
        a["sim_step_base_ms"] / 1000.0, a["sim_step_per_req_ms"] / 1000.0, settings.accept_length
    )
    engine = BatchEngine(
        settings.max_running, step, a["max_queued_requests"], prefill_model(settings), prefix_cache(settings)
    )
    state = State(
        settings=settings,
        batcher=AsyncBatcher(engine, a["sim_time_scale"]),
        injector=FaultInjector(settings.faults),
    )
    state.sync_wedge()
    return state


async def serve(settings: SimSettings) -> int:
    """Run the server until drained after SIGTERM/SIGINT. Returns the process exit code."""
    loop = asyncio.get_running_loop()
    a = settings.args
    state = build_state(settings)
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
    from tracegen.simulator.launch_args import parse_args

    settings = parse_args(sys.argv[1:] if argv is None else argv)
    _configure_logging(settings.args["log_level"])
    sys.exit(asyncio.run(serve(settings)))
