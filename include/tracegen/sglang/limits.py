"""How large a server's answer to one request may be: its body, one line of an event stream, an error body.

A server that sends more than any honest answer could hold (a chunk that claims 2**64 bytes, an error body that
never ends, one event-stream line of tens of megabytes) would otherwise be buffered whole in the client's memory.
Each limit is derived from what the request asked for, generously: an honest answer stays far below it, and past
it the attempt fails naming the limit (`ResponseTooLarge`, a server fault retried like a malformed body).
"""

from __future__ import annotations

from dataclasses import dataclass

from tracegen.sglang.malformed import MalformedResponse

# The fixed part of any answer (its JSON keys, meta_info, an error's text), with room to spare.
BASE_BYTES = 1 << 20
# An answer may echo what it was asked (a chat answer returns its prompt's ids, /separate_reasoning the text it
# split), escaped: a byte of the request can come back as several.
PER_REQUEST_BYTE = 16
# One generated token in a streamed answer: its id, its text (escaped, up to a few dozen bytes) and, when the
# server streams every token, an event's whole meta_info (under 1 KiB in SGLang 0.5.23) around it.
PER_TOKEN_BYTES = 2048
# One generated token inside one event line: a cumulative stream repeats every id and all the text so far.
PER_TOKEN_LINE_BYTES = 256
# An error body: SGLang's are a message and a code, FastAPI's validation errors echo the request.
ERROR_BASE_BYTES = 256 << 10
PER_REQUEST_BYTE_IN_ERROR = 4


class ResponseTooLarge(MalformedResponse):
    """An answer past one of its `ResponseLimits`."""

    kind = "response too large"


@dataclass(frozen=True, slots=True)
class ResponseLimits:
    """The most bytes an answer may have: `body` (a 200's whole body, streamed or not), `line` (one line of an
    event stream), `error` (the body of any other status)."""

    body: int
    line: int
    error: int

    @classmethod
    def for_request(cls, request_bytes: int, cap: int | None = None) -> ResponseLimits:
        """The limits of the answer to a request of `request_bytes` bytes generating up to `cap` tokens (None:
        a route that generates nothing, whose answer is about as large as what it was sent)."""
        echoed = BASE_BYTES + PER_REQUEST_BYTE * request_bytes
        tokens = cap or 0
        return cls(body=echoed + PER_TOKEN_BYTES * tokens, line=echoed + PER_TOKEN_LINE_BYTES * tokens,
                   error=ERROR_BASE_BYTES + PER_REQUEST_BYTE_IN_ERROR * request_bytes)


def too_large(what: str, limit: int) -> ResponseTooLarge:
    return ResponseTooLarge(f"the {what} is past its limit of {limit:,} bytes")
