"""The stand-in judged by SGLang's own code: its answers are what SGLang's protocol models serialize, it
refuses the requests SGLang refuses, and it reports what SGLang reports (context length, running-request
cap, metrics, /model_info, auth). Each test here failed on the stand-in before it mirrored SGLang 0.5.23."""

from __future__ import annotations

import asyncio
import json
import re
import signal

import httpx
import pytest
from fixtures import sglang_reference as sglang_ref
from fixtures.simulator import start_sim_server

from tracegen.fleet.server import served_context_length
from tracegen.sglang.autotune import parse_metrics
from tracegen.simulator.middleware import auth_allows

KEY = "sk-fidelity"
TOOLS = [{"type": "function", "function": {"name": "run_tests", "parameters": {"type": "object"}}}]


def user(text: str = "question") -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def seedlike(tmp_path_factory):
    """A server launched with the reference job's fleet's parsers and an API key."""
    server = start_sim_server(
        tmp_path_factory.mktemp("fidelity"), api_key=KEY, reasoning_parser="qwen3", tool_call_parser="qwen25",
        enable_metrics=True, sim_length_model="short", sim_tool_call_rate=0.5, model_path="Qwen/Qwen3-8B",
    )  # fmt: skip
    yield server
    server.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def client(seedlike):
    with httpx.Client(base_url=seedlike.url, headers=seedlike.headers, timeout=60) as c:
        yield c


# ---- what it answers ----------------------------------------------------------------------------------


def test_chat_completions_are_what_sglangs_models_serialize(client):
    # Each sample calls a tool with probability 0.5 (sim_tool_call_rate), drawn afresh per request: ask until
    # one has (at least 12 requests; 40 without one would be a 1e-12 chance).
    bodies = []
    for i in range(40):
        bodies.append(client.post("/v1/chat/completions", json={"messages": user(f"q{i}"), "tools": TOOLS,
                                                                "max_tokens": 4000}).json())  # fmt: skip
        if i >= 11 and any(b["choices"][0]["finish_reason"] == "tool_calls" for b in bodies):
            break
    bodies.append(client.post("/v1/chat/completions", json={"messages": user(), "max_tokens": 3}).json())
    bodies.append(client.post("/v1/chat/completions", json={"messages": user(), "max_tokens": 500,
                                                            "return_token_ids": True}).json())  # fmt: skip
    reasons = {b["choices"][0]["finish_reason"] for b in bodies}
    assert {"tool_calls", "length"} <= reasons, reasons
    for body in bodies:
        assert sglang_ref.as_sglang_serializes("ChatCompletionResponse", body) == body
    # No tool call: the key is absent, as SGLang's ChatMessage serializer leaves it out.
    assert all("tool_calls" not in b["choices"][0]["message"] for b in bodies
               if b["choices"][0]["finish_reason"] != "tool_calls")  # fmt: skip


