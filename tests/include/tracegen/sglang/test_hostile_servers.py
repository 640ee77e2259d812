"""Whatever a server sends, the client hands on only what was asked, from the request that asked: servers of our own
on loopback (raw asyncio, HTTP written by hand) that answer twice, ignore the cap, never finish, or send more than
any answer could hold, against the public `SGLangClient`."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest

from tracegen.sglang.client import ChatRequest, ClientConfig, Sampling, ServerEndpoint, SGLangClient

FAST = dict(backoff_base_s=0.01, backoff_max_s=0.02, jitter_seed=1)
MiB = 1 << 20


@dataclass
class Request:
    method: str
    path: str
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


# Answers one request on `writer`; returns whether the connection may carry another.
Answer = Callable[["HostileServer", Request, asyncio.StreamWriter], Awaitable[bool]]


class HostileServer:
    """A loopback HTTP/1.1 server whose answers are whatever `answer` writes; `sent` counts the body bytes the
    answers managed to write before the client hung up."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.sent = 0
        self.connections = 0

    async def __aenter__(self) -> HostileServer:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            try:
                while True:
                    head = await reader.readuntil(b"\r\n\r\n")
                    method, path, _ = head.split(b"\r\n", 1)[0].decode().split(" ", 2)
                    length = 0
                    for line in head.split(b"\r\n")[1:]:
                        if line.lower().startswith(b"content-length:"):
                            length = int(line.split(b":", 1)[1])
                    request = Request(method, path, await reader.readexactly(length))
                    if request.path == "/abort_request":  # as SGLang 0.5.23: 200, empty, whatever the rid
                        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                        continue
                    if not await self.answer(self, request, writer):
                        break
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

        self.server = await asyncio.start_server(serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()

    async def write(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        writer.write(data)
        await writer.drain()
        self.sent += len(data)


def json_answer(body: dict[str, Any], status: str = "200 OK") -> bytes:
    raw = json.dumps(body).encode()
    return b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        status.encode(), len(raw), raw)


def chat_answer(content: str) -> dict[str, Any]:
    """A chat completion SGLang could send, its counts agreeing with its ids."""
    return {"id": "x", "object": "chat.completion", "choices": [{
        "index": 0, "finish_reason": "stop", "prompt_token_ids": [1, 2, 3], "response_token_ids": [5, 6],
        "message": {"role": "assistant", "content": content, "reasoning_content": None}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}  # fmt: skip


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def event(ids: list[int], count: int, finish: str | None = None) -> bytes:
    meta = {"prompt_tokens": 4, "completion_tokens": count, "finish_reason": {"type": finish} if finish else None}
    return chunk(b"data: " + json.dumps({"text": "ab" * len(ids), "output_ids": ids, "meta_info": meta}).encode()
                 + b"\n\n")


SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
CHUNKED_JSON_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"


def row(i: int, max_tokens: int = 16) -> ChatRequest:
    return ChatRequest(i, [{"role": "user", "content": f"row {i}"}], sampling=Sampling(max_tokens=max_tokens),
                       model="m")


def client(url: str, **config: Any) -> SGLangClient:
    return SGLangClient([ServerEndpoint(url, max_in_flight=1)], ClientConfig(**{**FAST, **config}))


# ---- a response belongs to its request ------------------------------------------------------------------------


def test_an_answer_sent_twice_in_one_write_never_becomes_the_next_requests_answer():
    async def twice(server: HostileServer, request: Request, writer: asyncio.StreamWriter) -> bool:
        asked = request.json()["messages"][0]["content"]
        writer.write(json_answer(chat_answer(f"answer to {asked}")) + json_answer(chat_answer(f"stray after {asked}")))
        return True

    async def main() -> list[str | None]:
        async with HostileServer(twice) as server, client(server.url, max_attempts=1) as c:
            outs = [await c.complete(row(i)) for i in range(4)]
        return [o.value.content if o.value else o.failed for o in outs]

    assert asyncio.run(main()) == [f"answer to row {i}" for i in range(4)]


def test_an_answer_sent_again_later_on_an_idle_connection_never_becomes_the_next_requests_answer():
    # The stray copy comes after the answer has been read and the connection has gone idle: a pool that hands
    # the connection to the next request would give it the stray bytes as its answer.
    async def late(server: HostileServer, request: Request, writer: asyncio.StreamWriter) -> bool:
        asked = request.json()["messages"][0]["content"]
        await server.write(writer, json_answer(chat_answer(f"answer to {asked}")))
        await asyncio.sleep(0.05)
        await server.write(writer, json_answer(chat_answer(f"stray after {asked}")))
        return True

    async def main() -> list[str | None]:
        async with HostileServer(late) as server, client(server.url, max_attempts=1) as c:
            outs = []
            for i in range(4):
                outs.append(await c.complete(row(i)))
                await asyncio.sleep(0.1)  # the stray copy has arrived on the idle connection by now
        return [o.value.content if o.value else o.failed for o in outs]

    assert asyncio.run(main()) == [f"answer to row {i}" for i in range(4)]


# ---- every row held to its cap and its counts to its ids, however it ended ------------------------------------


class _StopAt:
    """A watch that stops the request once it has seen `n` ids (the loop watch's verdict, without its rule)."""

    def __init__(self, n: int) -> None:
        self.n, self.seen = n, 0

    def feed(self, new_ids: Any) -> Any:
        self.seen += len(new_ids)
        return "loop" if self.seen >= self.n else None


def test_a_stream_past_its_cap_is_refused_even_when_the_watch_stops_it():
    """The server ignores max_new_tokens=64 and loops on; the watch would stop it at 1,088 ids. Nothing of it may
    come back as an answer: 1,088 ids broke the cap, counted honestly or not."""

    async def loops(server: HostileServer, request: Request, writer: asyncio.StreamWriter) -> bool:
        await server.write(writer, SSE_HEAD)
        sent = 0
        while sent < 4096:
            sent += 64
            await server.write(writer, event(list(range(64)), sent))
        await asyncio.sleep(30)
        return False

    async def main() -> Any:
        async with HostileServer(loops) as server, client(server.url, max_attempts=2) as c:
            return await c.generate(list(range(4)), max_new_tokens=64, sampling=Sampling(max_tokens=64),
                                    watch=lambda: _StopAt(1088))

    out = asyncio.run(main())
    assert out.value is None and "above the request's max_new_tokens of 64" in out.failed, out


def test_a_stopped_stream_whose_counts_disagree_with_its_ids_is_refused():
    async def miscounts(server: HostileServer, request: Request, writer: asyncio.StreamWriter) -> bool:
        await server.write(writer, SSE_HEAD)
        await server.write(writer, event([1, 2, 3, 4], 4))
        await server.write(writer, event([5, 6, 7, 8], 8))
        await server.write(writer, event([9, 10, 11, 12], 900))  # 12 ids sent, 900 counted
        await asyncio.sleep(30)
        return False

    async def main() -> Any:
        async with HostileServer(miscounts) as server, client(server.url, max_attempts=1) as c:
            return await c.generate(list(range(4)), max_new_tokens=64, sampling=Sampling(max_tokens=64),
                                    watch=lambda: _StopAt(12))

    out = asyncio.run(main())
    assert out.value is None and "completion_tokens is 900" in out.failed, out


# ---- a total deadline per attempt -------------------------------------------------------------------------------

IDLE_S = 2.0  # the idle read timeout; the attempt deadline is twice it unless set


async def _trickled_body(server: HostileServer, request: Request, writer: asyncio.StreamWriter) -> bool:
    body = json.dumps(chat_answer("slow")).encode()
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body))
    for byte in body:
        writer.write(bytes([byte]))
        await writer.drain()
        await asyncio.sleep(0.5)
    return True


async def _endless_continue(server: HostileServer, request: Request, writer: asyncio.StreamWriter) -> bool:
    while True:
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.5)


