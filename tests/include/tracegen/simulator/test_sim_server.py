"""The stand-in as a real subprocess over HTTP: endpoints, shapes, status codes, auth, streaming, capacity."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest
from fixtures.simulator import start_sim_server

from tracegen.simulator.lengths import LengthModel, draw
from tracegen.simulator.tokens import THINK_END_ID, THINK_ID, chat_prompt_tokens, decode

SHORT = LengthModel.parse("short")
KEY = "sk-test"
# Servers started with --enable-deterministic-inference draw sample 42 (SGLang's default seed) for a
# request without a seed, so `draw(..., sample=DETERMINISTIC)` predicts their output exactly.
DETERMINISTIC = 42


def msgs(i: int) -> list[dict]:
    return [{"role": "user", "content": f"question {i}"}]


def predict(messages, model: LengthModel = SHORT):
    return draw(messages, 0, model, sample=DETERMINISTIC)


def find_prompt(pred, model: LengthModel = SHORT) -> list[dict]:
    for i in range(10_000):
        if pred(predict(msgs(i), model)):
            return msgs(i)
    raise AssertionError("no prompt matches")


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One server for the read-only shape tests: reasoning parser, metrics, api key, short lengths,
    deterministic sampling so tests can predict each response."""
    server = start_sim_server(
        tmp_path_factory.mktemp("simshared"),
        enable_deterministic_inference=True,
        reasoning_parser="qwen3",
        enable_metrics=True,
        api_key=KEY,
        sim_length_model="short",
        model_path="Qwen/Qwen3-30B-A3B",
        served_model_name="qwen3",
        context_length=4096,
    )
    yield server
    server.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def client(shared):
    with httpx.Client(base_url=shared.url, headers=shared.headers, timeout=30) as c:
        yield c


def chat(client, messages, **extra):
    return client.post("/v1/chat/completions", json={"model": "whatever", "messages": messages, **extra})


# -- health and info ----------------------------------------------------------------------------------
def test_health_ready_endpoints_200_when_warm(client):
    for path in ("/health", "/health_generate", "/ready"):
        r = client.get(path)
        assert r.status_code == 200 and r.content == b""


def test_health_is_503_until_warm_then_ready_line_logged(sim_server):
    sim = sim_server(wait=False, sim_warmup_s=1.5)
    statuses = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            statuses.append(httpx.get(sim.url + "/health", timeout=2).status_code)
        except httpx.TransportError:
            time.sleep(0.05)
            continue
        if statuses[-1] == 200:
            break
        time.sleep(0.05)
    assert statuses[0] == 503 and statuses[-1] == 200
    assert httpx.get(sim.url + "/health_generate").status_code == 200
    assert "The server is fired up and ready to roll!" in sim.log()


def test_ready_line_not_logged_at_warning_level(sim_server):
    sim = sim_server(log_level="warning")
    assert httpx.get(sim.url + "/health").status_code == 200
    assert "fired up" not in sim.log()


def test_model_info_and_deprecated_alias(client):
    info = client.get("/model_info").json()
    assert info == client.get("/get_model_info").json()
    assert info["model_path"] == "Qwen/Qwen3-30B-A3B" and info["served_model_name"] == "qwen3"
    assert info["is_generation"] is True and info["reasoning_parser"] == "qwen3"
    assert info["weight_version"] == "default" and info["model_type"] == "qwen3_moe"
    assert info["architectures"] == ["Qwen3MoeForCausalLM"] and info["preferred_sampling_params"] is None


