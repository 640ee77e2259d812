"""Rows SGLang would refuse are found when the dataset is read, and recorded invalid with the reason, instead
of being sent and coming back rejected after waiting for GPU time. Judged by SGLang's own request models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fixtures import sglang_reference as sglang_ref

from tracegen.dataset.reader import InvalidRow, PromptRow, build_index, parse_row, read_rows

USER = {"role": "user", "content": "question"}
OBJECT = {"type": "object", "properties": {"path": {"type": "string"}}}


def tool(parameters: object) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


TOOL_RESULT = {"role": "tool", "tool_call_id": "c1", "content": "ok"}


def call(arguments: str) -> dict:
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]}


# (row, reason the reader gives, or "" when SGLang accepts the request the row becomes)
ROWS = [
    ({"messages": [USER]}, ""),
    ({"messages": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]}, "type 'input_text'"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, ""),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "a text part needs"),
    ({"messages": [{"role": "user", "content": [{"type": "thinking", "text": "hm"}]}]}, "only valid in assistant"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "role 'robot'"),
    ({"messages": [{"role": "User", "content": "hi"}]}, "role 'User'"),
    ({"messages": [USER], "tools": [tool(OBJECT)]}, ""),
    ({"messages": [USER], "tools": [tool({"type": "object", "properties": {"n": {"type": "bigint"}}})]}, ""),
    ({"messages": [USER], "tools": [tool({"type": "objekt"})]}, "not a valid JSON Schema"),
    ({"messages": [USER], "tools": [tool({"type": "object", "required": "path"})]}, "not a valid JSON Schema"),
    ({"messages": [USER], "tools": [tool({"type": "object", "properties": {"n": {"type": 5}}})]}, "JSON Schema"),
    ({"messages": [USER], "tools": [{"type": "function", "function": {"name": "f", "description": 3}}]},
     "'description' must be a string"),
    ({"messages": [USER, call('{"path": "a"}'), TOOL_RESULT]}, ""),
    ({"messages": [USER, call('{"path": '), TOOL_RESULT]}, "arguments must be valid JSON"),
    ({"messages": [USER, call('["a"]'), TOOL_RESULT]}, "arguments must be a JSON object"),
    ({"messages": [USER, call('{"n": NaN}'), TOOL_RESULT]}, "arguments must be valid JSON"),
]  # fmt: skip


@pytest.mark.parametrize(("row", "reason"), ROWS, ids=[str(i) for i in range(len(ROWS))])
def test_rows_sglang_refuses_are_invalid_when_read(row, reason):
    sglang_says = sglang_ref.chat_request_refusal({k: v for k, v in row.items() if k in ("messages", "tools")})
    assert (sglang_says is None) == (reason == ""), sglang_says
    parsed = parse_row(0, json.dumps(row))
    if reason:
        assert isinstance(parsed, InvalidRow) and reason in parsed.reason, parsed
    else:
        assert isinstance(parsed, PromptRow), parsed
        # The request the row becomes is one SGLang accepts.
        assert sglang_ref.chat_request_refusal({"messages": parsed.messages, "tools": parsed.tools}) is None


def test_a_user_messages_name_is_dropped_as_sglang_drops_it():
    row = parse_row(0, json.dumps({"messages": [{"role": "system", "content": "s", "name": "sys"},
                                                {"role": "user", "content": "hi", "name": "alice"}]}))  # fmt: skip
    assert isinstance(row, PromptRow)
    assert row.messages == [{"role": "system", "content": "s", "name": "sys"}, {"role": "user", "content": "hi"}]
    sent = sglang_ref.sglang().protocol.ChatCompletionRequest.model_validate({"messages": row.messages})
    assert [m.model_dump(exclude_none=True) for m in sent.messages][1] == {"role": "user", "content": "hi"}


def test_a_tools_schema_is_sent_as_given_after_the_check():
    parameters = {"type": "object", "properties": {"n": {"type": "varchar(20)"}}}
    row = parse_row(0, json.dumps({"messages": [USER], "tools": [tool(parameters)]}))
    assert isinstance(row, PromptRow) and row.tools[0]["function"]["parameters"] == parameters


def test_invalid_rows_are_found_by_the_chunk_reader(tmp_path: Path):
    lines = [json.dumps(row) for row, _ in ROWS]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(lines) + "\n")
    index = build_index(str(path), stride=4)
    got = list(read_rows(index, 0, index.n_rows))
    assert [isinstance(r, InvalidRow) for r in got] == [bool(reason) for _, reason in ROWS]
