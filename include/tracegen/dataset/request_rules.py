"""What SGLang's /v1/chat/completions refuses in a request's messages and tools, before any generation.

Read from SGLang 0.5.23's request models (`sglang.srt.entrypoints.openai.protocol`: the message, content
part and tool models a request body must validate against) and from its chat handler's tool check
(`OpenAIServingChat._validate_request`: every tool's `parameters` must be a valid JSON Schema after SGLang
rewrites database-style type names such as "varchar" or "int32"). The dataset reader refuses such rows when
it reads them, recording them invalid instead of sending them; the stand-in refuses such requests with
SGLang's status. The tests check both against SGLang's own models.

Each check raises ValueError with a message naming the field.
"""

from __future__ import annotations

import functools
import json
from typing import Any

# A user message has its own model (role "user", content required); every other role shares one.
USER_ROLE = "user"
GENERIC_ROLES = ("system", "assistant", "tool", "function", "developer", "latest_reminder", "root")
# What a user message keeps: SGLang's user model has no other field and drops the rest silently (a
# user message's `name` never reaches the chat template).
USER_MESSAGE_KEYS = frozenset({"role", "content"})

TEXT_PART_TYPES = frozenset({"text"})
THINKING_PART_TYPES = frozenset({"thinking", "reasoning"})
# Media parts need a multimodal model; a text model refuses them too ("Model only supports text input").
MEDIA_PART_TYPES = frozenset({"image_url", "video_url", "audio_url", "input_audio"})
CONTENT_PART_TYPES = TEXT_PART_TYPES | THINKING_PART_TYPES | MEDIA_PART_TYPES | {"tool_reference"}

_STANDARD_TYPES = frozenset({"string", "number", "integer", "boolean", "array", "object", "null"})
# sglang.srt.function_call.utils: database / ORM type names SGLang rewrites to JSON Schema types.
_TYPE_ALIASES = {
    "str": "string", "text": "string", "varchar": "string", "char": "string", "enum": "string",
    "uuid": "string", "date": "string", "datetime": "string", "time": "string", "timestamp": "string",
    "binary": "string", "blob": "string", "bytea": "string", "bytes": "string", "varbinary": "string",
    "bool": "boolean", "bigint": "integer", "smallint": "integer", "tinyint": "integer",
    "double": "number", "decimal": "number", "real": "number", "numeric": "number",
    "arr": "array", "tuple": "array", "set": "array", "map": "object",
}  # fmt: skip
_PREFIX_RULES = (
    (("int", "uint", "long", "short", "unsigned"), "integer"),
    (("num", "float"), "number"),
    (("list",), "array"),
    (("dict",), "object"),
)
_PREFIX_BOUNDARY = frozenset("0123456789[<( \t")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
               "unevaluatedItems", "unevaluatedProperties")  # fmt: skip


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


def _optional(value: Any, check: Any) -> bool:
    return value is None or check(value)


def check_content_part(part: Any, where: str, role: str) -> None:
    """One element of a list `content`: a part type SGLang's models know, with its required fields."""
    if not isinstance(part, dict):
        raise ValueError(f"{where} must be an object, got {type(part).__name__}")
    kind = part.get("type")
    if kind not in CONTENT_PART_TYPES:
        raise ValueError(f"{where}.type {kind!r} is not one of {sorted(CONTENT_PART_TYPES)}")
    if kind == "text" and not _is_str(part.get("text")):
        raise ValueError(f"{where}: a text part needs a string 'text'")
    if kind in THINKING_PART_TYPES:
        if role != "assistant":
            raise ValueError(f"{where}: thinking content parts are only valid in assistant messages")
        given = [key for key in ("thinking", "text") if part.get(key) is not None]
        if len(given) != 1 or not _is_str(part[given[0]]):
            raise ValueError(
                f"{where}: thinking parts require exactly one of 'thinking' or 'text' (a string)"
            )
    if kind in ("image_url", "video_url", "audio_url"):
        ref = part.get(kind)
        if not isinstance(ref, dict) or not _is_str(ref.get("url")):
            raise ValueError(f"{where}: a {kind} part needs '{kind}': {{'url': string}}")
    if kind == "input_audio":
        audio = part.get("input_audio")
        if (
            not isinstance(audio, dict)
            or not _is_str(audio.get("data"))
            or audio.get("format") not in ("wav", "mp3")
        ):
            raise ValueError(
                f"{where}: an input_audio part needs 'input_audio': {{'data': string, 'format': wav|mp3}}"
            )
    if kind == "tool_reference" and not _is_str(part.get("name")):
        raise ValueError(f"{where}: a tool_reference part needs a string 'name'")


