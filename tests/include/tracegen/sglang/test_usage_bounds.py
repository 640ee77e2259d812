"""A server's token counts are bounded: usage must agree with the token ids the same
response returns and stay within the request's cap. Otherwise the response is a server fault of its own
kind (`InconsistentUsage`, a `MalformedResponse`): retried like any bad body, never committed as a row.

Through the client against a scripted SGLang-shaped server on loopback (real HTTP), as a chunk's rows and
a truncated row's continuation reach it, and through the parsers."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp import web

from tracegen.generate.rows import complete_row
from tracegen.sglang.client import ChatRequest, ClientConfig, Sampling, ServerEndpoint, SGLangClient
from tracegen.sglang.usage import InconsistentUsage
from tracegen.sglang.wire import MalformedResponse, parse_completion, parse_generate

MESSAGES = [{"role": "user", "content": "hello"}]
FAST = dict(backoff_base_s=0.01, backoff_max_s=0.02, probe_interval_s=0.05, probe_timeout_s=2.0, jitter_seed=1)


def chat(completion_tokens: int, *, ids: list[int] | None = None, finish: str = "stop", reasoning: int = 0,
         prompt_ids: list[int] | None = None, prompt_tokens: int = 3, cached: Any = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish,
                              "message": {"role": "assistant", "content": "42", "reasoning_content": None}}
    if ids is not None:
        choice["response_token_ids"] = ids
        choice["prompt_token_ids"] = prompt_ids if prompt_ids is not None else [7] * prompt_tokens
    return {"id": "cmpl-1", "object": "chat.completion", "choices": [choice],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens, "reasoning_tokens": reasoning,
                      # As SGLang 0.5.23 reports it: null without --enable-cache-report.
                      "prompt_tokens_details": None if cached is None else {"cached_tokens": cached}}}


def generated(completion_tokens: int, ids: list[int] | None, finish: str = "stop", cached: Any = 0) -> dict[str, Any]:
    meta = {"finish_reason": {"type": finish}, "prompt_tokens": 5, "completion_tokens": completion_tokens,
            "reasoning_tokens": 0}
    if cached is not None:  # every /generate answer of SGLang 0.5.23 says it; an older server may not
        meta["cached_tokens"] = cached
    return {"text": "more", "output_ids": ids, "meta_info": meta}


async def _serve(replies: list[dict[str, Any]], seen: list[Any]) -> tuple[web.AppRunner, str]:
    async def handler(request: web.Request) -> web.Response:
        if request.path == "/health":
            return web.Response(status=200)
        seen.append(await request.json())
        return web.json_response(replies[min(len(seen) - 1, len(replies) - 1)])

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]


def complete(replies: list[dict[str, Any]], *, max_tokens: int = 16, attempts: int = 6):
    seen: list[Any] = []

    async def main():
        runner, url = await _serve(replies, seen)
        try:
            cfg = ClientConfig(max_attempts=attempts, quarantine_after=50, **FAST)
            async with SGLangClient([ServerEndpoint(url)], cfg) as client:
                return await complete_row(
                    client, ChatRequest(0, MESSAGES, sampling=Sampling(max_tokens=max_tokens), model="m"),
                    run_id="r", chunk=0)
        finally:
            await runner.cleanup()

    return asyncio.run(main()), seen


def continue_row(replies: list[dict[str, Any]], *, max_new_tokens: int = 8, attempts: int = 6):
    seen: list[Any] = []

    async def main():
        runner, url = await _serve(replies, seen)
        try:
            cfg = ClientConfig(max_attempts=attempts, quarantine_after=50, **FAST)
            async with SGLangClient([ServerEndpoint(url)], cfg) as client:
                return await client.generate([1, 2, 3], max_new_tokens=max_new_tokens,
                                             sampling=Sampling(max_tokens=16))
        finally:
            await runner.cleanup()

    return asyncio.run(main()), seen


# ---- through the client -----------------------------------------------------------------


def test_counts_beyond_the_cap_or_the_ids_are_retried_and_the_honest_answer_is_kept() -> None:
    # The attack: taken at its word, the first answer is committed as an ok row of 10**12 completion tokens.
    row, seen = complete([chat(10**12), chat(9000, ids=[11, 12]), chat(2, ids=[11, 12])], max_tokens=16)
    assert len(seen) == 3 and seen[0]["max_tokens"] == 16
    assert (row.status, row.attempt, row.completion_tokens, row.finish_reason) == ("ok", 3, 2, "stop")


@pytest.mark.parametrize(("reply", "needle"), [
    (chat(10**12), "usage.completion_tokens is 1,000,000,000,000, above the request's max_tokens of 16"),
    (chat(9000, ids=[11, 12]), "usage.completion_tokens is 9,000 but the response returned 2 output token ids"),
    (chat(17, finish="length"), "usage.completion_tokens is 17, above the request's max_tokens of 16"),
    (chat(2, ids=[11, 12], prompt_ids=[1]), "usage.prompt_tokens is 3 but the response returned 1 prompt token ids"),
    (chat(2, reasoning=5), "usage.reasoning_tokens is 5, above completion_tokens (2)"),
    (chat(2, cached=4), "usage.prompt_tokens_details.cached_tokens is 4, above prompt_tokens (3)"),
], ids=["10^12-stop", "9000-for-2-ids", "over-the-cap", "prompt-ids", "reasoning-over-completion",
        "cached-over-prompt"])
def test_a_server_that_keeps_miscounting_leaves_a_failed_row_naming_it(reply, needle) -> None:
    row, seen = complete([reply], max_tokens=16, attempts=2)
    assert len(seen) == 2  # retried like any bad body
    assert row.status == "failed" and row.completion_tokens == 0  # nothing of it is kept
    assert f"usage inconsistent with the response: {needle}" in row.error, row.error


def test_a_continuation_is_held_to_its_max_new_tokens_and_its_output_ids() -> None:
    out, seen = continue_row([generated(9000, [11, 12]), generated(10**12, None), generated(2, [11, 12])])
    assert len(seen) == 3 and seen[0]["sampling_params"]["max_new_tokens"] == 8
    assert out.value is not None and (out.value.completion_tokens, out.value.output_ids, out.attempt) == (2, [11, 12], 3)
    out, _ = continue_row([generated(9, None, "length")], attempts=2)
    assert out.value is None and "meta_info.completion_tokens is 9, above the request's max_new_tokens of 8" in out.failed


def test_a_continuation_finding_more_cached_than_it_sent_is_refused() -> None:
    out, seen = continue_row([generated(2, [11, 12], cached=6)], attempts=2)
    assert len(seen) == 2 and out.value is None
    assert "usage inconsistent with the response: meta_info.cached_tokens is 6, above prompt_tokens (5)" in out.failed


def test_the_cached_count_is_kept_where_reported_and_unknown_where_not() -> None:
    row, _ = complete([chat(2, ids=[11, 12], cached=2)])
    assert (row.status, row.prompt_tokens, row.cached_tokens, row.ledger_values()["cached_tokens"]) == ("ok", 3, 2, 2)
    # The chat route without --enable-cache-report: unknown, never 0.
    row, _ = complete([chat(2, ids=[11, 12])])
    assert row.status == "ok" and row.cached_tokens is None and row.ledger_values()["cached_tokens"] is None
    out, _ = continue_row([generated(2, [11, 12], cached=4)])
    assert out.value is not None and out.value.cached_tokens == 4
    out, _ = continue_row([generated(2, [11, 12], cached=None)])
    assert out.value is not None and out.value.cached_tokens is None


# ---- the parsers -----------------------------------------------------------------------------------


def test_counts_that_agree_are_read_as_given() -> None:
    c = parse_completion(json.dumps(chat(16, ids=list(range(16)), finish="length", reasoning=4)).encode(),
                         max_tokens=16)
    assert (c.completion_tokens, c.reasoning_tokens, len(c.response_token_ids or [])) == (16, 4, 16)
    # Without ids and without a cap (the health probe), only the counts' own consistency is checked.
    assert parse_completion(json.dumps(chat(10**6)).encode()).completion_tokens == 10**6
    g = parse_generate(json.dumps(generated(3, [1, 2, 3])).encode(), max_new_tokens=3)
    assert g.completion_tokens == 3


def test_inconsistent_usage_is_a_malformed_response_of_its_own_kind() -> None:
    with pytest.raises(InconsistentUsage) as info:
        parse_completion(json.dumps(chat(9000, ids=[1, 2])).encode(), max_tokens=16)
    assert isinstance(info.value, MalformedResponse) and info.value.kind == "usage inconsistent with the response"
    with pytest.raises(InconsistentUsage, match="2 output token ids"):
        parse_generate(json.dumps(generated(9000, [1, 2])).encode())


@pytest.mark.parametrize("bad", [[11, True], [11, -1], [11, 1 << 32], [11, 12.0], [11, "12"], [[11]], "11 12", {"0": 11}])
def test_ids_that_are_not_token_ids_are_a_malformed_answer(bad):
    # JSON `true` is an int to Python; a float, a string or a nested list is no token id either.
    body = chat(2, ids=[11, 12])
    body["choices"][0]["response_token_ids"] = bad
    with pytest.raises(MalformedResponse, match="response_token_ids must be a list of token ids"):
        parse_completion(json.dumps(body).encode())
    body = chat(2, ids=[11, 12], prompt_ids=[1, 2, 3])
    body["choices"][0]["prompt_token_ids"] = bad
    with pytest.raises(MalformedResponse, match="prompt_token_ids must be a list of token ids"):
        parse_completion(json.dumps(body).encode())
    assert parse_completion(json.dumps(chat(2, ids=[0, (1 << 32) - 1])).encode()).response_token_ids == [0, (1 << 32) - 1]


@pytest.mark.parametrize("bad", [-1, True, 2.0, "2", [2]])
def test_a_cached_count_that_is_no_count_is_a_malformed_answer_naming_its_field(bad):
    with pytest.raises(MalformedResponse, match="usage.prompt_tokens_details.cached_tokens must be a non-negative"):
        parse_completion(json.dumps(chat(2, cached=bad)).encode())
    with pytest.raises(MalformedResponse, match="meta_info.cached_tokens must be a non-negative"):
        parse_generate(json.dumps(generated(2, [1, 2], cached=bad)).encode())
    body = chat(2)
    body["usage"]["prompt_tokens_details"] = [bad]
    with pytest.raises(MalformedResponse, match="usage.prompt_tokens_details must be an object or null"):
        parse_completion(json.dumps(body).encode())
