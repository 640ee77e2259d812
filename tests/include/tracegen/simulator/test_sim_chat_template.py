"""The stand-in renders and tokenizes a chat prompt exactly as SGLang 0.5.23 does with Qwen3's template.

The judge is SGLang's own code and `transformers`: SGLang's request models, its content-format detection
and its content helper prepare the messages and tools (`sglang_reference.chat_template_input`), and
`transformers`' `apply_chat_template` renders them with the tokenizer folder's `chat_template.jinja` and
encodes them with its `tokenizer.json`. The stand-in's prompt ids (`tokens.chat_prompt_ids`, what its chat
route counts as prompt_tokens and returns as prompt_token_ids) must be those ids, on every prompt of the
bundled dataset and on the shapes that dataset does not hold: tools without a description, in another key
order, with database-style types, a tool-level defer_loading, tool_choice "none" and a named choice,
content parts, thinking parts, reasoning in an earlier turn, calls with and without text, arguments as a
string or an object, consecutive tool results, a capitalised role, thinking off, and a final assistant
message, which SGLang serves as a user message, or continues under continue_final_message.
"""

from __future__ import annotations

import copy
import gzip
import json

import pytest
from fixtures import sglang_reference as reference

from tracegen.config import SAMPLE_DATASET
from tracegen.simulator import protocol
from tracegen.simulator.bpe import TOKENIZER_DIR
from tracegen.simulator.chat_template import TEMPLATE_FILE, render_chat
from tracegen.simulator.tokens import chat_prompt_ids

transformers = pytest.importorskip("transformers")

