"""tracegen's SGLang client against a real SGLang server (fixtures.real_sglang): every kind of request it sends.

The model is tiny and random (fixtures/tiny_qwen3.py), so these tests judge the protocol, never the text: the
answers parse, their counts agree with their ids, the ids are the server's own tokenization, a streamed answer
is the whole one, an abort frees the request on the server, and the refusals are refusals.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tracegen.audit.loop_stop import LoopVerdict, LoopWatch
from tracegen.sglang.autotune import parse_metrics
from tracegen.sglang.client import ChatRequest, ClientConfig, ServerEndpoint, SGLangClient
from tracegen.sglang.settings import Sampling
from tracegen.sglang.stream import STOPPED

pytestmark = pytest.mark.real_sglang

MODEL = "qwen3-tiny"
TOOLS = [{"type": "function", "function": {
    "name": "run_tests", "description": "Run the test suite",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]  # fmt: skip
MESSAGES = [{"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": "The build fails in parser.py; find out why and fix it."}]  # fmt: skip
GREEDY = Sampling(max_tokens=40, temperature=0.0, top_p=1.0, top_k=0)
END_OF_TURN = 151645  # <|im_end|>, at Qwen3's id in the stand-in's tokenizer the tiny model uses
FAST = dict(backoff_base_s=0.01, backoff_max_s=0.05, request_deadline_s=120.0)


def run(url: str, scenario, **config):
    async def main():
        endpoint = ServerEndpoint(url, max_in_flight=4, name="real-sglang:gpu0")
        async with SGLangClient([endpoint], ClientConfig(**{**FAST, **config})) as client:
            return await scenario(client)

    return asyncio.run(main())


def metrics(url: str) -> dict[str, float]:
    return parse_metrics(httpx.get(f"{url}/metrics", timeout=10).text)


class AfterIds:
    """Stops the request once `n` ids arrived."""

    def __init__(self, n: int) -> None:
        self.n, self.fed = n, []

    def feed(self, new_ids):
        self.fed.extend(new_ids)
        return {"after": len(self.fed)} if len(self.fed) >= self.n else None


def test_a_chat_completion_with_tools_and_reasoning_parses_and_its_ids_are_the_servers(real_sglang):
    request = ChatRequest(0, MESSAGES, model=MODEL, sampling=Sampling(max_tokens=24), tools=TOOLS)

    async def scenario(client):
        return await client.complete(request), await client.tokenize(request)

    # SGLang samples afresh: the tiny model's first token is now and then its end of turn, which leaves
    # nothing to parse. Such a sample is reported empty; the next one is asked.
    for _ in range(5):
        done, tokenized = run(real_sglang.url, scenario)
        assert done.value is not None, done
        c = done.value
        assert c.finish_reason in ("stop", "length") and c.prompt_tokens == len(c.prompt_token_ids)
        assert c.completion_tokens == len(c.response_token_ids) <= 24
        if c.response_token_ids != [END_OF_TURN]:
            break
        assert not c.reasoning_content and c.content == "" and c.tool_calls is None
    else:
        pytest.fail("five samples in a row ended at their first token")
    # The tiny model never writes </think>: Qwen3's parser then holds the whole output as reasoning.
    assert c.reasoning_content and c.content == "" and c.tool_calls is None
    assert 0 < c.reasoning_tokens <= c.completion_tokens
    # /v1/tokenize of the same messages and tools is the prompt the chat route generated from.
    assert tokenized.value == c.prompt_token_ids
    assert c.prompt_token_ids[-3:] == [151644, 77091, 198] or c.prompt_token_ids[-1] == 198


def test_generate_continues_a_cut_completion_from_its_ids(real_sglang):
    first = ChatRequest(1, MESSAGES, model=MODEL, sampling=GREEDY)

    async def scenario(client):
        cut = (await client.complete(first)).value
        more = await client.generate(cut.prompt_token_ids + cut.response_token_ids, max_new_tokens=16,
                                     sampling=GREEDY, require_reasoning=True)  # fmt: skip
        return cut, more.value

    cut, more = run(real_sglang.url, scenario)
    assert cut.finish_reason == "length" and cut.completion_tokens == 40  # greedy never picks the stop token
    assert more is not None and more.finish_reason == "length" and more.completion_tokens == 16
    assert len(more.output_ids) == 16 and more.prompt_tokens == cut.prompt_tokens + 40
    assert more.text and more.reasoning_tokens == 16


def test_a_streamed_generate_is_the_whole_one_and_a_watch_verdict_aborts_it_by_rid(real_sglang):
    prompt = list(range(1000, 1040))

    async def scenario(client):
        whole = await client.generate(prompt, max_new_tokens=48, sampling=GREEDY)
        watched: list[int] = []

        class Never:
            def feed(self, ids):
                watched.extend(ids)

        streamed = await client.generate(prompt, max_new_tokens=48, sampling=GREEDY, watch=Never)
        before = metrics(real_sglang.url)
        stopper = AfterIds(10)
        stopped = await client.generate(prompt, max_new_tokens=3000, sampling=GREEDY, watch=lambda: stopper)
        return whole.value, streamed.value, watched, before, stopped.value, stopper

    whole, streamed, watched, before, stopped, stopper = run(real_sglang.url, scenario)
    assert (streamed.output_ids, streamed.text, streamed.finish_reason) == (whole.output_ids, whole.text, "length")
    assert watched == whole.output_ids and streamed.stopped is None
    # The verdict aborted the request (POST /abort_request with its rid): SGLang counts it, and the answer holds
    # every id that arrived, far short of the 3,000 asked for.
    assert stopped.finish_reason == STOPPED and stopped.stopped == {"after": stopper.fed.__len__()}
    assert stopped.output_ids[: len(stopper.fed)] == stopper.fed and len(stopped.output_ids) < 3000
    # SGLang sets its running-requests gauge when its scheduler next logs its stats, which can come a moment after
    # the abort has freed the request: the gauge is read until it says so, within a deadline.
    deadline = time.monotonic() + 10
    after = metrics(real_sglang.url)
    while after["sglang:num_running_reqs"] and time.monotonic() < deadline:
        time.sleep(0.2)
        after = metrics(real_sglang.url)
    assert after["sglang:num_aborted_requests_total"] == before.get("sglang:num_aborted_requests_total", 0) + 1
    assert after["sglang:num_running_reqs"] == 0


def test_the_loop_watch_stops_a_greedy_loop(real_sglang):
    """Greedy decoding of the tiny model falls into a loop at once: the watch the engine uses stops it."""

    async def scenario(client):
        return await client.generate(list(range(2000, 2030)), max_new_tokens=3000, sampling=GREEDY,
                                     watch=LoopWatch)  # fmt: skip

    out = run(real_sglang.url, scenario).value
    assert out.finish_reason == STOPPED and isinstance(out.stopped, LoopVerdict)
    assert out.stopped.at_token <= len(out.output_ids) < 3000 and out.stopped.period >= 1


def test_separate_reasoning_and_parse_function_call_with_the_servers_own_parsers(real_sglang):
    raw = ('<think>\nThe parser drops the last token.\n</think>\n\nRunning the tests.\n<tool_call>\n'
           '{"name": "run_tests", "arguments": {"path": "tests/test_parser.py"}}\n</tool_call>')  # fmt: skip

    async def scenario(client):
        parsers = (await client.server_parsers()).value
        split = (await client.separate_reasoning(raw, parsers.reasoning)).value
        calls = (await client.parse_function_call(split[1], TOOLS, parsers.tool_call)).value
        return parsers, split, calls

    parsers, (reasoning, answer), (normal, calls) = run(real_sglang.url, scenario)
    # SGLang reports qwen25 as the parser it resolves it to.
    assert (parsers.reasoning, parsers.tool_call, parsers.incremental_stream) == ("qwen3", "qwen", True)
    assert reasoning.strip() == "The parser drops the last token." and answer.lstrip().startswith("Running")
    assert normal.strip() == "Running the tests."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("run_tests", '{"path": "tests/test_parser.py"}')]


def test_server_info_and_metrics_as_autotune_reads_them(real_sglang):
    """Autotune sizes each server's in-flight limit from /server_info's batch and /metrics' gauges."""

    async def scenario(client):
        requests = [ChatRequest(i, MESSAGES, model=MODEL, sampling=Sampling(max_tokens=30)) for i in range(12)]
        done = await asyncio.gather(*(client.complete(r) for r in requests))
        return done, client.autotune_history

    done, history = run(real_sglang.url, scenario, autotune=True, autotune_interval_s=0.2)
    assert all(d.value is not None for d in done), [d for d in done if d.value is None]
    info = httpx.get(f"{real_sglang.url}/server_info", timeout=10).json()
    assert info["max_running_requests"] == 8
    assert history and all(1 <= h["limit"] <= 1024 and h["running"] >= 0 for h in history)
    gauges = metrics(real_sglang.url)
    assert {"sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:gen_throughput"} <= set(gauges)


def test_a_prompt_over_the_context_is_refused_not_retried(real_sglang):
    long = [{"role": "user", "content": " ".join(f"word{i}" for i in range(3000))}]

    async def scenario(client):
        return await client.complete(ChatRequest(3, long, model=MODEL, sampling=Sampling(max_tokens=64)))

    out = run(real_sglang.url, scenario)
    assert out.value is None and out.rejected and out.attempt == 1, out
    assert "context" in out.rejected.lower() or "longer than" in out.rejected.lower(), out.rejected
