"""SGLang's non-streaming tool-call parsing for Qwen's `<tool_call>` format, as sglang 0.5.23 does it.

One function serves both the chat route (with --tool-call-parser) and `POST /parse_function_call`, so a
client that joins the raw text of a truncated response and of its continuation gets exactly the message
the chat route would have given for the whole response. The behaviour is that of
`FunctionCallParser.parse_non_stream` with `Qwen25Detector` (parser names `qwen` and `qwen25`): the text
before the first `<tool_call>\\n` (stripped) is the normal text, every `<tool_call>\\n{json}\\n</tool_call>`
block naming a given tool is a call. SGLang's other parser names read formats the stand-in never emits.
"""

from __future__ import annotations

import json
import re
from typing import Any

BOT_TOKEN = "<tool_call>\n"
EOT_TOKEN = "\n</tool_call>"
_BLOCK = re.compile(rf"{re.escape(BOT_TOKEN)}(.*?){re.escape(EOT_TOKEN)}", re.DOTALL)

# Parser names whose detector is Qwen25Detector.
QWEN_TOOL_PARSERS = frozenset({"qwen", "qwen25"})
# Names SGLang parses with its adapter for that model's tokenizer (`native_text_parser`): a server that does
# not serve the model refuses them with HTTP 400.
ADAPTER_TOOL_PARSERS = frozenset({"deepseekv4", "deepseekv41"})
# Every name in sglang 0.5.23's FunctionCallParser.ToolCallParserEnum; any other is a ValueError (HTTP 500).
SGLANG_TOOL_PARSERS = frozenset({
    *QWEN_TOOL_PARSERS, *ADAPTER_TOOL_PARSERS, "apertus2509", "beam", "cohere_command4", "deepseekv3",
    "deepseekv31", "deepseekv32", "dots", "glm", "glm45", "glm47", "gpt-oss", "k2_horizon", "kimi_k2",
    "kimi_k3", "lfm2", "ling3", "llama3", "mimo", "minicpm5", "mistral", "muse", "poolside_v1", "pythonic",
    "qwen3_coder", "spark25", "step3", "step3p5", "minimax-m2", "minimax-m3", "nanbeige", "trinity",
    "interns1", "hermes", "hunyuan", "gigachat3", "gigachat35", "gemma4", "inkling", "iquest_q1",
    "response_template",
})  # fmt: skip


class UnsupportedToolParser(ValueError):
    """SGLang has no such tool-call parser (its FunctionCallParser raises ValueError: a plain HTTP 500)."""


class AdapterToolParser(ValueError):
    """SGLang parses this format with its model's tokenizer, and the stand-in serves no such model (400)."""


class UnmodelledToolParser(ValueError):
    """SGLang has this parser, but it reads a format the stand-in does not produce (501)."""


def check_parser(parser: str | None) -> None:
    """Raise what SGLang's /parse_function_call raises for `parser` before parsing anything."""
    if parser in ADAPTER_TOOL_PARSERS:
        raise AdapterToolParser(
            f"{parser!r} output is parsed with its model's tokenizer; this server does not serve that model"
        )
    if parser not in SGLANG_TOOL_PARSERS:
        raise UnsupportedToolParser(f"Unsupported tool_call_parser: {parser}")
    if parser not in QWEN_TOOL_PARSERS:
        raise UnmodelledToolParser(f"tool-call parser {parser!r} is not modelled by the stand-in")


def chat_tool_parser(server_parser: str) -> str:
    """The parser the chat route parses with: the stand-in always writes Qwen's format, so a server launched
    with a parser for another format parses it as Qwen's would."""
    return server_parser if server_parser in QWEN_TOOL_PARSERS else "qwen25"


def _tool_indices(tools: list[dict[str, Any]]) -> dict[str, int]:
    return {t["function"]["name"]: i for i, t in enumerate(tools) if t["function"].get("name")}


def _calls(action: Any, indices: dict[str, int]) -> list[dict[str, Any]]:
    """BaseFormatDetector.parse_base_json: calls to tools that exist (others are dropped, as by default)."""
    out = []
    for act in action if isinstance(action, list) else [action]:
        name = act.get("name")
        if not (name and name in indices):
            continue
        arguments = act.get("parameters") or act.get("arguments", {})
        out.append({"tool_index": indices[name], "name": name,
                    "parameters": json.dumps(arguments, ensure_ascii=False)})  # fmt: skip
    return out


def parse_function_call(
    text: str, tools: list[dict[str, Any]], parser: str
) -> tuple[str, list[dict[str, Any]]]:
    """(normal_text, calls) as SGLang's `parse_non_stream`; calls as its ToolCallItem dumps them
    (`tool_index`, `name`, `parameters` as a JSON string)."""
    check_parser(parser)
    if not tools:
        return text, []
    idx = text.find(BOT_TOKEN)
    if idx == -1:
        return text, []
    indices = _tool_indices(tools)
    calls = []
    for block in _BLOCK.findall(text):
        try:
            action = json.loads(block.strip())
        except json.JSONDecodeError:
            continue
        calls += _calls(action, indices)
    return text[:idx].strip(), calls
