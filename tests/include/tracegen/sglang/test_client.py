"""The client against the real SGLang stand-in over HTTP: fields, reasoning split, rejection, every
fault the stand-in can inject, auth, and load spread over several servers.

Servers run with a large time scale and requests use small max_tokens, so generations take milliseconds.
"""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from collections.abc import Sequence

import aiohttp
import httpx
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
from tracegen.store.records import GeneratedRow

MODEL = "m"
# Short pauses and probes: the stand-in recovers in milliseconds, the defaults are for real GPUs.
FAST = dict(backoff_base_s=0.02, backoff_max_s=0.1, probe_interval_s=0.05, probe_timeout_s=1.0, jitter_seed=7)


def prompt(i: int, words: int = 12) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"row {i}: " + " ".join(f"w{i}x{j}" for j in range(words))}]


async def run_rows(
    client: SGLangClient, indices: Sequence[int], *, max_tokens: int = 48, concurrency: int = 16
) -> list[GeneratedRow]:
    """What a chunk engine does: `concurrency` rows in flight, one complete() per row."""
    gate = asyncio.Semaphore(concurrency)
    sampling = Sampling(max_tokens=max_tokens, temperature=0.6, top_p=0.95, seed=1)

    async def one(i: int) -> GeneratedRow:
        async with gate:
            return await complete_row(client, ChatRequest(i, prompt(i), sampling=sampling, model=MODEL),
                                      run_id="run1", chunk=2)

    return list(await asyncio.gather(*(one(i) for i in indices)))


