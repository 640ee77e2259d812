"""What SGLang 0.5.23's chat handler hands a chat template, for a template whose content format it
detects as 'string' (as Qwen3's is): the messages and tools of a request, as its request models dump them
and `OpenAIServingChat._apply_jinja_template` and `_process_messages` prepare them.

- **messages**: roles other than `user` lower-cased, a user message keeping only role and content, null
  fields dropped; null content becomes "", a list of parts the text of its text parts joined by one space
  (`process_content_for_template_format`); an assistant's tool-call `arguments` given as a JSON string is
  parsed into its object (`request_rules.tool_call_arguments`; a request whose arguments are not one is
  refused before this);
- **a final assistant message**: SGLang's chat route hands every request to `_handle_last_assistant_message`,
  so a last message from the assistant becomes a user message with the same content (its tool calls and
  reasoning dropped); with `continue_final_message` it is taken out instead, and its content encoded after
  the rendered prompt (`template_messages`). Its /tokenize route does the same unless `add_generation_prompt`
  is given, which renders the messages as they are;
- **tools**: as its `Tool` model dumps them: `type`, then `function` (the keys the client sent, in its
  order, then `description` and `parameters` as null when it left them out; `strict` and `defer_loading`
  only when set), then `defer_loading` (null unless sent); database-style type names in `parameters`
  rewritten (its tool check rewrites them in place before the template sees them); no tools at all under
  tool_choice "none", and only the named one when tool_choice names a function.

The stand-in renders its prompts from these (`simulator/chat_template.py`), and the `conversations` export
writes them, so that a trainer rendering a row with the same template gets the prompt the server rendered.
tests/include/tracegen/simulator/test_sim_chat_template.py checks both against SGLang's own models.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from tracegen.dataset.request_rules import USER_ROLE, normalize_schema_types, tool_call_arguments

TEXT_PARTS = ("text", "input_text")  # the part types SGLang's string content format keeps
_FUNCTION_FIELDS = ("description", "name", "parameters", "strict", "defer_loading")  # its Function model's order


def _content(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, list):
        return " ".join(p["text"] for p in content if isinstance(p, Mapping) and p.get("type") in TEXT_PARTS)
    return content


def _tool_call(call: Mapping[str, Any]) -> dict[str, Any]:
    given = call.get("function") or {}
    fn = {"name": given.get("name"), "arguments": given.get("arguments")}  # its model's fields, null if left out
    if isinstance(fn["arguments"], str):
        fn["arguments"] = tool_call_arguments(fn["arguments"])
    return {"id": call.get("id"), "index": call.get("index"), "type": call.get("type", "function"), "function": fn}


def template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """One message as SGLang hands it to the chat template."""
    role = message.get("role")
    if role == USER_ROLE:
        return {"role": role, "content": _content(message.get("content"))}
    out: dict[str, Any] = {"role": str(role).lower(), "content": _content(message.get("content"))}
    for key in ("tool_call_id", "name", "phase", "reasoning_content"):
        if message.get(key) is not None:
            out[key] = message[key]
    if message.get("tool_calls") is not None:
        out["tool_calls"] = [_tool_call(c) for c in message["tool_calls"]]
    return out


def template_messages(messages: Sequence[Mapping[str, Any]], *, continue_final_message: bool = False,
                      as_given: bool = False) -> tuple[list[dict[str, Any]], str]:
    """The messages SGLang hands the chat template, and the text it encodes after the rendered prompt ("" for
    none). A final assistant message becomes a user message with its content, or with
    `continue_final_message` is taken out and its content is that text; `as_given` (/tokenize with
    `add_generation_prompt` set) leaves it, unless `continue_final_message`."""
    out = [template_message(m) for m in messages]
    if not _ends_with_assistant([m["role"] for m in out]) or (as_given and not continue_final_message):
        return out, ""
    if continue_final_message:
        return out[:-1], out[-1]["content"]
    out[-1] = {"role": USER_ROLE, "content": out[-1]["content"]}
    return out, ""


def served_roles(messages: Sequence[Any]) -> list[str]:
    """Each message's role as a chat completion's template sees it (`template_messages`), without building
    the messages: lower case, a final assistant message's as user."""
    roles = [USER_ROLE if m.get("role") == USER_ROLE else str(m.get("role")).lower()
             for m in messages if isinstance(m, Mapping)]
    if _ends_with_assistant(roles):
        roles[-1] = USER_ROLE
    return roles


def _ends_with_assistant(roles: Sequence[str]) -> bool:
    return bool(roles) and roles[-1] == "assistant"


def template_tool(tool: Mapping[str, Any]) -> dict[str, Any]:
    """One tool as SGLang's Tool model dumps it for the chat template."""
    given = tool["function"]
    fn = {k: given.get(k) for k in _FUNCTION_FIELDS}
    if fn["defer_loading"] is None and tool.get("defer_loading") is not None:
        fn["defer_loading"] = tool["defer_loading"]  # its model copies the tool's setting down
    if fn["parameters"] is not None:
        fn["parameters"] = copy.deepcopy(fn["parameters"])
        normalize_schema_types(fn["parameters"])
    for key in ("strict", "defer_loading"):
        if fn[key] is None:
            del fn[key]
    order = [k for k in given if k in fn] + [k for k in fn if k not in given]
    return {"type": tool.get("type", "function"), "function": {k: fn[k] for k in order},
            "defer_loading": tool.get("defer_loading")}


def template_tools(tools: Sequence[Mapping[str, Any]] | None,
                   tool_choice: str | Mapping[str, Any] = "auto") -> list[dict[str, Any]] | None:
    """The tools the template renders: none under tool_choice "none", only the named one for a named choice."""
    if not tools or tool_choice == "none":
        return None
    if isinstance(tool_choice, Mapping):
        name = (tool_choice.get("function") or {}).get("name")
        return [template_tool(t) for t in tools if t["function"].get("name") == name] or None
    return [template_tool(t) for t in tools]
