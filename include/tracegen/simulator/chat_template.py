"""Qwen3's chat template, applied to a chat request as SGLang 0.5.23's chat handler applies it.

The template is `tokenizer/chat_template.jinja`, the file `transformers` reads from the tokenizer folder,
rendered with the Jinja settings of `transformers`' `apply_chat_template` (sandboxed, `trim_blocks`,
`lstrip_blocks`, loop controls, its `tojson`), from the messages and tools as SGLang prepares them for it
(`tracegen.dataset.template_input`). So the stand-in counts and tokenizes a prompt as a real server
does; tests/include/tracegen/simulator/test_sim_chat_template.py checks it against `transformers`'
`apply_chat_template` fed by SGLang's own request models and content helper.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

from tracegen.dataset.template_input import template_message, template_tools
from tracegen.simulator.bpe import TOKENIZER_DIR

TEMPLATE_FILE = TOKENIZER_DIR / "chat_template.jinja"


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # transformers' filter (Jinja's own escapes HTML, which no chat template wants).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


@lru_cache(maxsize=1)
def _template() -> Any:
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(TEMPLATE_FILE.read_text(encoding="utf-8"))


def render_chat(messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None = None, *,
                thinking: bool = True, add_generation_prompt: bool = True,
                tool_choice: str | Mapping[str, Any] = "auto") -> str:
    """The prompt text SGLang's chat handler renders for these messages and tools."""
    key = json.dumps([messages, tools, tool_choice], ensure_ascii=False, default=str)
    return _rendered(key, thinking, add_generation_prompt)


@lru_cache(maxsize=4096)
def _rendered(key: str, thinking: bool, add_generation_prompt: bool) -> str:
    messages, tools, tool_choice = json.loads(key)
    kwargs = {} if thinking else {"enable_thinking": False}  # SGLang passes chat_template_kwargs as given
    return _template().render(messages=[template_message(m) for m in messages],
                              tools=template_tools(tools, tool_choice),
                              add_generation_prompt=add_generation_prompt, **kwargs)
