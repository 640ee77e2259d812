"""A server's keep-alive HTTP/1.1 connections, each response body handed to a callback as its bytes arrive, inside
the event loop's own read: how the client sends every request of a row's generation (`SGLangClient._attempt`).

A streamed generation is read in one event per `--stream-interval` tokens, and an httpx stream costs a task
wake-up, an anyio cancel scope and a selector register and unregister per read (httpcore's `_receive_event`); a
whole request pays the same machinery on every read and write. Here a read is one `data_received` call: h11 (httpx's
own HTTP/1.1 parser) frames the bytes, the caller's callback takes them (for a stream, `SGLangClient` puts the
events together and feeds its loop watch there), and the waiting coroutine wakes once, when the response has ended
or the callback says stop (docs/benchmarks.md, "Where the tokens of looping rows go", has the CPU this saves).
Past the head of a 200 in chunks (how SGLang's uvicorn sends every event stream and every large answer), the
chunks are unframed here (`_Chunks`): h11's per-chunk events cost about as much as decoding the event they carry.

Failures are raised as httpx's exception types, so the client handles them as it always has: a read that waits
past the deadline is `httpx.ReadTimeout`, a dropped connection `httpx.RemoteProtocolError` or `httpx.ReadError`, a
refused connect `httpx.ConnectError`, a connect past its timeout `httpx.ConnectTimeout`.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable

import h11
import httpx

# What the callback is handed and says: the next bytes of a 200 body; True stops the read (the connection is then
# closed, the rest of the response unread).
OnBody = Callable[[bytes], bool]


class _Connection(asyncio.Protocol):
    """One connection, read by callbacks; one request at a time on it (`start`, then the waiter's result)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.http = h11.Connection(h11.CLIENT)
        self.closed = False
        self.idle_since = 0.0
        self._waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self._on_body: OnBody | None = None
        self._status = 0
        self._body: list[bytes] = []
        self._read_timeout = 0.0
        self._last_read = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._chunks: _Chunks | None = None  # a 200's chunked body, read past h11

    # -- asyncio.Protocol ----------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if exc is not None:
            self._fail(httpx.ReadError(f"{type(exc).__name__}: {exc}"))
        elif self._waiter is not None and not self._waiter.done():
            self._read(b"")  # the end of a body framed by the connection's close, or a response cut short
            self._fail(httpx.RemoteProtocolError("the server closed the connection before the response ended"))

    def data_received(self, data: bytes) -> None:
        if self._waiter is None or self._waiter.done():
            self.close()  # bytes nobody asked for: the connection cannot carry another request
            return
        self._last_read = self.loop.time()
        self._read(data)

    def _read(self, data: bytes) -> None:
        if self._chunks is not None:
            self._read_chunks(data)
            return
        http = self.http
        try:
            http.receive_data(data)
            while True:
                event = http.next_event()
                kind = type(event)
                if kind is h11.Data:
                    if self._status != 200:
                        self._body.append(event.data)
                    elif self._on_body(event.data):  # type: ignore[misc]
                        self._finish()  # stopped: the response is not done, so `request` closes the connection
                        return
                elif event is h11.NEED_DATA:
                    return
                elif kind is h11.Response:
                    self._status = event.status_code
                    if self._status == 200 and _plain_chunked(event):
                        self._chunks = _Chunks()
                        self._read_chunks(http.trailing_data[0])  # what h11 received past the head
                        return
                elif kind is h11.EndOfMessage:
                    self._finish()
                    return
                elif kind is h11.ConnectionClosed:
                    raise httpx.RemoteProtocolError("the server closed the connection before the response ended")
                # h11.InformationalResponse (1xx): the response follows
        except h11.RemoteProtocolError as exc:
            self._fail(httpx.RemoteProtocolError(f"malformed HTTP response: {exc}"))
        except Exception as exc:  # the callback's own: the stream is wrong, say so to the waiting caller
            self._fail(exc)

    def _read_chunks(self, data: bytes) -> None:
        chunks = self._chunks
        try:
            for piece in chunks.feed(data):  # type: ignore[union-attr]
                if self._on_body(piece):  # type: ignore[misc]
                    self._finish()  # stopped: the body is not done, so `request` closes the connection
                    return
        except _BadChunk as exc:
            self._fail(httpx.RemoteProtocolError(f"malformed HTTP response: {exc}"))
            return
        except Exception as exc:  # the callback's own
            self._fail(exc)
            return
        if chunks.done:  # type: ignore[union-attr]
            self._finish()

    # -- one request -----------------------------------------------------------------------------------
    def start(self, request: bytes, on_body: OnBody, read_timeout: float) -> asyncio.Future[tuple[int, bytes]]:
        self._waiter = self.loop.create_future()
        if self.closed or self.transport.is_closing():  # type: ignore[union-attr]
            # Closed by the server between the connect and now (a tunnel whose far end is gone accepts, then
            # closes): nothing would ever answer, and the read deadline is minutes away. The request was not sent.
            self._waiter.set_exception(httpx.RemoteProtocolError("the server closed the connection before the "
                                                                 "request was sent"))
            return self._waiter
        self._on_body, self._status, self._body = on_body, 0, []
        self._read_timeout = read_timeout
        self._last_read = self.loop.time()
        self._timer = self.loop.call_at(self._last_read + read_timeout, self._check_deadline)
        self.transport.write(request)  # type: ignore[union-attr]
        return self._waiter

    def _check_deadline(self) -> None:
        # One timer per request, moved on only when it fires: a read does no timer work.
        if self._waiter is None or self._waiter.done():
            return
        due = self._last_read + self._read_timeout
        if self.loop.time() >= due:
            self._fail(httpx.ReadTimeout(f"no bytes for {self._read_timeout:g} s"))
        else:
            self._timer = self.loop.call_at(due, self._check_deadline)

    def _finish(self) -> None:
        self._cancel_timer()
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result((self._status, b"".join(self._body)))

    def _fail(self, exc: BaseException) -> None:
        self._cancel_timer()
        self.close()
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(exc)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def reusable(self) -> bool:
        """Whether the last request ended cleanly on a connection both sides keep open; readies it for the next."""
        if self._chunks is not None:  # a body read past h11: done when its last chunk and trailer came, no more
            clean = self._chunks.done and not self._chunks.rest and not self.closed
            self._chunks = None
            self.http = h11.Connection(h11.CLIENT)  # h11 saw only the head: the next request starts afresh
            return clean
        if self.closed or self.http.our_state is not h11.DONE or self.http.their_state is not h11.DONE:
            return False
        self.http.start_next_cycle()
        return True

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


def _plain_chunked(response: h11.Response) -> bool:
    """An HTTP/1.1 response in chunks that leaves the connection open: its body can be read past h11 (any other
    stays with h11, which knows what a close or HTTP/1.0 means for the connection)."""
    chunked = closing = False
    for name, value in response.headers:  # h11 gives names lower-cased
        if name == b"transfer-encoding":
            chunked = value.lower() == b"chunked"
        elif name == b"connection":
            closing = closing or b"close" in value.lower()
    return chunked and not closing and response.http_version == b"1.1"


class _BadChunk(Exception):
    pass


_HEX = frozenset(b"0123456789abcdefABCDEF")
_LINE_LIMIT = 4096  # a chunk-size line or trailer line longer than this is not HTTP from a server


class _Chunks:
    """A chunked body's framing (RFC 9112 7.1): `feed` takes bytes as they arrive, returns the data they carry;
    `done` once the last chunk and the trailer section have come; `rest`: bytes past the body (none from a server
    that answers one request at a time)."""

    def __init__(self) -> None:
        self.done = False
        self.rest = b""
        self._held = b""  # an incomplete size or trailer line
        self._left = 0  # data bytes of the current chunk still to come
        self._crlf = False  # the CRLF after a chunk's data is next
        self._trailer = False  # past the last chunk: trailer lines until an empty one

    def feed(self, data: bytes) -> list[bytes]:
        if self.done:
            self.rest += data
            return []
        buf = self._held + data if self._held else data
        self._held = b""
        out: list[bytes] = []
        pos, end = 0, len(buf)
        while pos < end:
            if self._left:
                take = min(self._left, end - pos)
                out.append(buf[pos:pos + take])
                pos += take
                self._left -= take
                continue
            if self._crlf:
                if end - pos < 2:
                    break
                if buf[pos:pos + 2] != b"\r\n":
                    raise _BadChunk("a chunk's data is not followed by CRLF")
                pos += 2
                self._crlf = False
                continue
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                break
            if eol - pos > _LINE_LIMIT:
                raise _BadChunk("a chunk-size or trailer line is too long")
            line, pos = buf[pos:eol], eol + 2
            if self._trailer:
                if not line:
                    self.done, self.rest = True, buf[pos:]
                    return out
                continue
            size = line.split(b";", 1)[0].strip()
            if not size or len(size) > 16 or not _HEX.issuperset(size):
                raise _BadChunk(f"bad chunk size {line[:40]!r}")
            self._left = int(size, 16)
            self._crlf = self._left > 0
            self._trailer = self._left == 0
        if end - pos > _LINE_LIMIT:
            raise _BadChunk("a chunk-size or trailer line is too long")
        self._held = buf[pos:]
        return out


class ServerConnections:
    """One server's connections: reused while the server keeps them open and for less than
    `keepalive_expiry_s` idle (below the server's own keep-alive, so a reused one is never one it is closing), at most
    `max_idle` kept."""

    def __init__(self, url: str, *, headers: dict[str, str], tls: ssl.SSLContext | None, connect_timeout_s: float,
                 read_timeout_s: float, keepalive_expiry_s: float, max_idle: int) -> None:
        parsed = httpx.URL(url)
        self.host = parsed.host
        self.port = parsed.port or (443 if parsed.scheme == "https" else 80)
        self.tls = tls if parsed.scheme == "https" else None
        self.base_path = parsed.raw_path.decode("ascii").split("?")[0].rstrip("/")
        host_header = parsed.netloc.decode("ascii").rpartition("@")[2]
        self.headers = [("Host", host_header), ("User-Agent", "tracegen"), ("Accept", "*/*"),
                        *((k, v) for k, v in headers.items() if k.lower() not in ("host", "content-length"))]
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.keepalive_expiry_s = keepalive_expiry_s
        self.max_idle = max_idle
        self._idle: list[_Connection] = []

    async def request(self, method: str, path: str, body: bytes, on_body: OnBody) -> tuple[int, bytes]:
        """`method` `path` with `body`: a 200 body goes to `on_body` as it arrives and (200, b"") is returned once
        the response ends or `on_body` returns True; any other status is returned with its whole body. Raises
        httpx's transport errors, and whatever `on_body` raises (the connection is then closed)."""
        conn = self._idle_connection() or await self._connect()
        head = h11.Request(method=method, target=self.base_path + path,
                           headers=[*self.headers, ("Content-Length", str(len(body)))])
        try:
            request = conn.http.send(head) + conn.http.send(h11.Data(data=body)) + conn.http.send(h11.EndOfMessage())
            result = await conn.start(request, on_body, self.read_timeout_s)
        except BaseException:  # a cancelled attempt (a wedged server) included: the connection is mid-response
            conn.close()
            raise
        if conn.reusable() and len(self._idle) < self.max_idle:
            conn.idle_since = conn.loop.time()
            self._idle.append(conn)
        else:
            conn.close()
        return result

    def _idle_connection(self) -> _Connection | None:
        while self._idle:
            conn = self._idle.pop()
            if (not conn.closed and not conn.transport.is_closing()  # type: ignore[union-attr]
                    and conn.loop.time() - conn.idle_since < self.keepalive_expiry_s):
                return conn
            conn.close()
        return None

    async def whole(self, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
        """`method` `path` with `body`: (status, the whole response body)."""
        parts: list[bytes] = []

        def take(data: bytes) -> bool:
            parts.append(data)
            return False

        status, raw = await self.request(method, path, body, take)
        return status, b"".join(parts) if status == 200 else raw

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(loop), self.host, self.port, ssl=self.tls,
                                       server_hostname=self.host if self.tls is not None else None),
                self.connect_timeout_s)
        except TimeoutError:
            raise httpx.ConnectTimeout(f"no connection to {self.host}:{self.port} within "
                                       f"{self.connect_timeout_s:g} s") from None
        except OSError as exc:  # ssl.SSLError included
            raise httpx.ConnectError(f"{type(exc).__name__}: {exc}") from None
        return conn

    def close(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()
