"""Prompts in, one row at a time: the dataset reader a chunk task uses.

A dataset is a JSONL (plain or gzip) or Parquet file, local or on S3, or a local folder of Parquet shards or a
Hugging Face dataset saved to disk (`dataset.folder`). Each row is one conversation in one of the input forms `dataset.forms` knows
(OpenAI `messages`, ShareGPT `conversations`, a `prompt` string), with optional `tools`, `id` and metadata
(`category` or `source`); the run's `Reading` says which, and which of its assistant turns are generated
(`dataset.turns`): one prompt row each. A prompt row's index is its position among the dataset's prompt rows
and is stable. `build_index` (see `dataset.index`) scans the file once; `read_rows(index, start, stop)` then
reads only the bytes of the conversations holding that slice.

A malformed row is a *result*, `InvalidRow(index, reason)`, never an exception: one bad line
among a million must not kill a chunk, and the run decides whether to fail naming the row or
record it `invalid` (what counts as malformed: `dataset.conversation`). A missing or unreadable file is an
exception (`DatasetError`) naming the URI.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from tracegen.dataset.blocks import iter_block_items, open_data
from tracegen.dataset.conversation import MAX_ROW_DEPTH, decode, nested_too_deeply, unexpected
from tracegen.dataset.index import DatasetIndex, build_index
from tracegen.dataset.reading import Reading
from tracegen.dataset.request_rules import (
    as_sglang_reads,
    check_chainable,
    check_content_part,
    check_prompt_end,
    check_tool,
    check_tool_call_arguments,
    check_tool_parameters,
)
from tracegen.dataset.row_ids import row_id
from tracegen.dataset.source import ByteSource, CountingSource, DatasetError, open_source
from tracegen.dataset.turns import prompt_count, prompt_messages, turn_id

__all__ = [
    "MAX_ROW_DEPTH",
    "ROLES",
    "ByteSource",
    "CountingSource",
    "DatasetError",
    "DatasetIndex",
    "InvalidRow",
    "PromptRow",
    "build_index",
    "open_source",
    "parse_conversation",
    "parse_row",
    "read_indices",
    "read_rows",
]

ROLES = ("system", "user", "assistant", "tool")
DEFAULT_READING = Reading()
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
    check_prompt_end(messages)


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


def parse_row(index: int, item: bytes | str | dict[str, Any], *, columnar: bool = False,
              reading: Reading = DEFAULT_READING) -> PromptRow | InvalidRow:
    """Validate one raw row (a JSONL line or a Parquet row dict) as the prompt row `index`: a row read one
    prompt row per conversation (`turns` last or first). Never raises for what a row holds."""
    if reading.expands:
        raise ValueError("parse_row reads one prompt row per conversation; use parse_conversation under turns=each or chain")
    return parse_conversation(index, index, item, columnar=columnar, reading=reading)[0]


def parse_conversation(source_row: int, first_index: int, item: bytes | str | dict[str, Any], *,
                       columnar: bool = False, reading: Reading = DEFAULT_READING) -> list[PromptRow | InvalidRow]:
    """The prompt rows of the dataset's row `source_row` (indices from `first_index`), each a PromptRow or an
    InvalidRow naming why. A row that cannot be read as a conversation is one InvalidRow, as the index pass
    counted it (`dataset.conversation`).

    Never raises for what a row holds: any exception while it is parsed or checked makes it an InvalidRow, so
    one bad row cannot stop a chunk (or fail every retry of it)."""
    conversation = decode(item, reading, columnar=columnar)
    if isinstance(conversation, str):
        return [InvalidRow(first_index, conversation)]
    raw_id = conversation.own_id
    if isinstance(raw_id, bool) or (raw_id is not None and not isinstance(raw_id, str | int)):
        reason = f"id must be a string or an integer, got {type(raw_id).__name__}"
        return [InvalidRow(first_index + t, reason) for t in range(prompt_count(conversation.messages, reading.turns))]
    messages = conversation.messages
    if isinstance(messages, list):
        # Keep only the keys a chat request takes: dataset-specific extras must not reach the server. A
        # user message keeps role and content only, as SGLang reads it (it drops a user's `name`).
        messages = [as_sglang_reads({k: v for k, v in m.items() if k in _MESSAGE_KEYS})
                    if isinstance(m, dict) else m for m in messages]
    own_id = None if raw_id is None else str(raw_id)
    unchainable = None
    if reading.chained and isinstance(messages, list):
        try:
            check_chainable(messages)
        except ValueError as exc:
            unchainable = str(exc)
    out: list[PromptRow | InvalidRow] = []
    for t, prompt in enumerate(prompt_messages(messages, reading.turns)):
        index = first_index + t
        where = f"turn {t + 1} of row {source_row}: " if reading.expands else ""
        if unchainable is not None:
            out.append(InvalidRow(index, where + unchainable))
            continue
        try:
            out.append(PromptRow(
                index=index, messages=prompt, tools=conversation.tools,
                id=turn_id(row_id(own_id, source_row), t + 1) if reading.expands else own_id,
                category=conversation.category,
            ))
        except ValueError as exc:
            out.append(InvalidRow(index, where + str(exc)))
        except RecursionError:
            out.append(InvalidRow(index, where + nested_too_deeply()))
        except Exception as exc:  # the principle: what a row holds never raises past its row
            out.append(InvalidRow(index, where + unexpected(exc)))
    return out


def _expanded(index: DatasetIndex, row: int, item: Any, columnar: bool) -> list[PromptRow | InvalidRow]:
    """The prompt rows of the file's row `row`, as many as the index counted: a conversation that reads as
    another number now (only a reader of another version could) gives invalid rows for the indexed ones,
    never rows paired with another conversation's indices."""
    first, count = index.first_prompt_row(row), index.prompt_rows_of(row)
    rows = parse_conversation(row, first, item, columnar=columnar, reading=index.reading)
    if len(rows) == count:
        return rows
    reason = (f"row {row} reads as {len(rows)} prompt rows ({index.reading.describe()}), {count} when it was "
              "indexed: index the dataset again into a new output root")
    return [InvalidRow(first + t, reason) for t in range(count)]


