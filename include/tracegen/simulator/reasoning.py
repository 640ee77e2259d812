"""SGLang's non-streaming reasoning split for `<think>…</think>` output, as sglang 0.5.23 does it.

One function serves both the chat route (`separate_reasoning: true`) and `POST /separate_reasoning`,
so a client that joins the raw text of a truncated response and of its continuation gets exactly the
split the chat route would have given for the whole response. The behaviour is that of
`BaseReasoningFormatDetector.detect_and_parse` for the detectors that use `<think>` tags; other
parser names SGLang knows use formats the stand-in never emits (see `SGLANG_REASONING_PARSERS`).
"""

from __future__ import annotations

THINK_START = "<think>"
THINK_END = "</think>"

# Parser name -> (force_reasoning, tool_start_token) for the `<think>` detectors: Qwen3Detector
# (qwen3-thinking and minimax are forced by ReasoningParser) and DeepSeekR1Detector (always forced).
THINK_TAG_PARSERS: dict[str, tuple[bool, str | None]] = {
    "qwen3": (False, "<tool_call>"),
    "qwen3-thinking": (True, "<tool_call>"),
    "minimax": (True, "<tool_call>"),
    "dots": (False, "<tool_call>"),
    "nanbeige": (False, "<tool_call>"),
    "interns1": (False, "<tool_call>"),
    "deepseek-r1": (True, None),
    "step3": (True, None),
    "step3p5": (True, None),
    "gigachat35": (True, None),
}
# Every name sglang 0.5.23's ReasoningParser accepts; an unknown one is a ValueError there (HTTP 500).
SGLANG_REASONING_PARSERS = frozenset({
    *THINK_TAG_PARSERS, "apertus2509", "beam", "deepseek-v3", "deepseek-v4", "deepseek-v41", "glm45",
    "ling3", "hunyuan", "gpt-oss", "k2_horizon", "kimi", "kimi_k2", "kimi_k3", "mimo", "muse",
    "poolside_v1", "minimax-append-think", "minimax-m3", "mistral", "nemotron_3",
    "granite_thinking_parser", "gemma4", "inkling", "iquest_q1", "cohere_command4", "response_template",
})  # fmt: skip


class UnsupportedParser(ValueError):
    """SGLang has no such reasoning parser."""


class UnmodelledParser(ValueError):
    """SGLang has this parser, but it reads a format the stand-in does not produce."""


def chat_parser(server_parser: str) -> str:
    """The parser the chat route splits with: the stand-in always emits Qwen3's `<think>` format, so a
    server launched with a parser for another format splits it as Qwen3's would."""
    return server_parser if server_parser.lower() in THINK_TAG_PARSERS else "qwen3"


def separate_reasoning(text: str, parser: str, force: bool = False) -> tuple[str, str]:
    """(reasoning_text, normal_text) of raw model output, "" for an absent part.

    `force` is the chat route's: there SGLang also forces reasoning when the request leaves thinking on.
    """
    name = parser.lower()
    if name not in THINK_TAG_PARSERS:
        if name in SGLANG_REASONING_PARSERS:
            raise UnmodelledParser(f"reasoning parser {parser!r} is not modelled by the stand-in")
        raise UnsupportedParser(f"Unsupported model type: {parser}")
    forced, tool_start = THINK_TAG_PARSERS[name]
    if not (forced or force or THINK_START in text):
        return "", text
    body = text
    while body.startswith(THINK_START):
        body = body[len(THINK_START) :]
    if THINK_END not in body:
        cut = body.find(tool_start) if tool_start else -1
        if cut != -1:  # a tool call opened inside the thinking closes it implicitly
            return body[:cut], body[cut:]
        return body, ""  # truncated before the end tag: all of it is reasoning
    reasoning, normal = body.split(THINK_END, 1)
    return reasoning, normal
