"""Async client that asks SGLang's `/v1/chat/completions` for one dataset row's completion (a `ChatRequest`),
and sends the requests that continue a truncated row (`/generate` from its token ids, then SGLang's
reasoning and tool-call split of the whole text: `tracegen.generate.extend` puts them together).

The client returns what the server said; it knows nothing of the ledger (`tracegen.generate.rows` turns an
answer into a ledger row). The chunk engine calls `SGLangClient.complete()` once per row, with up to
`client.capacity` calls in flight. Every call ends in exactly one of:
- an `Outcome` with a `Completion` value (finish_reason stop/length/tool_calls, token counts from `usage`,
  the prompt's and the response's token ids);
- an `Outcome` `rejected`: the server refused the request itself (400, e.g. context overflow), for good;
- an `Outcome` `failed`: transient failures (5xx, dropped connections, timeouts, `abort`, malformed bodies,
  token counts that disagree with the response's ids or the request's cap) used up the retry budget;
  a later run retries the row;
- `FatalClientError` raised: the configuration is wrong (401, no server reachable for a long time) and
  every further row would fail the same way.
Every other request goes through the same routing, deadlines and retries and ends in an `Outcome` too.
Routing, quarantine and probes live in `tracegen.sglang.routing`; failure kinds and backoff in `tracegen.sglang.retry`.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from tracegen.sglang.affinity import prefix_key
from tracegen.sglang.http import HttpFailure, HttpTimeout
from tracegen.sglang.limits import ResponseLimits
from tracegen.sglang.retry import (
    FATAL,
    TRANSIENT,
    FatalClientError,
    TransientError,
    backoff_delay,
    classify_status,
)
from tracegen.sglang.routing import ServerEndpoint, ServerPool, ServerState
from tracegen.sglang.settings import ClientConfig, Sampling
from tracegen.sglang.stream import EventReader, StreamAssembly, StreamRejected, TokenWatch
from tracegen.sglang.wire import (
    ABORT_PATH,
    DETOKENIZE_PATH,
    GENERATE_PATH,
    PARSE_FUNCTION_CALL_PATH,
    PATH,
    SEPARATE_REASONING_PATH,
    SERVER_INFO_PATH,
    TOKENIZE_PATH,
    ChatRequest,
    Completion,
    Generated,
    MalformedResponse,
    ServerParsers,
    build_abort_body,
    build_body,
    build_detokenize_body,
    build_generate_body,
    build_parse_function_call_body,
    build_separate_reasoning_body,
    build_tokenize_body,
    error_message,
    parse_completion,
    parse_detokenize,
    parse_function_calls,
    parse_generate,
    parse_separate_reasoning,
    parse_server_parsers,
    parse_tokenize,
)

__all__ = ["ChatRequest", "ClientConfig", "Completion", "FatalClientError", "Outcome", "Sampling", "SGLangClient",
           "ServerEndpoint"]

T = TypeVar("T")
log = logging.getLogger(__name__)
# Seconds an abort may take before the stream is closed anyway (SGLang aborts a disconnected request too).
ABORT_WAIT_S = 5.0


class _Aborted(Exception):
    """SGLang answered 200 with finish_reason `abort`: not a result, so the request is tried again."""


@dataclass(slots=True)
class Outcome(Generic[T]):
    """How one request ended, retries included: a `value`, or `rejected` (the server refused the request
    itself, permanent), or `failed` (the retry budget ran out)."""

    value: T | None = None
    rejected: str | None = None
    failed: str | None = None
    attempt: int = 0
    server: str = ""
    latency_s: float = 0.0


def _chat_result(raw: bytes, max_tokens: int | None = None) -> Completion:
    completion = parse_completion(raw, max_tokens=max_tokens)
    if completion.finish_reason == "abort":
        raise _Aborted
    return completion


def _generate_result(raw: bytes, max_new_tokens: int | None = None) -> Generated:
    generated = parse_generate(raw, max_new_tokens=max_new_tokens)
    if generated.finish_reason == "abort":
        raise _Aborted
    return generated


def _not_streamed(raw: bytes) -> Any:
    raise AssertionError("a streamed call's answer is read from its events")  # never called: see _attempt


def _call_id() -> str:
    # The chat route's tool-call ids: "call_" + 24 hex digits, fresh per call.
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True, slots=True)
class _Stream:
    """A streamed /generate: the body for a request id (fresh per attempt, so an abort names only this attempt's
    request), a new watch per attempt, and the cap."""

    body: Callable[[str], bytes]
    watch: Callable[[], TokenWatch]
    max_new_tokens: int


class SGLangClient:
    """Completes rows against a set of SGLang servers. Use as `async with SGLangClient(...) as client:`."""

    def __init__(self, servers: Sequence[ServerEndpoint], config: ClientConfig | None = None) -> None:
        self.config = config or ClientConfig()
        self._pool = ServerPool(list(servers), self.config)
        self._rng = random.Random(self.config.jitter_seed)
        self._fatal: FatalClientError | None = None
        # Autotune hook: started on first use (it needs the running loop); listeners hear capacity changes.
        self._tuner: Any = None
        self._capacity_listeners: list[Any] = []
        self._parsers: ServerParsers | None = None
        self._parsers_lock = asyncio.Lock()

    async def __aenter__(self) -> SGLangClient:
        self._start_tuner()
        return self

    def _start_tuner(self) -> None:
        if not self.config.autotune or self._tuner is not None:
            return
        from tracegen.sglang.autotune import Autotuner, TunePolicy

        policy = TunePolicy(ceiling=self.config.autotune_ceiling, interval_s=self.config.autotune_interval_s)
        self._tuner = Autotuner(self._pool, policy, on_change=self._capacity_changed)
        self._tuner.start()

    def on_capacity_change(self, listener: Any) -> None:
        """Call `listener(capacity)` whenever the autotuner changes the total in-flight limit."""
        self._capacity_listeners.append(listener)

    def _capacity_changed(self) -> None:
        for listener in self._capacity_listeners:
            listener(self.capacity)

    @property
    def autotune_history(self) -> list[dict[str, Any]]:
        return self._tuner.history if self._tuner is not None else []

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._tuner is not None:
            await self._tuner.stop()
        await self._pool.aclose()

    @property
    def capacity(self) -> int:
        """Sum of the servers' in-flight limits: how many `complete()` calls are worth running at once."""
        return self._pool.capacity

    def stats(self) -> list[dict[str, Any]]:
        """Per-server counters (sent, completed, failures, quarantined, ...)."""
        return self._pool.snapshot()

    async def complete(self, request: ChatRequest) -> Outcome[Completion]:
        """The completion of one dataset row, as the server gave it, or why there is none (`rejected`,
        `failed`). Raises FatalClientError on configuration problems."""
        if self._fatal is not None:
            raise self._fatal
        self._start_tuner()
        index, messages, tools, model = request.index, request.messages, request.tools, request.model
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"row {index}: messages must be a non-empty list, got {type(messages).__name__}")
        if tools is not None and not isinstance(tools, list):
            raise ValueError(f"row {index}: tools must be a list or None, got {type(tools).__name__}")
        if not isinstance(model, str) or not model:
            raise ValueError(f"model must be a non-empty string, got {model!r}")
        # Token ids: what a truncated row is continued from, and what a drafter trainer reads without
        # re-tokenising.
        body = build_body(request, return_token_ids=True)
        self._pool.probe_model = model
        # The response's counts are checked against its own token ids and this request's cap.
        max_tokens = request.sampling.max_tokens
        return await self._call("POST", PATH, body, lambda raw: _chat_result(raw, max_tokens),
                                limits=ResponseLimits.for_request(len(body), max_tokens),
                                affinity=prefix_key(messages, tools))

    async def generate(
        self, input_ids: list[int], *, max_new_tokens: int, sampling: Sampling, require_reasoning: bool = False,
        watch: Callable[[], TokenWatch] | None = None, affinity: str | None = None,
    ) -> Outcome[Generated]:
        """`/generate` continuing `input_ids` (a prompt's ids + the response so far) by up to
        `max_new_tokens`, with the row's sampling params (`require_reasoning`: the response so far ends
        inside its thinking).

        With `watch` (a factory: one watch per attempt) the output is streamed and fed to the watch as it
        arrives; once the watch returns a verdict the request is aborted (`POST /abort_request` with its rid,
        then the connection closed), which frees its slot on the server at once, and the answer is what it
        had generated, finish `stream.STOPPED`, the verdict in `Generated.stopped`. `affinity`: the prompt's
        prefix key (`affinity.prefix_key`), so the request goes where that prefix is likely cached."""

        def body(rid: str | None) -> bytes:
            return build_generate_body(input_ids, max_new_tokens=max_new_tokens, sampling=sampling,
                                       require_reasoning=require_reasoning, rid=rid)

        whole = body(None)
        # A streamed body differs from the whole one by its rid alone: the same limits fit both.
        limits = ResponseLimits.for_request(len(whole), max_new_tokens)
        if watch is None:
            return await self._call("POST", GENERATE_PATH, whole, lambda raw: _generate_result(raw, max_new_tokens),
                                    limits=limits, affinity=affinity)
        return await self._call("POST", GENERATE_PATH, None, _not_streamed, limits=limits,
                                stream=_Stream(body, watch, max_new_tokens), affinity=affinity)

    async def separate_reasoning(self, text: str, parser: str) -> Outcome[tuple[str, str]]:
        """SGLang's (reasoning, answer) split of raw model output, the chat route's own."""
        body = build_separate_reasoning_body(text, parser)
        return await self._call("POST", SEPARATE_REASONING_PATH, body, parse_separate_reasoning,
                                limits=ResponseLimits.for_request(len(body)), generation=False)

    async def parse_function_call(
        self, text: str, tools: list[dict[str, Any]], parser: str
    ) -> Outcome[tuple[str, list[dict[str, Any]]]]:
        """SGLang's (answer, tool calls) split of an answer, the chat route's own."""
        body = build_parse_function_call_body(text, tools, parser)
        return await self._call("POST", PARSE_FUNCTION_CALL_PATH, body,
                                lambda raw: parse_function_calls(raw, _call_id),
                                limits=ResponseLimits.for_request(len(body)), generation=False)

    async def tokenize(self, request: ChatRequest) -> Outcome[list[int]]:
        """The prompt ids the chat route would generate `request` from (SGLang's `/v1/tokenize` of its
        messages and tools)."""
        body = build_tokenize_body(request.messages, request.tools, request.model, request.template_kwargs)
        return await self._call("POST", TOKENIZE_PATH, body, parse_tokenize,
                                limits=ResponseLimits.for_request(len(body)), generation=False)

    async def detokenize(self, ids: list[int]) -> Outcome[str]:
        """The server's decoding of `ids` (SGLang's `/detokenize`). A server without the route answers it
        `rejected` (HTTP 404/405), never fatal: the caller falls back to what it has."""
        body = build_detokenize_body(ids)
        return await self._call("POST", DETOKENIZE_PATH, body, parse_detokenize,
                                limits=ResponseLimits.for_request(len(body)), generation=False, optional=True)

    async def server_parsers(self) -> Outcome[ServerParsers]:
        """The reasoning and tool-call parsers the servers run (one fleet, one launch: asked once)."""
        async with self._parsers_lock:
            if self._parsers is not None:
                return Outcome(self._parsers)
            out = await self._call("GET", SERVER_INFO_PATH, None, parse_server_parsers,
                                   limits=ResponseLimits.for_request(0), generation=False)
            self._parsers = out.value
            return out

    async def _call(
        self,
        method: str,
        path: str,
        body: bytes | None,
        parse: Callable[[bytes], T],
        *,
        limits: ResponseLimits,
        generation: bool = True,
        optional: bool = False,
        stream: _Stream | None = None,
        affinity: str | None = None,
    ) -> Outcome[T]:
        """One request with the client's routing, deadlines and retries. `generation`: a request that runs
        the model, whose success is the progress signal behind wedge detection (a wedged server still
        answers the tokenizer-side parsing routes, so those must not vouch for it). `optional`: the server may
        not have the route; a 404 or 405 is then `rejected`, not a fatal misconfiguration. `limits`: the largest
        answer the request may get. `affinity`: the prompt's prefix key, for routing."""
        if self._fatal is not None:
            raise self._fatal
        self._start_tuner()
        pool = self._pool
        call = _Call(method, path, body, parse, limits, generation, optional, stream)
        last_error = ""
        previous: ServerState | None = None
        attempt = 0
        while attempt < self.config.max_attempts:
            try:
                server = await pool.acquire(avoid=previous, key=affinity)
            except FatalClientError as exc:
                self._fatal = exc
                raise
            attempt += 1
            started = time.monotonic()
            try:
                result = await self._attempt(server, call, started)
            except TransientError as exc:
                last_error = f"{server.shown_url}: {exc}"
            else:
                if isinstance(result, _Rejected):
                    return Outcome(rejected=result.message, attempt=attempt, server=server.name)
                latency = time.monotonic() - started
                return Outcome(result, attempt=attempt, server=server.name, latency_s=latency)
            finally:
                pool.release(server)
            previous = server
            if attempt < self.config.max_attempts:
                await asyncio.sleep(
                    backoff_delay(attempt, self.config.backoff_base_s, self.config.backoff_max_s, self._rng)
                )
        return Outcome(failed=f"{attempt} attempts failed; last: {last_error}", attempt=attempt)

    async def _attempt(self, server: ServerState, call: _Call[T], started: float) -> T | _Rejected:
        """One HTTP attempt of `call` on `server`, started at `started` (monotonic). Returns the parsed
        body (ok) or a `_Rejected` (the server's message); raises TransientError (retry) or
        FatalClientError (stop)."""
        pool = self._pool
        if call.stream is not None:
            sending = self._stream(server, call.path, call.stream, call.limits)
        else:
            sending = server.http.exchange(call.method, call.path, call.body or b"", limits=call.limits)
        task = asyncio.create_task(sending)
        server.tasks.add(task)
        try:
            response = await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if task.cancelled() and current is not None and not current.cancelling():
                # Cancelled by the pool because this server was found wedged: re-route, not a crash.
                raise TransientError(f"server wedged ({server.reason}); request re-routed") from None
            raise
        except HttpTimeout as exc:
            reason = str(exc)  # which deadline fired
            if exc.waited_on_server:  # silent or trickling alike: the server holds the request and does not finish
                pool.record_timeout(server, started, reason, exc.deadline)
            else:
                pool.record_failure(server, reason)
            raise TransientError(reason) from None
        except HttpFailure as exc:
            # Dropped connections, refused connects, resets, responses that are not HTTP.
            reason = f"{type(exc).__name__}: {exc}"
            pool.record_failure(server, reason)
            raise TransientError(reason) from None
        except StreamRejected as exc:  # an error event with a 4xx code: the request itself is refused
            server.consecutive_failures = 0
            return _Rejected(str(exc))
        except (MalformedResponse, _Aborted) as exc:  # from a stream read inside the task, or a body past its limit
            reason = "finish_reason abort" if isinstance(exc, _Aborted) else f"{exc.kind}: {exc}"
            pool.record_failure(server, reason)
            raise TransientError(reason) from None
        finally:
            server.tasks.discard(task)

        status, raw = response
        return self._judge_answer(server, call, status, raw)

    def _judge_answer(self, server: ServerState, call: _Call[T], status: int, raw: Any) -> T | _Rejected:
        """What an answered attempt amounts to: its parsed body (ok), a `_Rejected` (the request is wrong
        for this server), TransientError (retry) or FatalClientError (stop), the server's health recorded."""
        pool = self._pool
        if status == 200 and call.stream is not None:
            pool.record_success(server)
            return raw
        if status == 200:
            try:
                result = call.parse(raw)
            except MalformedResponse as exc:
                reason = f"{exc.kind}: {exc}"  # malformed, or usage inconsistent with the response
                pool.record_failure(server, reason)
                raise TransientError(reason) from None
            except _Aborted:
                pool.record_failure(server, "finish_reason abort")
                raise TransientError("finish_reason abort (the server aborted the request)") from None
            if call.generation:
                pool.record_success(server)
            return result

        message = error_message(raw, status)
        kind = classify_status(status)
        if kind == TRANSIENT:
            reason = f"HTTP {status}: {message}"
            pool.record_failure(server, reason)
            raise TransientError(reason)
        if call.optional and status in (404, 405):
            # A route this server does not have (an older release): the request is answered, not the URL wrong.
            return _Rejected(f"HTTP {status}: {message}")
        if kind == FATAL:
            hint = " (check the api key for this server)" if status in (401, 403) else ""
            self._fatal = FatalClientError(f"{server.shown_url} answered HTTP {status}: {message}{hint}")
            raise self._fatal
        # REJECTED: the request itself is wrong for this server (context overflow): never retried. The
        # server answered, so it is alive.
        server.consecutive_failures = 0
        return _Rejected(f"HTTP {status}: {message}")

    async def _stream(self, server: ServerState, path: str, stream: _Stream,
                      limits: ResponseLimits) -> tuple[int, Any]:
        """A streamed /generate: (status, body), a 200's body being its events put together (`Generated`), each
        new id fed to the attempt's watch as the events arrive; aborted as soon as the watch says so. Raises
        `stream.StreamFailed` (transient), `StreamRejected`, `_Aborted`, `InconsistentUsage` (the cap or the counts
        broken, however the stream ends), `ResponseTooLarge`, and `http`'s failures."""
        rid = uuid.uuid4().hex
        assembly = StreamAssembly(cap=stream.max_new_tokens)
        reader, watch = EventReader(limits.line), stream.watch()
        verdict = None

        def on_body(chunk: bytes) -> bool:
            nonlocal verdict
            for data in reader.feed(chunk):
                if assembly.done:
                    break
                new = assembly.feed_event(data)
                if new:
                    verdict = watch.feed(new)
                    if verdict is not None:
                        return True
            return False

        try:
            status, raw = await server.http.exchange("POST", path, stream.body(rid), limits=limits, on_body=on_body)
        except MalformedResponse:
            # Refused mid-stream (past the cap, counts that disagree, a line past its limit): the request may
            # still be generating on the server.
            await self._abort(server, rid)
            raise
        if status != 200:
            return status, raw
        if verdict is not None:
            await self._abort(server, rid)
            return 200, assembly.stopped(verdict)
        generated = assembly.result()
        if generated.finish_reason == "abort":
            raise _Aborted
        return 200, generated

    async def _abort(self, server: ServerState, rid: str) -> None:
        """Ask the server to abort request `rid` now (the slot stays held until it is answered, so no new request
        waits on it). SGLang 0.5.23 answers 200 with an empty body whatever the rid, so the answer confirms nothing
        but that the server heard. Best effort: the stream's connection is closed already, which makes SGLang abort
        it too once it notices the disconnect, so a failure here costs seconds of decoding, never a row."""
        try:
            response = await server.http.post(ABORT_PATH, build_abort_body(rid), timeout=ABORT_WAIT_S)
        except (HttpFailure, MalformedResponse) as exc:
            log.info("%s: abort of %s not confirmed (%s); the closed stream aborts it", server.name, rid, exc)
            return
        if response.status_code != 200:
            log.info("%s: /abort_request answered HTTP %d: %s", server.name, response.status_code,
                     error_message(response.content, response.status_code))


@dataclass(frozen=True, slots=True)
class _Rejected:
    message: str


@dataclass(frozen=True, slots=True)
class _Call(Generic[T]):
    """One request as every attempt of it sends it: the route, the encoded body, how a 200 body is read,
    the largest answer it may get, and how its answer counts (`generation`, `optional`: see `SGLangClient._call`)."""

    method: str
    path: str
    body: bytes | None
    parse: Callable[[bytes], T]
    limits: ResponseLimits
    generation: bool
    optional: bool
    stream: _Stream | None = None
