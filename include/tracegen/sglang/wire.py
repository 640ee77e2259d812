"""The wire format of the SGLang routes the client uses, non-streaming: building each request body and
validating each response into a small typed result.

- `POST /v1/chat/completions`: a row's completion, with the prompt's and the response's token ids;
- `POST /generate` with `input_ids`: the continuation of a truncated row from its exact tokens;
- `POST /separate_reasoning`, `POST /parse_function_call`: SGLang's own split of raw text into thinking,
  answer and tool calls, as the chat route does it;
- `POST /detokenize`: the server's decoding of a whole id sequence (an extended row's text);
- `GET /server_info`: which reasoning and tool-call parsers the server runs.

A server that answers 200 with a body we cannot trust (not JSON, missing fields, wrong types) is a
server fault: `parse_completion` raises `MalformedResponse` naming what is wrong, and the client
retries it like a 5xx instead of crashing or committing a broken row. Its counts are held to its ids and the
request's cap by `tracegen.sglang.usage` (`InconsistentUsage`, a `MalformedResponse`: retried the same way).
"""

from __future__ import annotations

import json
from dataclasses import KW_ONLY, dataclass
from typing import Annotated, Any

import msgspec

from tracegen.sglang.malformed import MalformedResponse
from tracegen.sglang.settings import Sampling
from tracegen.sglang.usage import check_usage

PATH = "/v1/chat/completions"
GENERATE_PATH = "/generate"
SEPARATE_REASONING_PATH = "/separate_reasoning"
PARSE_FUNCTION_CALL_PATH = "/parse_function_call"
SERVER_INFO_PATH = "/server_info"
DETOKENIZE_PATH = "/detokenize"
TOKENIZE_PATH = "/v1/tokenize"
# SGLang 0.5.23 aborts the request of exactly that rid ({"rid"}) and answers 200 with an empty body whatever the
# rid; the aborted stream still ends with a finish_reason of type `abort`, then `[DONE]`.
ABORT_PATH = "/abort_request"
# A token id as the client takes one from a server: a non-negative integer under 2**32 (JSON `true` is not one).
TokenId = Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]
_TOKEN_IDS = list[TokenId]
# The finish reasons of a completion, as SGLang reports them: it ended by itself, or at the cap ("length").
FINISH_REASONS = ("stop", "tool_calls", "length")
# What SGLang reports; `abort` is not a completion (the client retries it), the rest are.
SERVER_FINISH_REASONS = frozenset({*FINISH_REASONS, "abort"})


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
    # With `return_token_ids`: what the server generated from (the templated prompt) and generated.
    prompt_token_ids: list[int] | None = None
    response_token_ids: list[int] | None = None
    # Prompt tokens the server found in its prefix cache (`cached_count`); None: it did not say.
    cached_tokens: int | None = None


@dataclass(slots=True)
class Generated:
    """One `/generate` response: the new tokens only."""

    text: str
    output_ids: list[int] | None
    finish_reason: str  # "stop" | "length" | "abort", or `stream.STOPPED`: the client stopped it
    prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int
    # Prompt tokens the server found in its prefix cache (`cached_count`); None: it did not say.
    cached_tokens: int | None = None
    # Why the client stopped a streamed request (its watch's verdict, `stream.TokenWatch`); None otherwise.
    stopped: Any = None


@dataclass(frozen=True, slots=True)
class ServerParsers:
    """The parsers a server was launched with (None: without one), and how it streams."""

    reasoning: str | None
    tool_call: str | None
    # --incremental-streaming-output: each streamed event holds only its new ids. Without it every event
    # repeats the whole output so far, which costs the client quadratic bytes: tracegen streams (to stop a
    # loop) only from servers that stream incrementally.
    incremental_stream: bool = False


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """One chat completion to ask for: the dataset row's messages and tools, the model and the sampling.
    `index` is the row's, named in the errors a bad request raises; `template_kwargs` are the chat template's
    arguments (SGLang's `chat_template_kwargs`, e.g. enable_thinking), on the chat route and in `/v1/tokenize`
    alike; `extra` goes into the body as is."""

    index: int
    messages: list[dict[str, Any]]
    _: KW_ONLY
    model: str
    sampling: Sampling
    tools: list[dict[str, Any]] | None = None
    template_kwargs: dict[str, Any] | None = None
    extra: dict[str, Any] | None = None