async def _keepalive_comments(server: HostileServer, request: Request, writer: asyncio.StreamWriter) -> bool:
    writer.write(SSE_HEAD + event([1], 1))
    while True:
        writer.write(chunk(b": keep-alive\n\n"))
        await writer.drain()
        await asyncio.sleep(0.5)


async def _done_without_end(server: HostileServer, request: Request, writer: asyncio.StreamWriter) -> bool:
    writer.write(SSE_HEAD + event([1, 2], 2, "stop") + chunk(b"data: [DONE]\n\n"))
    while True:  # the chunked body never ends (no 0-chunk), a comment now and then keeping the read alive
        writer.write(chunk(b": still here\n\n"))
        await writer.drain()
        await asyncio.sleep(0.5)


@pytest.mark.parametrize("answer, streamed", [
    (_trickled_body, False), (_endless_continue, False), (_keepalive_comments, True), (_done_without_end, True),
], ids=["body-1-byte-per-0.5s", "endless-100-continue", "sse-keepalive-forever", "done-but-body-never-ends"])
def test_an_attempt_ends_by_its_total_deadline_and_the_server_counts_as_failing(answer, streamed):
    async def main() -> tuple[Any, list[dict[str, Any]]]:
        async with HostileServer(answer) as server, client(server.url, max_attempts=1,
                                                           request_deadline_s=IDLE_S) as c:
            if streamed:
                call = c.generate([1, 2], max_new_tokens=64, sampling=Sampling(max_tokens=64), watch=lambda: _StopAt(99))
            else:
                call = c.complete(row(0))
            # Far past the attempt deadline (2 x IDLE_S): the bound only catches an attempt that never ends.
            out = await asyncio.wait_for(call, 30)
            return out, c.stats()

    out, stats = asyncio.run(main())
    assert out.value is None and f"within the {2 * IDLE_S:g} s attempt deadline" in out.failed, out
    assert stats[0]["quarantined"] and "attempt deadline" in stats[0]["reason"], stats


