"""SGLang's wire format for the stand-in: request validation and response/error bodies.

Validation raises `BadRequest` with a message naming the bad field; the HTTP layer turns it into
SGLang's 400 body (flat on OpenAI routes, nested on /generate). Response builders take token counts
from the batching engine and render the sample's token ids and their text as SGLang's detokenizer
returns it. Raw text is what the model emits (`<think>\n…\n</think>\n\n…`); the chat route's split is
SGLang's parser applied to it. The text of a prefix joined with its continuation's is the whole
response's only when the prefix ends on a whole character: decoding all the ids at once is what is exact.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from tracegen.dataset.request_rules import (
    MEDIA_PART_TYPES,
    as_sglang_reads,
    check_message,
    check_tool,
    check_tool_call_arguments,
    check_tool_parameters,
)
from tracegen.sglang.launch_flags import sglang_version
from tracegen.simulator.lengths import Drawn, Sample
from tracegen.simulator.reasoning import chat_parser, separate_reasoning
from tracegen.simulator.tokens import EOS_TOKEN_ID, Response, decode, detokenize

SGLANG_VERSION = sglang_version()  # the release whose protocol and flags the stand-in mirrors
DEFAULT_SAMPLING_SEED = 42  # SGLang's seed for a request without one, in deterministic mode
_INT64 = (-(2**63), 2**63 - 1)


class BadRequest(ValueError):
    """HTTP 400 with this message, for a body SGLang's request model refuses (FastAPI's validation, which
    SGLang answers with error type "Bad Request")."""

    error_type = "Bad Request"


class RequestRefused(BadRequest):
    """HTTP 400 from SGLang's chat handler itself: its request checks (tool schemas, tool_choice) and the
    context-length check; error type "BadRequestError"."""

    error_type = "BadRequestError"


class ConversionRefused(BadRequest):
    """HTTP 400 for a ValueError while SGLang converts the request (e.g. token ids asked for on a stream);
    error type "BadRequest"."""

    error_type = "BadRequest"


def parse_json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"Invalid JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"Request body must be a JSON object, got {type(body).__name__}")
    return body


def _int(body: Mapping[str, Any], key: str, minimum: int, where: str = "") -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{where}{key} must be an integer, got {json.dumps(value)[:80]}")
    if value < minimum:
        raise BadRequest(f"{where}{key} must be >= {minimum}, got {value}")
    return value


def _number(body: Mapping[str, Any], key: str, low: float, high: float, where: str = "") -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise BadRequest(f"{where}{key} must be a number in [{low}, {high}], got {json.dumps(value)[:80]}")
    return float(value)


# Sampling controls SGLang honours that the stand-in does not model: SGLang stops at a stop string or id (finish
# `{"type": "stop", "matched": ...}`) and biases logits. Ignoring them would answer kinder than SGLang (a request
# it stops early would run on), so the stand-in refuses a request that sets one; tracegen sends none.
UNMODELLED_CONTROLS = ("stop", "stop_token_ids", "stop_regex", "logit_bias")


def _check_sampling(body: Mapping[str, Any], where: str = "") -> None:
    """SGLang's `SamplingParams.verify` of top_k, min_p and repetition_penalty (both routes reach it), and the
    controls the stand-in refuses (UNMODELLED_CONTROLS)."""
    for key in UNMODELLED_CONTROLS:
        if body.get(key) not in (None, "", [], {}):
            raise BadRequest(f"{where}{key} is not modelled by the SGLang stand-in (SGLang would honour it)")
    top_k = body.get("top_k")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or (top_k < 1 and top_k != -1)):
        raise BadRequest(f"{where}top_k must be -1 (disable) or at least 1, got {json.dumps(top_k)[:80]}.")
    _number(body, "min_p", 0.0, 1.0, where)
    if _number(body, "repetition_penalty", 0.0, 2.0, where) == 0.0:
        raise BadRequest(f"{where}repetition_penalty must be in (0, 2] (1.0 = no penalty), got 0.")


def _bool(body: Mapping[str, Any], key: str, default: bool, where: str = "") -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"{where}{key} must be true or false, got {json.dumps(value)[:80]}")
    return value


def _optional_bool(body: Mapping[str, Any], key: str) -> bool | None:
    return None if body.get(key) is None else _bool(body, key, False)


def _seed(body: Mapping[str, Any], key: str, where: str = "") -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{where}{key} must be an integer, got {json.dumps(value)[:80]}")
    if not _INT64[0] <= value <= _INT64[1]:  # SGLang's SamplingParams.verify, on the seed it becomes
        raise BadRequest(f"sampling_seed must be in [-2**63, 2**63 - 1], got {value}.")
    return value


def _rid(body: Mapping[str, Any]) -> str | None:
    rid = body.get("rid")
    if rid is not None and (not isinstance(rid, str) or not rid):
        raise BadRequest(f"rid must be a non-empty string, got {json.dumps(rid)[:80]}")
    return rid


@dataclass(frozen=True, slots=True)
class ChatRequest:
    messages: list[dict[str, Any]]  # as SGLang's models keep them (a user message's `name` dropped)
    tools: list[dict[str, Any]] | None
    max_tokens: int | None
    stream: bool
    include_usage: bool
    enable_thinking: bool
    separate_reasoning: bool
    ignore_eos: bool
    model: str | None
    rid: str | None
    seed: int | None = None
    return_prompt_token_ids: bool = False
    return_token_ids: bool = False
    tool_choice: str | dict[str, Any] = "none"
    priority: int | None = None
    continue_final_message: bool = False
    # SGLang's `sglext` ids: the prompt's and the output's ids at the response's level, whole or streamed (a last
    # chunk of their own); asked in the body or by the `x-sglext-return-*-ids: 1` headers (`sglext_asked`).
    return_input_ids_in_sglext: bool = False
    return_output_ids_in_sglext: bool = False
    sglext_ids_framed: bool = False  # `x-sglext-ids-framed: 1`: the streamed ids chunk is an `event: sglext_ids`

    @property
    def asks_sglext_ids(self) -> bool:
        return self.return_input_ids_in_sglext or self.return_output_ids_in_sglext


SGLEXT_INPUT_HEADER, SGLEXT_OUTPUT_HEADER, SGLEXT_FRAMED_HEADER = (
    "x-sglext-return-input-ids", "x-sglext-return-output-ids", "x-sglext-ids-framed")


def sglext_asked(req: ChatRequest, headers: Mapping[str, str]) -> ChatRequest:
    """`req` with SGLang's header opt-ins applied: a header whose value is exactly "1" turns its flag on."""
    return replace(
        req,
        return_input_ids_in_sglext=req.return_input_ids_in_sglext or headers.get(SGLEXT_INPUT_HEADER) == "1",
        return_output_ids_in_sglext=req.return_output_ids_in_sglext or headers.get(SGLEXT_OUTPUT_HEADER) == "1",
        sglext_ids_framed=headers.get(SGLEXT_FRAMED_HEADER) == "1",
    )


