"""A server's HTTP client (`tracegen.sglang.http.ServerHttp`) against scripted HTTP servers on loopback: a streamed
body arrives whole and in order however it is split, every request has a connection of its own (nothing a server
sends after an answer can answer another request), and every way a server can go wrong ends as one of `http`'s failures the client handles (a stall as a
timeout, a cut or garbage as a failure, a refused connect as a connect error), the connection closed."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from fixtures.certs import self_signed

from tracegen.common.tls import tls_for
from tracegen.sglang.http import ConnectError, HttpFailure, HttpTimeout, ServerHttp
from tracegen.sglang.limits import ResponseLimits

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    return head, await reader.readexactly(length)


def _chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


class Server:
    """A loopback server running `handler` per connection; counts connections and the request bodies seen."""

    def __init__(self, handler: Handler, tls: ssl.SSLContext | None = None) -> None:
        self.handler, self.tls = handler, tls
        self.connections = 0
        self.bodies: list[bytes] = []

    async def __aenter__(self) -> Server:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            try:
                await self.handler(reader, writer)
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

        self.server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=self.tls)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()

    def url(self, scheme: str = "http") -> str:
        return f"{scheme}://127.0.0.1:{self.port}"


LIMITS = ResponseLimits.for_request(100, 64)


class _Conns:
    """A `ServerHttp` as these tests drive it: a POST whose 200 body goes to a callback."""

    def __init__(self, http: ServerHttp) -> None:
        self.http = http

    async def request(self, method: str, path: str, body: bytes, on_body: Callable[[bytes], bool]) -> tuple[int, bytes]:
        return await self.http.exchange(method, path, body, limits=LIMITS, on_body=on_body)

    async def close(self) -> None:
        await self.http.aclose()


def _conns(url: str, *, read_timeout_s: float = 5.0, tls: ssl.SSLContext | None = None) -> _Conns:
    return _Conns(ServerHttp(url, headers={"Content-Type": "application/json", "Authorization": "Bearer k"},
                             tls=tls or tls_for(url), connect_timeout_s=5.0, read_timeout_s=read_timeout_s,
                             attempt_deadline_s=60.0))


def _collect() -> tuple[list[bytes], Callable[[bytes], bool]]:
    got: list[bytes] = []

    def on_body(data: bytes) -> bool:
        got.append(data)
        return False

    return got, on_body


def test_a_body_split_anywhere_arrives_whole_on_a_connection_of_its_own():
    body = b"".join(b'data: {"n": %d}\n\n' % i for i in range(50)) + b"data: [DONE]\n\n"

    async def main():
        seen: list[bytes] = []

        async def handler(reader, writer):
            while True:
                head, sent = await _read_request(reader)
                seen.append(head)
                writer.write(SSE_HEAD)
                framed = _chunked(*(body[i:i + 7] for i in range(0, len(body), 7)))
                for i in range(0, len(framed), 5):  # the chunk framing itself split across reads
                    writer.write(framed[i:i + 5])
                    await writer.drain()
                    await asyncio.sleep(0)

        async with Server(handler) as server:
            conns = _conns(server.url() + "/base/")
            results = []
            for _ in range(3):
                got, on_body = _collect()
                status, raw = await conns.request("POST", "/generate", b'{"x": 1}', on_body)
                results.append((status, raw, b"".join(got)))
            await conns.close()
            return server.connections, seen, results

    connections, seen, results = asyncio.run(main())
    assert results == [(200, b"", body)] * 3
    assert connections == 3  # a connection per request: none carries a second answer
    head = seen[0].decode().lower()
    assert head.startswith("post /base/generate http/1.1") and "authorization: bearer k" in head
    assert "host: 127.0.0.1:" in head and "content-length: 8" in head


def test_chunk_extensions_and_trailers_are_read():
    # RFC 9112 7.1: a size line may carry extensions, the last chunk may be followed by trailer fields.
    framed = SSE_HEAD + b"5;name=value\r\ndata:\r\n4 \r\n 1\n\n\r\n0;last\r\nx-trailer: 1\r\nx-other: 2\r\n\r\n"

    async def handler(reader, writer):
        while True:
            await _read_request(reader)
            for i in range(0, len(framed), 3):
                writer.write(framed[i:i + 3])
                await writer.drain()
                await asyncio.sleep(0)

    bodies, connections = _two_requests(handler)
    assert bodies == [((200, b""), b"data: 1\n\n")] * 2 and connections == 2


def _two_requests(handler: Handler) -> tuple[list[tuple[tuple[int, bytes], bytes]], int]:
    """Two POSTs on one server's connections: each one's (status, body) with the bytes its callback took, and
    how many connections the server saw."""

    async def main():
        async with Server(handler) as server:
            conns = _conns(server.url())
            results = []
            for _ in range(2):
                got, on_body = _collect()
                results.append((await conns.request("POST", "/generate", b"{}", on_body), b"".join(got)))
            await conns.close()
            return results, server.connections

    return asyncio.run(main())


@pytest.mark.parametrize("framing", [b"zz\r\nhello\r\n0\r\n\r\n", b"5\r\nhelloXX0\r\n\r\n",
                                     b"1" * 5000, b"\r\n", b"-5\r\nhello\r\n0\r\n\r\n"],
                         ids=["not hex", "no CRLF after data", "endless size line", "empty size", "negative"])
def test_a_malformed_chunk_framing_is_a_protocol_error_and_the_connection_closed(framing):
    async def main():
        async def handler(reader, writer):
            await _read_request(reader)
            writer.write(SSE_HEAD + framing)
            await writer.drain()
            await asyncio.sleep(5)

        async with Server(handler) as server:
            conns = _conns(server.url(), read_timeout_s=2.0)
            got, on_body = _collect()
            with pytest.raises(HttpFailure, match="malformed"):
                await conns.request("POST", "/generate", b"{}", on_body)
            await conns.close()

    asyncio.run(main())


def test_an_answer_sent_past_the_body_never_answers_the_next_request():
    # A whole second response after the last chunk, in the same write: nobody asked for it.
    async def handler(reader, writer):
        while True:
            await _read_request(reader)
            writer.write(SSE_HEAD + _chunked(b"data: 1\n\n") + SSE_HEAD + _chunked(b"data: stray\n\n"))
            await writer.drain()

    results, _ = _two_requests(handler)
    assert results == [((200, b""), b"data: 1\n\n")] * 2


@pytest.mark.parametrize("answer", [
    # the server says it closes: the body is read and the connection is not kept
    b"HTTP/1.1 200 OK\r\nconnection: close\r\ntransfer-encoding: chunked\r\n\r\n" + _chunked(b"data: 1\n\n"),
], ids=["connection close"])
def test_a_connection_the_server_will_not_carry_on_is_not_reused(answer):
    async def handler(reader, writer):
        while True:
            await _read_request(reader)
            writer.write(answer)
            await writer.drain()

    results, connections = _two_requests(handler)
    assert results == [((200, b""), b"data: 1\n\n")] * 2 and connections == 2


def test_an_error_status_is_returned_with_its_body_and_never_fed_to_the_callback():
    async def main():
        answers = [b"HTTP/1.1 400 Bad Request\r\ncontent-length: 13\r\n\r\n{\"error\": 42}",
                   # A body framed by the connection's close: read to the end.
                   b"HTTP/1.1 503 Service Unavailable\r\nconnection: close\r\n\r\nbusy, try later"]

        async def handler(reader, writer):
            await _read_request(reader)
            writer.write(answers.pop(0))
            await writer.drain()

        async with Server(handler) as server:
            conns = _conns(server.url())
            got, on_body = _collect()
            first = await conns.request("POST", "/generate", b"{}", on_body)
            second = await conns.request("POST", "/generate", b"{}", on_body)
            third_got, third = _collect()
            with pytest.raises(HttpFailure):  # the server is gone: nothing listening
                server.server.close()
                await server.server.wait_closed()
                await conns.request("POST", "/generate", b"{}", third)
            return first, second, got, server.connections

    first, second, got, connections = asyncio.run(main())
    assert first == (400, b'{"error": 42}') and second == (503, b"busy, try later")
    assert got == [] and connections == 2


def test_a_stop_closes_the_connection_and_the_next_request_opens_another():
    async def main():
        async def handler(reader, writer):
            await _read_request(reader)
            writer.write(SSE_HEAD)
            for i in range(1000):
                writer.write(_chunked(b"data: %d\n\n" % i)[:-5])  # chunks only: the body never ends
                await writer.drain()
                await asyncio.sleep(0.001)

        async with Server(handler) as server:
            conns = _conns(server.url())
            got: list[bytes] = []

            def stop_at_three(data: bytes) -> bool:
                got.append(data)
                return len(got) >= 3

            stopped = await conns.request("POST", "/generate", b"{}", stop_at_three)
            again = await conns.request("POST", "/generate", b"{}", lambda data: True)
            await conns.close()
            return stopped, got, again, server.connections

    stopped, got, again, connections = asyncio.run(main())
    assert stopped == (200, b"") and len(got) == 3 and again == (200, b"")
    assert connections == 2


def test_what_the_callback_raises_reaches_the_caller_and_the_next_request_gets_its_own_answer():
    # (The connection may be reused: its response had ended, nothing of it left unread.)
    async def main():
        async def handler(reader, writer):
            while True:
                await _read_request(reader)
                writer.write(SSE_HEAD + _chunked(b"data: {bad json\n\n", b"data: [DONE]\n\n"))
                await writer.drain()

        async with Server(handler) as server:
            conns = _conns(server.url())

            def refuse(data: bytes) -> bool:
                raise ValueError(f"not an event: {data[:10]!r}")

            with pytest.raises(ValueError, match="not an event"):
                await conns.request("POST", "/generate", b"{}", refuse)
            got, on_body = _collect()
            ok = await conns.request("POST", "/generate", b"{}", on_body)
            await conns.close()
            return ok, got, server.connections

    ok, got, connections = asyncio.run(main())
    assert ok == (200, b"") and b"".join(got) == b"data: {bad json\n\ndata: [DONE]\n\n" and connections <= 2


@pytest.mark.parametrize("fault", ["stall", "cut", "garbage", "refused"])
def test_a_server_that_goes_wrong_ends_as_the_failure_the_client_handles(fault):
    expected = {"stall": HttpTimeout, "cut": HttpFailure, "garbage": HttpFailure,
                "refused": ConnectError}[fault]

    async def main():
        async def handler(reader, writer):
            await _read_request(reader)
            if fault == "garbage":
                writer.write(b"this is not HTTP\r\n\r\n")
                await writer.drain()
                await asyncio.sleep(5)
                return
            writer.write(SSE_HEAD + _chunked(b"data: 1\n\n")[:-5])
            await writer.drain()
            if fault == "stall":
                await asyncio.sleep(5)
            # "cut": the connection closes mid-body

        async with Server(handler) as server:
            url = server.url()
            if fault == "refused":
                server.server.close()
                await server.server.wait_closed()
            conns = _conns(url, read_timeout_s=0.3)
            got, on_body = _collect()
            loop = asyncio.get_running_loop()
            started = loop.time()
            with pytest.raises(expected):
                await conns.request("POST", "/generate", b"{}", on_body)
            waited = loop.time() - started
            await conns.close()
            return waited, got

    waited, got = asyncio.run(main())
    if fault == "stall":
        assert got == [b"data: 1\n\n"] and 0.3 <= waited < 3  # the deadline counts from the last bytes read


def test_a_connection_closed_before_its_request_is_answered_fails_at_once():
    # A tunnel whose far end is gone accepts the connect, then closes it: the request must fail then, not wait for
    # the read deadline.
    async def main():
        async def handler(reader, writer):
            writer.close()

        async with Server(handler) as server:
            conns = _conns(server.url(), read_timeout_s=30.0)
            got, on_body = _collect()
            with pytest.raises(HttpFailure):
                await asyncio.wait_for(conns.request("POST", "/generate", b"{}", on_body), 10)
            await conns.close()

    asyncio.run(main())


def test_a_cancelled_read_closes_its_connection():
    async def main():
        closed = asyncio.Event()

        async def handler(reader, writer):
            await _read_request(reader)
            writer.write(SSE_HEAD)
            await writer.drain()
            await reader.read()  # returns once the client has closed the connection
            closed.set()

        async with Server(handler) as server:
            conns = _conns(server.url())
            task = asyncio.create_task(conns.request("POST", "/generate", b"{}", lambda data: False))
            await asyncio.sleep(0.2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.wait_for(closed.wait(), 5)
            await conns.close()

    asyncio.run(main())


def test_an_https_server_is_verified_and_read_alike(tmp_path: Path):
    cert, key = self_signed(tmp_path)
    server_tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_tls.load_cert_chain(cert, key)
    trusting = ssl.create_default_context(cafile=str(cert))

    async def main():
        async def handler(reader, writer):
            while True:
                await _read_request(reader)
                writer.write(SSE_HEAD + _chunked(b"data: [DONE]\n\n"))
                await writer.drain()

        async with Server(handler, tls=server_tls) as server:
            conns = _conns(server.url("https"), tls=trusting)
            got, on_body = _collect()
            ok = await conns.request("POST", "/generate", b"{}", on_body)
            await conns.close()
            stranger = _conns(server.url("https"), tls=ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT))
            with pytest.raises(ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                await stranger.request("POST", "/generate", b"{}", on_body)
            await stranger.close()
            return ok, got

    ok, got = asyncio.run(main())
    assert ok == (200, b"") and got == [b"data: [DONE]\n\n"]