def build_body(request: ChatRequest, *, return_token_ids: bool = False) -> bytes:
    """The JSON request body, encoded once per row (retries resend the same bytes)."""
    sampling = request.sampling
    body: dict[str, Any] = {
        "model": request.model,
        "messages": request.messages,
        "max_tokens": sampling.max_tokens,
        **sampling.params(),
        "stream": False,
    }
    if sampling.seed is not None:
        body["seed"] = sampling.seed
    if request.tools:
        body["tools"] = request.tools
    if request.template_kwargs:
        body["chat_template_kwargs"] = request.template_kwargs
    if return_token_ids:
        body["return_token_ids"] = True
    if request.extra:
        body.update(request.extra)
    return _encode(body)


def _encode(body: dict[str, Any]) -> bytes:
    # msgspec, not json.dumps: a body carries a prompt's or a response's token ids, thousands of them, and the
    # encoding is the client's own CPU a request (several times json.dumps's speed; UTF-8, no ASCII escapes).
    try:
        return msgspec.json.encode(body)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"request body is not JSON-serialisable: {exc}") from exc


def build_generate_body(
    input_ids: list[int],
    *,
    max_new_tokens: int,
    sampling: Sampling,
    require_reasoning: bool = False,
    rid: str | None = None,
) -> bytes:
    """`/generate` continuing `input_ids` (prompt ids + the response so far) by up to `max_new_tokens`,
    with `sampling` (the run's that produced the response). `require_reasoning`: the response so far ends
    inside its thinking, so the server counts the new tokens up to the end of the thinking as reasoning
    tokens (it counts only thinking a response opens itself otherwise). `rid`: the request streams its
    output, under this id (what `/abort_request` names)."""
    params: dict[str, Any] = {"max_new_tokens": max_new_tokens, **sampling.params()}
    if sampling.seed is not None:
        params["sampling_seed"] = sampling.seed
    body: dict[str, Any] = {"input_ids": input_ids, "sampling_params": params, "stream": rid is not None}
    if rid is not None:
        body["rid"] = rid
    if require_reasoning:
        body["require_reasoning"] = True
    return _encode(body)


def build_abort_body(rid: str) -> bytes:
    """`/abort_request` of the request streamed under `rid` (SGLang 0.5.23 matches the rid exactly)."""
    return _encode({"rid": rid})


def build_tokenize_body(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, model: str,
                        template_kwargs: dict[str, Any] | None = None) -> bytes:
    """`/v1/tokenize` of a chat request's messages and tools: the prompt ids the chat route would generate
    from (SGLang renders them with the same template, the same template arguments and the same processing)."""
    body: dict[str, Any] = {"model": model, "messages": messages}
    if tools:
        body["tools"] = tools
    if template_kwargs:
        body["chat_template_kwargs"] = template_kwargs
    return _encode(body)


def build_separate_reasoning_body(text: str, parser: str) -> bytes:
    return _encode({"text": text, "reasoning_parser": parser})


def build_detokenize_body(ids: list[int]) -> bytes:
    """`/detokenize` of one id sequence, special tokens skipped (SGLang's default, as its chat route decodes)."""
    return _encode({"tokens": ids})


def parse_detokenize(raw: bytes) -> str:
    """The text of a /detokenize body (one sequence)."""
    data = _object(raw)
    text = data.get("text")
    if not isinstance(text, str):
        raise MalformedResponse(f"detokenize must answer a text string, got {data!r:.160}")
    return text


def parse_tokenize(raw: bytes) -> list[int]:
    """The prompt ids of a /v1/tokenize body of one chat request (`tokens`, as many as its `count`)."""
    data = _object(raw)
    ids = token_ids(data, "tokens", "tokenize: ")
    if not ids or data.get("count") != len(ids):
        raise MalformedResponse(f"tokenize must answer a non-empty 'tokens' list and its 'count', got {data!r:.160}")
    return ids