def sglext_ids(req: ChatRequest, prompt_ids: list[int], output_ids: list[int]) -> dict[str, Any]:
    """The response-level `sglext` of the ids `req` asked for (`req.asks_sglext_ids`)."""
    ext: dict[str, Any] = {}
    if req.return_input_ids_in_sglext and prompt_ids:
        ext["input_ids"] = list(prompt_ids)
    if req.return_output_ids_in_sglext:
        ext["output_ids"] = [list(output_ids)]
    return ext


def _tool_choice(body: Mapping[str, Any], tools: list[dict[str, Any]] | None) -> str | dict[str, Any]:
    """SGLang's tool_choice: "auto" when tools are given and it is not, else "none"; a named function must
    be among the tools, and "required" needs some."""
    choice = body.get("tool_choice")
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in ("auto", "required", "none"):
            raise BadRequest(f"tool_choice must be 'auto', 'required', 'none' or a function, got {choice!r}")
        if choice == "required" and not tools:
            raise RequestRefused("Tools cannot be empty if tool choice is set to required.")
        return choice
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(fn, dict) or not _optional_str(fn.get("name")):
        raise BadRequest("tool_choice must be 'auto', 'required', 'none' or {'function': {'name': ...}}")
    if not tools:
        raise RequestRefused("Tools cannot be empty if tool choice is set to a specific tool.")
    if not any(t["function"]["name"] == fn.get("name") for t in tools):
        raise RequestRefused(f"Tool '{fn.get('name')}' not found in tools list.")
    return choice


def _optional_str(value: Any) -> bool:
    return value is None or isinstance(value, str)


