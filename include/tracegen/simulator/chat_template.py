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

from tracegen.dataset.template_input import template_messages, template_tools
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
                thinking: bool = True, add_generation_prompt: bool | None = None,
                tool_choice: str | Mapping[str, Any] = "auto",
                continue_final_message: bool = False) -> tuple[str, str]:
    """(the prompt text SGLang's chat handler renders for these messages and tools, the text it encodes
    after it: a final assistant message's content under `continue_final_message`, else ""). None for
    `add_generation_prompt` is a chat completion's rendering; True or False is /tokenize's, as given."""
    key = json.dumps([messages, tools, tool_choice], ensure_ascii=False, default=str)
    return _rendered(key, thinking, add_generation_prompt, continue_final_message)


@lru_cache(maxsize=4096)
def _rendered(key: str, thinking: bool, add_generation_prompt: bool | None,
              continue_final_message: bool) -> tuple[str, str]:
    messages, tools, tool_choice = json.loads(key)
    handed, after = template_messages(messages, continue_final_message=continue_final_message,
                                      as_given=add_generation_prompt is not None)
    kwargs = {} if thinking else {"enable_thinking": False}  # SGLang passes chat_template_kwargs as given
    text = _template().render(messages=handed, tools=template_tools(tools, tool_choice),
                              add_generation_prompt=add_generation_prompt is not False, **kwargs)
    return text, after
