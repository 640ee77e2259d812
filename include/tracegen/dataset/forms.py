"""The input forms a dataset row may be in, each turned into one OpenAI-style conversation.

- `messages`: OpenAI chat messages (`role`, `content`, `tool_calls`, ...), as tracegen has always read;
- `sharegpt`: `conversations`, a list of `{"from", "value"}` (human, gpt, system, function_call,
  observation) or of `{"role", "content"}`, with `system` and `tools` beside it; a tool call given as JSON
  text (`function_call`'s value, or an assistant's `tool_calls` string) is parsed into OpenAI's
  `tool_calls`, and each `observation` answers the call before it (`tool_call_id`);
- `prompt`: one prompt string (and an optional `system` string).

`dataset_fields` maps these field names onto a dataset's own (`{"prompt": "question"}`). With
`dataset_format=auto` each row's form is told by the field it holds; a row holding none is refused, naming the
forms tracegen knows and the row's own fields. The conversation is checked later, as a prompt
(`dataset.reader.PromptRow`); here only what is needed to build it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tracegen.dataset.reading import AUTO, FORM_FIELD, MESSAGES, PROMPT, SHAREGPT, Reading

# ShareGPT's speaker tags (and the role names some ShareGPT files use instead) as OpenAI roles.
SHAREGPT_ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "model": "assistant", "chatgpt": "assistant",
    "system": "system",
    "function_call": "assistant",
    "observation": "tool", "tool": "tool", "function": "tool",
}  # fmt: skip
_SHOWN_KEYS = 12


@dataclass(frozen=True, slots=True)
class Conversation:
    """A row as one OpenAI-style conversation, before its turns are chosen and it is checked as a prompt."""

    messages: Any
    tools: Any
    own_id: Any
    category: str | None


def known_forms() -> str:
    return ("'messages' (OpenAI chat messages), 'conversations' (ShareGPT: from/value or role/content) or "
            "'prompt' (a prompt string)")


def mapped(obj: dict[str, Any], fields: dict[str, str]) -> dict[str, Any]:
    """The row with its own field names replaced by tracegen's (`dataset_fields`); a mapped field the row
    lacks is simply absent, and its form's check names it."""
    if not fields:
        return obj
    sources = set(fields.values())
    out = {k: v for k, v in obj.items() if k not in sources}
    for ours, theirs in fields.items():
        if theirs in obj:
            out[ours] = obj[theirs]
    return out


def form_of(obj: dict[str, Any], reading: Reading) -> str:
    """The row's form: the one named, or (auto) the first whose field the row holds."""
    if reading.form != AUTO:
        name = FORM_FIELD[reading.form]
        if obj.get(name) is None:
            theirs = reading.fields.get(name)
            named = f" (dataset_fields maps it to {theirs!r})" if theirs else ""
            raise ValueError(f"missing {name!r}{named}: dataset_format={reading.form} reads rows by it; "
                             f"the row has {_keys(obj)}")
        return reading.form
    for form, name in FORM_FIELD.items():
        if obj.get(name) is not None:
            return form
    raise ValueError(f"row is in no form tracegen reads: it needs {known_forms()}, and has {_keys(obj)}. Map "
                     "the dataset's own names with dataset_fields, e.g. {\"prompt\": \"question\"}")


def _keys(obj: dict[str, Any]) -> str:
    keys = sorted(str(k) for k in obj)
    shown = ", ".join(repr(k) for k in keys[:_SHOWN_KEYS])
    more = f" and {len(keys) - _SHOWN_KEYS} more" if len(keys) > _SHOWN_KEYS else ""
    return f"fields {shown}{more}" if keys else "no fields"


def conversation_of(obj: dict[str, Any], reading: Reading) -> Conversation:
    """The row as one conversation; ValueError naming the field when it cannot be built."""
    obj = mapped(obj, reading.fields)
    form = form_of(obj, reading)
    meta = obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {}
    category = _first_str(obj.get("category"), obj.get("source"), meta.get("category"), meta.get("source"))
    tools = obj.get("tools")
    if form == MESSAGES:
        messages = obj["messages"]
    elif form == SHAREGPT:
        messages = _with_system(obj, sharegpt_messages(obj["conversations"]))
        tools = sharegpt_tools(tools)
    else:
        assert form == PROMPT
        prompt = obj["prompt"]
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f"'prompt' must be a non-empty string, got {_kind(prompt)}")
        messages = _with_system(obj, [{"role": "user", "content": prompt}])
    return Conversation(messages=messages, tools=tools, own_id=obj.get("id"), category=category)


