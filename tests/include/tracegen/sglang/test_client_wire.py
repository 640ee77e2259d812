"""The client against small scripted HTTP servers on loopback: malformed bodies, odd statuses, config
validation, and the pure pieces (body building, response parsing, backoff, status classification).

The scripted server is real aiohttp over TCP; it exists because the SGLang stand-in (rightly) never sends
broken JSON, and the client must survive a server that does.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Awaitable, Callable

import pytest
from aiohttp import web

from tracegen.generate.rows import complete_row
from tracegen.sglang.client import (
    ChatRequest,
    ClientConfig,
    FatalClientError,
    Sampling,
    ServerEndpoint,
    SGLangClient,
)
from tracegen.sglang.retry import FATAL, REJECTED, TRANSIENT, backoff_delay, classify_status
from tracegen.sglang.wire import (
    MalformedResponse,
    ServerParsers,
    build_body,
    build_generate_body,
    error_message,
    parse_completion,
    parse_function_calls,
    parse_generate,
    parse_separate_reasoning,
    parse_server_parsers,
)

MESSAGES = [{"role": "user", "content": "hello"}]
FAST = dict(backoff_base_s=0.01, backoff_max_s=0.02, probe_interval_s=0.05, probe_timeout_s=2.0, jitter_seed=1)


def good_body(**overrides: object) -> dict:
    body = {
        "id": "cmpl-1",
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "42", "reasoning_content": "think", "tool_calls": None},
                "finish_reason": "stop",
            }
        ],
        "usage": {
            "prompt_tokens": 5,
            "completion_tokens": 7,
            "total_tokens": 12,
            "reasoning_tokens": 3,
            "completion_tokens_details": {"reasoning_tokens": 3},
        },
    }
    body.update(overrides)
    return body


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def serve(handler: Handler) -> tuple[web.AppRunner, str]:
    """A real HTTP server on a free loopback port answering every path with `handler`."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


def run(coro: Awaitable[object]) -> object:
    return asyncio.run(coro)  # type: ignore[arg-type]


# -- pure pieces ---------------------------------------------------------------------------------


def test_parse_completion_reads_all_fields() -> None:
    c = parse_completion(json.dumps(good_body()).encode())
    assert (c.id, c.content, c.reasoning_content, c.finish_reason) == ("cmpl-1", "42", "think", "stop")
    assert (c.prompt_tokens, c.completion_tokens, c.reasoning_tokens) == (5, 7, 3)


def test_parse_completion_reasoning_tokens_from_details_or_absent() -> None:
    body = good_body()
    del body["usage"]["reasoning_tokens"]
    assert parse_completion(json.dumps(body).encode()).reasoning_tokens == 3
    del body["usage"]["completion_tokens_details"]
    assert parse_completion(json.dumps(body).encode()).reasoning_tokens == 0


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (b"<html>502 Bad Gateway</html>", "not JSON"),
        (b"[1, 2]", "JSON list"),
        (json.dumps(good_body(choices=[])).encode(), "choices"),
        (json.dumps(good_body(usage=None)).encode(), "usage"),
        (json.dumps(good_body(usage={"prompt_tokens": "5", "completion_tokens": 1})).encode(), "prompt_tokens"),
        (json.dumps(good_body(usage={"prompt_tokens": 5})).encode(), "completion_tokens"),
        (
            json.dumps(good_body(choices=[{"message": {"content": 1}, "finish_reason": "stop"}])).encode(),
            "content",
        ),
        (json.dumps(good_body(choices=[{"message": {}, "finish_reason": "weird"}])).encode(), "finish_reason"),
        (json.dumps(good_body(choices=[{"finish_reason": "stop"}])).encode(), "message"),
    ],
)
def test_parse_completion_rejects_malformed(raw: bytes, needle: str) -> None:
    with pytest.raises(MalformedResponse, match=needle):
        parse_completion(raw)


def test_abort_needs_no_usage() -> None:
    body = good_body(choices=[{"message": {"content": ""}, "finish_reason": "abort"}], usage=None)
    assert parse_completion(json.dumps(body).encode()).finish_reason == "abort"