def test_streamed_chunks_validate_against_sglangs_stream_model(client):
    body = {"messages": user("stream"), "max_tokens": 200, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        chunks = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert chunks[-1] == "[DONE]"
    for chunk in chunks[:-1]:
        sglang_ref.sglang().protocol.ChatCompletionStreamResponse.model_validate_json(chunk)


def test_ids_asked_in_sglext_come_at_the_responses_level_as_sglang_sends_them(client):
    # Whole: the prompt's and the output's ids, the same as the choice's own token-id fields.
    asked = {"return_input_ids_in_sglext": True, "return_output_ids_in_sglext": True}
    body = client.post("/v1/chat/completions", json={"messages": user("ids"), "max_tokens": 300, **asked,
                                                     "return_token_ids": True}).json()  # fmt: skip
    assert sglang_ref.as_sglang_serializes("ChatCompletionResponse", body) == body
    choice = body["choices"][0]
    assert body["sglext"] == {"input_ids": choice["prompt_token_ids"], "output_ids": [choice["response_token_ids"]]}
    assert "sglext" not in client.post("/v1/chat/completions", json={"messages": user(), "max_tokens": 3}).json()
    # Streamed, asked by SGLang's headers: one chunk of its own after the last delta, before the usage; with
    # x-sglext-ids-framed the ids chunk is a named event.
    stream = {"messages": user("stream ids"), "max_tokens": 300, "stream": True,
              "stream_options": {"include_usage": True}}  # fmt: skip
    for framed in (False, True):
        headers = {"x-sglext-return-input-ids": "1", "x-sglext-return-output-ids": "1"}
        if framed:
            headers["x-sglext-ids-framed"] = "1"
        with client.stream("POST", "/v1/chat/completions", json=stream, headers=headers) as r:
            lines = [line for line in r.iter_lines() if line]
        chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        for chunk in chunks:
            sglang_ref.sglang().protocol.ChatCompletionStreamResponse.model_validate(chunk)
        *deltas, ids, usage = chunks
        # SGLang writes this chunk with the stream model's model_dump_json().
        assert sglang_ref.as_sglang_serializes("ChatCompletionStreamResponse", ids) == ids
        assert deltas[-1]["choices"][0]["finish_reason"] in ("stop", "length") and ids["choices"] == []
        assert len(ids["sglext"]["input_ids"]) == usage["usage"]["prompt_tokens"]
        assert len(ids["sglext"]["output_ids"][0]) == usage["usage"]["completion_tokens"]
        at = lines.index("data: " + json.dumps(ids))
        assert (lines[at - 1] == "event: sglext_ids") == framed and lines[-1] == "data: [DONE]"


def test_models_and_errors_are_what_sglang_serializes(client):
    models = client.get("/v1/models").json()
    assert sglang_ref.as_sglang_serializes("ModelList", models) == models
    too_long = client.post("/v1/chat/completions", json={"messages": user(), "max_tokens": 10**6})
    error = too_long.json()
    assert too_long.status_code == 400 and sglang_ref.as_sglang_serializes("ErrorResponse", error) == error
    # The context check is the chat handler's own: SGLang's create_error_response names it BadRequestError.
    assert error["type"] == "BadRequestError" and "maximum context length" in error["message"]


def test_model_info_has_sglangs_keys(client):
    assert list(client.get("/model_info").json()) == sglang_ref.model_info_keys()
    info = client.get("/model_info").json()
    # Launched with qwen25, SGLang resolves the deprecated name at start-up and reports qwen.
    assert info["tool_call_parser"] == "qwen" and info["load_format"] == "auto"


def test_without_a_tool_call_parser_sglang_reports_no_tool_call(sim_server):
    sim = sim_server(sim_length_model="short", sim_tool_call_rate=1.0)
    for i in range(5):
        body = httpx.post(f"{sim.url}/v1/chat/completions", timeout=30,
                          json={"messages": user(f"q{i}"), "tools": TOOLS, "max_tokens": 4000}).json()  # fmt: skip
        choice = body["choices"][0]
        assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
        assert '<tool_call>\n{"name": "run_tests"' in choice["message"]["content"]
        assert sglang_ref.as_sglang_serializes("ChatCompletionResponse", body) == body


# ---- what it refuses ----------------------------------------------------------------------------------

SCHEMA_WITH_BAD_TYPE = {"type": "object", "properties": {"n": {"type": 5}}}
# (request body fields beside "max_tokens", does SGLang accept it before generating)
REQUESTS = [
    ({"messages": user()}, True),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, True),
    ({"messages": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]}, False),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, False),
    # A text model (what the stand-in serves): SGLang refuses media parts.
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]}, False),
    ({"messages": [{"role": "robot", "content": "hi"}]}, False),
    ({"messages": [{"role": "User", "content": "hi"}]}, False),
    ({"messages": [{"role": "System", "content": "be brief"}, *user()]}, True),
    ({"messages": [{"role": "developer", "content": "be brief"}, *user()]}, True),
    ({"messages": [{"role": "user", "content": None}]}, False),
    ({"messages": [{"role": "user", "content": [{"type": "thinking", "thinking": "hmm"}]}]}, False),
    ({"messages": [*user(), {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm"}]}]}, True),
    ({"messages": [*user(), {"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}]}, False),
    ({"messages": [{"role": "user", "content": "hi", "name": "alice"}]}, True),
    ({"messages": []}, False),
    ({"messages": user(), "tools": TOOLS}, True),
    ({"messages": user(), "tools": [{"type": "function", "function": {"parameters": {}}}]}, False),
    ({"messages": user(), "tools": [{"function": {"name": "f", "parameters": {"type": "varchar(20)"}}}]}, True),
    ({"messages": user(), "tools": [{"function": {"name": "f", "parameters": {"type": "objekt"}}}]}, False),
    ({"messages": user(), "tools": [{"function": {"name": "f", "parameters": SCHEMA_WITH_BAD_TYPE}}]}, False),
    ({"messages": user(), "tool_choice": "required"}, False),
    ({"messages": user(), "tools": TOOLS, "tool_choice": {"function": {"name": "other"}}}, False),
]


@pytest.mark.parametrize(("fields", "accepted"), REQUESTS, ids=[str(i) for i in range(len(REQUESTS))])
def test_the_stand_in_refuses_what_sglang_refuses(client, fields, accepted):
    body = {**fields, "max_tokens": 8}
    sglang_says = sglang_ref.chat_request_refusal(body)
    assert (sglang_says is None) == accepted, sglang_says
    r = client.post("/v1/chat/completions", json=body)
    assert (r.status_code == 200) == accepted, r.text
    if not accepted:
        assert r.status_code == 400 and sglang_ref.as_sglang_serializes("ErrorResponse", r.json()) == r.json()


def test_a_user_messages_name_is_dropped_as_sglang_drops_it(client):
    parsed = sglang_ref.sglang().protocol.ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi", "name": "a-long-speaker-name"}]}
    )
    assert "name" not in parsed.messages[0].model_dump()
    named = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi",
                                                                    "name": "a-long-speaker-name"}], "max_tokens": 2})
    plain = client.post("/v1/chat/completions", json={"messages": user("hi"), "max_tokens": 2})
    assert named.json()["usage"]["prompt_tokens"] == plain.json()["usage"]["prompt_tokens"]


def test_error_types_are_sglangs(client):
    # FastAPI's validation of the body (SGLang's request model): "Bad Request".
    refused = client.post("/v1/chat/completions", json={"messages": [{"role": "robot", "content": "x"}]})
    assert refused.json()["type"] == "Bad Request"
    # The handler's own checks: "BadRequestError"; a ValueError while converting the request: "BadRequest".
    bad_schema = {"messages": user(), "tools": [{"function": {"name": "f", "parameters": {"type": "objekt"}}}]}
    assert client.post("/v1/chat/completions", json=bad_schema).json()["type"] == "BadRequestError"
    streamed_ids = {"messages": user(), "stream": True, "return_token_ids": True}
    assert client.post("/v1/chat/completions", json=streamed_ids).json()["type"] == "BadRequest"


def test_a_body_that_is_not_json_is_refused_as_sglang_refuses_it(client):
    r = client.post("/v1/chat/completions", content=json.dumps({"messages": user()}),
                    headers={"Content-Type": "text/plain"})  # fmt: skip
    body = r.json()
    assert r.status_code == 400 and body["type"] == "Bad Request"
    assert "Unsupported Media Type: Only 'application/json' is allowed" in body["message"]
    assert sglang_ref.as_sglang_serializes("ErrorResponse", body) == body
    charset = client.post("/v1/chat/completions", content=json.dumps({"messages": user(), "max_tokens": 2}),
                          headers={"Content-Type": "application/json; charset=utf-8"})  # fmt: skip
    assert charset.status_code == 200


HEADERS = [None, "", "Bearer k", "bearer k", "BEARER k", "Bearer  k", "Bearer k ", "Basic k", "Bearer",
           "Bearer admin", "Bearerk"]  # fmt: skip
PATHS = ["/v1/chat/completions", "/v1/models", "/model_info", "/health", "/health_generate", "/metrics",
         "/ready", "/abort_request", "/generate"]  # fmt: skip


def test_auth_decisions_are_sglangs():
    auth = sglang_ref.sglang().auth
    levels = {"/abort_request": auth.AuthLevel.ADMIN_OPTIONAL}
    for api_key, admin_key in ((None, None), ("k", None), (None, "admin"), ("k", "admin")):
        for method in ("GET", "POST", "OPTIONS"):
            for path in PATHS:
                for header in HEADERS:
                    theirs = auth.decide_request_auth(
                        method=method, path=path, authorization_header=header, api_key=api_key,
                        admin_api_key=admin_key, auth_level=levels.get(path, auth.AuthLevel.NORMAL),
                    ).allowed  # fmt: skip
                    ours = auth_allows(method, path, header, api_key, admin_key)
                    assert ours == theirs, (api_key, admin_key, method, path, header)


def test_two_spaces_after_bearer_are_refused(seedlike):
    assert httpx.get(f"{seedlike.url}/v1/models", headers={"Authorization": f"Bearer  {KEY}"}).status_code == 401
    assert httpx.get(f"{seedlike.url}/v1/models", headers={"Authorization": f"bearer {KEY}"}).status_code == 200


# ---- server facts -------------------------------------------------------------------------------------


def test_context_length_is_reported_as_sglang_reports_it(sim_server):
    sim = sim_server(sim_length_model="short")
    info = httpx.get(f"{sim.url}/server_info").json()
    model = httpx.get(f"{sim.url}/v1/models").json()["data"][0]
    # No --context-length: /server_info says null (the flag), /v1/models the model's own limit.
    assert info["context_length"] is None and model["max_model_len"] == 40960
    assert info["max_req_input_len"] == 40960 - 1 - 5
    assert served_context_length(sim.url, {}, "sim/Qwen3-test") == 40960
    prompt = httpx.post(f"{sim.url}/v1/chat/completions", json={"messages": user(), "max_tokens": 1}).json()
    n_prompt = prompt["usage"]["prompt_tokens"]
    fits = httpx.post(f"{sim.url}/v1/chat/completions", json={"messages": user(), "max_tokens": 40960 - n_prompt})
    over = httpx.post(f"{sim.url}/v1/chat/completions", json={"messages": user(), "max_tokens": 40961 - n_prompt})
    assert fits.status_code == 200 and over.status_code == 400
    given = sim_server(context_length=8192)
    assert httpx.get(f"{given.url}/server_info").json()["context_length"] == 8192
    assert served_context_length(given.url, {}, "sim/Qwen3-test") == 8192


async def _post(client: httpx.AsyncClient, path: str, body: dict) -> None:
    try:
        await client.post(path, json=body)
    except httpx.HTTPError:
        pass


def test_speculative_decoding_runs_48_requests_at_once(sim_server):
    sim = sim_server(speculative_algorithm="EAGLE3", sim_length_model="fixed:100000", context_length=200000,
                     sim_time_scale=10)  # fmt: skip

    async def scenario() -> dict:
        async with httpx.AsyncClient(base_url=sim.url, timeout=60) as c:
            body = {"text": "x", "sampling_params": {"max_new_tokens": 100000}}
            background = [asyncio.create_task(_post(c, "/generate", body)) for _ in range(60)]
            await asyncio.sleep(1.0)
            info = (await c.get("/server_info")).json()
            await c.post("/abort_request", json={"abort_all": True})
            await asyncio.gather(*background)
            return info

    info = asyncio.run(scenario())
    assert info["max_running_requests"] == 48
    state = info["internal_states"][0]
    assert state["effective_max_running_requests_per_dp"] == 48
    assert (state["num_running_reqs"], state["num_queue_reqs"]) == (48, 12)


def _series(text: str, name: str) -> dict[str, float]:
    """priority label value -> value, for one metric."""
    out = {}
    for labels, value in re.findall(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", text, re.MULTILINE):
        out[dict(re.findall(r'(\w+)="([^"]*)"', labels)).get("priority")] = float(value)
    return out


def test_priority_scheduling_metrics_and_the_autotuner_reads_the_totals(sim_server):
    sim = sim_server(enable_priority_scheduling=True, enable_metrics=True, max_running_requests=2,
                     sim_length_model="fixed:100000", context_length=200000, sim_time_scale=10)  # fmt: skip

    async def scenario() -> str:
        async with httpx.AsyncClient(base_url=sim.url, timeout=60) as c:
            def start(i: int) -> asyncio.Task:
                return asyncio.create_task(_post(c, "/v1/chat/completions", {
                    "messages": user(f"q{i}"), "max_tokens": 100000, "priority": i % 2}))  # fmt: skip

            # The two slots go to the first two arrivals, one of each priority; the other three
            # wait. Started all at once, which two won was a race, and so was the series set.
            background = [start(0), start(1)]
            await asyncio.sleep(0.5)
            background += [start(i) for i in range(2, 5)]
            await asyncio.sleep(1.0)
            text = (await c.get("/metrics")).text
            await c.post("/abort_request", json={"abort_all": True})
            await asyncio.gather(*background)
            return text

    text = asyncio.run(scenario())
    running, queued = _series(text, "sglang:num_running_reqs"), _series(text, "sglang:num_queue_reqs")
    # SGLang: the total under priority="", one series per priority beside it.
    assert running[""] == 2 and queued[""] == 3
    assert sum(v for p, v in running.items() if p) == 2 and sum(v for p, v in queued.items() if p) == 3
    assert set(running) == {"", "0", "1"}
    metrics = parse_metrics(text)
    assert (metrics["sglang:num_running_reqs"], metrics["sglang:num_queue_reqs"]) == (2, 3)


# ---- the tokenizer routes -------------------------------------------------------------------

TOKENIZE = [
    ({"prompt": "fix the failing test → 修复 🙂"}, True),
    ({"prompt": ["one", "两个"]}, True),
    ({"messages": user("hi"), "tools": TOOLS}, True),
    ({"messages": user("hi"), "add_generation_prompt": False}, True),
    ({"prompt": "x", "messages": user()}, False),
    ({}, False),
    ({"prompt": 5}, False),
]


@pytest.mark.parametrize(("body", "accepted"), TOKENIZE, ids=[str(i) for i in range(len(TOKENIZE))])
def test_tokenize_is_what_sglangs_models_accept_and_serialize(client, body, accepted):
    protocol = sglang_ref.sglang().protocol
    try:
        protocol.TokenizeRequest.model_validate(body)
        sglang_accepts = True
    except ValueError:
        sglang_accepts = False
    assert sglang_accepts == accepted
    for path in ("/tokenize", "/v1/tokenize"):
        r = client.post(path, json=body)
        assert (r.status_code == 200) == accepted, r.text
        if accepted:
            assert sglang_ref.as_sglang_serializes("TokenizeResponse", r.json()) == r.json()


def test_tokenize_and_detokenize_are_the_chat_routes_own_tokens(client):
    chat = client.post("/v1/chat/completions", json={"messages": user("修复它 🙏"), "tools": TOOLS,
                                                     "max_tokens": 300, "return_token_ids": True,
                                                     "separate_reasoning": False}).json()  # fmt: skip
    choice = chat["choices"][0]
    tokenized = client.post("/tokenize", json={"messages": user("修复它 🙏"), "tools": TOOLS}).json()
    assert tokenized["tokens"] == choice["prompt_token_ids"] and tokenized["count"] == chat["usage"]["prompt_tokens"]
    # Without tools (nothing parsed out), the chat route's raw text is the decoding of its ids (the stop
    # token, special, skipped).
    plain = client.post("/v1/chat/completions", json={"messages": user("修复它 🙏"), "max_tokens": 300,
                                                      "return_token_ids": True, "separate_reasoning": False})
    choice = plain.json()["choices"][0]
    ids = choice["response_token_ids"]
    decoded = client.post("/detokenize", json={"tokens": ids}).json()
    assert sglang_ref.as_sglang_serializes("DetokenizeResponse", decoded) == decoded
    assert decoded["text"] == choice["message"]["content"]
    batch = client.post("/v1/detokenize", json={"tokens": [ids[:3], ids[3:9]], "skip_special_tokens": False}).json()
    assert sglang_ref.as_sglang_serializes("DetokenizeResponse", batch) == batch and len(batch["text"]) == 2
    assert client.post("/detokenize", json={"tokens": []}).json() == {"text": ""}
    # Bytes that are not whole characters decode to U+FFFD, as the tokenizer's lossy UTF-8 decoding does.
    emoji = client.post("/tokenize", json={"prompt": "\U0001f9ea\U0001f9ec"}).json()["tokens"]
    partial = client.post("/detokenize", json={"tokens": emoji[:1]}).json()["text"]
    assert len(emoji) > 2 and partial.endswith("\ufffd")
    for bad in ({"tokens": ["a"]}, {"tokens": "x"}, {}):
        with pytest.raises(ValueError):
            sglang_ref.sglang().protocol.DetokenizeRequest.model_validate(bad)
        assert client.post("/detokenize", json=bad).status_code == 400