def _check_tool_call(call: Any, where: str) -> None:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise ValueError(f"{where} must be an object with a 'function' object")
    fn = call["function"]
    if not _optional(call.get("id"), _is_str) or call.get("type", "function") != "function":
        raise ValueError(f"{where}: 'id' must be a string and 'type' 'function'")
    index = call.get("index")
    if index is not None and (isinstance(index, bool) or not isinstance(index, int)):
        raise ValueError(f"{where}.index must be an integer")
    if not _optional(fn.get("name"), _is_str) or not _optional(
        fn.get("arguments"), lambda a: isinstance(a, str | dict)
    ):
        raise ValueError(f"{where}.function: 'name' must be a string, 'arguments' a string or an object")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def tool_call_arguments(arguments: str) -> dict[str, Any]:
    """An assistant's earlier tool call's `arguments` string as SGLang's chat handler reads it before the
    chat template renders it (`normalize_assistant_tool_call_arguments`, strict): a JSON object, or the
    request is refused with SGLang's message (HTTP 400). Parsed as orjson parses: NaN and Infinity are not
    JSON."""
    try:
        parsed = json.loads(arguments, parse_constant=_no_constant)
    except ValueError:
        raise ValueError("Assistant tool call function.arguments must be valid JSON.") from None
    if not isinstance(parsed, dict):
        raise ValueError("Assistant tool call function.arguments must be a JSON object.")
    return parsed


def check_tool_call_arguments(messages: list[Any], *, locate: bool = True) -> None:
    """Every assistant tool call's string `arguments` in `messages` as `tool_call_arguments` reads it; the
    error names the field unless `locate` is false (SGLang's own message is bare)."""
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or str(message.get("role", "")).lower() != "assistant":
            continue
        for j, call in enumerate(message.get("tool_calls") or ()):
            fn = call.get("function") if isinstance(call, dict) else None
            args = fn.get("arguments") if isinstance(fn, dict) else None
            if not isinstance(args, str):
                continue
            try:
                tool_call_arguments(args)
            except ValueError as exc:
                if not locate:
                    raise
                raise ValueError(f"messages[{i}].tool_calls[{j}].function.arguments: {exc}") from None


def check_prompt_end(messages: list[Any]) -> None:
    """A prompt must end where generation starts: never with an assistant message. SGLang's chat route serves
    a final assistant message as a user message (`template_input`), so the model would be asked to answer
    its own old answer, and the export would show a turn the model never saw as its history. Every prompt
    row passes here, whatever form it came in and whichever turns were chosen (`dataset.turns`)."""
    if messages and isinstance(messages[-1], dict) and str(messages[-1].get("role", "")).lower() == "assistant":
        raise ValueError(
            f"messages[{len(messages) - 1}] is an assistant message: a prompt must end with a user or tool "
            "message, where generation starts (SGLang would serve it as a user message and the model would "
            "answer its own answer). turns=last generates a conversation's final assistant turn again; a "
            "conversation with two assistant messages in a row cannot be cut there"
        )


def check_chainable(messages: list[Any]) -> None:
    """A conversation read with `turns=chain` holds no tool call and no tool result: its later turns answer
    the original call's result, and the model's own answer would call something else, or nothing, so no
    result would be true for it. Told on the whole conversation, as every one of its turns is refused (turn 1
    of such a conversation is its first step towards that call). ShareGPT's function_call and observation
    arrive here as an assistant's `tool_calls` and a `tool` message (`dataset.forms`)."""
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            continue
        role = str(message.get("role", "")).lower()
        if role in ("tool", "function") or (role == "assistant" and message.get("tool_calls")):
            what = "a tool result" if role != "assistant" else "an assistant tool call"
            raise ValueError(
                f"messages[{i}] is {what}: turns=chain cannot regenerate a conversation whose turns answer a "
                "tool's result (the model's own call would get no result); read it with turns=each or last"
            )