def test_error_message_shapes() -> None:
    flat = {"object": "error", "message": "too long", "type": "BadRequest", "code": 400}
    assert error_message(json.dumps(flat).encode(), 400) == "too long"
    assert error_message(json.dumps({"error": {"message": "nested"}}).encode(), 400) == "nested"
    assert error_message(json.dumps({"error": "Unauthorized"}).encode(), 401) == "Unauthorized"
    assert error_message(b"plain text", 502) == "plain text"
    assert "empty body" in error_message(b"", 500)


def test_build_body_includes_only_what_is_set() -> None:
    body = json.loads(build_body(ChatRequest(0, MESSAGES, model="m", sampling=Sampling(8, 0.6, 0.95, None))))
    assert body == {
        "model": "m",
        "messages": MESSAGES,
        "max_tokens": 8,
        "temperature": 0.6,
        "top_p": 0.95,
        # What the chat route would otherwise take from the model's generation config: sent, every one.
        "top_k": 20,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "stream": False,
    }
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    body = json.loads(
        build_body(ChatRequest(0, MESSAGES, model="m", sampling=Sampling(8, 0, 1, 3), tools=tools,
                               extra={"chat_template_kwargs": {"enable_thinking": False}}))
    )
    assert body["seed"] == 3 and body["tools"] == tools and body["chat_template_kwargs"] == {"enable_thinking": False}
    with pytest.raises(ValueError, match="JSON"):
        build_body(ChatRequest(0, [{"content": object()}], model="m", sampling=Sampling(8, 0, 1, None)))


def test_token_ids_are_asked_for_and_read_back() -> None:
    body = json.loads(build_body(ChatRequest(0, MESSAGES, model="m", sampling=Sampling(8, 0.6, 0.95, None)),
                                 return_token_ids=True))
    assert body["return_token_ids"] is True and body["stream"] is False
    choice = {**good_body()["choices"][0], "prompt_token_ids": [1, 2, 3], "response_token_ids": [9, 151645]}
    # The usage the ids imply (counts that disagree with them are a server fault: test_usage_bounds.py).
    usage = {**good_body()["usage"], "prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
             "reasoning_tokens": 1, "completion_tokens_details": {"reasoning_tokens": 1}}
    c = parse_completion(json.dumps(good_body(choices=[choice], usage=usage)).encode())
    assert (c.prompt_token_ids, c.response_token_ids) == ([1, 2, 3], [9, 151645])
    assert parse_completion(json.dumps(good_body()).encode()).response_token_ids is None  # not asked, not there
    for bad in ([1, "2"], [True], [-1], "1 2 3"):
        broken = {**choice, "response_token_ids": bad}
        with pytest.raises(MalformedResponse, match="response_token_ids"):
            parse_completion(json.dumps(good_body(choices=[broken], usage=usage)).encode())


