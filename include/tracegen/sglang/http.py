"""One SGLang server's HTTP client: every request tracegen sends to SGLang (a row's generation, the parsing routes,
aborts, health probes, /metrics) goes through a `ServerHttp`, on aiohttp, each answer held to the same bounds.

Why aiohttp and not httpx (both pinned): on the streamed path, reading one row's events cost about a third of
httpx's CPU (docs/benchmarks.md, "Client CPU"), and aiohttp does not hand bytes a server sent past a response to the
next request on that connection: a connection is reused only when its response ended with nothing left unread
(httpx 0.28 / httpcore 1.0.9 returned them as the next request's answer).

What an answer is held to, whatever the server sends:
- a total deadline per attempt (`ClientConfig.attempt_deadline`) beside the idle read timeout
  (`request_deadline_s`): a server that trickles its body, sends endless `100 Continue` heads or never ends its
  body fails the attempt, and the error says which deadline fired;
- size limits (`ResponseLimits`): a 200's body, streamed or not, and an error body; an event stream's lines are
  bounded where they are split (`stream.EventReader`).

Proxies are never used (`trust_env=False`, everywhere tracegen talks to SGLang, as `fleet.server`'s checks): the
servers are on loopback, on a tunnel's local port or on the cluster's own network, and a worker's HTTP(S)_PROXY
would send a tunnel's 127.0.0.1 traffic to a corporate proxy instead.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import yarl

from tracegen.sglang.limits import ResponseLimits, too_large

# What a streamed 200's bytes are handed to as they arrive; True stops the read (the connection is then closed,
# the rest of the response unread).
OnBody = Callable[[bytes], bool]


class HttpFailure(Exception):
    """The exchange broke before a whole answer: a refused or dropped connection, a response that is not HTTP."""


class ConnectError(HttpFailure):
    """No connection to the server: refused, unreachable, or its TLS handshake failed."""


class HttpTimeout(HttpFailure):
    """A deadline fired. `waited_on_server`: the server had the request and did not finish answering it in time (the
    evidence behind wedge detection); False for a connect that timed out."""

    def __init__(self, message: str, *, waited_on_server: bool, deadline: str) -> None:
        super().__init__(message)
        self.waited_on_server = waited_on_server
        self.deadline = deadline  # how the deadline is named where it is set, e.g. "the 30 s attempt deadline"


@dataclass(frozen=True, slots=True)
class Reply:
    """A whole answer to a probe, an abort or a /metrics poll."""

    status_code: int
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")

    def json(self) -> Any:
        return json.loads(self.content)


class ServerHttp:
    """One server's connections, one per request: a connection never carries a second exchange, so bytes a server
    sends after its answer (a stray copy, a late duplicate) can never be read as the next request's answer.
    aiohttp's pool does not look at an idle connection's unread bytes before handing it out, and the cost of a
    connection per request is small beside a row's (docs/benchmarks.md, "Client CPU"). Opened inside the loop."""

    def __init__(self, url: str, *, headers: dict[str, str], tls: ssl.SSLContext, connect_timeout_s: float,
                 read_timeout_s: float, attempt_deadline_s: float) -> None:
        parsed = yarl.URL(url.rstrip("/"), encoded=True)
        # identity: a compressed body would be inflated past the limits before they could count it.
        self.headers = {**headers, "Accept-Encoding": "identity"}
        if parsed.user is not None:
            # Credentials in the URL (a proxy in front of SGLang) are Basic auth unless an api key is sent; aiohttp
            # refuses both at once.
            if "Authorization" not in self.headers:
                self.headers["Authorization"] = aiohttp.encode_basic_auth(parsed.user, parsed.password or "")
            parsed = parsed.with_user(None)
        self.url = str(parsed)
        self.tls = tls
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.attempt_deadline_s = attempt_deadline_s
        self._session: aiohttp.ClientSession | None = None
        self._urls: dict[str, yarl.URL] = {}

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            # limit=0: routing bounds what is in flight; an abort or a probe never waits for a pooled connection.
            connector = aiohttp.TCPConnector(limit=0, force_close=True, ssl=self.tls)
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s,
                                            sock_read=self.read_timeout_s)
            self._session = aiohttp.ClientSession(connector=connector, timeout=timeout, headers=self.headers,
                                                  trust_env=False, auto_decompress=False, raise_for_status=False)
        return self._session

    def _url(self, path: str) -> yarl.URL:
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = yarl.URL(self.url + path, encoded=True)
        return url

    async def exchange(self, method: str, path: str, body: bytes, *, limits: ResponseLimits,
                       on_body: OnBody | None = None, deadline_s: float | None = None) -> tuple[int, bytes]:
        """`method` `path` with `body`: (status, body). A 200's body goes to `on_body` as it arrives when one is
        given (b"" returned), else is returned whole; any other status is returned with its whole body. The whole
        exchange is bounded by `deadline_s` (default: the attempt deadline) and `limits`. Raises `HttpTimeout`,
        `HttpFailure`, `ResponseTooLarge`, and whatever `on_body` raises."""
        deadline = self.attempt_deadline_s if deadline_s is None else deadline_s
        try:
            async with asyncio.timeout(deadline):
                return await self._exchange(method, path, body, limits, on_body)
        except TimeoutError:
            # Only the total deadline surfaces as TimeoutError: `_exchange` turns aiohttp's own timeouts into ours.
            raise HttpTimeout(f"no whole answer within the {deadline:g} s attempt deadline", waited_on_server=True,
                              deadline=f"{deadline:g} s attempt deadline") from None

    async def _exchange(self, method: str, path: str, body: bytes, limits: ResponseLimits,
                        on_body: OnBody | None) -> tuple[int, bytes]:
        try:
            async with self._client().request(method, self._url(path), data=body) as response:
                status = response.status
                if status != 200:
                    return status, await _read_whole(response, limits.error, f"HTTP {status} error body")
                if on_body is None:
                    return 200, await _read_whole(response, limits.body, "response body")
                taken = 0
                try:
                    async for piece in response.content.iter_any():
                        taken += len(piece)
                        if taken > limits.body:
                            raise too_large("response body", limits.body)
                        if on_body(piece):
                            response.close()  # stopped mid-response: its connection cannot carry another request
                            break
                except BaseException:
                    response.close()  # refused or cancelled mid-response: the connection goes with it
                    raise
                return 200, b""
        except aiohttp.ConnectionTimeoutError:
            raise HttpTimeout(f"no connection within {self.connect_timeout_s:g} s", waited_on_server=False,
                              deadline=f"{self.connect_timeout_s:g} s connect timeout") from None
        except aiohttp.ServerTimeoutError:
            raise HttpTimeout(f"no bytes for {self.read_timeout_s:g} s (the idle read timeout)",
                              waited_on_server=True, deadline=f"{self.read_timeout_s:g} s deadline") from None
        except aiohttp.ClientConnectorError as exc:
            raise ConnectError(f"cannot connect to {self.url}: {exc.os_error}") from None
        except aiohttp.ClientResponseError as exc:  # a head aiohttp could not parse
            raise HttpFailure(f"malformed HTTP response: {exc.message}") from None
        except aiohttp.ClientPayloadError as exc:  # a body cut short or framed wrong
            raise HttpFailure(f"malformed or cut HTTP body: {exc}") from None
        except aiohttp.ClientError as exc:  # refused, reset or dropped connections
            raise HttpFailure(f"{type(exc).__name__}: {exc}") from None

    async def get(self, path: str, *, timeout: float) -> Reply:
        """A probe's GET, its answer whole (bounded like any answer to a request of its size)."""
        status, raw = await self.exchange("GET", path, b"", limits=ResponseLimits.for_request(0),
                                          deadline_s=timeout)
        return Reply(status, raw)

    async def post(self, path: str, body: bytes, *, timeout: float) -> Reply:
        """A probe's or an abort's POST of a JSON `body`, its answer whole."""
        status, raw = await self.exchange("POST", path, body, limits=ResponseLimits.for_request(len(body)),
                                          deadline_s=timeout)
        return Reply(status, raw)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


async def _read_whole(response: aiohttp.ClientResponse, limit: int, what: str) -> bytes:
    """A response's whole body, failing as soon as it is past `limit` (a Content-Length over it, before any read)."""
    if response.content_length is not None and response.content_length > limit:
        response.close()
        raise too_large(what, limit)
    parts: list[bytes] = []
    taken = 0
    async for piece in response.content.iter_any():
        taken += len(piece)
        if taken > limit:
            response.close()
            raise too_large(what, limit)
        parts.append(piece)
    return b"".join(parts)