# ---- bounded sizes ------------------------------------------------------------------------------------------

FLOOD = 48 * MiB


async def _flood(server: HostileServer, writer: asyncio.StreamWriter, head: bytes) -> bool:
    await server.write(writer, head)
    piece = b"x" * MiB
    for _ in range(FLOOD // MiB):
        await server.write(writer, piece)
    await asyncio.sleep(30)
    return False


@pytest.mark.parametrize("head, streamed, limit", [
    (CHUNKED_JSON_HEAD + b"ffffffffffffffff\r\n", False, "response body"),
    (b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: text/plain\r\ntransfer-encoding: chunked\r\n\r\n"
     b"ffffffffffffffff\r\n", False, "HTTP 500 error body"),
    (SSE_HEAD + b"ffffffffffffffff\r\n" + b"data: ", True, "event-stream line"),
], ids=["huge-chunk", "endless-500-body", "sse-line-without-newline"])  # fmt: skip
def test_an_answer_past_its_limit_fails_the_attempt_naming_the_limit(head, streamed, limit):
    async def floods(server: HostileServer, request: Request, writer: asyncio.StreamWriter) -> bool:
        return await _flood(server, writer, head)

    sent = []

    async def main() -> Any:
        async with HostileServer(floods) as server, client(server.url, max_attempts=1) as c:
            if streamed:
                call = c.generate([1, 2], max_new_tokens=64, sampling=Sampling(max_tokens=64), watch=lambda: _StopAt(99))
            else:
                call = c.complete(row(0))
            out = await asyncio.wait_for(call, 60)
            sent.append(server.sent)
            return out

    out = asyncio.run(main())
    assert out.value is None and f"the {limit} is past its limit of" in out.failed, out
    # The client hung up long before the flood was over: it held at most its limit, not the server's 48 MiB.
    assert sent[0] < 16 * MiB, sent