def build_parse_function_call_body(text: str, tools: list[dict[str, Any]], parser: str) -> bytes:
    return _encode({"text": text, "tools": tools, "tool_call_parser": parser})


def int_field(usage: dict[str, Any], key: str, *, required: bool) -> int:
    value = usage.get(key)
    if value is None and not required:
        return 0
    # bool is an int subclass; a server saying `true` tokens is broken, not 1.
    if type(value) is not int or value < 0:
        raise MalformedResponse(f"usage.{key} must be a non-negative integer, got {value!r}")
    return value


def cached_count(container: dict[str, Any] | None, key: str, where: str) -> int | None:
    """The prompt tokens a server says it found cached, where SGLang 0.5.23 says it: `meta_info.cached_tokens`
    of every /generate answer and streamed event; on the chat route `usage.prompt_tokens_details.cached_tokens`,
    only when the server runs with --enable-cache-report (`prompt_tokens_details` is null without). None where
    the server did not say (an older server, the chat route without the flag): unknown, never 0."""
    value = None if container is None else container.get(key)
    if value is None:
        return None
    if type(value) is not int or value < 0:
        raise MalformedResponse(f"{where}{key} must be a non-negative integer or absent, got {value!r:.80}")
    return value


def _opt_str(message: dict[str, Any], key: str) -> str | None:
    value = message.get(key)
    if value is not None and not isinstance(value, str):
        raise MalformedResponse(f"message.{key} must be a string or null, got {type(value).__name__}")
    return value


def _object(raw: bytes) -> dict[str, Any]:
    try:
        data = msgspec.json.decode(raw)  # several times json.loads's speed: a chat body holds its token ids
    except msgspec.DecodeError as exc:
        snippet = raw[:120].decode("utf-8", "replace")
        raise MalformedResponse(f"body is not JSON ({exc}); starts with {snippet!r}") from None
    if not isinstance(data, dict):
        raise MalformedResponse(f"body is a JSON {type(data).__name__}, expected an object")
    return data


def token_ids(container: dict[str, Any], key: str, where: str) -> list[int] | None:
    ids = container.get(key)
    if ids is None:
        return None
    # Checked in C: a whole answer holds thousands (a Python loop over 5,400 took 0.3 ms, this 0.05).
    try:
        return msgspec.convert(ids, _TOKEN_IDS)
    except msgspec.ValidationError:
        raise MalformedResponse(f"{where}{key} must be a list of token ids, got {ids!r:.120}") from None


def parse_completion(raw: bytes, *, max_tokens: int | None = None) -> Completion:
    """Validate a 200 body from /v1/chat/completions; raise MalformedResponse saying what is wrong.
    `max_tokens`: the request's cap, which no count of completion tokens may exceed."""
    data = _object(raw)
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
    prompt_details = usage.get("prompt_tokens_details")
    if prompt_details is not None and not isinstance(prompt_details, dict):
        raise MalformedResponse(f"usage.prompt_tokens_details must be an object or null, got {prompt_details!r:.80}")
    response_id = data.get("id")
    completion = Completion(
        id=response_id if isinstance(response_id, str) else None,
        content=_opt_str(message, "content"),
        reasoning_content=_opt_str(message, "reasoning_content"),
        tool_calls=tool_calls,
        finish_reason=finish_reason,
        prompt_tokens=int_field(usage, "prompt_tokens", required=True),
        completion_tokens=int_field(usage, "completion_tokens", required=True),
        reasoning_tokens=reasoning_tokens or 0,
        prompt_token_ids=token_ids(choice, "prompt_token_ids", "choices[0]."),
        response_token_ids=token_ids(choice, "response_token_ids", "choices[0]."),
        cached_tokens=cached_count(prompt_details, "cached_tokens", "usage.prompt_tokens_details."),
    )
    check_usage("usage.", prompt_tokens=completion.prompt_tokens, completion_tokens=completion.completion_tokens,
                 reasoning_tokens=completion.reasoning_tokens, prompt_ids=completion.prompt_token_ids,
                 output_ids=completion.response_token_ids, cap=max_tokens, cap_name="max_tokens",
                 cached_tokens=completion.cached_tokens, cached_name="prompt_tokens_details.cached_tokens")
    return completion