def check_message(message: Any, where: str) -> None:
    """One chat message as SGLang's message models accept it (a user message, or another known role)."""
    if not isinstance(message, dict):
        raise ValueError(f"{where} must be an object, got {type(message).__name__}")
    role = message.get("role")
    if not _is_str(role):
        raise ValueError(f"{where}.role must be a string")
    content = message.get("content")
    if role == USER_ROLE:
        if not isinstance(content, str | list):
            raise ValueError(f"{where}.content: a user message needs a string or a list of parts")
    else:
        if role.lower() not in GENERIC_ROLES:
            raise ValueError(
                f"{where}.role {role!r} is not 'user' or one of {', '.join(GENERIC_ROLES)} (case-insensitive)"
            )
        if not _optional(content, lambda c: isinstance(c, str | list)):
            raise ValueError(f"{where}.content must be a string, a list of parts or null")
        for key in ("tool_call_id", "name", "reasoning_content"):
            if not _optional(message.get(key), _is_str):
                raise ValueError(f"{where}.{key} must be a string or null")
        calls = message.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list):
                raise ValueError(f"{where}.tool_calls must be a list")
            for j, call in enumerate(calls):
                _check_tool_call(call, f"{where}.tool_calls[{j}]")
    if isinstance(content, list):
        for j, part in enumerate(content):
            check_content_part(part, f"{where}.content[{j}]", role.lower() if role != USER_ROLE else role)


def as_sglang_reads(message: dict[str, Any]) -> dict[str, Any]:
    """The message as SGLang's model keeps it: a user message loses every key but role and content."""
    if message.get("role") == USER_ROLE:
        return {k: v for k, v in message.items() if k in USER_MESSAGE_KEYS}
    return message


def _normalized_type(raw: Any) -> Any:
    if not isinstance(raw, str) or raw in _STANDARD_TYPES:
        return raw
    base = raw.split("(", 1)[0].strip().lower()
    if base in _STANDARD_TYPES:
        return base
    if base in _TYPE_ALIASES:
        return _TYPE_ALIASES[base]
    for prefixes, target in _PREFIX_RULES:
        for prefix in prefixes:
            if base == prefix or (
                len(base) > len(prefix) and base.startswith(prefix) and base[len(prefix)] in _PREFIX_BOUNDARY
            ):
                return target
    return raw


def normalize_schema_types(schema: Any) -> None:
    """SGLang's `normalize_json_schema_types`, in place: database-style type names become JSON Schema types
    wherever a subschema can stand, before the schema is checked (and rendered into the prompt)."""
    if isinstance(schema, list):
        for item in schema:
            normalize_schema_types(item)
        return
    if not isinstance(schema, dict):
        return
    if "type" in schema:
        kind = schema["type"]
        if isinstance(kind, str):
            schema["type"] = _normalized_type(kind)
        elif isinstance(kind, list):
            merged: list[Any] = []
            for item in kind:
                item = _normalized_type(item)
                if item not in merged:
                    merged.append(item)
            schema["type"] = merged
    for key in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for sub in schema[key].values():
                normalize_schema_types(sub)
    for key in _SUBSCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for sub in schema[key]:
                normalize_schema_types(sub)
    for key in _SUBSCHEMAS:
        if key in schema:
            normalize_schema_types(schema[key])


def check_tool(tool: Any, where: str) -> None:
    """One entry of `tools` as SGLang's Tool model accepts it."""
    if not isinstance(tool, dict):
        raise ValueError(f"{where} must be an object, got {type(tool).__name__}")
    fn = tool.get("function")
    if not _is_str(tool.get("type", "function")) or not isinstance(fn, dict) or not _is_str(fn.get("name")):
        raise ValueError(f"{where} needs a 'function' object with a string 'name'")
    if not _optional(fn.get("description"), _is_str) or not _optional(
        fn.get("strict"), lambda v: isinstance(v, bool)
    ):
        raise ValueError(f"{where}.function: 'description' must be a string, 'strict' true or false")


def check_tool_parameters(tool: dict[str, Any], where: str) -> None:
    """SGLang's chat handler's check of a (model-valid) tool: its `parameters`, with database-style type
    names rewritten, must be a valid JSON Schema (draft 2020-12). Checked on a copy: the caller's tool is
    sent as given."""
    parameters = tool["function"].get("parameters")
    if parameters is None:
        return
    try:
        canonical = json.dumps(parameters, sort_keys=True)
    except (RecursionError, ValueError):
        raise ValueError(f"{where}.function.parameters is too deeply nested or contains a cycle") from None
    problem = _schema_problem(canonical)
    if problem is not None:
        raise ValueError(f"{where}.function.parameters {problem}")


# Checking a schema against the JSON Schema metaschema costs about half a millisecond, and an agentic
# dataset repeats the same few tool sets on every row: judge each distinct schema once per process.
@functools.lru_cache(maxsize=4096)
def _schema_problem(canonical: str) -> str | None:
    from jsonschema import Draft202012Validator, SchemaError

    schema = json.loads(canonical)
    try:
        normalize_schema_types(schema)
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        return f"is not a valid JSON Schema: {exc.message}"
    except RecursionError:
        return "is too deeply nested or contains a cycle"
    return None