def test_server_info_is_flat_resolved_args(client, shared):
    info = client.get("/server_info").json()
    legacy = client.get("/get_server_info").json()
    assert set(info) == set(legacy)
    assert info["model_path"] == "Qwen/Qwen3-30B-A3B" and info["port"] == shared.port
    # SGLang's scheduler: one token short of the context, less 5 reserved tokens.
    assert info["context_length"] == 4096 and info["max_req_input_len"] == 4090
    assert info["reasoning_parser"] == "qwen3" and info["api_key"] == KEY
    assert (
        "tracegen.simulator" in info["launch_command"]
        and "--reasoning-parser qwen3" in info["launch_command"]
    )
    assert isinstance(info["max_total_num_tokens"], int) and info["version"] == "0.5.23"
    state = info["internal_states"][0]
    assert {"last_gen_throughput", "avg_spec_accept_length"} <= set(state)
    occ = info["sim_occupancy"]
    assert {"busy_slot_sim_s", "available_slot_sim_s", "occupancy", "tokens_generated"} <= set(occ)


def test_v1_models(client):
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    (model,) = body["data"]
    assert model["id"] == "qwen3" and model["root"] == "qwen3" and model["owned_by"] == "sglang"
    assert model["object"] == "model" and model["parent"] is None and model["max_model_len"] == 4096


def test_unknown_route_is_json_404(client):
    r = client.get("/nope")
    assert r.status_code == 404 and r.json() == {"detail": "Not Found"}


# -- auth ---------------------------------------------------------------------------------------------
def test_auth_rule(shared):
    url = shared.url
    for path in ("/v1/models", "/server_info", "/model_info"):
        assert httpx.get(url + path).status_code == 401
        r = httpx.get(url + path, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}
        assert httpx.get(url + path, headers={"Authorization": f"bEaReR {KEY}"}).status_code == 200
    r = httpx.post(url + "/generate", json={"text": "x"})
    assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}
    assert httpx.post(url + "/sim/faults", json={}).status_code == 401
    for path in ("/health", "/health_generate", "/ready", "/metrics"):
        assert httpx.get(url + path).status_code == 200, path


# -- chat completions ---------------------------------------------------------------------------------
def test_chat_stop_shape_and_usage(client):
    m = find_prompt(lambda d: 30 < d.total < 200)
    d = predict(m)
    body = chat(client, m, max_tokens=1000, return_token_ids=True).json()
    assert body["object"] == "chat.completion" and body["model"] == "whatever"
    choice = body["choices"][0]
    assert (
        choice["finish_reason"] == "stop" and choice["matched_stop"] == 151645 and choice["logprobs"] is None
    )
    msg = choice["message"]
    assert msg["role"] == "assistant" and "tool_calls" not in msg
    assert msg["content"] and msg["reasoning_content"]
    # SGLang's qwen3 split of "<think>\n…\n</think>\n\n…"; the last answer token is the stop token.
    assert msg["reasoning_content"].startswith("\n") and msg["reasoning_content"].endswith("\n")
    assert msg["content"].startswith("\n\n")
    # The text is the decoding of the ids: the thinking through </think> is d.reasoning tokens, then the
    # answer, the stop token last (counted, not decoded).
    ids = choice.pop("response_token_ids")
    prompt_ids = choice.pop("prompt_token_ids")
    assert len(ids) == d.total and ids[0] == THINK_ID and ids[d.reasoning - 1] == THINK_END_ID and ids[-1] == 151645
    assert decode(ids) == "<think>" + msg["reasoning_content"] + "</think>" + msg["content"]
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)
    u = body["usage"]
    assert u["completion_tokens"] == d.total and u["reasoning_tokens"] == d.reasoning
    assert u["completion_tokens_details"] == {"reasoning_tokens": d.reasoning}
    assert (
        u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
        and u["prompt_tokens_details"] is None
    )
    assert body["metadata"] == {"weight_version": "default",
                                "weight_versions": [{"version": "default", "start": 0, "end": d.total}]}
    again = chat(client, m, max_tokens=1000).json()["choices"]
    assert again == body["choices"]  # deterministic