def _with_system(obj: dict[str, Any], messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    system = obj.get("system")
    if system is None or (isinstance(system, str) and not system):
        return messages
    if not isinstance(system, str):
        raise ValueError(f"'system' must be a string, got {_kind(system)}")
    if messages and messages[0].get("role") == "system":
        raise ValueError("'system' is given beside a conversation that opens with a system turn: which one?")
    return [{"role": "system", "content": system}, *messages]


def sharegpt_messages(turns: Any) -> list[dict[str, Any]]:
    """ShareGPT turns as OpenAI messages: speaker tags as roles, tool calls given as JSON text parsed, and
    each tool result bound to the call it answers (in order) when it does not say."""
    if isinstance(turns, str):
        turns = _json(turns, "'conversations'")
    if not isinstance(turns, list):
        raise ValueError(f"'conversations' must be a list, got {_kind(turns)}")
    out: list[dict[str, Any]] = []
    pending: list[str] = []  # ids of the calls not yet answered, oldest first
    calls = 0
    for i, turn in enumerate(turns):
        where = f"conversations[{i}]"
        if not isinstance(turn, dict):
            raise ValueError(f"{where} must be an object, got {_kind(turn)}")
        turn = {k: v for k, v in turn.items() if v is not None}  # a columnar file's absent keys are nulls
        tag = turn.get("from", turn.get("role"))
        if not isinstance(tag, str) or tag.lower() not in SHAREGPT_ROLES:
            raise ValueError(f"{where}: speaker {tag!r} is not one of {sorted(SHAREGPT_ROLES)} (its 'from' or 'role')")
        tag = tag.lower()
        role = SHAREGPT_ROLES[tag]
        value = turn.get("value", turn.get("content"))
        message: dict[str, Any] = {"role": role}
        if tag == "function_call":
            message["content"] = None
            message["tool_calls"] = _calls_of(_json(value, f"{where}.value") if isinstance(value, str) else value,
                                              where, calls)
        else:
            message["content"] = value
            if "tool_calls" in turn:
                raw = turn["tool_calls"]
                parsed = _json(raw, f"{where}.tool_calls") if isinstance(raw, str) else raw
                message["tool_calls"] = _calls_of(parsed, where, calls)
            for key in ("tool_call_id", "name", "reasoning_content"):
                if key in turn:
                    message[key] = turn[key]
        if message.get("tool_calls"):
            calls += len(message["tool_calls"])
            pending = [c["id"] for c in message["tool_calls"] if isinstance(c.get("id"), str)]
        if role == "tool" and "tool_call_id" not in message and pending:
            message["tool_call_id"] = pending.pop(0)
        out.append(message)
    return out


def _calls_of(value: Any, where: str, numbered_from: int) -> list[dict[str, Any]]:
    """Tool calls given as one call or a list of calls, each `{name, arguments}` or OpenAI's
    `{id, type, function: {name, arguments}}`, as OpenAI tool calls with `arguments` as JSON text."""
    items = value if isinstance(value, list) else [value]
    calls = []
    for j, item in enumerate(items):
        if not isinstance(item, dict):
            raise ValueError(f"{where}: tool call {j} must be an object, got {_kind(item)}")
        fn = item.get("function") if isinstance(item.get("function"), dict) else item
        name, args = fn.get("name"), fn.get("arguments", {})
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}: tool call {j} has no 'name'")
        calls.append({
            "id": item.get("id") if isinstance(item.get("id"), str) else f"call_{numbered_from + j}",
            "type": "function",
            "function": {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args)},
        })
    return calls


def sharegpt_tools(tools: Any) -> Any:
    """ShareGPT's `tools` (often JSON text, often bare function definitions) as OpenAI tools."""
    if isinstance(tools, str):
        if not tools.strip():
            return None
        tools = _json(tools, "'tools'")
    if not isinstance(tools, list):
        return tools  # the prompt check names it
    return [{"type": "function", "function": t} if isinstance(t, dict) and "function" not in t and "name" in t
            else t for t in tools]


def _json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{where} holds text that is not JSON ({exc})") from None


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _first_str(*values: Any) -> str | None:
    for value in values:
        if isinstance(value, str) and value:
            return value
    return None
