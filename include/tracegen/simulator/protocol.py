"""SGLang's wire format for the stand-in: request validation and response/error bodies.

Validation raises `BadRequest` with a message naming the bad field; the HTTP layer turns it into
SGLang's 400 body (flat on OpenAI routes, nested on /generate). Response builders take token counts
from the batching engine and render the sample's pseudo-text and token ids. Raw text is what the model
emits (`<think>\n…\n</think>\n\n…`); the chat route's split is SGLang's parser applied to it, so raw
text of a prefix joined with its continuation splits exactly as the whole response would.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tracegen.simulator.lengths import Drawn, Sample
from tracegen.simulator.reasoning import chat_parser, separate_reasoning
from tracegen.simulator.text import words
from tracegen.simulator.tokens import EOS_TOKEN_ID, ResponseIds

THINK_OPEN = "<think>\n"
THINK_CLOSE = "\n</think>\n\n"
SGLANG_VERSION = "0.5.23"
DEFAULT_SAMPLING_SEED = 42  # SGLang's seed for a request without one, in deterministic mode
_INT64 = (-(2**63), 2**63 - 1)


class BadRequest(ValueError):
    """The request is malformed: HTTP 400 with this message."""


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


def _bool(body: Mapping[str, Any], key: str, default: bool, where: str = "") -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"{where}{key} must be true or false, got {json.dumps(value)[:80]}")
    return value


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
    messages: list[dict[str, Any]]
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


def parse_chat(body: dict[str, Any]) -> ChatRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadRequest(f"messages[{i}] must be an object, got {type(m).__name__}")
        if not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}].role must be a string")
        content = m.get("content")
        if content is not None and not isinstance(content, str | list):
            raise BadRequest(f"messages[{i}].content must be a string, a list of parts or null")
        if isinstance(content, list) and not all(isinstance(p, dict) for p in content):
            raise BadRequest(f"messages[{i}].content parts must be objects")
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise BadRequest("tools must be a list of objects")
    max_tokens = _int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1)
    _number(body, "temperature", 0.0, 100.0)
    _number(body, "top_p", 0.0, 1.0)
    seed = _seed(body, "seed")
    _int(body, "n", 1)
    if body.get("n", 1) != 1:
        raise BadRequest("n > 1 is not supported by the stand-in")
    stream = _bool(body, "stream", False)
    return_prompt_token_ids = _bool(body, "return_prompt_token_ids", False)
    return_token_ids = _bool(body, "return_token_ids", False)
    if stream and return_prompt_token_ids:  # verbatim from SGLang's serving_chat
        raise BadRequest(
            "return_prompt_token_ids is not supported with streaming. "
            "Please set stream=false when using return_prompt_token_ids=true."
        )
    if stream and return_token_ids:
        raise BadRequest(
            "return_token_ids is not supported with streaming on /v1/chat/completions. "
            "Please set stream=false when using return_token_ids=true."
        )
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest("stream_options must be an object")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise BadRequest("chat_template_kwargs must be an object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("model must be a string")
    # Accepted as SGLang accepts it. The stand-in cannot recover a sample from text, so a prefilled
    # assistant message is just more prompt: continue rows by token ids through /generate instead.
    _bool(body, "continue_final_message", False)
    return ChatRequest(
        messages=messages,
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
    )


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    prompt: str | list[int]
    max_new_tokens: int
    stream: bool
    ignore_eos: bool
    rid: str | None
    sampling_seed: int | None = None


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
    )


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
        raise BadRequest(input_too_long(input_tokens, context_length))
    if max_new_tokens is not None and input_tokens + max_new_tokens > context_length:
        raise BadRequest(context_overflow(input_tokens, max_new_tokens, context_length))


def openai_error(message: str, status: int, kind: str = "BadRequest") -> dict[str, Any]:
    return {"object": "error", "message": message, "type": kind, "param": None, "code": status}


def native_error(message: str) -> dict[str, Any]:
    return {"error": {"message": message}}


ERROR_TYPES = {400: "BadRequest", 404: "NotFound", 500: "InternalServerError", 503: "ServiceUnavailable"}


def new_id() -> str:
    return uuid.uuid4().hex


def now() -> int:
    return int(time.time())


@dataclass(frozen=True, slots=True)
class Plan:
    """What one request will produce: a stretch of one sample, and how it finishes.

    Token positions in `sample` are absolute; this request produces positions [start, start + target).
    `start` > 0 for a continuation: the response tokens the client sent back after the prompt.
    """

    sample: Sample
    response: ResponseIds
    reasoning: int  # thinking tokens of the whole sample as generated (0 when thinking is off)
    start: int
    target: int  # tokens produced if not aborted
    finish: str  # "stop" | "length" | "tool_calls" when it reaches target
    cap: int  # max_new_tokens of this request
    tool_name: str | None = None

    @property
    def ends_with_eos(self) -> bool:
        """The last token is the stop token, which SGLang counts but does not detokenize."""
        return self.finish in ("stop", "tool_calls")

    @property
    def loop(self) -> tuple[int, int] | None:
        """(onset, period) of a runaway's repetition, for `words`."""
        return (self.sample.loop_onset, self.sample.loop_period) if self.sample.runaway else None