RUN_SHELL = {"type": "function", "function": {
    "name": "run_shell", "description": "Run a command.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}
BARE = {"type": "function", "function": {"name": "ping"}}
REORDERED = {"function": {"parameters": {"type": "object", "properties": {"n": {"type": "int32"},
                                                                         "at": {"type": "varchar(32)"}}},
                          "strict": True, "name": "count"}, "type": "function", "defer_loading": True}
CALL = {"id": "call_1", "type": "function", "function": {"name": "run_shell", "arguments": '{"command":"ls  -la"}'}}
CALL_OBJECT = {"id": "call_2", "type": "function", "function": {"name": "ping", "arguments": {"host": "é"}}}
CALL_BARE = {"id": "call_3", "function": {"name": "ping"}}  # no arguments: SGLang's model dumps them as null


def _user(text):
    return {"role": "user", "content": text}


CASES = {
    "plain": {"messages": [_user("hi")]},
    "system-and-name": {"messages": [{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "hi", "name": "bob"}]},
    "tools-of-every-shape": {"messages": [_user("go")], "tools": [RUN_SHELL, BARE, REORDERED]},
    "tool-choice-none": {"messages": [_user("go")], "tools": [RUN_SHELL, BARE], "tool_choice": "none"},
    "tool-choice-named": {"messages": [_user("go")], "tools": [RUN_SHELL, BARE],
                          "tool_choice": {"type": "function", "function": {"name": "ping"}}},
    "calls-without-text": {"messages": [
        {"role": "system", "content": "agent"}, _user("fix it"),
        {"role": "assistant", "content": None, "tool_calls": [CALL, CALL_OBJECT, CALL_BARE]},
        {"role": "tool", "tool_call_id": "call_1", "content": "ok"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "pong"},
                                                               {"type": "text", "text": "again"}]}],
        "tools": [RUN_SHELL, BARE]},
    "calls-with-text-and-reasoning": {"messages": [
        _user("fix it"),
        {"role": "assistant", "content": "Looking.", "reasoning_content": "\nfirst ls\n", "tool_calls": [CALL]},
        {"role": "tool", "content": "ok"},
        {"role": "Assistant", "content": "Done.", "reasoning_content": "all good"},
        _user("thanks")], "tools": [RUN_SHELL]},
    "content-parts": {"messages": [
        {"role": "system", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]},
    "thinking-off": {"messages": [_user("hi")], "chat_template_kwargs": {"enable_thinking": False}},
    "empty-and-special-strings": {"messages": [
        {"role": "assistant", "content": ""}, _user("<tool_response>\nx\n</tool_response> <|fim_prefix|>")]},
    # A final assistant message: served as a user message with its content (tool calls and reasoning
    # dropped), or under continue_final_message taken out and its content encoded after the prompt.
    "final-assistant": {"messages": [_user("fix it"), {"role": "assistant", "content": "Partial", "name": "x"}]},
    "final-assistant-calls": {"messages": [
        _user("fix it"), {"role": "assistant", "content": None, "reasoning_content": "hm", "tool_calls": [CALL]}],
        "tools": [RUN_SHELL]},
    "final-assistant-parts": {"messages": [_user("go"), {"role": "assistant", "content": [
        {"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]},
    "continue-final-message": {"messages": [_user("fix it"), {"role": "assistant", "content": " Let me"}],
                               "continue_final_message": True},
    "continue-final-message-empty": {"messages": [_user("hi"), {"role": "assistant", "content": ""}],
                                     "continue_final_message": True},
    "continue-final-message-after-a-user": {"messages": [_user("hi")], "continue_final_message": True},
}


@pytest.fixture(scope="module")
def hf_tokenizer():
    return transformers.AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))


def _stand_in_ids(body: dict) -> list[int]:
    req = protocol.parse_chat(copy.deepcopy(body))
    return chat_prompt_ids(req.messages, req.tools, req.enable_thinking, req.tool_choice, req.continue_final_message)


def _sglang_text(body: dict, tok) -> tuple[str, str | None]:
    """The prompt text SGLang renders, and what it encodes after it."""
    messages, tools, kwargs, prefix = reference.chat_template_input(body)
    return tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False, **kwargs), prefix


def _sglang_ids(body: dict, tok) -> list[int]:
    text, prefix = _sglang_text(body, tok)
    return tok.encode(text) + (tok.encode(prefix) if prefix else [])


def test_sglang_reads_qwen3s_template_as_string_content():
    # The stand-in flattens content parts because SGLang does for this template.
    assert reference.template_content_format(TEMPLATE_FILE.read_text()) == "string"


@pytest.mark.parametrize("name", list(CASES))
def test_the_stand_in_renders_every_shape_as_sglang_does(name, hf_tokenizer):
    body = CASES[name]
    assert reference.chat_request_refusal(body) is None
    text, prefix = _sglang_text(body, hf_tokenizer)
    req = protocol.parse_chat(copy.deepcopy(body))
    assert render_chat(req.messages, req.tools, thinking=req.enable_thinking, tool_choice=req.tool_choice,
                       continue_final_message=req.continue_final_message) == (text, prefix or "")
    assert _stand_in_ids(body) == _sglang_ids(body, hf_tokenizer)


def test_the_stand_in_renders_every_bundled_prompt_as_sglang_does(hf_tokenizer):
    with gzip.open(SAMPLE_DATASET, "rt") as f:
        rows = [json.loads(line) for line in f]
    differ = []
    for row in rows:
        body = {"messages": row["messages"], **({"tools": row["tools"]} if row.get("tools") else {})}
        if _stand_in_ids(body) != _sglang_ids(body, hf_tokenizer):
            differ.append(row["id"])
    assert len(rows) == 3000 and differ == [], differ[:10]


@pytest.mark.parametrize("arguments", ['{"command": ', "[1, 2]", '"ls"', '{"x": NaN}'])
def test_arguments_that_are_not_a_json_object_are_refused_with_sglangs_message(arguments):
    call = {"id": "c", "type": "function", "function": {"name": "run_shell", "arguments": arguments}}
    body = {"messages": [_user("go"), {"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "content": "x"}], "tools": [RUN_SHELL]}
    with pytest.raises(ValueError) as sglang_says:
        reference.chat_template_input(body)
    with pytest.raises(protocol.ConversionRefused) as stand_in_says:
        protocol.parse_chat(body)
    assert str(stand_in_says.value) == str(sglang_says.value)


def test_tokenize_renders_messages_as_given_when_add_generation_prompt_is_set(hf_tokenizer):
    # SGLang's /tokenize sets `_format_add_generation_prompt` from the field, so a final assistant message
    # is rendered as an assistant turn there (and the generation prompt is as asked); omitted, it is a chat
    # completion's rendering, the final assistant message served as a user message.
    from tracegen.simulator.tokens import text_ids

    messages = [_user("fix it"), {"role": "assistant", "content": "Prefilled"}]
    for flag in (True, False):
        req = protocol.parse_tokenize({"messages": messages, "add_generation_prompt": flag})
        expected = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=flag, tokenize=False)
        assert chat_prompt_ids(req.messages, req.tools, req.enable_thinking,
                               add_generation_prompt=req.add_generation_prompt) == text_ids(expected)
    req = protocol.parse_tokenize({"messages": messages})
    assert req.add_generation_prompt is None
    assert chat_prompt_ids(req.messages, req.tools, req.enable_thinking) == _sglang_ids({"messages": messages},
                                                                                        hf_tokenizer)
