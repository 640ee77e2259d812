"""A raw dataset row (a JSONL line or a columnar row's dict) as one conversation, or why it cannot be one.

Shared by the index pass (which counts each conversation's prompt rows under `turns=each`) and the reader
(which expands it into them), so both see the same conversation in the same bytes.

What a row holds never raises here: any exception while it is decoded becomes a reason. That includes a line
of 200 KB of `[` (json.loads raises RecursionError, not ValueError), a row nested deeper than
`MAX_ROW_DEPTH` (one that parses here could still fail to serialise on its way to a server, further down the
stack, where no row is named), and text that is not valid Unicode (a lone UTF-16 surrogate such as
`"\\ud800"` is valid JSON, but no UTF-8 writer can store it: the row's spool line, part and export would all
fail, after the GPU time was spent).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from tracegen.dataset.forms import Conversation, conversation_of
from tracegen.dataset.reading import Reading

# How deep a row's JSON may nest (objects and arrays, the row object itself at depth 1). A chat request with
# tools nests a few levels, a tool's JSON Schema a few dozen at most; Python's parser and serialiser fail
# somewhere below 1000 depending on the stack they run on, so the same row could parse in one task (the
# pilot's read) and fail in another (the request body). A fixed bound far below that decides it once.
MAX_ROW_DEPTH = 128
# An unexpected exception's message is quoted in the row's reason up to this many characters: enough to act
# on, never the row itself.
_REASON_CHARS = 200
# A code point JSON can escape but UTF-8 cannot encode: a surrogate left alone (json.loads joins a valid pair
# into one character, so any surrogate left in a parsed string is lone).
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
# Where one can come from in a row's bytes: a `\\uD800`-`\\uDFFF` escape, or surrogate code points encoded as
# UTF-8 (CESU), which json.loads decodes with `surrogatepass`. Rows with neither skip the walk below.
_MAY_HOLD_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
# Nested JSON a columnar file may store as text.
_JSON_COLUMNS = ("messages", "conversations", "tools", "metadata")


def columnar_id(value: Any) -> Any:
    """A columnar row's id as the dataset meant it: pandas stores an integer id column holding one null as
    float64 (3 becomes 3.0, the null NaN), so an integral float is its integer and NaN no id. Any other
    float is left for the row checks to refuse."""
    if isinstance(value, float):
        if math.isnan(value):
            return None
        if value.is_integer():
            return int(value)
    return value


def _columnar(item: dict[str, Any]) -> dict[str, Any]:
    """Undo what Parquet and Arrow do to JSON rows: nested JSON stored as strings, absent keys as nulls, an
    integer id column with a null as floats."""
    out = dict(item)
    for key in _JSON_COLUMNS:
        if isinstance(out.get(key), str):
            try:
                out[key] = json.loads(out[key])
            except ValueError as exc:
                raise ValueError(f"column '{key}' holds a string that is not JSON ({exc})") from None
    if isinstance(out.get("messages"), list):
        out["messages"] = [
            {k: v for k, v in m.items() if v is not None or k == "content"} if isinstance(m, dict) else m
            for m in out["messages"]
        ]
    if out.get("tools") == []:
        out["tools"] = None
    if "id" in out:
        out["id"] = columnar_id(out["id"])
    return out


def _too_deep(obj: Any, limit: int = MAX_ROW_DEPTH) -> bool:
    """Whether `obj` nests dicts and lists deeper than `limit` (iterative: no recursion to exhaust)."""
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > limit:
            return True
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values() if isinstance(v, dict | list))
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value if isinstance(v, dict | list))
    return False


def _unencodable_text(obj: Any) -> str | None:
    """Where `obj` holds a string (a value or a key) with a lone surrogate, as a path (`messages[1].content`);
    None when every string can be written as UTF-8."""
    stack: list[tuple[Any, str]] = [(obj, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if _LONE_SURROGATE.search(value):
                return path or "the row"
        elif isinstance(value, dict):
            for key, item in value.items():
                if isinstance(key, str) and _LONE_SURROGATE.search(key):
                    return f"a key of {path}" if path else "a key of the row"
                stack.append((item, f"{path}.{key}" if path else str(key)))
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{i}]") for i, item in enumerate(value))
    return None


def nested_too_deeply() -> str:
    return f"row is nested too deeply (more than {MAX_ROW_DEPTH} levels of objects and arrays)"


def decode(item: bytes | str | dict[str, Any], reading: Reading, *, columnar: bool = False) -> Conversation | str:
    """The row as one conversation, or the reason it is not one (never raises for what a row holds)."""
    try:
        return _decode(item, reading, columnar)
    except ValueError as exc:
        return str(exc)
    except RecursionError:
        return nested_too_deeply()
    except Exception as exc:  # the principle: what a row holds never raises past its row
        return unexpected(exc)


def unexpected(exc: Exception) -> str:
    detail = str(exc)
    if len(detail) > _REASON_CHARS:
        detail = detail[:_REASON_CHARS] + "..."
    return f"row could not be read ({type(exc).__name__}: {detail})"


def _decode(item: bytes | str | dict[str, Any], reading: Reading, columnar: bool) -> Conversation | str:
    if isinstance(item, bytes | str):
        try:
            obj = json.loads(item)
        except RecursionError:
            return f"malformed JSON: {nested_too_deeply()}"
        except ValueError as exc:
            return f"malformed JSON: {exc}"
    else:
        obj = item
    if not isinstance(obj, dict):
        return f"row must be a JSON object, got {type(obj).__name__}"
    if columnar:
        obj = _columnar(obj)
    if _too_deep(obj):
        return nested_too_deeply()
    if not (isinstance(item, bytes) and not _MAY_HOLD_SURROGATE.search(item)):
        where = _unencodable_text(obj)
        if where is not None:
            return (f"{where} holds a lone UTF-16 surrogate (such as \\ud800): it is not valid Unicode, and no "
                    "UTF-8 file (spool, part, export) can hold it")
    return conversation_of(obj, reading)