def plan_request(drawn: Drawn, cap: int, ignore_eos: bool, tool_name: str | None = None) -> Plan:
    """What a request for `drawn` with max_new_tokens `cap` produces: the rest of the sample, or `cap`."""
    sample, response, start = drawn.sample, drawn.response, drawn.generated
    reasoning = sample.reasoning if response.thinking else 0
    # Thinking off: the answer alone, unless the sample is a runaway, which loops in the answer instead.
    natural = sample.total if response.thinking or sample.runaway else max(1, sample.answer)
    # A prefix at or past where its sample stops (another length model produced it) stops at once.
    remaining = max(1, natural - start)
    if ignore_eos or remaining > cap:
        return Plan(sample, response, reasoning, start, cap, "length", cap)
    finish = "tool_calls" if tool_name else "stop"
    return Plan(sample, response, reasoning, start, remaining, finish, cap, tool_name)


def split(plan: Plan, n: int) -> tuple[int, int]:
    """(thinking, answer) tokens among the first n this request produced."""
    before = min(plan.start, plan.reasoning)
    r = min(plan.start + n, plan.reasoning) - before
    return r, n - r


def raw_text(plan: Plan, prev: int, n: int) -> str:
    """Raw model output between this request's token counts prev and n: thinking inline in tags."""
    a, b = plan.start + prev, plan.start + n
    if plan.ends_with_eos and n >= plan.target:
        b -= 1  # the stop token has no text
    reasoning, loop, key = plan.reasoning, plan.loop, plan.sample.key
    out = []
    if reasoning and a == 0 and b > 0:
        out.append(THINK_OPEN)
    r0, r1 = min(a, reasoning), min(b, reasoning)
    if r1 > r0:
        out.append((" " if r0 else "") + words(key, r0, r1 - r0, loop))
    if reasoning and a <= reasoning < plan.start + n:  # the first answer token closes the thinking
        out.append(THINK_CLOSE)
    w0, w1 = max(a, reasoning), max(b, reasoning)
    if w1 > w0:
        out.append((" " if w0 > reasoning else "") + words(key, w0, w1 - w0, loop))
    return "".join(out)


def chat_texts(plan: Plan, n: int, parser: str | None, thinking: bool) -> tuple[str, str]:
    """(reasoning_content, content) of the first n tokens, "" for an absent part.

    With a reasoning parser the split is SGLang's, applied to the raw text; without one the thinking
    stays inline in content, as the raw model output would.
    """
    raw = raw_text(plan, 0, n)
    if parser is None:
        return "", raw
    return separate_reasoning(raw, chat_parser(parser), force=thinking)


def tool_calls(plan: Plan) -> list[dict[str, Any]]:
    return [{
        "id": f"call_{plan.sample.key:016x}",
        "index": 0,
        "type": "function",
        "function": {"name": plan.tool_name, "arguments": json.dumps({"query": words(plan.sample.key, 7, 3)})},
    }]  # fmt: skip


def output_ids(plan: Plan, n: int) -> list[int]:
    """Token ids of the first n tokens this request produced (ending with the stop token if it stopped)."""
    ids = plan.response.ids(plan.start, n)
    if plan.ends_with_eos and n >= plan.target and ids:
        ids[-1] = EOS_TOKEN_ID
    return ids


def usage(prompt_tokens: int, completion: int, reasoning: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": None,
        "reasoning_tokens": reasoning,
    }
    if reasoning > 0:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return out


def finish_reason_native(finish: str, cap: int, abort_message: str | None) -> dict[str, Any]:
    if finish == "abort":
        return {"type": "abort", "message": abort_message or "Abort request"}
    if finish == "length":
        return {"type": "length", "length": cap}
    return {"type": "stop", "matched": EOS_TOKEN_ID}


def ceil_div(a: int, b: float) -> int:
    return int(math.ceil(a / b))