def test_generate_body_and_response() -> None:
    body = json.loads(build_generate_body([5, 6, 7], max_new_tokens=4096, sampling=Sampling(4096, 0.6, 0.95, None)))
    # Every param the chat route would take from the model's generation config, sent as the chat route gets it.
    assert body == {"input_ids": [5, 6, 7], "stream": False,
                    "sampling_params": {"max_new_tokens": 4096, "temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                        "min_p": 0.0, "repetition_penalty": 1.0}}
    seeded = json.loads(build_generate_body([5], max_new_tokens=1, sampling=Sampling(1, 0, 1, 3, top_k=0),
                                            require_reasoning=True))
    assert seeded["sampling_params"]["sampling_seed"] == 3 and seeded["require_reasoning"] is True
    assert seeded["sampling_params"]["top_k"] == -1  # 0, no top-k, is SGLang's -1
    meta = {"finish_reason": {"type": "stop", "matched": 151645}, "prompt_tokens": 4100, "completion_tokens": 3,
            "reasoning_tokens": 1}
    g = parse_generate(json.dumps({"text": " end</think>ok", "output_ids": [1, 2, 151645], "meta_info": meta}).encode())
    assert (g.text, g.output_ids, g.finish_reason, g.prompt_tokens, g.completion_tokens, g.reasoning_tokens) == (
        " end</think>ok", [1, 2, 151645], "stop", 4100, 3, 1)
    cut = {**meta, "finish_reason": {"type": "length", "length": 3}}
    del cut["reasoning_tokens"]  # a server without a reasoning parser does not count thinking
    g = parse_generate(json.dumps({"text": "x", "output_ids": [1, 2, 3], "meta_info": cut}).encode())
    assert g.finish_reason == "length" and g.reasoning_tokens == 0
    aborted = {"text": "", "meta_info": {"finish_reason": {"type": "abort", "message": "Abort request"}}}
    assert parse_generate(json.dumps(aborted).encode()).finish_reason == "abort"
    for bad, needle in [({"meta_info": meta}, "'text'"), ({"text": "x"}, "meta_info"),
                        ({"text": "x", "meta_info": {**meta, "finish_reason": "stop"}}, "finish_reason"),
                        ({"text": "x", "meta_info": {**meta, "completion_tokens": None}}, "completion_tokens"),
                        ({"text": "x", "output_ids": "12", "meta_info": meta}, "output_ids")]:
        with pytest.raises(MalformedResponse, match=needle):
            parse_generate(json.dumps(bad).encode())


def test_parser_routes_responses() -> None:
    assert parse_separate_reasoning(b'{"reasoning_text": "r", "text": "t"}') == ("r", "t")
    with pytest.raises(MalformedResponse, match="reasoning_text"):
        parse_separate_reasoning(b'{"text": "t"}')
    ids = iter(["call_a", "call_b"])
    normal, calls = parse_function_calls(json.dumps({"normal_text": "n", "calls": [
        {"tool_index": 3, "name": "run", "parameters": '{"cmd": "ls"}'}, {"name": "x", "parameters": "{}"}]}).encode(),
        lambda: next(ids))  # indices are the calls' ordinals, as the chat route numbers them
    assert normal == "n" and calls == [
        {"id": "call_a", "index": 0, "type": "function", "function": {"name": "run", "arguments": '{"cmd": "ls"}'}},
        {"id": "call_b", "index": 1, "type": "function", "function": {"name": "x", "arguments": "{}"}}]
    with pytest.raises(MalformedResponse, match="parameters"):
        parse_function_calls(b'{"normal_text": "", "calls": [{"name": "x"}]}', lambda: "id")
    assert parse_server_parsers(b'{"reasoning_parser": "qwen3", "tool_call_parser": null}') == ServerParsers("qwen3", None)
    assert parse_server_parsers(b'{"reasoning_parser": ""}') == ServerParsers(None, None)
    with pytest.raises(MalformedResponse, match="tool_call_parser"):
        parse_server_parsers(b'{"tool_call_parser": 3}')


def test_classify_status() -> None:
    assert [classify_status(s) for s in (500, 502, 503, 429, 408)] == [TRANSIENT] * 5
    assert [classify_status(s) for s in (400, 413, 422)] == [REJECTED] * 3
    assert [classify_status(s) for s in (401, 403, 404, 302)] == [FATAL] * 4


def test_backoff_grows_is_capped_and_jittered() -> None:
    rng = random.Random(0)
    delays = [backoff_delay(a, 1.0, 8.0, rng) for a in range(1, 8)]
    for attempt, d in enumerate(delays, start=1):
        ceiling = min(8.0, 2.0 ** (attempt - 1))
        assert ceiling / 2 <= d <= ceiling
    assert len({round(d, 6) for d in delays}) == len(delays)
    with pytest.raises(ValueError, match="attempt"):
        backoff_delay(0, 1.0, 8.0, rng)


@pytest.mark.parametrize(
    ("factory", "needle"),
    [
        (lambda: ServerEndpoint("127.0.0.1:30000"), "http://"),
        (lambda: ServerEndpoint("http://h:1", max_in_flight=0), "max_in_flight"),
        (lambda: ServerEndpoint("http://h:1", api_key=""), "api_key"),
        (lambda: ClientConfig(request_deadline_s=0), "request_deadline_s"),
        (lambda: ClientConfig(max_attempts=0), "max_attempts"),
        (lambda: ClientConfig(backoff_base_s=5, backoff_max_s=1), "backoff_max_s"),
        (lambda: SGLangClient([]), "at least one"),
        (lambda: SGLangClient([ServerEndpoint("http://h:1/"), ServerEndpoint("http://h:1")]), "distinct"),
    ],
)
def test_bad_configuration_is_a_clear_error(factory: Callable[[], object], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        factory()


def test_api_key_is_not_in_repr() -> None:
    assert "sekrit" not in repr(ServerEndpoint("http://h:1", api_key="sekrit"))


# -- against scripted servers ----------------------------------------------------------------------


def test_malformed_bodies_are_retried_then_succeed() -> None:
    replies = [b"<html>oops</html>", json.dumps(good_body(usage={})).encode(), json.dumps(good_body()).encode()]
    seen = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(await request.json())
        return web.Response(body=replies[min(len(seen) - 1, 2)], content_type="application/json")

    async def main() -> None:
        runner, url = await serve(handler)
        try:
            async with SGLangClient([ServerEndpoint(url)], ClientConfig(**FAST)) as client:
                row = await complete_row(client, ChatRequest(3, MESSAGES, sampling=Sampling(max_tokens=16), model="m"),
                                         run_id="r", chunk=0)
        finally:
            await runner.cleanup()
        assert row.status == "ok" and row.attempt == 3 and row.content == "42"
        assert seen[0]["max_tokens"] == 16 and seen[0]["messages"] == MESSAGES

    run(main())


def test_malformed_forever_gives_failed_row_naming_the_problem() -> None:
    async def handler(request: web.Request) -> web.Response:
        if request.path == "/health":
            return web.Response(status=200)
        return web.Response(body=b"{not json", content_type="application/json")

    async def main() -> None:
        runner, url = await serve(handler)
        try:
            cfg = ClientConfig(max_attempts=2, quarantine_after=5, **FAST)
            async with SGLangClient([ServerEndpoint(url)], cfg) as client:
                row = await complete_row(client, ChatRequest(0, MESSAGES, sampling=Sampling(max_tokens=16), model="m"),
                                         run_id="", chunk=0)
        finally:
            await runner.cleanup()
        assert row.status == "failed" and row.attempt == 2
        assert "malformed response" in row.error and "not JSON" in row.error and url in row.error

    run(main())


def test_404_is_fatal_and_latches() -> None:
    async def handler(request: web.Request) -> web.Response:
        return web.json_response({"detail": "Not Found"}, status=404)

    async def main() -> None:
        runner, url = await serve(handler)
        try:
            async with SGLangClient([ServerEndpoint(url)], ClientConfig(**FAST)) as client:
                with pytest.raises(FatalClientError, match="404"):
                    await client.complete(ChatRequest(0, MESSAGES, sampling=Sampling(max_tokens=16), model="m"))
                with pytest.raises(FatalClientError):
                    await client.complete(ChatRequest(1, MESSAGES, sampling=Sampling(max_tokens=16), model="m"))
        finally:
            await runner.cleanup()

    run(main())


def test_bad_messages_are_a_clear_error() -> None:
    async def main() -> None:
        async with SGLangClient([ServerEndpoint("http://127.0.0.1:9")]) as client:
            with pytest.raises(ValueError, match="row 7: messages"):
                await client.complete(ChatRequest(7, [], sampling=Sampling(max_tokens=16), model="m"))

    run(main())


def test_nothing_listening_becomes_fatal_after_all_down_window() -> None:
    async def main() -> None:
        # A port nobody listens on: connect errors -> quarantine -> probes fail -> fatal after the window.
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cfg = ClientConfig(quarantine_after=2, all_down_fatal_s=0.5, max_attempts=50, **FAST)
        async with SGLangClient([ServerEndpoint(f"http://127.0.0.1:{port}")], cfg) as client:
            with pytest.raises(FatalClientError, match="unusable for more than 0.5 s") as info:
                await client.complete(ChatRequest(0, MESSAGES, sampling=Sampling(max_tokens=16), model="m"))
            assert "ConnectError" in str(info.value)
            assert client.stats()[0]["quarantined"]

    run(main())