def read_rows(
    index: DatasetIndex,
    start: int,
    stop: int,
    *,
    source: ByteSource | None = None,
    aws_conn_id: str = "aws_default",
) -> Iterator[PromptRow | InvalidRow]:
    """Prompt rows [start, stop) in order, reading only the blocks of their conversations: O(stop - start)
    bytes (plus at most two blocks' worth)."""
    if not 0 <= start <= stop <= index.n_prompt_rows:
        raise DatasetError(f"dataset {index.source_uri}: rows [{start}, {stop}) outside [0, {index.n_prompt_rows})")
    if start == stop:
        return
    first, last = (int(r) for r in index.conversations(np.asarray([start, stop - 1])))
    lo, hi = index.blocks_for(first, last + 1)
    src = source or open_data(index, aws_conn_id)
    columnar = index.format == "parquet"
    for row, item in iter_block_items(index, src, lo, hi):
        if row > last:
            break
        if row >= first:
            for prompt in _expanded(index, row, item, columnar):
                if start <= prompt.index < stop:
                    yield prompt


def read_indices(
    index: DatasetIndex,
    indices: Iterable[int],
    *,
    source: ByteSource | None = None,
    aws_conn_id: str = "aws_default",
) -> Iterator[PromptRow | InvalidRow]:
    """The given prompt rows (e.g. a pilot sample), in ascending order, reading only the blocks that hold
    their conversations."""
    wanted = np.unique(np.fromiter(indices, dtype=np.int64))
    if wanted.size == 0:
        return
    if wanted[0] < 0 or wanted[-1] >= index.n_prompt_rows:
        bad = int(wanted[0] if wanted[0] < 0 else wanted[-1])
        raise DatasetError(f"dataset {index.source_uri}: row {bad} outside [0, {index.n_prompt_rows})")
    src = source or open_data(index, aws_conn_id)
    columnar = index.format == "parquet"
    rows = np.unique(index.conversations(wanted))
    blocks = np.unique(np.searchsorted(index.block_rows, rows, side="right") - 1)
    wanted_set = set(wanted.tolist())
    rows_set = set(rows.tolist())
    # Consecutive blocks are read together, so a dense sample costs no more requests than a slice.
    run_start = prev = int(blocks[0])
    for b in [*blocks[1:].tolist(), None]:
        if b is not None and b == prev + 1:
            prev = b
            continue
        for row, item in iter_block_items(index, src, run_start, prev + 1):
            if row in rows_set:
                for prompt in _expanded(index, row, item, columnar):
                    if prompt.index in wanted_set:
                        yield prompt
        if b is not None:
            run_start = prev = b
