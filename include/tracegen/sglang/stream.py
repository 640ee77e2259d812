"""A streamed `/generate`: SGLang's server-sent events put together into one `Generated`, and watched as they
arrive so that the caller can stop a request that has gone wrong (a loop) without waiting for the cap.

What SGLang 0.5.23 sends (`http_server.serve_generate_request`, `TokenizerManager._handle_batch_output`):
- one `data: {json}` event per `--stream-interval` decoded tokens (several coalesced when the client lags),
  then `data: [DONE]`;
- with `--incremental-streaming-output`, each event holds only the new `text` and `output_ids`; without it,
  each holds every `output_ids` so far and the text so far;
- every event's `meta_info` carries `prompt_tokens`, `cached_tokens` (what the prefix cache held of the prompt)
  and the running `completion_tokens`; its `finish_reason` is null until the last event, which sets it
  (`{"type": "stop" | "length" | "abort"}`);
- a failure after the response started is an event `{"error": {"message", "code", ...}}`, then `[DONE]`.

Stopping a request: the client closes the response and sends `POST /abort_request {"rid"}` (SGLang 0.5.23
matches the exact rid, frees the request's slot at once and answers 200 with an empty body whatever the rid); a
disconnect alone is aborted by SGLang two seconds later (`TokenizerManager.create_abort_task`), two seconds of
decoding paid for nothing.

However a stream ends, what it holds is held to the request's cap and its counts to its ids
(`tracegen.sglang.usage`): every event as it arrives (a server ignoring `max_new_tokens` fails at the first event
past it, before any watch could stop it and keep what it sent), and the result once more.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from tracegen.sglang.limits import too_large
from tracegen.sglang.usage import InconsistentUsage, check_cap, check_usage
from tracegen.sglang.wire import Generated, MalformedResponse, TokenId, cached_count, int_field

DONE = b"[DONE]"


class _Event(msgspec.Struct):
    """The fields of one streamed event the client reads (SGLang sends more: they are skipped unread).
    Decoded and checked in one pass, ids included: the client reads an event per stream interval per row."""

    text: str | None = None
    output_ids: list[TokenId] | None = None
    meta_info: dict[str, Any] | None = None
    error: Any = None


_decode_event = msgspec.json.Decoder(_Event).decode
# The finish of a request the client stopped because its watch said so: not one of SGLang's.
STOPPED = "stopped"


class TokenWatch(Protocol):
    """Judges a generation as its token ids arrive; `feed` returns a verdict (any object that is not None)
    once the request should be stopped, None to let it run on."""

    def feed(self, new_ids: Sequence[int]) -> Any | None: ...


class StreamRejected(Exception):
    """The server refused the request inside the stream (an error event with a 4xx code): for good."""


class StreamFailed(MalformedResponse):
    """The stream broke off or reported a server-side error: transient, retried like a 5xx."""

    kind = "stream failed"


@dataclass
class StreamAssembly:
    """The state of one streamed /generate under `cap` new tokens: the events seen so far, put together.
    `feed_event` takes one parsed `data:` payload and returns the output ids it added."""

    cap: int | None = None
    incremental: bool | None = None  # unknown until a second event shows whether ids repeat
    output_ids: list[int] = field(default_factory=list)
    text_parts: list[str] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    finish: dict[str, Any] | None = None
    events: int = 0
    done: bool = False

    def feed_event(self, data: bytes) -> list[int]:
        if data.strip() == DONE:
            self.done = True
            return []
        try:
            event = _decode_event(data)
        except msgspec.ValidationError as exc:
            raise StreamFailed(f"event {self.events + 1}: {exc}: {data[:120]!r}") from None
        except msgspec.DecodeError as exc:
            raise StreamFailed(f"event {self.events + 1} is not JSON ({exc}): {data[:120]!r}") from None
        self.events += 1
        error = event.error
        if error is not None:
            message = error.get("message") if isinstance(error, dict) else error
            code = error.get("code") if isinstance(error, dict) else None
            if isinstance(code, int) and 400 <= code < 500 and code != 429:
                raise StreamRejected(f"HTTP {code} in the stream: {message}")
            raise StreamFailed(f"the server reported an error in the stream: {message!r:.200}")
        if self.finish is not None:
            raise StreamFailed("an event arrived after the one that finished the request")
        meta = event.meta_info
        if meta is None:
            raise StreamFailed(f"event {self.events}: 'meta_info' must be an object, got null")
        new = self._take_ids(event.output_ids or [], meta)
        where = f"event {self.events}: meta_info."
        check_cap(where, len(self.output_ids), self.cap, "max_new_tokens")
        count = meta.get("completion_tokens")
        if count is not None and count != len(self.output_ids):
            raise InconsistentUsage(f"{where}completion_tokens is {count!r} but the stream has sent "
                                    f"{len(self.output_ids):,} output token ids")
        text = event.text
        if text is not None:
            if self.incremental:
                self.text_parts.append(text)
            else:
                self.text_parts = [text]  # the first event's, or the whole text so far
        self.meta = meta
        finish = meta.get("finish_reason")
        if finish is not None:
            if not isinstance(finish, dict) or finish.get("type") not in ("stop", "length", "abort"):
                raise StreamFailed(f"meta_info.finish_reason must be a stop, length or abort object, "
                                   f"got {finish!r:.120}")
            self.finish = finish
        return new

    def _take_ids(self, ids: list[int], meta: dict[str, Any]) -> list[int]:
        # SGLang does not say which mode it streams in. The first event holds every id so far either way; the
        # second tells by the running completion_tokens: a cumulative event holds that many ids, an
        # incremental one only those generated since the last event.
        if self.events == 1:
            self.output_ids = list(ids)
            return ids
        if self.incremental is None:
            count = meta.get("completion_tokens")
            if type(count) is not int or count not in (len(ids), len(self.output_ids) + len(ids)):
                raise StreamFailed(f"event {self.events}: completion_tokens {count!r} is neither the event's "
                                   f"{len(ids)} ids nor the {len(self.output_ids) + len(ids)} sent so far")
            self.incremental = count != len(ids)
        if self.incremental:
            self.output_ids.extend(ids)
            return ids
        if ids[: len(self.output_ids)] != self.output_ids:
            raise StreamFailed(f"event {self.events}: the cumulative output ids do not extend the earlier ones")
        new = ids[len(self.output_ids):]
        self.output_ids = list(ids)
        return new

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def result(self) -> Generated:
        """The finished request as a non-streamed /generate would have answered it."""
        if self.finish is None:
            raise StreamFailed(f"the stream ended after {self.events} events without a finish_reason")
        kind = self.finish["type"]
        if kind == "abort":
            return Generated(self.text, None, "abort", 0, 0, 0)
        generated = Generated(
            text=self.text,
            output_ids=self.output_ids,
            finish_reason=kind,
            prompt_tokens=int_field(self.meta, "prompt_tokens", required=True),
            completion_tokens=int_field(self.meta, "completion_tokens", required=True),
            reasoning_tokens=int_field(self.meta, "reasoning_tokens", required=False),
            cached_tokens=cached_count(self.meta, "cached_tokens", "meta_info."),
        )
        check_usage("meta_info.", prompt_tokens=generated.prompt_tokens,
                    completion_tokens=generated.completion_tokens, reasoning_tokens=generated.reasoning_tokens,
                    prompt_ids=None, output_ids=generated.output_ids, cap=self.cap, cap_name="max_new_tokens",
                    cached_tokens=generated.cached_tokens)
        return generated

    def stopped(self, verdict: Any) -> Generated:
        """What the request had generated when the client stopped it: every id received, finish `stopped`, its
        counts checked as a finished request's are (the server's running reasoning count is capped at the ids
        received: it may run ahead of the last event the client read)."""
        reasoning = self.meta.get("reasoning_tokens")
        generated = Generated(
            text=self.text,
            output_ids=list(self.output_ids),
            finish_reason=STOPPED,
            prompt_tokens=int_field(self.meta, "prompt_tokens", required=True),
            completion_tokens=len(self.output_ids),
            reasoning_tokens=min(reasoning, len(self.output_ids)) if type(reasoning) is int and reasoning >= 0
            else 0,
            cached_tokens=cached_count(self.meta, "cached_tokens", "meta_info."),
            stopped=verdict,
        )
        check_usage("meta_info.", prompt_tokens=generated.prompt_tokens,
                    completion_tokens=generated.completion_tokens, reasoning_tokens=generated.reasoning_tokens,
                    prompt_ids=None, output_ids=generated.output_ids, cap=self.cap, cap_name="max_new_tokens",
                    cached_tokens=generated.cached_tokens)
        return generated


class EventReader:
    """Splits the bytes of a `text/event-stream` body into the payloads of its `data:` lines, none longer than
    `line_limit` bytes (`ResponseLimits.line`). A line's pieces are joined once, when its end arrives: a line
    arriving in thousands of reads costs linear time, not a re-join of everything held at every read."""

    def __init__(self, line_limit: int) -> None:
        self.line_limit = line_limit
        self._held: list[bytes] = []  # the pieces of a line whose end has not come yet
        self._held_bytes = 0

    def feed(self, chunk: bytes) -> list[bytes]:
        if b"\n" not in chunk:
            self._hold(chunk)
            return []
        if self._held:
            chunk = b"".join(self._held) + chunk
            self._held, self._held_bytes = [], 0
        *lines, rest = chunk.split(b"\n")
        if rest:
            self._hold(rest)
        limit = self.line_limit
        out = []
        for line in lines:
            if len(line) > limit:
                raise too_large("event-stream line", limit)
            if line.startswith(b"data:"):
                out.append(line[5:].lstrip())
        return out

    def _hold(self, piece: bytes) -> None:
        self._held.append(piece)
        self._held_bytes += len(piece)
        if self._held_bytes > self.line_limit:
            raise too_large("event-stream line", self.line_limit)
