"""POST /parse_function_call as sglang 0.5.23 answers it, judged by SGLang's own FunctionCallParser, and a
/generate continuation of a sample that ends in a tool call ending in the raw call the chat route parses."""

from __future__ import annotations

import importlib.util
import re
import signal
from pathlib import Path

import httpx
import pytest
from fixtures import sglang_reference as sglang_ref
from fixtures.simulator import start_sim_server

TOOLS = [
    {"type": "function", "function": {"name": "run_tests", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "read_file", "description": "Read a file."}},
]
CALL = '<tool_call>\n{"name": "run_tests", "arguments": {"query": "all"}}\n</tool_call>'
TEXTS = [
    "no call here",
    "\n\nLet me run them.\n\n" + CALL,
    CALL + "\n" + CALL.replace("run_tests", "read_file"),
    "before " + CALL.replace("run_tests", "undefined_tool"),
    "broken <tool_call>\n{not json}\n</tool_call> after",
    "unclosed <tool_call>\n{\"name\": \"run_tests\"",
    '<tool_call>\n{"name": "read_file", "parameters": {"path": "é"}}\n</tool_call>',
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_sim_server(tmp_path_factory.mktemp("pfc"), reasoning_parser="qwen3", tool_call_parser="qwen25",
                         sim_length_model="short", sim_tool_call_rate=1.0, enable_deterministic_inference=True)
    yield s
    s.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as c:
        yield c


def _sglang_parse(text: str, tools: list, parser: str | None) -> dict:
    """SGLang's own non-streaming parse, as its /parse_function_call route answers it: the parser names of
    `FunctionCallParser.ToolCallParserEnum` (read from its source: importing it needs xgrammar), then
    `parse_non_stream` (no tools: the text as it is) with its `Qwen25Detector`."""
    sglang_ref.sglang()
    source = Path(importlib.util.find_spec("sglang").submodule_search_locations[0],
                  "srt/function_call/function_call_parser.py").read_text()
    enum = source[source.index("ToolCallParserEnum"):source.index("def __init__")]
    names = set(re.findall(r'"([^"]+)": \w+Detector', enum))
    if parser not in names:
        raise ValueError(f"Unsupported tool_call_parser: {parser}")
    assert re.search(rf'"{parser}": Qwen25Detector', enum), parser
    with sglang_ref._gpu_stack_absent():
        detector = importlib.import_module("sglang.srt.function_call.qwen25_detector").Qwen25Detector()
        protocol = importlib.import_module("sglang.srt.entrypoints.openai.protocol")
        parsed = [protocol.Tool.model_validate(t) for t in tools]
        if not parsed:
            return {"normal_text": text, "calls": []}
        has_call = detector.has_tool_call(text)
        result = detector.detect_and_parse(text, parsed)
    if not (result.calls or has_call):
        return {"normal_text": text, "calls": []}
    return {"normal_text": result.normal_text, "calls": [c.model_dump() for c in result.calls]}


@pytest.mark.parametrize("parser", ["qwen25", "qwen"])
def test_parse_function_call_answers_what_sglangs_parser_does(client, parser):
    for text in TEXTS:
        for tools in (TOOLS, []):
            r = client.post("/parse_function_call", json={"text": text, "tools": tools, "tool_call_parser": parser})
            assert r.status_code == 200, r.text
            assert r.json() == _sglang_parse(text, tools, parser), (text, tools)
    body = client.post("/parse_function_call", json={"text": TEXTS[1], "tools": TOOLS,
                                                     "tool_call_parser": parser}).json()
    assert body == {"normal_text": "Let me run them.",
                    "calls": [{"tool_index": 0, "name": "run_tests", "parameters": '{"query": "all"}'}]}


def test_parse_function_call_refuses_as_sglang_does(client):
    def post(body):
        return client.post("/parse_function_call", json=body)

    # Unknown parser (or none): FunctionCallParser's ValueError outside any handler, the server's plain 500.
    for name in ("qwen3", None):
        r = post({"text": CALL, "tools": TOOLS, "tool_call_parser": name})
        assert (r.status_code, r.text) == (500, "Internal Server Error")
        with pytest.raises(ValueError, match="Unsupported tool_call_parser"):
            _sglang_parse(CALL, TOOLS, name)
    # An adapter's parser on a server not serving its model: HTTPException(400) in SGLang's ErrorResponse.
    r = post({"text": CALL, "tools": TOOLS, "tool_call_parser": "deepseekv4"})
    assert r.status_code == 400
    assert r.json() == {"object": "error", "type": "400", "param": None, "code": 400, "message":
                        "'deepseekv4' output is parsed with its model's tokenizer; this server does not serve that model"}
    # A parser SGLang has for a format the stand-in never writes.
    assert post({"text": CALL, "tools": TOOLS, "tool_call_parser": "llama3"}).status_code == 501
    # Bodies SGLang's request model refuses: its validation error, 400 "Bad Request".
    for body in ({"tools": TOOLS, "tool_call_parser": "qwen25"}, {"text": 3, "tool_call_parser": "qwen25"},
                 {"text": CALL, "tools": [{"type": "function"}], "tool_call_parser": "qwen25"},
                 {"text": CALL, "tools": {"a": 1}, "tool_call_parser": "qwen25"},
                 {"text": CALL, "tools": TOOLS, "tool_call_parser": 5}):
        r = post(body)
        assert r.status_code == 400, body
        assert r.json()["type"] == "Bad Request" and r.json()["code"] == 400
    r = client.post("/parse_function_call", content=b"not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400


def test_generate_continuation_ends_in_the_call_the_chat_route_parses(client):
    # Every sample of a prompt with tools calls one (--sim-tool-call-rate 1): continue one cut at 20 tokens.
    messages = [{"role": "user", "content": "fix the failing test"}]
    chat = {"messages": messages, "tools": TOOLS, "seed": 7}
    whole = client.post("/v1/chat/completions", json={**chat, "max_tokens": 4000}).json()["choices"][0]
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["tool_calls"]
    first = client.post("/v1/chat/completions",
                        json={**chat, "max_tokens": 20, "return_token_ids": True,
                              "separate_reasoning": False}).json()["choices"][0]  # fmt: skip
    assert first["finish_reason"] == "length"
    gen = client.post("/generate", json={"input_ids": first["prompt_token_ids"] + first["response_token_ids"],
                                         "sampling_params": {"max_new_tokens": 3980, "sampling_seed": 7}}).json()
    # /generate parses nothing: the raw call is in its text, and it stopped at the stop token.
    assert gen["text"].endswith("</tool_call>") and "<tool_call>\n" in gen["text"]
    assert gen["meta_info"]["finish_reason"] == {"type": "stop", "matched": 151645}
    raw = first["message"]["content"] + gen["text"]
    split = client.post("/separate_reasoning", json={"text": raw, "reasoning_parser": "qwen3"}).json()
    parsed = client.post("/parse_function_call", json={"text": split["text"], "tools": TOOLS,
                                                       "tool_call_parser": "qwen25"}).json()  # fmt: skip
    message = whole["message"]
    assert split["reasoning_text"] == message["reasoning_content"]
    assert parsed["normal_text"] == message["content"]
    assert [(c["name"], c["parameters"]) for c in parsed["calls"]] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]
    ]


def test_the_stand_ins_parser_names_are_sglangs():
    from tracegen.simulator.tool_calls import SGLANG_TOOL_PARSERS

    source = Path(importlib.util.find_spec("sglang").submodule_search_locations[0],
                  "srt/function_call/function_call_parser.py").read_text()
    enum = source[source.index("ToolCallParserEnum"):source.index("def __init__")]
    assert set(re.findall(r'"([^"]+)": \w+Detector', enum)) == SGLANG_TOOL_PARSERS
