"""Prompts in, one row at a time: the dataset reader a chunk task uses.

A dataset is a JSONL (plain or gzip) or Parquet file, local or on S3. Each row holds OpenAI-style
`messages`, optional `tools`, optional `id` and optional metadata (`category` or `source`). The
row index is the row's position and is stable. `build_index` (see `dataset.index`) scans the
file once; `read_rows(index, start, stop)` then reads only the bytes of that slice.

A malformed row is a *result*, `InvalidRow(index, reason)`, never an exception: one bad line
among a million must not kill a chunk, and the run decides whether to fail naming the row or
record it `invalid`. That holds for ANY exception raised while a row is parsed and checked (a line of
200 KB of `[` makes `json.loads` raise RecursionError, not ValueError), and for a row nested deeper than
`MAX_ROW_DEPTH` (one that parses here could still fail to serialise on its way to a server, further down
the stack, where no row is named), and for text that is not valid Unicode (a lone UTF-16 surrogate such as
`"\\ud800"` is valid JSON, but no UTF-8 writer can store it: the row's spool line, part and export would all
fail, after the GPU time was spent). A missing or unreadable file is an exception (`DatasetError`) naming the URI.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from tracegen.dataset.blocks import iter_block_items, open_data
from tracegen.dataset.index import DatasetIndex, build_index
from tracegen.dataset.request_rules import (
    as_sglang_reads,
    check_content_part,
    check_tool,
    check_tool_call_arguments,
    check_tool_parameters,
)
from tracegen.dataset.source import ByteSource, CountingSource, DatasetError, open_source

__all__ = [
    "ROLES",
    "ByteSource",
    "CountingSource",
    "DatasetError",
    "DatasetIndex",
    "InvalidRow",
    "PromptRow",
    "build_index",
    "open_source",
    "parse_row",
    "read_indices",
    "read_rows",
]

ROLES = ("system", "user", "assistant", "tool")
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
_MESSAGE_KEYS = frozenset({"role", "content", "tool_calls", "tool_call_id", "name", "reasoning_content"})


@dataclass(frozen=True, slots=True)
class InvalidRow:
    """A dataset row that cannot be sent: its index and why, in words a person can act on."""

    index: int
    reason: str


@dataclass(frozen=True, slots=True)
class PromptRow:
    """One valid prompt. Construction validates it; `parse_row` turns the ValueError into InvalidRow."""

    index: int
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    id: str | None = None
    category: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.index, int) or self.index < 0:
            raise ValueError(f"index {self.index!r} is not a non-negative int")
        _check_messages(self.messages)
        _check_tools(self.tools)
        if self.id is not None and not isinstance(self.id, str):
            raise ValueError(f"id must be a string, got {type(self.id).__name__}")
        if self.category is not None and not isinstance(self.category, str):
            raise ValueError(f"category must be a string, got {type(self.category).__name__}")


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list):
        raise ValueError(f"'messages' must be a list, got {type(messages).__name__}")
    if not messages:
        raise ValueError("'messages' is empty")
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise ValueError(f"{where} must be an object, got {type(msg).__name__}")
        role = msg.get("role")
        if role not in ROLES:
            raise ValueError(f"{where}.role {role!r} is not one of {ROLES}")
        content = msg.get("content")
        if content is not None and not isinstance(content, str | list):
            raise ValueError(f"{where}.content must be a string, a list of parts or null, got {type(content).__name__}")
        if isinstance(content, list):
            # Only the part types SGLang's request models know (an OpenAI Responses `input_text` part is
            # refused there): found here, the row is recorded invalid instead of rejected after queueing.
            for j, part in enumerate(content):
                check_content_part(part, f"{where}.content[{j}]", role)
        tool_calls = msg.get("tool_calls")
        if tool_calls is not None:
            if role != "assistant":
                raise ValueError(f"{where}: only assistant messages carry tool_calls (role is {role!r})")
            if not isinstance(tool_calls, list) or not all(isinstance(c, dict) for c in tool_calls):
                raise ValueError(f"{where}.tool_calls must be a list of objects")
        if content is None and not (role == "assistant" and tool_calls):
            raise ValueError(f"{where} ({role}) has no content")
        for key in ("tool_call_id", "name"):
            if msg.get(key) is not None and not isinstance(msg[key], str):
                raise ValueError(f"{where}.{key} must be a string, got {type(msg[key]).__name__}")
    # SGLang refuses the request when an earlier call's arguments are not a JSON object.
    check_tool_call_arguments(messages)


def _check_tools(tools: Any) -> None:
    if tools is None:
        return
    if not isinstance(tools, list):
        raise ValueError(f"'tools' must be a list or absent, got {type(tools).__name__}")
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise ValueError(f"tools[{i}] must be an object, got {type(tool).__name__}")
        # SGLang's tool model and its handler's check that `parameters` is a valid JSON Schema.
        check_tool(tool, f"tools[{i}]")
        check_tool_parameters(tool, f"tools[{i}]")


def _columnar(item: dict[str, Any]) -> dict[str, Any]:
    """Undo what Parquet does to JSON rows: nested JSON stored as strings, absent keys as nulls."""
    out = dict(item)
    for key in ("messages", "tools", "metadata"):
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


def _nested_too_deeply() -> str:
    return f"row is nested too deeply (more than {MAX_ROW_DEPTH} levels of objects and arrays)"


def parse_row(index: int, item: bytes | str | dict[str, Any], *, columnar: bool = False) -> PromptRow | InvalidRow:
    """Validate one raw row (a JSONL line or a Parquet row dict) into a PromptRow or an InvalidRow.

    Never raises for what a row holds: any exception while it is parsed or checked makes it an InvalidRow
    naming `index`, so one bad row cannot stop a chunk (or fail every retry of it)."""
    try:
        return _parse_row(index, item, columnar)
    except ValueError as exc:
        return InvalidRow(index, str(exc))
    except RecursionError:
        return InvalidRow(index, _nested_too_deeply())
    except Exception as exc:  # the principle: what a row holds never raises past its row
        detail = str(exc)
        if len(detail) > _REASON_CHARS:
            detail = detail[:_REASON_CHARS] + "..."
        return InvalidRow(index, f"row could not be read ({type(exc).__name__}: {detail})")


def _parse_row(index: int, item: bytes | str | dict[str, Any], columnar: bool) -> PromptRow | InvalidRow:
    if isinstance(item, bytes | str):
        try:
            obj = json.loads(item)
        except RecursionError:
            return InvalidRow(index, f"malformed JSON: {_nested_too_deeply()}")
        except ValueError as exc:
            return InvalidRow(index, f"malformed JSON: {exc}")
    else:
        obj = item
    if not isinstance(obj, dict):
        return InvalidRow(index, f"row must be a JSON object, got {type(obj).__name__}")
    if columnar:
        obj = _columnar(obj)
    if _too_deep(obj):
        return InvalidRow(index, _nested_too_deeply())
    if not (isinstance(item, bytes) and not _MAY_HOLD_SURROGATE.search(item)):
        where = _unencodable_text(obj)
        if where is not None:
            return InvalidRow(index, f"{where} holds a lone UTF-16 surrogate (such as \\ud800): it is not valid "
                                     "Unicode, and no UTF-8 file (spool, part, export) can hold it")
    if "messages" not in obj or obj["messages"] is None:
        return InvalidRow(index, "missing 'messages'")
    meta = obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {}
    category = _first_str(obj.get("category"), obj.get("source"), meta.get("category"), meta.get("source"))
    raw_id = obj.get("id")
    if isinstance(raw_id, bool) or (raw_id is not None and not isinstance(raw_id, str | int)):
        return InvalidRow(index, f"id must be a string or an integer, got {type(raw_id).__name__}")
    messages = obj["messages"]
    if isinstance(messages, list):
        # Keep only the keys a chat request takes: dataset-specific extras must not reach the server. A
        # user message keeps role and content only, as SGLang reads it (it drops a user's `name`).
        messages = [as_sglang_reads({k: v for k, v in m.items() if k in _MESSAGE_KEYS})
                    if isinstance(m, dict) else m for m in messages]
    return PromptRow(
        index=index,
        messages=messages,
        tools=obj.get("tools"),
        id=None if raw_id is None else str(raw_id),
        category=category,
    )


def _first_str(*values: Any) -> str | None:
    for value in values:
        if isinstance(value, str) and value:
            return value
    return None


def read_rows(
    index: DatasetIndex,
    start: int,
    stop: int,
    *,
    source: ByteSource | None = None,
    aws_conn_id: str = "aws_default",
) -> Iterator[PromptRow | InvalidRow]:
    """Rows [start, stop) in order, reading O(stop - start) bytes (plus at most two blocks' worth)."""
    lo, hi = index.blocks_for(start, stop)
    src = source or open_data(index, aws_conn_id)
    columnar = index.format == "parquet"
    for row, item in iter_block_items(index, src, lo, hi):
        if row >= stop:
            break
        if row >= start:
            yield parse_row(row, item, columnar=columnar)


def read_indices(
    index: DatasetIndex,
    indices: Iterable[int],
    *,
    source: ByteSource | None = None,
    aws_conn_id: str = "aws_default",
) -> Iterator[PromptRow | InvalidRow]:
    """The given rows (e.g. a pilot sample), in ascending order, reading only the blocks that hold them."""
    wanted = np.unique(np.fromiter(indices, dtype=np.int64))
    if wanted.size == 0:
        return
    if wanted[0] < 0 or wanted[-1] >= index.n_rows:
        bad = int(wanted[0] if wanted[0] < 0 else wanted[-1])
        raise DatasetError(f"dataset {index.source_uri}: row {bad} outside [0, {index.n_rows})")
    src = source or open_data(index, aws_conn_id)
    columnar = index.format == "parquet"
    blocks = np.unique(np.searchsorted(index.block_rows, wanted, side="right") - 1)
    wanted_set = set(wanted.tolist())
    # Consecutive blocks are read together, so a dense sample costs no more requests than a slice.
    run_start = prev = int(blocks[0])
    for b in [*blocks[1:].tolist(), None]:
        if b is not None and b == prev + 1:
            prev = b
            continue
        for row, item in iter_block_items(index, src, run_start, prev + 1):
            if row in wanted_set:
                yield parse_row(row, item, columnar=columnar)
        if b is not None:
            run_start = prev = b
