"""Extending one truncated row, against a scripted SGLang on loopback: the requests it sends (/generate from
the exact ids with the remaining budget and the row's sampling params, then the server's own parsers on
the whole raw text), the row it builds, and the fallback for a row stored without token ids.

The engine-level pivot against the stand-in is in test_engine.py; this file pins the protocol details the
stand-in cannot show: a server with a tool-call parser, aborts, and the exact bodies.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from tracegen.dataset.reader import PromptRow
from tracegen.generate.extend import Extension, Superseded, extend_row, not_extendable, raw_text
from tracegen.sglang.client import ClientConfig, Sampling, ServerEndpoint, SGLangClient
from tracegen.simulator.reasoning import separate_reasoning
from tracegen.store.records import (
    EXTENDED,
    FAILED,
    FALLBACK_REGENERATED,
    OK,
    GeneratedRow,
    pack_token_ids,
    unpack_token_ids,
)

FAST = dict(backoff_base_s=0.01, backoff_max_s=0.02, probe_interval_s=0.05, probe_timeout_s=2.0, jitter_seed=1)
TOOLS = [{"type": "function", "function": {"name": "run", "parameters": {"type": "object"}}}]
CALL = '<tool_call>\n{"name": "run", "arguments": {"cmd": "pytest"}}\n</tool_call>'


def truncated(**fields: Any) -> GeneratedRow:
    base = dict(index=7, status=OK, max_tokens=4, run_id="r4", chunk=0, id="p7", finish_reason="length",
                content="", reasoning_content="\nthinking so far", completion_tokens=4, reasoning_tokens=4,
                prompt_tokens=3, category="code", prompt_token_ids=pack_token_ids([1, 2, 3]),
                response_token_ids=pack_token_ids([10, 11, 12, 13]))
    return GeneratedRow(**{**base, **fields})


class Scripted:
    """An SGLang with a reasoning and a tool-call parser; /generate aborts once, then finishes the row."""

    def __init__(self, tool_parser: str | None = "qwen25", reasoning_parser: str | None = "qwen3") -> None:
        self.parsers = {"reasoning_parser": reasoning_parser, "tool_call_parser": tool_parser}
        self.seen: list[tuple[str, Any]] = []
        self.generated = 0

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json() if request.method == "POST" else None
        self.seen.append((request.path, body))
        if request.path == "/server_info":
            return web.json_response({**self.parsers, "version": "0.5.23"})
        if request.path == "/generate":
            self.generated += 1
            if self.generated == 1:
                return web.json_response({"text": "", "meta_info": {"finish_reason": {"type": "abort"}}})
            return web.json_response({
                "text": " done\n</think>\n\nCalling." + CALL, "output_ids": [7, 8, 151645],
                "meta_info": {"finish_reason": {"type": "stop", "matched": 151645}, "prompt_tokens": 7,
                              "completion_tokens": 3, "reasoning_tokens": 1}})  # fmt: skip
        if request.path == "/separate_reasoning":
            reasoning, text = separate_reasoning(body["text"], body["reasoning_parser"])
            return web.json_response({"reasoning_text": reasoning, "text": text})
        if request.path == "/parse_function_call":
            normal, _, rest = body["text"].partition("<tool_call>")
            call = json.loads(rest.split("</tool_call>")[0])
            return web.json_response({"normal_text": normal, "calls": [
                {"tool_index": 0, "name": call["name"], "parameters": json.dumps(call["arguments"])}]})
        if request.path == "/v1/chat/completions":
            return web.json_response({
                "id": "c1", "choices": [{"index": 0, "finish_reason": "stop",
                                         "message": {"role": "assistant", "content": "fresh", "reasoning_content": "r"},
                                         "prompt_token_ids": [1, 2, 3], "response_token_ids": [5, 151645]}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 2}})  # fmt: skip
        return web.json_response({"detail": "Not Found"}, status=404)


def extend(server: Scripted, job: Extension, cap: int = 8, **client: Any) -> GeneratedRow:
    async def main() -> GeneratedRow:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", server.handle)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        try:
            async with SGLangClient([ServerEndpoint(url)], ClientConfig(**{**FAST, **client})) as sglang:
                sampling = Sampling(max_tokens=cap, temperature=0.6, top_p=0.95)
                return await extend_row(sglang, job, sampling=sampling, model="m", run_id="r8", chunk=3)
        finally:
            await runner.cleanup()

    return asyncio.run(main())


SUPERSEDED = Superseded(7, 4, "parts/r4/c00000-a.jsonl.gz")


def test_a_row_cut_in_its_thinking_continues_it_and_splits_like_the_chat_route() -> None:
    server = Scripted()
    prompt = PromptRow(7, [{"role": "user", "content": "fix it"}], tools=TOOLS, id="p7")
    # The row was sampled at 0.7 / 0.9 by its run; this run samples at 0.6 / 0.95.
    row = extend(server, Extension(truncated(), SUPERSEDED, prompt, 0.7, 0.9))

    generate = [body for path, body in server.seen if path == "/generate"]
    assert len(generate) == 2  # the abort was tried again, like any transient failure
    # Its exact ids, the budget left under the new cap, and the sampling params it was drawn with.
    # Cut inside its thinking: the server counts the continuation's thinking as such.
    assert generate[-1] == {"input_ids": [1, 2, 3, 10, 11, 12, 13], "stream": False, "require_reasoning": True,
                            "sampling_params": {"max_new_tokens": 4, "temperature": 0.7, "top_p": 0.9}}
    # The server's own split, of the whole raw text: the prefix's thinking runs on into the continuation's.
    whole = "<think>\nthinking so far done\n</think>\n\nCalling." + CALL
    assert ("/separate_reasoning", {"text": whole, "reasoning_parser": "qwen3"}) in server.seen
    assert ("/parse_function_call", {"text": "\n\nCalling." + CALL, "tools": TOOLS, "tool_call_parser": "qwen25"}) \
        in server.seen
    assert row.status == OK and row.max_tokens == 8 and row.run_id == "r8" and row.chunk == 3
    assert row.reasoning_content == "\nthinking so far done\n" and row.content == "\n\nCalling."
    assert row.finish_reason == "tool_calls"
    [call] = row.tool_calls
    assert call["function"] == {"name": "run", "arguments": '{"cmd": "pytest"}'} and call["id"].startswith("call_")
    assert (row.completion_tokens, row.reasoning_tokens, row.prompt_tokens) == (7, 5, 3)
    assert unpack_token_ids(row.response_token_ids) == [10, 11, 12, 13, 7, 8, 151645]
    assert row.prompt_token_ids == truncated().prompt_token_ids
    assert row.provenance == {"action": EXTENDED, "policy": "extend", "supersedes": SUPERSEDED.ref(),
                              "tokens_before": 4, "tokens_after": 7, "new_tokens": 3,
                              "sampling": {"temperature": 0.7, "top_p": 0.9}}
    assert (row.pivot, row.prefix_tokens, row.new_tokens) == (EXTENDED, 4, 3)
    assert row.ledger_values()["pivot"] == EXTENDED and row.ledger_values()["prefix_tokens"] == 4


def test_without_parsers_the_text_stays_whole_as_the_chat_route_leaves_it() -> None:
    server = Scripted(tool_parser=None, reasoning_parser=None)
    # A server without a reasoning parser left the thinking inline in content.
    source = truncated(content="<think>\nthinking so far", reasoning_content=None)
    row = extend(server, Extension(source, SUPERSEDED, None, 0.6, 0.95))
    assert [p for p, _ in server.seen if p in ("/separate_reasoning", "/parse_function_call")] == []
    assert row.content == "<think>\nthinking so far done\n</think>\n\nCalling." + CALL
    assert row.reasoning_content is None and row.tool_calls is None and row.finish_reason == "stop"


def test_a_row_without_token_ids_is_generated_again_and_says_so() -> None:
    server = Scripted()
    prompt = PromptRow(7, [{"role": "user", "content": "fix it"}], id="p7")
    source = truncated(prompt_token_ids=None, response_token_ids=None)
    assert "no token ids" in not_extendable(source)
    row = extend(server, Extension(source, SUPERSEDED, prompt, 0.6, 0.95))
    assert [p for p, _ in server.seen] == ["/v1/chat/completions"]
    assert row.status == OK and row.content == "fresh" and row.completion_tokens == 2
    assert row.provenance["action"] == FALLBACK_REGENERATED and "no token ids" in row.provenance["reason"]
    assert row.provenance["supersedes"] == SUPERSEDED.ref() and row.prefix_tokens == 0


def test_ids_that_do_not_match_the_row_are_not_continued() -> None:
    assert not_extendable(truncated()) is None
    assert "do not match" in not_extendable(truncated(completion_tokens=5))


def test_a_failed_split_fails_the_row_so_a_later_run_extends_it_again() -> None:
    class Broken(Scripted):
        async def handle(self, request: web.Request) -> web.Response:
            if request.path == "/separate_reasoning":
                return web.json_response({"detail": "parser down"}, status=503)
            return await super().handle(request)

    row = extend(Broken(tool_parser=None), Extension(truncated(), SUPERSEDED, None, 0.6, 0.95), max_attempts=2,
                 quarantine_after=5)
    assert row.status == FAILED and "/separate_reasoning" in row.error and "continuing the row cut at 4" in row.error


def test_raw_text_rebuilds_what_the_parser_split() -> None:
    assert raw_text(truncated()) == "<think>\nthinking so far"
    answered = truncated(content="\n\nThe fix", reasoning_content="\nthought\n")
    assert raw_text(answered) == "<think>\nthought\n</think>\n\nThe fix"
    assert separate_reasoning(raw_text(answered), "qwen3") == ("\nthought\n", "\n\nThe fix")
    # A parser that trims can leave content "" right after </think>: the token counts say the answer began.
    assert raw_text(truncated(reasoning_tokens=3)).endswith("</think>")
    assert raw_text(truncated(reasoning_content=None, content="plain")) == "plain"