def test_a_seeded_sample_is_independent_of_the_cap(client):
    m = find_prompt(lambda d: d.total > 120 and d.reasoning < 100)
    d = predict(m)
    cut = chat(client, m, max_tokens=100).json()
    full = chat(client, m, max_tokens=2000).json()
    assert cut["choices"][0]["finish_reason"] == "length" and cut["usage"]["completion_tokens"] == 100
    assert full["choices"][0]["finish_reason"] == "stop" and full["usage"]["completion_tokens"] == d.total
    # Cut in the answer: thinking complete, answer a prefix of the full answer.
    assert (
        cut["choices"][0]["message"]["reasoning_content"]
        == full["choices"][0]["message"]["reasoning_content"]
    )
    assert full["choices"][0]["message"]["content"].startswith(cut["choices"][0]["message"]["content"])


def test_cap_inside_thinking_puts_everything_in_reasoning_content(client):
    m = find_prompt(lambda d: d.reasoning > 30)
    body = chat(client, m, max_completion_tokens=10, return_token_ids=True).json()
    msg = body["choices"][0]["message"]
    ids = body["choices"][0]["response_token_ids"]
    assert body["choices"][0]["finish_reason"] == "length" and len(ids) == 10 and THINK_END_ID not in ids
    assert msg["content"] == "" and "<think>" + msg["reasoning_content"] == decode(ids)
    assert body["usage"]["reasoning_tokens"] == 10


def test_thinking_off_has_no_reasoning(client):
    m = find_prompt(lambda d: d.answer > 2)
    body = chat(client, m, max_tokens=1000, chat_template_kwargs={"enable_thinking": False}).json()
    msg = body["choices"][0]["message"]
    assert msg["reasoning_content"] is None and msg["content"]
    assert body["usage"]["reasoning_tokens"] == 0 and body["usage"]["completion_tokens_details"] is None


def test_without_reasoning_parser_thinking_stays_inline(sim_server):
    sim = sim_server(sim_length_model="short", enable_deterministic_inference=True)
    m = find_prompt(lambda d: 5 < d.total < 200)
    body = httpx.post(sim.url + "/v1/chat/completions", json={"messages": m, "max_tokens": 1000}).json()
    msg = body["choices"][0]["message"]
    assert (
        msg["reasoning_content"] is None
        and msg["content"].startswith("<think>\n")
        and "\n</think>\n\n" in msg["content"]
    )
    assert body["usage"]["completion_tokens_details"] is None


def test_tools_can_finish_with_tool_calls(sim_server):
    sim = sim_server(tool_call_parser="qwen25", sim_length_model="short")
    tools = [{"type": "function", "function": {"name": "run_tests", "parameters": {"type": "object"}}}]
    reasons = set()
    with httpx.Client(base_url=sim.url, timeout=30) as c:
        for i in range(40):
            body = chat(c, msgs(i), max_tokens=4000, tools=tools).json()
            reasons.add(body["choices"][0]["finish_reason"])
            if body["choices"][0]["finish_reason"] == "tool_calls":
                (call,) = body["choices"][0]["message"]["tool_calls"]
                assert call["function"]["name"] == "run_tests" and json.loads(call["function"]["arguments"])
            else:
                assert "tool_calls" not in body["choices"][0]["message"]
        # tool_choice "none": SGLang does not run the parser, the call stays in the text.
        body = chat(c, msgs(0), max_tokens=4000, tools=tools, tool_choice="none").json()
        assert body["choices"][0]["finish_reason"] != "tool_calls"
    assert "tool_calls" in reasons and "stop" in reasons


def test_without_a_tool_call_parser_calls_stay_in_the_text(client):
    """SGLang parses tool calls only when started with --tool-call-parser: otherwise the model's call is
    part of `content` and the request finishes with `stop`."""
    tools = [{"type": "function", "function": {"name": "run_tests", "parameters": {"type": "object"}}}]
    contents = []
    for i in range(40):
        choice = chat(client, msgs(i), max_tokens=3000, tools=tools).json()["choices"][0]
        assert choice["finish_reason"] in ("stop", "length") and "tool_calls" not in choice["message"]
        contents.append(choice["message"]["content"])
    assert any('<tool_call>\n{"name": "run_tests"' in c for c in contents)


