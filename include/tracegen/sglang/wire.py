"""The wire format of SGLang's OpenAI-compatible `POST /v1/chat/completions` (non-streaming):
building the request body and validating the response into a small typed result.

A server that answers 200 with a body we cannot trust (not JSON, missing fields, wrong types) is a
server fault: `parse_completion` raises `MalformedResponse` naming what is wrong, and the client
retries it like a 5xx instead of crashing or committing a broken row.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tracegen.store.records import FINISH_REASONS

PATH = "/v1/chat/completions"
# What SGLang reports; `abort` is not a completion (the client retries it), the rest are.
SERVER_FINISH_REASONS = frozenset({*FINISH_REASONS, "abort"})


class MalformedResponse(ValueError):
    """A 200 response whose body is not a valid chat completion."""


@dataclass(slots=True)
class Completion:
    """The fields of one chat completion that the pipeline keeps."""

    id: str | None
    content: str | None
    reasoning_content: str | None
    tool_calls: list[dict[str, Any]] | None
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int


def build_body(
    messages: list[dict[str, Any]],
    *,
    model: str,
    max_tokens: int,
    temperature: float,
    top_p: float,
    seed: int | None,
    tools: list[dict[str, Any]] | None = None,
    extra: dict[str, Any] | None = None,
) -> bytes:
    """The JSON request body, encoded once per row (retries resend the same bytes)."""
    body: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "stream": False,
    }
    if seed is not None:
        body["seed"] = seed
    if tools:
        body["tools"] = tools
    if extra:
        body.update(extra)
    try:
        return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
    except (TypeError, ValueError) as exc:
        raise ValueError(f"request body is not JSON-serialisable: {exc}") from exc


def _int_field(usage: dict[str, Any], key: str, *, required: bool) -> int:
    value = usage.get(key)
    if value is None and not required:
        return 0
    # bool is an int subclass; a server saying `true` tokens is broken, not 1.
    if type(value) is not int or value < 0:
        raise MalformedResponse(f"usage.{key} must be a non-negative integer, got {value!r}")
    return value


def _opt_str(message: dict[str, Any], key: str) -> str | None:
    value = message.get(key)
    if value is not None and not isinstance(value, str):
        raise MalformedResponse(f"message.{key} must be a string or null, got {type(value).__name__}")
    return value


def parse_completion(raw: bytes) -> Completion:
    """Validate a 200 body from /v1/chat/completions; raise MalformedResponse saying what is wrong."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        snippet = raw[:120].decode("utf-8", "replace")
        raise MalformedResponse(f"body is not JSON ({exc}); starts with {snippet!r}") from None
    if not isinstance(data, dict):
        raise MalformedResponse(f"body is a JSON {type(data).__name__}, expected an object")
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise MalformedResponse(f"'choices' must be a non-empty list of objects, got {choices!r:.120}")
    choice = choices[0]
    message = choice.get("message")
    if not isinstance(message, dict):
        raise MalformedResponse(f"choices[0].message must be an object, got {message!r:.120}")
    finish_reason = choice.get("finish_reason")
    if finish_reason not in SERVER_FINISH_REASONS:
        raise MalformedResponse(
            f"choices[0].finish_reason must be one of {sorted(SERVER_FINISH_REASONS)}, got {finish_reason!r}"
        )
    tool_calls = message.get("tool_calls")
    if tool_calls is not None and not (
        isinstance(tool_calls, list) and all(isinstance(call, dict) for call in tool_calls)
    ):
        raise MalformedResponse(f"message.tool_calls must be a list of objects or null, got {tool_calls!r:.120}")
    usage = data.get("usage")
    if finish_reason == "abort":
        # SGLang omits usage on aborts; nothing of an abort is kept, so do not insist on it.
        return Completion(None, None, None, None, "abort", 0, 0, 0)
    if not isinstance(usage, dict):
        raise MalformedResponse(f"'usage' must be an object, got {usage!r:.120}")
    reasoning_tokens = usage.get("reasoning_tokens")
    if reasoning_tokens is None:
        details = usage.get("completion_tokens_details")
        reasoning_tokens = details.get("reasoning_tokens") if isinstance(details, dict) else None
    if reasoning_tokens is not None and (type(reasoning_tokens) is not int or reasoning_tokens < 0):
        raise MalformedResponse(f"usage.reasoning_tokens must be a non-negative integer, got {reasoning_tokens!r}")
    response_id = data.get("id")
    return Completion(
        id=response_id if isinstance(response_id, str) else None,
        content=_opt_str(message, "content"),
        reasoning_content=_opt_str(message, "reasoning_content"),
        tool_calls=tool_calls,
        finish_reason=finish_reason,
        prompt_tokens=_int_field(usage, "prompt_tokens", required=True),
        completion_tokens=_int_field(usage, "completion_tokens", required=True),
        reasoning_tokens=reasoning_tokens or 0,
    )


def error_message(raw: bytes, status: int) -> str:
    """The human message inside an SGLang error body (flat OpenAI shape, nested, or plain text)."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        data = None
    if isinstance(data, dict):
        message = data.get("message")
        error = data.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            message = error["message"]
        elif message is None and isinstance(error, str):
            message = error
        elif message is None and isinstance(data.get("detail"), str):
            message = data["detail"]
        if isinstance(message, str) and message:
            return message
    text = raw[:500].decode("utf-8", "replace").strip()
    return text or f"HTTP {status} with an empty body"
