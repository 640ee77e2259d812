"""The stand-in against real SGLang: the same requests to both, and every key, type and finish-reason shape of
the answers compared. Every other test of the suite trusts the stand-in to answer as SGLang does; this is where
that trust is checked, so a difference the stand-in grows (or a new SGLang release brings) fails here.

Values differ (a random tiny model against the stand-in's corpus), so shapes are compared: each answer becomes
its tree of keys with the JSON type of every leaf, lists by their first element. `KNOWN` lists the differences
the stand-in keeps on purpose, each with its reason; anything else fails.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import httpx
import pytest
from fixtures.real_sglang import FLEET_FLAGS, SERVED_MODEL

from tracegen.sglang.settings import Sampling
from tracegen.sglang.wire import (
    ChatRequest,
    build_body,
    build_generate_body,
    build_parse_function_call_body,
    build_separate_reasoning_body,
    build_tokenize_body,
)

pytestmark = pytest.mark.real_sglang

TOOLS = [{"type": "function", "function": {
    "name": "run_tests", "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]  # fmt: skip
MESSAGES = [{"role": "user", "content": "The build fails in parser.py; fix it."}]
# Greedy: the tiny model's greedy output never ends, so both servers stop at the cap and their answers line up
# place by place (sampled, real SGLang now and then ends at the first token: another shape of answer).
SAMPLING = Sampling(max_tokens=6, temperature=0.0, top_p=1.0, top_k=0)
# Paths (dotted, `[]` for a list's elements) where a difference is known and kept, and why.
KNOWN = {
    # SGLang's per-request timing and storage instrumentation; tracegen reads none of it.
    **{f"meta_info.{key}": "SGLang's timing instrumentation, not modelled" for key in (
        "forward_entry_time", "prefill_finished_time", "queue_time", "request_received_ts", "first_token_latency",
        "api_server_dispatch_finish_ts", "request_finished_ts", "decode_throughput", "response_sent_to_client_ts",
        "storage_prefetch_wait", "storage_staging_wait", "prefill_launch_delay", "prefill_launch_latency",
        "inference_time")},  # fmt: skip
    # Null without a cache hit, an object with one: which it is depends on what each server was sent before (the
    # real server is shared by every test of the session). Compared by value, on one sequence sent to both
    # servers alike, in test_the_prefix_cache_counts_cached_tokens_as_sglang_does.
    "meta_info.cached_tokens_details": "depends on each server's cache, compared by value on one sequence",
}


def known(path: str) -> bool:
    path = path.lstrip(".")
    return any(path == key or path.endswith("." + key) for key in KNOWN)


def shape(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: shape(v) for key, v in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return {bool: "bool", int: "int", float: "float", str: "str", type(None): "null"}[type(value)]


def differences(real: Any, stand_in: Any, path: str = "") -> list[str]:
    """Where the two shapes differ, as `path: real ... stand-in ...` lines (KNOWN paths left out)."""
    if known(path):
        return []
    if isinstance(real, dict) and isinstance(stand_in, dict):
        found = []
        for key in sorted(set(real) | set(stand_in)):
            where = f"{path}.{key}"
            if key not in stand_in:
                found += [] if known(where) else [f"{where}: only real SGLang has it ({real[key]})"]
            elif key not in real:
                found += [] if known(where) else [f"{where}: only the stand-in has it ({stand_in[key]})"]
            else:
                found += differences(real[key], stand_in[key], where)
        return found
    if isinstance(real, list) and isinstance(stand_in, list) and real and stand_in:
        return differences(real[0], stand_in[0], f"{path}[]")
    return [] if real == stand_in else [f"{path}: real SGLang {real}, the stand-in {stand_in}"]


@pytest.fixture(scope="module")
def servers(real_sglang, sim_server_module):
    return {"real SGLang": real_sglang.url, "stand-in": sim_server_module.url}


@pytest.fixture(scope="module")
def sim_server_module(tmp_path_factory):
    from fixtures.simulator import start_sim_server

    flags = {flag.lstrip("-").replace("-", "_"): value for flag, value in FLEET_FLAGS.items()}
    server = start_sim_server(tmp_path_factory.mktemp("sim"), served_model_name=SERVED_MODEL, context_length=4096,
                              **flags)  # fmt: skip
    yield server
    server.stop()


def post(url: str, path: str, body: bytes | dict) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url + path, content=content, headers={"Content-Type": "application/json"}, timeout=120)


def events(url: str, path: str, body: bytes | dict) -> list[Any]:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    found = []
    with httpx.stream("POST", url + path, content=content, headers={"Content-Type": "application/json"},
                      timeout=120) as response:  # fmt: skip
        for line in response.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                found.append(data if data == "[DONE]" else json.loads(data))
    return found


def both(servers, ask) -> dict[str, Any]:
    return {name: ask(url) for name, url in servers.items()}


def assert_same_shape(answers: dict[str, Any]) -> None:
    real, stand_in = (shape(answers[name]) for name in ("real SGLang", "stand-in"))
    diff = differences(real, stand_in)
    assert not diff, "the stand-in answers unlike SGLang:\n" + "\n".join(diff)


def chat_body(max_tokens: int = 6, **extra) -> bytes:
    request = ChatRequest(0, MESSAGES, model=SERVED_MODEL, sampling=replace(SAMPLING, max_tokens=max_tokens), tools=TOOLS,
                          extra=extra or None)  # fmt: skip
    return build_body(request, return_token_ids=True)


def generate_body(ids: list[int], max_new_tokens: int = 6, stream: bool = False) -> dict:
    body = json.loads(build_generate_body(ids, max_new_tokens=max_new_tokens, sampling=SAMPLING,
                                          require_reasoning=False, rid=None))  # fmt: skip
    return {**body, "stream": stream}


def test_a_whole_chat_completion(servers):
    answers = both(servers, lambda url: post(url, "/v1/chat/completions", chat_body()).json())
    assert_same_shape(answers)
    assert {a["choices"][0]["finish_reason"] for a in answers.values()} == {"length"}


def test_a_streamed_chat_completion_chunk_by_chunk(servers):
    body = json.loads(chat_body(max_tokens=3))
    body.update(stream=True, stream_options={"include_usage": True})
    del body["return_token_ids"]  # a 400 on a stream, in SGLang and the stand-in alike
    answers = both(servers, lambda url: events(url, "/v1/chat/completions", body))
    # First chunk, a delta, the finish chunk, the usage chunk, [DONE]: compared place by place.
    for name, chunks in answers.items():
        assert chunks[-1] == "[DONE]" and chunks[-2]["usage"] and chunks[-3]["choices"][0]["finish_reason"], name
    pick = {name: {"first": c[0], "delta": c[1], "finish": c[-3], "usage": c[-2]} for name, c in answers.items()}
    assert_same_shape(pick)


def test_generate_whole_and_streamed_incrementally(servers):
    ids = list(range(1000, 1020))
    whole = both(servers, lambda url: post(url, "/generate", generate_body(ids)).json())
    assert_same_shape(whole)
    assert {a["meta_info"]["finish_reason"]["type"] for a in whole.values()} == {"length"}
    streamed = both(servers, lambda url: events(url, "/generate", generate_body(ids, stream=True)))
    assert_same_shape({name: {"first": e[0], "last": e[-2]} for name, e in streamed.items()})
    for name, e in streamed.items():  # incremental: the events' ids add up to the whole output
        assert sum(len(x["output_ids"]) for x in e[:-1]) == 6 and e[-1] == "[DONE]", name


def test_the_prefix_cache_counts_cached_tokens_as_sglang_does(servers):
    """The same sequence to both: a prompt, the same prompt (all but its last token cached), a prompt sharing a
    prefix of it, and one extending the first with its answer (SGLang caches a finished request's output too,
    all but its last token, whose KV was never computed). Page size 1 on both (SGLang's default)."""
    prompt = list(range(20_000, 20_040))  # ids no other test sends (reserved tokens): nothing of them is cached yet

    def sequence(url: str) -> list[tuple[int, Any]]:
        first = post(url, "/generate", generate_body(prompt)).json()
        output = first["output_ids"]
        metas = [first["meta_info"]] + [post(url, "/generate", generate_body(ids)).json()["meta_info"] for ids in (
            prompt, prompt[:25] + [3000, 3001], prompt + output[:3] + [3002])]  # fmt: skip
        return [(m["cached_tokens"], m["cached_tokens_details"]) for m in metas]

    answers = both(servers, sequence)
    assert answers["stand-in"] == answers["real SGLang"] == [
        (0, None), (39, {"device": 39, "host": 0}), (25, {"device": 25, "host": 0}),
        (43, {"device": 43, "host": 0})]  # fmt: skip


def test_a_stop_control_is_honoured_by_sglang_and_refused_by_the_stand_in(servers):
    """The stand-in does not model stop strings or ids: it refuses them rather than ignore them (ignoring them
    would answer kinder than SGLang, which stops early). tracegen sends none."""
    ids = list(range(1000, 1020))
    greedy = generate_body(ids)
    greedy["sampling_params"].update(temperature=0.0, top_k=-1, top_p=1.0)
    first = post(servers["real SGLang"], "/generate", greedy).json()["output_ids"]
    for control, value in (("stop_token_ids", [first[0]]), ("stop", ["\n"])):
        body = json.loads(json.dumps(greedy))
        body["sampling_params"][control] = value
        real = post(servers["real SGLang"], "/generate", body)
        if control == "stop_token_ids":
            assert real.json()["meta_info"]["finish_reason"] == {"type": "stop", "matched": first[0]}
        stand_in = post(servers["stand-in"], "/generate", body)
        assert stand_in.status_code == 400 and control in stand_in.text


def test_a_prompt_over_the_context_is_refused_alike(servers):
    ids = list(range(1000, 1000 + 4200))
    answers = both(servers, lambda url: post(url, "/generate", generate_body(ids)))
    assert {r.status_code for r in answers.values()} == {400}
    assert_same_shape({name: r.json() for name, r in answers.items()})
    chat = both(servers, lambda url: post(url, "/v1/chat/completions", chat_body(max_tokens=4090)))
    assert {r.status_code for r in chat.values()} == {400}
    assert_same_shape({name: r.json() for name, r in chat.items()})


def test_tokenize_separate_reasoning_and_parse_function_call(servers):
    raw = ('<think>\nwhy\n</think>\n\nRunning.\n<tool_call>\n{"name": "run_tests", "arguments": {"path": "t.py"}}'
           "\n</tool_call>")  # fmt: skip
    asks = {
        "tokenize": lambda url: post(url, "/v1/tokenize", build_tokenize_body(MESSAGES, TOOLS, SERVED_MODEL)).json(),
        "separate": lambda url: post(url, "/separate_reasoning", build_separate_reasoning_body(raw, "qwen3")).json(),
        "calls": lambda url: post(url, "/parse_function_call",
                                  build_parse_function_call_body(raw.split("</think>")[1], TOOLS, "qwen")).json(),
    }  # fmt: skip
    answers = {name: ask for name, ask in asks.items()}
    for what, ask in answers.items():
        got = both(servers, ask)
        assert_same_shape(got)
        if what == "tokenize":  # the same tokenizer, the same chat template: the same ids
            assert got["real SGLang"]["tokens"] == got["stand-in"]["tokens"]
        else:
            assert got["real SGLang"] == got["stand-in"], what


def test_thinking_off_renders_the_same_prompt_on_both(servers):
    # chat_template_kwargs reach the template alike: Qwen3's template closes an empty think block after the
    # generation prompt, and that is the prompt a row with thinking off is generated from.
    got = {name: both(servers, lambda url, kw=kw: post(url, "/v1/tokenize", build_tokenize_body(
        MESSAGES, TOOLS, SERVED_MODEL, kw)).json()) for name, kw in (("on", None), ("off", {"enable_thinking": False}))}
    for answers in got.values():
        assert answers["real SGLang"]["tokens"] == answers["stand-in"]["tokens"]
    thinking, plain = got["on"]["real SGLang"]["tokens"], got["off"]["real SGLang"]["tokens"]
    assert plain[: len(thinking)] == thinking and len(plain) > len(thinking)


def test_server_info_reports_what_tracegen_reads_as_sglang_does(servers):
    info = both(servers, lambda url: httpx.get(url + "/server_info", timeout=30).json())
    read = ("reasoning_parser", "tool_call_parser", "incremental_streaming_output", "max_running_requests",
            "context_length", "version", "model_path", "served_model_name")  # fmt: skip
    for key in read:
        assert key in info["real SGLang"] and key in info["stand-in"], key
    assert {k: info["stand-in"][k] for k in read[:4]} == {k: info["real SGLang"][k] for k in read[:4]}
    # Everything else the stand-in reports, SGLang reports under the same name (the stand-in adds its own knobs
    # only under sim_*).
    invented = sorted(k for k in info["stand-in"] if k not in info["real SGLang"] and not k.startswith("sim_"))
    assert not invented, invented


def test_metrics_hold_the_gauges_autotune_reads(servers):
    from tracegen.sglang.autotune import parse_metrics

    for name, url in servers.items():
        gauges = parse_metrics(httpx.get(url + "/metrics", timeout=30).text)
        assert {"sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:gen_throughput"} <= set(gauges), name