def parse_chat(body: dict[str, Any]) -> ChatRequest:
    messages, tools, tool_choice = _chat_prompt(body)
    priority = body.get("priority")
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
        raise BadRequest(f"priority must be an integer, got {json.dumps(priority)[:80]}")
    max_tokens = _int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1)
    _number(body, "temperature", 0.0, 100.0)
    _number(body, "top_p", 0.0, 1.0)
    _check_sampling(body)
    seed = _seed(body, "seed")
    _int(body, "n", 1)
    if body.get("n", 1) != 1:
        raise BadRequest("n > 1 is not supported by the stand-in")
    stream, return_prompt_token_ids, return_token_ids = _chat_returns(body)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest("stream_options must be an object")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise BadRequest("chat_template_kwargs must be an object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("model must be a string")
    # As SGLang: a final assistant message is continued (its content encoded after the generation prompt),
    # or without this flag served as a user message. The stand-in cannot recover a sample from text, so
    # the continuation is a fresh sample of those prompt ids: continue rows by token ids through /generate.
    continue_final_message = _bool(body, "continue_final_message", False)
    try:  # SGLang parses earlier tool calls' arguments while it converts the request for its template
        check_tool_call_arguments(messages, locate=False)
    except ValueError as exc:
        raise ConversionRefused(str(exc)) from None
    return ChatRequest(
        messages=[as_sglang_reads(m) for m in messages],
        tools=tools or None,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=bool(options and _bool(options, "include_usage", False, "stream_options.")),
        enable_thinking=_bool(kwargs or {}, "enable_thinking", True, "chat_template_kwargs."),
        separate_reasoning=_bool(body, "separate_reasoning", True),
        ignore_eos=_bool(body, "ignore_eos", False),
        model=model,
        rid=_rid(body),
        seed=seed,
        return_prompt_token_ids=return_prompt_token_ids,
        return_token_ids=return_token_ids,
        tool_choice=tool_choice,
        priority=priority,
        continue_final_message=continue_final_message,
        return_input_ids_in_sglext=_bool(body, "return_input_ids_in_sglext", False),
        return_output_ids_in_sglext=_bool(body, "return_output_ids_in_sglext", False),
    )


def _chat_prompt(body: dict[str, Any]) -> tuple[list[Any], list[Any] | None, str | dict[str, Any]]:
    """(messages, tools, tool_choice) as SGLang checks them: its request model first, then its chat
    handler's own checks in its order."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise BadRequest("messages must be a list of {role, content} objects")
    for i, m in enumerate(messages):
        try:
            check_message(m, f"messages[{i}]")
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise BadRequest("tools must be a list of objects")
    try:
        for i, tool in enumerate(tools or []):
            check_tool(tool, f"tools[{i}]")
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    # The chat handler's own checks, in its order, after the request model accepted the body.
    if not messages:
        raise RequestRefused("Messages cannot be empty.")
    # The stand-in serves a text model, which SGLang refuses media for.
    media = next((part["type"] for m in messages if isinstance(m.get("content"), list)
                  for part in m["content"] if part["type"] in MEDIA_PART_TYPES), None)  # fmt: skip
    if media is not None:
        raise RequestRefused(f"Model only supports text input; received unsupported content type '{media}'.")
    tool_choice = _tool_choice(body, tools)
    try:
        for i, tool in enumerate(tools or []):
            check_tool_parameters(tool, f"Tool {i}")
    except ValueError as exc:
        raise RequestRefused(str(exc)) from None
    return messages, tools, tool_choice


def _chat_returns(body: dict[str, Any]) -> tuple[bool, bool, bool]:
    """(stream, return_prompt_token_ids, return_token_ids): token ids come only with a whole response."""
    stream = _bool(body, "stream", False)
    return_prompt_token_ids = _bool(body, "return_prompt_token_ids", False)
    return_token_ids = _bool(body, "return_token_ids", False)
    if stream and return_prompt_token_ids:  # verbatim from SGLang's serving_chat
        raise ConversionRefused(
            "return_prompt_token_ids is not supported with streaming. "
            "Please set stream=false when using return_prompt_token_ids=true."
        )
    if stream and return_token_ids:
        raise ConversionRefused(
            "return_token_ids is not supported with streaming on /v1/chat/completions. "
            "Please set stream=false when using return_token_ids=true."
        )
    return stream, return_prompt_token_ids, return_token_ids


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    prompt: str | list[int]
    max_new_tokens: int
    stream: bool
    ignore_eos: bool
    rid: str | None
    sampling_seed: int | None = None
    stream_interval: int | None = None  # sampling_params.stream_interval: tokens per event (None, 0: the server's)


def parse_generate(body: dict[str, Any]) -> GenerateRequest:
    text, ids = body.get("text"), body.get("input_ids")
    if text is not None and ids is not None:
        raise BadRequest("Either text or input_ids should be provided, not both")
    if text is None and ids is None:
        raise BadRequest("Either text or input_ids should be provided")
    if text is not None and not isinstance(text, str):
        raise BadRequest("text must be a string (batched requests are not supported by the stand-in)")
    if ids is not None and (
        not isinstance(ids, list)
        or not ids
        or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
    ):
        raise BadRequest("input_ids must be a non-empty list of integers")
    sp = body.get("sampling_params") or {}
    if not isinstance(sp, dict):
        raise BadRequest("sampling_params must be an object")
    where = "sampling_params."
    max_new = _int(sp, "max_new_tokens", 0, where)
    _number(sp, "temperature", 0.0, 100.0, where)
    _number(sp, "top_p", 0.0, 1.0, where)
    _check_sampling(sp, where)
    interval = sp.get("stream_interval")
    if interval is not None and (isinstance(interval, bool) or not isinstance(interval, int)):
        raise BadRequest(f"sampling_params.stream_interval must be an integer, got {json.dumps(interval)[:80]}")
    stop = sp.get("stop")
    if stop is not None and not (
        isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
    ):
        raise BadRequest("sampling_params.stop must be a string or a list of strings")
    return GenerateRequest(
        prompt=text if text is not None else ids,
        max_new_tokens=128 if max_new is None else max_new,
        stream=_bool(body, "stream", False),
        ignore_eos=_bool(sp, "ignore_eos", False, where),
        rid=_rid(body),
        sampling_seed=_seed(sp, "sampling_seed", where),
        stream_interval=interval,
    )


@dataclass(frozen=True, slots=True)
class TokenizeRequest:
    prompt: str | list[str] | None
    messages: list[dict[str, Any]] | None
    tools: list[dict[str, Any]] | None
    enable_thinking: bool
    add_generation_prompt: bool | None  # None: render as a chat completion does; set: render as given
    continue_final_message: bool = False


def parse_tokenize(body: dict[str, Any]) -> TokenizeRequest:
    """SGLang's TokenizeRequest: exactly one of `prompt` (a string or a list of strings) and `messages`
    (checked as the chat route checks them); with messages, `add_generation_prompt` (default: as a chat
    completion renders them), `continue_final_message` and `chat_template_kwargs.enable_thinking`."""
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise BadRequest("Value error, Exactly one of 'prompt' or 'messages' must be provided.")
    if prompt is not None and not (
        isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, str) for t in prompt))
    ):
        raise BadRequest("prompt must be a string or a list of strings")
    tools = body.get("tools")
    if messages is not None:
        if not isinstance(messages, list):
            raise BadRequest("messages must be a list of {role, content} objects")
        try:
            for i, m in enumerate(messages):
                check_message(m, f"messages[{i}]")
            if tools is not None and not isinstance(tools, list):
                raise ValueError("tools must be a list of objects")
            for i, tool in enumerate(tools or []):
                check_tool(tool, f"tools[{i}]")
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        try:
            check_tool_call_arguments(messages, locate=False)
        except ValueError as exc:
            raise ConversionRefused(str(exc)) from None
        messages = [as_sglang_reads(m) for m in messages]
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise BadRequest("chat_template_kwargs must be an object")
    _bool(body, "add_special_tokens", True)
    return TokenizeRequest(
        prompt=prompt, messages=messages, tools=tools or None,
        enable_thinking=_bool(kwargs or {}, "enable_thinking", True, "chat_template_kwargs."),
        add_generation_prompt=_optional_bool(body, "add_generation_prompt"),
        continue_final_message=_bool(body, "continue_final_message", False),
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class DetokenizeRequest:
    tokens: list[int] | list[list[int]]
    skip_special_tokens: bool


def parse_detokenize(body: dict[str, Any]) -> DetokenizeRequest:
    """SGLang's DetokenizeRequest: `tokens` a list of ids or of lists of ids, `skip_special_tokens`."""
    tokens = body.get("tokens")

    def ints(xs: Any) -> bool:
        return isinstance(xs, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in xs)

    if not (ints(tokens) or (isinstance(tokens, list) and all(ints(t) for t in tokens))):
        raise BadRequest("tokens must be a list of integers or a list of lists of integers")
    return DetokenizeRequest(tokens, _bool(body, "skip_special_tokens", True))


def input_too_long(input_tokens: int, context_length: int) -> str:
    return f"The input ({input_tokens} tokens) is longer than the model's context length ({context_length} tokens)."


def context_overflow(input_tokens: int, max_new_tokens: int, context_length: int) -> str:
    # Verbatim from SGLang's TokenizerManager._validate_one_request.
    return (
        f"Requested token count exceeds the model's maximum context length of {context_length} tokens. "
        f"You requested a total of {max_new_tokens + input_tokens} tokens: {input_tokens} tokens from the "
        f"input messages and {max_new_tokens} tokens for the completion. Please reduce the number of tokens "
        f"in the input messages or the completion to fit within the limit."
    )


def check_context(input_tokens: int, max_new_tokens: int | None, context_length: int) -> None:
    # SGLang: the input alone must be shorter than the context; input + max_new_tokens may equal it.
    if input_tokens >= context_length:
        raise RequestRefused(input_too_long(input_tokens, context_length))
    if max_new_tokens is not None and input_tokens + max_new_tokens > context_length:
        raise RequestRefused(context_overflow(input_tokens, max_new_tokens, context_length))


def openai_error(message: str, status: int, kind: str = "BadRequestError") -> dict[str, Any]:
    return {"object": "error", "message": message, "type": kind, "param": None, "code": status}


def native_error(message: str) -> dict[str, Any]:
    return {"error": {"message": message}}


# Error types of SGLang's own OpenAI-route errors by status (its create_error_response callers).
ERROR_TYPES = {400: "BadRequestError", 404: "NotFound", 500: "InternalServerError", 503: "ServiceUnavailable"}


def new_id() -> str:
    return uuid.uuid4().hex


def now() -> int:
    return int(time.time())


@dataclass(frozen=True, slots=True)
class Plan:
    """What one request will produce: a stretch of one sample's completion, and how it finishes.

    Token positions in `response` are absolute; this request produces positions [start, start + target).
    `start` > 0 for a continuation: the response tokens the client sent back after the prompt. `context`
    is the input's last ids, which SGLang's detokenizer decodes this request's output after.
    """

    sample: Sample
    response: Response
    reasoning: int  # thinking tokens of the whole completion, </think> included (0 without thinking)
    start: int
    target: int  # tokens produced if not aborted
    finish: str  # "stop" | "length" | "tool_calls" when it reaches target
    cap: int  # max_new_tokens of this request
    tool_name: str | None = None
    context: tuple[int, ...] = ()

    @property
    def ends_with_eos(self) -> bool:
        """The last token is the stop token, which SGLang counts but does not detokenize."""
        return self.finish in ("stop", "tool_calls")

    @property
    def loop(self) -> tuple[int, int] | None:
        """(onset, period) of a runaway's repetition, in body tokens."""
        return self.response.loop


def plan_request(drawn: Drawn, cap: int, ignore_eos: bool, tool_name: str | None = None) -> Plan:
    """What a request for `drawn` with max_new_tokens `cap` produces: the rest of the sample, or `cap`."""
    response = drawn.response(tool_name, ignore_eos)
    start = drawn.generated
    natural = response.total
    # A prefix at or past where its sample stops stops at once.
    remaining = None if natural is None else max(1, natural - start)
    if remaining is None or remaining > cap:
        return Plan(drawn.sample, response, response.reasoning, start, cap, "length", cap, None, drawn.context)
    finish = "tool_calls" if response.tool else "stop"
    return Plan(drawn.sample, response, response.reasoning, start, remaining, finish, cap,
                tool_name if response.tool else None, drawn.context)


def split(plan: Plan, n: int) -> tuple[int, int]:
    """(thinking, answer) tokens among the first n this request produced."""
    before = min(plan.start, plan.reasoning)
    r = min(plan.start + n, plan.reasoning) - before
    return r, n - r


def output_ids(plan: Plan, n: int) -> list[int]:
    """Token ids of the first n tokens this request produced (ending with the stop token if it stopped)."""
    ids = plan.response.ids(plan.start, n)
    if plan.ends_with_eos and n >= plan.target and ids:
        ids[-1] = EOS_TOKEN_ID
    return ids


def output_ids_between(plan: Plan, a: int, b: int, final: bool) -> list[int]:
    """Ids of this request's tokens a .. b-1 (`final`: b is where it finished, so a stop ends in the stop
    token), without building the ids before a."""
    ids = plan.response.ids(plan.start + a, b - a)
    if final and plan.ends_with_eos and b >= plan.target and ids:
        ids[-1] = EOS_TOKEN_ID
    return ids


def raw_text(plan: Plan, prev: int, n: int) -> str:
    """The decoding of this request's tokens prev .. n-1 on their own (the stop token has no text): raw
    model output, thinking inline in its tags. A slice that starts or ends inside a character has U+FFFD
    there; what a request returns is `text`."""
    return decode(output_ids(plan, n)[prev:n])


def text(plan: Plan, n: int, final: bool = True) -> str:
    """What SGLang returns for the first n tokens of this request: at finish (`final`), its detokenizer's
    text (`tokens.detokenize`: after the input's last ids, the matched stop trimmed, U+FFFD for a trailing
    incomplete character); while streaming, the text so far without an incomplete character at its end."""
    out = output_ids(plan, n)
    stopped = final and plan.ends_with_eos and n >= plan.target
    decoded = detokenize(plan.context, out, stopped)
    return decoded if final else decoded.rstrip("\ufffd")


def chat_texts(plan: Plan, n: int, parser: str | None, thinking: bool, final: bool = True) -> tuple[str, str]:
    """(reasoning_content, content) of the first n tokens, "" for an absent part.

    With a reasoning parser the split is SGLang's, applied to the raw text; without one the thinking
    stays inline in content, as the raw model output would.
    """
    return split_reasoning(text(plan, n, final), parser, thinking)


def split_reasoning(raw: str, parser: str | None, thinking: bool) -> tuple[str, str]:
    """(reasoning_content, content) of raw text, as `chat_texts` splits it."""
    if parser is None:
        return "", raw
    return separate_reasoning(raw, chat_parser(parser), force=thinking)


def tool_calls(plan: Plan, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat route's `tool_calls` from the calls SGLang's tool-call parser found in the text (only with
    --tool-call-parser): `index` is the call's ordinal, `tool_index` (the tool's position) is dropped."""
    return [{
        "id": f"call_{plan.sample.key:016x}{i:08x}",
        "index": i,
        "type": "function",
        "function": {"name": call["name"], "arguments": call["parameters"]},
    } for i, call in enumerate(calls)]  # fmt: skip


def usage(prompt_tokens: int, completion: int, reasoning: int, cached: int | None = None) -> dict[str, Any]:
    """SGLang's UsageInfo as it serializes it: every field present, the OpenAI-style details null unless
    there are reasoning tokens; the prompt's cached tokens only with --enable-cache-report (`cached` given),
    then whatever their count, 0 included (`UsageProcessor.calculate_response_usage`)."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": None if cached is None else {"cached_tokens": cached},
        "reasoning_tokens": reasoning,
        "completion_tokens_details": {"reasoning_tokens": reasoning} if reasoning > 0 else None,
    }


def stream_error(message: str) -> dict[str, Any]:
    """The event SGLang's /generate stream sends for an error raised once the stream is open (its
    tokenizer manager's ValueErrors: the context checks), before `[DONE]`."""
    return {"error": {"message": message, "type": "invalid_request_error", "code": 400, "retryable": False}}


def finish_reason_native(finish: str, cap: int, abort_message: str | None, running: bool = False) -> dict[str, Any]:
    """`running`: an abort of a running request (FINISH_ABORT's own JSON, status code and error type null);
    otherwise the tokenizer manager's short abort reason (a queued request, the fault injector's abort)."""
    if finish == "abort":
        if running:
            return {"type": "abort", "message": abort_message or "Aborted", "status_code": None, "err_type": None}
        return {"type": "abort", "message": abort_message or "Abort request"}
    if finish == "length":
        return {"type": "length", "length": cap}
    return {"type": "stop", "matched": EOS_TOKEN_ID}


def ceil_div(a: int, b: float) -> int:
    return int(math.ceil(a / b))