def parse_generate(raw: bytes, *, max_new_tokens: int | None = None) -> Generated:
    """Validate a 200 body from /generate (one non-streamed request); `max_new_tokens`: the request's."""
    data = _object(raw)
    text, meta = data.get("text"), data.get("meta_info")
    if not isinstance(text, str):
        raise MalformedResponse(f"'text' must be a string, got {text!r:.120}")
    if not isinstance(meta, dict):
        raise MalformedResponse(f"'meta_info' must be an object, got {meta!r:.120}")
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, dict) else None
    if kind not in ("stop", "length", "abort"):
        raise MalformedResponse(
            f"meta_info.finish_reason must be a stop, length or abort object, got {finish!r:.120}"
        )
    if kind == "abort":
        return Generated(text, None, "abort", 0, 0, 0)
    generated = Generated(
        text=text,
        output_ids=token_ids(data, "output_ids", ""),
        finish_reason=kind,
        prompt_tokens=int_field(meta, "prompt_tokens", required=True),
        completion_tokens=int_field(meta, "completion_tokens", required=True),
        reasoning_tokens=int_field(meta, "reasoning_tokens", required=False),
        cached_tokens=cached_count(meta, "cached_tokens", "meta_info."),
    )
    check_usage("meta_info.", prompt_tokens=generated.prompt_tokens, completion_tokens=generated.completion_tokens,
                 reasoning_tokens=generated.reasoning_tokens, prompt_ids=None, output_ids=generated.output_ids,
                 cap=max_new_tokens, cap_name="max_new_tokens", cached_tokens=generated.cached_tokens)
    return generated


def parse_separate_reasoning(raw: bytes) -> tuple[str, str]:
    """(reasoning_text, text) from /separate_reasoning."""
    data = _object(raw)
    reasoning, text = data.get("reasoning_text"), data.get("text")
    if not isinstance(reasoning, str) or not isinstance(text, str):
        raise MalformedResponse(
            f"separate_reasoning must answer reasoning_text and text strings, got {data!r:.160}"
        )
    return reasoning, text


def parse_function_calls(raw: bytes, new_id: Any) -> tuple[str, list[dict[str, Any]]]:
    """(normal_text, tool_calls) from /parse_function_call, the calls in the chat route's shape; `new_id()`
    names each call as the chat route does for every parser but the Kimi ones (a fresh id per call)."""
    data = _object(raw)
    normal, calls = data.get("normal_text"), data.get("calls")
    if not isinstance(normal, str) or not isinstance(calls, list):
        raise MalformedResponse(f"parse_function_call must answer normal_text and calls, got {data!r:.160}")
    out = []
    for i, call in enumerate(calls):
        if not isinstance(call, dict) or not isinstance(call.get("parameters"), str):
            raise MalformedResponse(f"calls[{i}] must hold a parameters string, got {call!r:.120}")
        # `index` is the call's ordinal, as the chat route numbers them (`tool_index` is the tool's
        # position in the request, not the call's).
        out.append({
            "id": new_id(), "index": i, "type": "function",
            "function": {"name": call.get("name"), "arguments": call["parameters"]},
        })  # fmt: skip
    return normal, out


def parse_server_parsers(raw: bytes) -> ServerParsers:
    """The reasoning and tool-call parsers a /server_info body reports, and whether it streams incrementally."""
    data = _object(raw)
    found = []
    for key in ("reasoning_parser", "tool_call_parser"):
        value = data.get(key)
        if value is not None and not isinstance(value, str):
            raise MalformedResponse(f"server_info.{key} must be a string or null, got {value!r:.80}")
        found.append(value or None)
    incremental = data.get("incremental_streaming_output", False)
    if not isinstance(incremental, bool):
        raise MalformedResponse(f"server_info.incremental_streaming_output must be a boolean, got {incremental!r:.80}")
    return ServerParsers(*found, incremental_stream=incremental)


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