def test_streaming_matches_non_streaming(client):
    m = find_prompt(lambda d: 40 < d.total < 150)
    full = chat(client, m, max_tokens=1000).json()
    with client.stream(
        "POST",
        "/v1/chat/completions",
        json={"messages": m, "max_tokens": 1000, "stream": True, "stream_options": {"include_usage": True}},
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    reasoning = "".join(
        c["choices"][0]["delta"].get("reasoning_content") or "" for c in chunks if c["choices"]
    )
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert reasoning == full["choices"][0]["message"]["reasoning_content"]
    assert content == full["choices"][0]["message"]["content"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert (
        chunks[-1]["choices"] == []
        and chunks[-1]["usage"]["completion_tokens"] == full["usage"]["completion_tokens"]
    )


def test_streaming_without_include_usage_has_no_usage(client):
    with client.stream(
        "POST", "/v1/chat/completions", json={"messages": msgs(1), "max_tokens": 5, "stream": True}
    ) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    # No chunk has usage: null on the deltas SGLang writes with pydantic, no key on those of build_sse_content.
    assert all(json.loads(x[6:]).get("usage") is None for x in lines[:-1])


# -- errors -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("payload", "fragment"),
    [
        (b"{not json", "Invalid JSON body"),
        (b"[1, 2]", "must be a JSON object"),
        (b"{}", "messages must be a list"),
        (json.dumps({"messages": "hi"}).encode(), "messages must be a list"),
        (json.dumps({"messages": [{"content": "x"}]}).encode(), "messages[0].role must be a string"),
        (json.dumps({"messages": [{"role": "user", "content": 5}]}).encode(), "messages[0].content"),
        (
            json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": "9"}).encode(),
            "max_tokens must be an integer",
        ),
        (
            json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}).encode(),
            "max_tokens must be >= 1",
        ),
        (
            json.dumps({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}).encode(),
            "stream must be true or false",
        ),
        (
            json.dumps({"messages": [{"role": "user", "content": "x"}], "temperature": -1}).encode(),
            "temperature",
        ),
    ],
)
def test_chat_bad_requests_are_flat_400(client, payload, fragment):
    r = client.post("/v1/chat/completions", content=payload, headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    body = r.json()
    # A body SGLang's request model refuses is FastAPI's validation error, answered as "Bad Request".
    assert (
        body["object"] == "error"
        and body["type"] == "Bad Request"
        and body["code"] == 400
        and body["param"] is None
    )
    assert fragment in body["message"]


def test_context_overflow_exact_message(client):
    m = [{"role": "user", "content": "fix the test " * 30}]
    n = chat_prompt_tokens(m)
    r = chat(client, m, max_tokens=4000)
    assert r.status_code == 400
    assert r.json()["message"] == (
        "Requested token count exceeds the model's maximum context length of 4096 tokens. You requested a total "
        f"of {4000 + n} tokens: {n} tokens from the input messages and 4000 tokens for the completion. Please "
        "reduce the number of tokens in the input messages or the completion to fit within the limit."
    )
    big = [{"role": "user", "content": "fix the test " * 2000}]
    r = chat(client, big, max_tokens=1)
    assert r.status_code == 400
    assert (
        r.json()["message"]
        == f"The input ({chat_prompt_tokens(big)} tokens) is longer than the model's context length (4096 tokens)."
    )


def test_generate_errors_are_nested(client):
    for payload, fragment in (
        (b"nope", "Invalid JSON body"),
        (b'{"text": 1}', "text must be a string"),
        (b'{"text": "x", "sampling_params": {"max_new_tokens": -1}}', "max_new_tokens must be >= 0"),
        (b'{"input_ids": ["a"]}', "input_ids"),
        (b"{}", "Either text or input_ids"),
    ):
        r = client.post("/generate", content=payload)
        assert r.status_code == 400 and fragment in r.json()["error"]["message"], payload
    r = client.post("/generate", json={"text": "x" * 400, "sampling_params": {"max_new_tokens": 4000}})
    assert r.status_code == 400 and "maximum context length of 4096" in r.json()["error"]["message"]


# -- native /generate ---------------------------------------------------------------------------------
def test_generate_native_shape_and_default_max_new_tokens(sim_server):
    # Seed calibration: almost every prompt is > 128 tokens.
    sim = sim_server(reasoning_parser="qwen3", enable_deterministic_inference=True)
    prompt = next(f"prompt {i}" for i in range(100) if draw(f"prompt {i}", sample=DETERMINISTIC).total > 128)
    body = httpx.post(sim.url + "/generate", json={"text": prompt}).json()
    meta = body["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 128}
    assert meta["completion_tokens"] == 128 and len(body["output_ids"]) == 128
    prompt_ids = httpx.post(sim.url + "/tokenize", json={"prompt": prompt}).json()["tokens"]
    assert meta["prompt_tokens"] == len(prompt_ids) and meta["cached_tokens"] == 0 and meta["num_retractions"] == 0
    assert meta["weight_version"] == "default" and meta["e2e_latency"] >= 0 and meta["id"]
    assert body["text"].startswith("<think>\n")
    short = next(f"p{i}" for i in range(1000) if draw(f"p{i}", sample=DETERMINISTIC).total < 2000)
    body = httpx.post(
        sim.url + "/generate", json={"text": short, "sampling_params": {"max_new_tokens": 4000}}
    ).json()
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": 151645}
    assert body["meta_info"]["completion_tokens"] == draw(short, sample=DETERMINISTIC).total
    assert body["output_ids"][-1] == 151645  # the stop token is counted and returned, as SGLang does
    ids = httpx.post(
        sim.url + "/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}}
    ).json()
    assert ids["meta_info"]["prompt_tokens"] == 3 and ids["meta_info"]["completion_tokens"] == 4


def test_generate_streaming_is_cumulative(client):
    with client.stream(
        "POST",
        "/generate",
        json={
            "text": "stream me",
            "stream": True,
            "sampling_params": {"max_new_tokens": 50, "ignore_eos": True},
        },
    ) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(x[6:]) for x in lines[:-1]]
    texts = [e["text"] for e in events]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 50}
    assert events[-1]["meta_info"]["completion_tokens"] == 50