def metric(url: str, name: str) -> float:
    """Sum of a counter over its label sets, read from the server's /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    values = [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)]
    assert values, f"{name} not in /metrics of {url}"
    return sum(values)


class CountingProxy:
    """A real HTTP pass-through in front of a stand-in that counts every request reaching it.

    The stand-in's counters skip requests it refuses (400s, injected 5xx); this counts what the client sent.
    """

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.counts: Counter[str] = Counter()
        self.url = ""

    async def __aenter__(self) -> CountingProxy:
        self._session = aiohttp.ClientSession()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._runner.cleanup()
        await self._session.close()

    async def _forward(self, request: web.Request) -> web.Response:
        self.counts[f"{request.method} {request.path}"] += 1
        headers = {k: v for k, v in request.headers.items() if k in ("Authorization", "Content-Type")}
        async with self._session.request(
            request.method, self.upstream + request.path_qs, data=await request.read(), headers=headers
        ) as upstream:
            return web.Response(status=upstream.status, body=await upstream.read(),
                                content_type=upstream.content_type)  # fmt: skip

    @property
    def completions(self) -> int:
        return self.counts["POST /v1/chat/completions"]


def all_ok(rows: list[GeneratedRow], n: int) -> None:
    assert sorted(r.index for r in rows) == list(range(n))
    bad = [(r.index, r.status, r.error) for r in rows if r.status != "ok"]
    assert not bad, bad
    assert all(r.finish_reason in ("stop", "length", "tool_calls") for r in rows)
    assert all(r.completion_tokens > 0 and r.prompt_tokens > 0 for r in rows)


def test_completion_fields_and_reasoning_split(sim_server) -> None:
    sim = sim_server(reasoning_parser="qwen3", enable_metrics=True)

    async def main() -> tuple[list[GeneratedRow], list[GeneratedRow]]:
        async with SGLangClient([ServerEndpoint(sim.url)], ClientConfig(**FAST)) as client:
            full = await run_rows(client, range(12), max_tokens=4096)
            cut = await run_rows(client, range(12, 18), max_tokens=4)
        return full, cut

    full, cut = asyncio.run(main())
    all_ok(full, 12)
    for r in full:
        assert (r.run_id, r.chunk, r.max_tokens, r.attempt, r.server) == ("run1", 2, 4096, 1, sim.url)
        assert isinstance(r.id, str) and r.latency_s > 0
        assert r.reasoning_content and 0 < r.reasoning_tokens <= r.completion_tokens <= 4096
        if r.finish_reason == "stop":
            assert r.content
    # A 4-token cap falls inside the thinking trace: all text is reasoning, content is "".
    assert all(r.finish_reason == "length" and r.completion_tokens == 4 for r in cut)
    assert all(r.content == "" and r.reasoning_content and r.cut_in_reasoning for r in cut)
    assert metric(sim.url, "sglang:num_requests_total") == 18


def test_tools_are_sent_and_tool_calls_kept(sim_server) -> None:
    # SGLang reports tool calls only when started with a tool-call parser.
    sim = sim_server(sim_tool_call_rate=1.0, tool_call_parser="qwen25", sim_length_model="fixed:2000")  # always fits the cap
    tools = [{"type": "function", "function": {"name": "run_tests", "parameters": {"type": "object"}}}]

    async def main() -> GeneratedRow:
        async with SGLangClient([ServerEndpoint(sim.url)], ClientConfig(**FAST)) as client:
            return await complete_row(
                client, ChatRequest(0, prompt(0), tools=tools, sampling=Sampling(max_tokens=8192), model=MODEL),
                run_id="", chunk=0,
            )

    row = asyncio.run(main())
    assert row.status == "ok" and row.finish_reason == "tool_calls", row
    assert row.tool_calls and row.tool_calls[0]["function"]["name"] == "run_tests"


def test_context_overflow_is_rejected_once(sim_server) -> None:
    sim = sim_server(context_length=256)

    async def main() -> tuple[list[GeneratedRow], int]:
        async with CountingProxy(sim.url) as proxy:
            async with SGLangClient([ServerEndpoint(proxy.url)], ClientConfig(**FAST)) as client:
                # Prompt fits, prompt + cap does not: SGLang's "Requested token count exceeds ..." 400.
                over = await complete_row(client, ChatRequest(5, prompt(5, 40), sampling=Sampling(max_tokens=250),
                                                              model=MODEL), run_id="", chunk=0)
                # The whole prompt is longer than the context: another 400 message, also rejected.
                huge = [{"role": "user", "content": "word " * 2000}]
                too_long = await complete_row(client, ChatRequest(6, huge, sampling=Sampling(max_tokens=8),
                                                                  model=MODEL), run_id="", chunk=0)
            return [over, too_long], proxy.completions

    (over, too_long), sent = asyncio.run(main())
    assert sent == 2  # one request per row: never retried
    for row in (over, too_long):
        assert (row.status, row.attempt, row.completion_tokens, row.content) == ("rejected", 1, 0, None)
        assert row.error.startswith("HTTP 400: ") and row.server == row.server
    assert "exceeds the model's maximum context length of 256 tokens" in over.error
    assert "context length (256 tokens)" in too_long.error


def test_5xx_rate_is_retried(sim_server) -> None:
    sim = sim_server(sim_error_rate=0.3, sim_error_status=503)

    async def main() -> tuple[list[GeneratedRow], int]:
        async with CountingProxy(sim.url) as proxy:
            return await _run_one_server(proxy.url, 40, max_attempts=10, quarantine_after=50), proxy.completions

    rows, sent = asyncio.run(main())
    all_ok(rows, 40)
    assert sum(r.attempt for r in rows) == sent > 40  # some rows needed more than one attempt


def test_dropped_connections_are_retried(sim_server) -> None:
    sim = sim_server(sim_drop_rate=0.3)
    rows = asyncio.run(_run_one_server(sim.url, 40, max_attempts=10, quarantine_after=50))
    all_ok(rows, 40)
    assert sum(r.attempt for r in rows) > 40


def test_hangs_hit_the_deadline_and_are_retried(sim_server) -> None:
    sim = sim_server(sim_hang_rate=0.2)
    rows = asyncio.run(_run_one_server(sim.url, 30, max_attempts=10, quarantine_after=50, request_deadline_s=1.0))
    all_ok(rows, 30)
    assert sum(r.attempt for r in rows) > 30


def test_aborts_are_retried_never_recorded(sim_server) -> None:
    sim = sim_server(sim_abort_rate=0.3)
    rows = asyncio.run(_run_one_server(sim.url, 40, max_attempts=10, quarantine_after=50))
    all_ok(rows, 40)
    assert sum(r.attempt for r in rows) > 40


def test_exhausted_retries_give_failed_rows(sim_server) -> None:
    sim = sim_server(sim_error_rate=1.0, sim_error_status=502)

    async def main() -> tuple[list[GeneratedRow], int]:
        async with CountingProxy(sim.url) as proxy:
            return await _run_one_server(proxy.url, 3, max_attempts=3, quarantine_after=50), proxy.completions

    rows, sent = asyncio.run(main())
    for r in rows:
        assert (r.status, r.attempt, r.server, r.content) == ("failed", 3, "", None)
        assert "3 attempts failed" in r.error and "HTTP 502" in r.error
    assert sent == 9


def test_crashed_server_work_moves_to_the_other(sim_server) -> None:
    # It exits when its 5th request arrives: fewer than the 8 the routing sends each server at the start, so
    # it crashes however the load then splits (a higher count could be served by the other server alone).
    crashing = sim_server(sim_crash_after=5)
    healthy = sim_server()

    async def main() -> tuple[list[GeneratedRow], list[dict]]:
        endpoints = [ServerEndpoint(crashing.url, max_in_flight=8), ServerEndpoint(healthy.url, max_in_flight=8)]
        async with SGLangClient(endpoints, ClientConfig(max_attempts=8, **FAST)) as client:
            rows = await run_rows(client, range(60), concurrency=16)
            return rows, client.stats()

    rows, stats = asyncio.run(main())
    all_ok(rows, 60)
    assert crashing.proc.wait(timeout=10) is not None  # it really died
    by_server = {s["url"]: s for s in stats}
    assert by_server[crashing.url]["quarantined"] and by_server[crashing.url]["completed"] <= 5
    assert sum(r.server == healthy.url for r in rows) >= 50


def test_wedged_server_is_quarantined(sim_server) -> None:
    # Wedged from the start (the stand-in's health stays 200, no token is ever produced), so the test does
    # not depend on how many requests happen to reach it before a mid-run wedge.
    wedged = sim_server(sim_wedged=True)
    healthy = sim_server()

    async def main() -> tuple[list[GeneratedRow], list[dict]]:
        endpoints = [ServerEndpoint(wedged.url, max_in_flight=4), ServerEndpoint(healthy.url, max_in_flight=4)]
        config = ClientConfig(max_attempts=8, request_deadline_s=1.5, quarantine_after=50, **FAST)
        async with SGLangClient(endpoints, config) as client:
            rows = await run_rows(client, range(40), concurrency=8)
            return rows, client.stats()

    rows, stats = asyncio.run(main())
    all_ok(rows, 40)
    w = next(s for s in stats if s["url"] == wedged.url)
    # /health still says 200, yet the server stays out: the probe's completion never finishes.
    assert httpx.get(f"{wedged.url}/health", timeout=5).status_code == 200
    assert w["quarantined"] and "no completion within" in w["reason"], w
    assert w["sent"] >= 1 and w["completed"] == 0
    # Everything it held was cancelled and re-routed at once, not left to wait out its own deadline.
    assert max(r.attempt for r in rows) == 2


def test_wedge_cancels_younger_requests_and_probe_restores(sim_server) -> None:
    sim = sim_server(sim_wedged=True)

    async def main() -> tuple[list[GeneratedRow], dict, dict]:
        config = ClientConfig(max_attempts=5, request_deadline_s=1.0, **FAST)
        async with SGLangClient([ServerEndpoint(sim.url)], config) as client:
            sampling = Sampling(max_tokens=16)
            first = asyncio.create_task(complete_row(
                client, ChatRequest(0, prompt(0), sampling=sampling, model=MODEL), run_id="", chunk=0))
            await asyncio.sleep(0.5)
            second = asyncio.create_task(complete_row(
                client, ChatRequest(1, prompt(1), sampling=sampling, model=MODEL), run_id="", chunk=0))
            while not client.stats()[0]["quarantined"]:
                await asyncio.sleep(0.01)
            # The first request's deadline passed with no completion at all: the younger request must be
            # cancelled now instead of waiting out the rest of its own deadline.
            at_quarantine = client.stats()[0]
            await asyncio.to_thread(sim.set_faults, wedged=False)
            rows = [await first, await second]
            return rows, at_quarantine, client.stats()[0]

    rows, at_quarantine, final = asyncio.run(main())
    assert "no completion within the 1 s deadline" in at_quarantine["reason"]
    assert [(r.status, r.attempt) for r in rows] == [("ok", 2), ("ok", 2)]
    # Only the first request timed out; the second was cancelled (a timeout would count a second failure).
    assert final["failures"] == 1 and final["quarantines"] == 1 and not final["quarantined"]


def test_quarantined_server_comes_back_when_healthy(sim_server) -> None:
    sim = sim_server(sim_error_rate=1.0, sim_error_status=503)

    async def main() -> tuple[GeneratedRow, list[dict]]:
        config = ClientConfig(max_attempts=20, quarantine_after=2, **FAST)
        async with SGLangClient([ServerEndpoint(sim.url)], config) as client:
            task = asyncio.create_task(
                complete_row(client, ChatRequest(0, prompt(0), sampling=Sampling(max_tokens=16), model=MODEL),
                             run_id="", chunk=0)
            )
            while not client.stats()[0]["quarantined"]:
                await asyncio.sleep(0.02)
            await asyncio.to_thread(sim.set_faults, error_rate=0.0)
            return await task, client.stats()

    row, stats = asyncio.run(main())
    assert row.status == "ok" and row.attempt == 3  # two 503s, then (after the probe) success
    assert stats[0]["quarantines"] == 1 and not stats[0]["quarantined"]


def test_api_key_accepted_and_wrong_key_is_fatal(sim_server) -> None:
    sim = sim_server(api_key="s3cret")

    async def main() -> None:
        async with SGLangClient([ServerEndpoint(sim.url, api_key="s3cret")], ClientConfig(**FAST)) as client:
            rows = await run_rows(client, range(3))
        all_ok(rows, 3)
        for key in ("wrong", None):
            async with SGLangClient([ServerEndpoint(sim.url, api_key=key)], ClientConfig(**FAST)) as client:
                with pytest.raises(FatalClientError, match="401.*Unauthorized.*api key"):
                    await run_rows(client, range(3))

    asyncio.run(main())


def test_load_spreads_over_two_servers(sim_server) -> None:
    servers = [sim_server(enable_metrics=True) for _ in range(2)]

    async def main() -> list[GeneratedRow]:
        endpoints = [ServerEndpoint(s.url, max_in_flight=8) for s in servers]
        async with SGLangClient(endpoints, ClientConfig(**FAST)) as client:
            assert client.capacity == 16
            return await run_rows(client, range(80), max_tokens=64, concurrency=16)

    rows = asyncio.run(main())
    all_ok(rows, 80)
    counts = [metric(s.url, "sglang:num_requests_total") for s in servers]
    assert sum(counts) == 80
    # Least-outstanding routing keeps both busy: 16 rows in flight on two servers of 8 slots each, so the
    # second server always takes a share. How even the split is depends on how fast each server answers
    # (on a loaded two-core machine one answered 72 of 80 while the other held its 8), so the floor is one
    # server's in-flight limit, not an even split.
    assert min(counts) >= 8, counts
    assert [sum(r.server == s.url for r in rows) for s in servers] == counts


async def _run_one_server(url: str, n: int, **config: float) -> list[GeneratedRow]:
    async with SGLangClient([ServerEndpoint(url, max_in_flight=8)], ClientConfig(**{**FAST, **config})) as client:
        return await run_rows(client, range(n), concurrency=8)


def test_a_server_url_with_credentials_is_shown_without_them(sim_server, caplog) -> None:
    import logging

    failing = sim_server(sim_error_rate=1.0, sim_error_status=503)
    keyed = sim_server(api_key="s3cret")

    def with_userinfo(url: str) -> str:
        return url.replace("http://", "http://gpuuser:gpupass@") + "/"

    async def main() -> tuple[list[GeneratedRow], list[dict], list[str]]:
        fatal = []
        retrying = ClientConfig(max_attempts=3, quarantine_after=50, **FAST)
        async with SGLangClient([ServerEndpoint(with_userinfo(failing.url))], retrying) as client:
            rows = await run_rows(client, range(2))
            stats = client.stats()
        all_down = ClientConfig(max_attempts=5, quarantine_after=2, all_down_fatal_s=0.5, **FAST)
        async with SGLangClient([ServerEndpoint(with_userinfo(failing.url))], all_down) as client:
            with pytest.raises(FatalClientError) as caught:
                await run_rows(client, range(1))
            fatal.append(str(caught.value))
        async with SGLangClient([ServerEndpoint(with_userinfo(keyed.url), api_key="wrong")], retrying) as client:
            with pytest.raises(FatalClientError) as caught:
                await run_rows(client, range(1))
            fatal.append(str(caught.value))
        return rows, stats, fatal

    with caplog.at_level(logging.DEBUG, logger="tracegen"):
        rows, stats, fatal = asyncio.run(main())
    with pytest.raises(ValueError) as refused:
        ServerEndpoint(with_userinfo(failing.url) + "?token=t0ken")
    assert [r.status for r in rows] == ["failed", "failed"]
    assert all(f"{failing.url}: HTTP 503" in r.error for r in rows), [r.error for r in rows]
    assert stats[0]["url"] == failing.url
    assert fatal[0].startswith("every server has been unusable") and f"{failing.url}: " in fatal[0], fatal[0]
    assert fatal[1].startswith(f"{keyed.url} answered HTTP 401"), fatal[1]
    logged = [r.getMessage() for r in caplog.records]
    assert any(m.startswith(f"quarantining {failing.url}: ") for m in logged), logged
    shown = "\n".join([*logged, *fatal, str(refused.value), *(f"{r.server} {r.error}" for r in rows),
                       repr(stats)])
    assert "gpuuser" not in shown and "gpupass" not in shown and "t0ken" not in shown