def test_speculative_meta_info(sim_server):
    sim = sim_server(speculative_algorithm="EAGLE", sim_accept_length=2.0)
    meta = httpx.post(
        sim.url + "/generate",
        json={"text": "x", "sampling_params": {"max_new_tokens": 10, "ignore_eos": True}},
    ).json()["meta_info"]
    assert meta["spec_accept_length"] == 2.0 and meta["spec_verify_ct"] == 5
    assert httpx.get(sim.url + "/server_info").json()["internal_states"][0]["avg_spec_accept_length"] == 2.0


# -- abort, queueing, capacity, metrics ---------------------------------------------------------------
async def _post(client: httpx.AsyncClient, path: str, body: dict) -> httpx.Response:
    return await client.post(path, json=body)


def test_abort_request_finishes_with_abort_http_200(sim_server):
    sim = sim_server(
        sim_time_scale=10, sim_length_model="fixed:100000", max_running_requests=1, context_length=200000
    )

    async def scenario():
        async with httpx.AsyncClient(base_url=sim.url, timeout=30) as c:
            running = asyncio.create_task(
                _post(
                    c,
                    "/generate",
                    {"text": "a", "rid": "r-run", "sampling_params": {"max_new_tokens": 100000}},
                )
            )
            # The second request must queue behind the first: on a loaded machine it could otherwise reach
            # the server first and be the one running (with tokens generated when it is aborted).
            for _ in range(200):
                info = (await c.get("/server_info")).json()["internal_states"][0]
                if info["num_running_reqs"] == 1:
                    break
                await asyncio.sleep(0.05)
            queued = asyncio.create_task(
                _post(c, "/v1/chat/completions", {"messages": msgs(1), "rid": "r-wait", "max_tokens": 100000})
            )
            await asyncio.sleep(0.5)
            assert (await c.post("/abort_request", json={"rid": "r-wait"})).status_code == 200
            assert (await c.post("/abort_request", json={"rid": "r-run"})).status_code == 200
            assert (await c.post("/abort_request", json={"rid": "unknown"})).status_code == 200
            assert (await c.post("/abort_request", json={"rid": 5})).status_code == 400
            return await running, await queued

    run, wait = asyncio.run(scenario())
    assert run.status_code == 200
    meta = run.json()["meta_info"]
    # A running request's abort is SGLang's FINISH_ABORT in the whole meta_info, with what it generated.
    assert meta["finish_reason"] == {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    assert meta["prompt_tokens"] == 1 and meta["completion_tokens"] == len(run.json()["output_ids"]) > 0
    assert wait.status_code == 200 and wait.json()["choices"][0]["finish_reason"] == "abort"
    assert wait.json()["usage"]["completion_tokens"] == 0


def test_queue_full_503(sim_server):
    sim = sim_server(
        sim_time_scale=10,
        sim_length_model="fixed:100000",
        context_length=200000,
        max_running_requests=1,
        max_queued_requests=1,
    )

    async def scenario():
        async with httpx.AsyncClient(base_url=sim.url, timeout=30) as c:
            bg = [
                asyncio.create_task(
                    _post(
                        c,
                        "/generate",
                        {"text": f"{i}", "rid": f"q{i}", "sampling_params": {"max_new_tokens": 100000}},
                    )
                )
                for i in range(2)
            ]
            await asyncio.sleep(0.5)
            chat_full = await _post(c, "/v1/chat/completions", {"messages": msgs(0), "max_tokens": 10})
            gen_full = await _post(c, "/generate", {"text": "z"})
            await c.post("/abort_request", json={"abort_all": True})
            await asyncio.gather(*bg)
            return chat_full, gen_full

    chat_full, gen_full = asyncio.run(scenario())
    assert chat_full.status_code == 503 and chat_full.json()["message"] == "The request queue is full."
    assert gen_full.status_code == 503 and gen_full.json() == {
        "error": {"message": "The request queue is full."}
    }


def test_capacity_running_capped_then_queued_and_metrics(sim_server):
    sim = sim_server(
        sim_time_scale=10,
        sim_length_model="fixed:100000",
        context_length=200000,
        max_running_requests=2,
        enable_metrics=True,
    )

    async def scenario():
        async with httpx.AsyncClient(base_url=sim.url, timeout=30) as c:
            bg = [
                asyncio.create_task(
                    _post(c, "/generate", {"text": f"{i}", "sampling_params": {"max_new_tokens": 100000}})
                )
                for i in range(5)
            ]
            await asyncio.sleep(0.6)
            info = (await c.get("/server_info")).json()
            metrics = (await c.get("/metrics")).text
            await c.post("/abort_request", json={"abort_all": True})
            await asyncio.gather(*bg)
            return info, metrics

    info, metrics = asyncio.run(scenario())
    assert info["sim_occupancy"]["num_running_reqs"] == 2 and info["sim_occupancy"]["num_queue_reqs"] == 3
    assert info["internal_states"][0]["num_queue_reqs"] == 3
    labels = 'model_name="sim/Qwen3-test",engine_type="unified",tp_rank="0",pp_rank="0",moe_ep_rank="0"'
    assert f"sglang:num_running_reqs{{{labels}}} 2" in metrics
    assert f"sglang:num_queue_reqs{{{labels}}} 3" in metrics
    occ = info["sim_occupancy"]
    assert occ["tokens_generated"] > 0 and 0 < occ["occupancy"] <= 1


def test_metrics_names(client):
    chat(client, msgs(3), max_tokens=50)
    text = httpx.get(client.base_url.join("/metrics")).text
    for name in (
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:gen_throughput",
        "sglang:token_usage",
        "sglang:spec_accept_length",
        "sglang:prompt_tokens_total",
        "sglang:generation_tokens_total",
        "sglang:num_requests_total",
        "sglang:num_aborted_requests_total",
        "sglang:time_to_first_token_seconds_bucket",
        "sglang:e2e_request_latency_seconds_count",
        "sglang:queue_time_seconds_sum",
        "tracegen_sim:busy_slot_seconds_total",
        "tracegen_sim:busy_seconds_total",
        "tracegen_sim:available_slot_seconds_total",
        "tracegen_sim:generated_tokens_total",
    ):
        assert f'{name}{{model_name="qwen3"' in text, name


def test_metrics_absent_without_flag(sim_server):
    sim = sim_server()
    assert httpx.get(sim.url + "/metrics").status_code == 404


def test_occupancy_near_full_under_saturation(sim_server):
    # 8 slots, 32 clients keeping them full: busy slot-time / available slot-time close to 1. Time scale 200:
    # a request lasts about 0.2 s of wall time, long beside a client's turnaround even on a loaded machine
    # (at 2000, 20 ms, and parallel test workers left slots idle between requests: 0.39 of the slot-time).
    sim = sim_server(sim_time_scale=200, max_running_requests=8, sim_length_model="fixed:2000")

    async def scenario():
        async with httpx.AsyncClient(base_url=sim.url, timeout=60) as c:
            await asyncio.sleep(0)

            async def worker(w):
                for k in range(6):
                    r = await _post(
                        c, "/generate", {"text": f"{w}-{k}", "sampling_params": {"max_new_tokens": 4000}}
                    )
                    assert r.status_code == 200

            await asyncio.gather(*(worker(w) for w in range(32)))
            return (await c.get("/server_info")).json()["sim_occupancy"]

    occ = asyncio.run(scenario())
    assert occ["tokens_generated"] == 32 * 6 * 2000
    assert occ["busy_slot_sim_s"] > 0.5 * occ["available_slot_sim_s"]


# -- shutdown -----------------------------------------------------------------------------------------
def test_sigterm_drains_in_flight_then_exits(sim_server):
    sim = sim_server(
        sim_time_scale=1, sim_length_model="fixed:60", sim_step_base_ms=20, sim_step_per_req_ms=0
    )

    async def scenario():
        async with httpx.AsyncClient(base_url=sim.url, timeout=30) as c:
            req = asyncio.create_task(
                _post(c, "/generate", {"text": "drain me", "sampling_params": {"max_new_tokens": 100}})
            )
            await asyncio.sleep(0.3)
            sim.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.2)
            health = (await c.get("/health")).status_code
            health_gen = (await c.get("/health_generate")).status_code
            refused = await _post(c, "/generate", {"text": "late"})
            return await req, health, health_gen, refused

    done, health, health_gen, refused = asyncio.run(scenario())
    assert health == 503 and health_gen == 503
    assert refused.status_code == 503
    assert done.status_code == 200
    assert done.json()["meta_info"]["finish_reason"] == {"type": "stop", "matched": 151645}
    assert done.json()["meta_info"]["completion_tokens"] == 60
    assert sim.proc.wait(15) == 0
    assert "draining 1 in-flight" in sim.log()


def test_context_limit_boundary_matches_sglang(client):
    # SGLang 0.5.23 accepts input + max_new_tokens == context length and rejects only more.
    m = [{"role": "user", "content": "fix the test " * 30}]
    n = chat_prompt_tokens(m, thinking=False)
    off = {"enable_thinking": False}
    assert chat(client, m, max_tokens=4096 - n + 1, chat_template_kwargs=off).status_code == 400
    assert chat(client, m, max_tokens=4096 - n, chat_template_kwargs=off).status_code == 200
