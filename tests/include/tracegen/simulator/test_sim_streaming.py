"""The stand-in streams, aborts and loops as SGLang 0.5.23 serves a model: /generate's events at
--stream-interval, incremental or cumulative, ending in the finish's meta_info and `[DONE]`; an abort by
`/abort_request` or by a closed connection frees the slot for the queue; runaway samples loop with periods
from one token to a thousand ("varied" loops)."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time

import httpx
import numpy as np
import pytest

from tracegen.simulator.lengths import LOOP_PERIOD_MAX, build_model, continued_sample, fresh_sample
from tracegen.simulator.protocol import output_ids, plan_request
from tracegen.simulator.streaming import Detokenizer, event_ends
from tracegen.simulator.tokens import EOS_TOKEN_ID, chat_prompt_ids, decode, detokenize, stream

FIXED_SEED = {"sampling_seed": 7}


def events(lines) -> tuple[list[dict], str]:
    """The JSON events of an SSE body and its last line."""
    data = [line for line in lines if line]
    assert all(line.startswith("data: ") for line in data), data[:3]
    return [json.loads(line[6:]) for line in data[:-1]], data[-1]


# -- events and their text ------------------------------------------------------------------------------
def test_events_are_due_at_the_first_token_then_every_interval():
    assert list(event_ends(0, 10, 1)) == list(range(1, 11))
    assert list(event_ends(0, 10, 4)) == [1, 5, 9]
    assert list(event_ends(5, 12, 4)) == [9]  # picked up where the last event was
    assert list(event_ends(9, 9, 4)) == []
    # With speculative decoding a step adds its accept length: events fall on step ends.
    assert list(event_ends(0, 12, 1, per_step=3.0)) == [3, 6, 9, 12]
    assert list(event_ends(0, 12, 4, per_step=3.0)) == [3, 9]
    assert list(event_ends(0, 10, 1, per_step=2.5)) == [2, 5, 7, 10]


@pytest.mark.parametrize("register", ["en", "intl"])
def test_incremental_text_adds_up_to_the_finished_text(register):
    # Windows of the stand-in's streams, cut anywhere (inside a character too, in the CJK and emoji register).
    s = stream(register)
    rng = random.Random(3)
    for _ in range(30):
        start = rng.randrange(s.size)
        ids = s.window(start, rng.randint(20, 400)).tolist()
        context = s.window(start - 5, 5).tolist()
        detok, text, at = Detokenizer(context), "", 0
        while at < len(ids):
            step = rng.randint(1, 7)
            piece = detok.step(ids[at : at + step], False)
            assert "\ufffd" not in piece  # a character is never sent in halves
            text, at = text + piece, at + step
        text += detok.step([EOS_TOKEN_ID], True)
        assert text == detokenize(context, ids + [EOS_TOKEN_ID], True)


# -- /generate over HTTP ------------------------------------------------------------------------------
def _stream(url: str, body: dict) -> tuple[list[dict], str]:
    with httpx.stream("POST", url + "/generate", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return events(r.iter_lines())


def test_streamed_generate_incremental_and_cumulative_end_as_unstreamed(sim_server):
    flags = dict(sim_length_model="fixed:300", enable_deterministic_inference=True, reasoning_parser="qwen3")
    cumulative = sim_server(**flags)
    incremental = sim_server(**flags, incremental_streaming_output=True, stream_interval=7)
    body = {"text": "stream this, please", "sampling_params": {"max_new_tokens": 250, **FIXED_SEED}}
    whole = httpx.post(cumulative.url + "/generate", json=body, timeout=60).json()
    n = whole["meta_info"]["completion_tokens"]
    assert n == 250 and whole["meta_info"]["finish_reason"] == {"type": "length", "length": 250}

    evs, last = _stream(cumulative.url, body)
    assert last == "data: [DONE]" and len(evs) == n  # --stream-interval 1: an event per token
    # Without --incremental-streaming-output each event repeats all the ids and the whole text so far.
    assert [len(e["output_ids"]) for e in evs] == list(range(1, n + 1))
    assert all(b["text"].startswith(a["text"]) for a, b in zip(evs, evs[1:], strict=False))
    assert evs[-1]["output_ids"] == whole["output_ids"] and evs[-1]["text"] == whole["text"]
    assert all(e["meta_info"]["finish_reason"] is None for e in evs[:-1])
    # The request's own, and the cache: the second sending finds all but the prompt's last token cached.
    own = ("id", "e2e_latency", "cached_tokens", "cached_tokens_details")
    assert {k: v for k, v in evs[-1]["meta_info"].items() if k not in own} == {
        k: v for k, v in whole["meta_info"].items() if k not in own}  # fmt: skip
    prompt = whole["meta_info"]["prompt_tokens"]
    assert whole["meta_info"]["cached_tokens"] == 0 and whole["meta_info"]["cached_tokens_details"] is None
    assert evs[-1]["meta_info"]["cached_tokens"] == prompt - 1
    assert evs[-1]["meta_info"]["cached_tokens_details"] == {"device": prompt - 1, "host": 0}

    evs, last = _stream(incremental.url, body)
    # At interval 7: the first token at once, then every 7, then the finish.
    assert last == "data: [DONE]" and len(evs) == math.ceil((n - 1) / 7) + 1
    assert [len(e["output_ids"]) for e in evs[:-1]] == [1] + [7] * (len(evs) - 2)
    assert [i for e in evs for i in e["output_ids"]] == whole["output_ids"]
    assert "".join(e["text"] for e in evs) == whole["text"]
    assert [e["meta_info"]["completion_tokens"] for e in evs[:-1]] == list(range(1, n, 7))
    final = evs[-1]["meta_info"]
    assert final["finish_reason"] == {"type": "length", "length": 250} and final["completion_tokens"] == n
    assert final["prompt_tokens"] == whole["meta_info"]["prompt_tokens"] and final["cached_tokens"] == 0
    assert final["reasoning_tokens"] == whole["meta_info"]["reasoning_tokens"] > 0
    # The request's own interval wins over the server's.
    evs, _ = _stream(incremental.url, {**body, "sampling_params": {**body["sampling_params"], "stream_interval": 50}})
    assert len(evs) == math.ceil((n - 1) / 50) + 1


def test_with_speculative_decoding_an_event_is_a_step_of_accepted_tokens(sim_server):
    sim = sim_server(sim_length_model="fixed:300", speculative_algorithm="EAGLE", sim_accept_length=2.0,
                     incremental_streaming_output=True)  # fmt: skip
    evs, _ = _stream(sim.url, {"text": "draft", "sampling_params": {"max_new_tokens": 200}})
    assert [len(e["output_ids"]) for e in evs] == [2] * 100
    assert evs[-1]["meta_info"]["spec_verify_ct"] == 100


def test_a_stream_refused_by_the_context_check_is_an_error_event(sim_server):
    sim = sim_server(context_length=64)
    evs, last = _stream(sim.url, {"text": "x", "sampling_params": {"max_new_tokens": 100}})
    assert last == "data: [DONE]" and len(evs) == 1
    error = evs[0]["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == 400 and error["retryable"] is False
    assert "maximum context length of 64 tokens" in error["message"]


def _running(sim) -> tuple[int, int]:
    info = sim.server_info()["internal_states"][0]
    return info["num_running_reqs"], info["num_queue_reqs"]


def _counts(url: str) -> tuple[float, float]:
    """(sglang:num_requests_total, sglang:num_aborted_requests_total)."""
    found = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        name = line.split("{", 1)[0]
        if name in ("sglang:num_requests_total", "sglang:num_aborted_requests_total"):
            found[name] = float(line.rsplit(" ", 1)[1])
    return found["sglang:num_requests_total"], found["sglang:num_aborted_requests_total"]


LONG = dict(sim_time_scale=10, sim_length_model="fixed:100000", context_length=200000, max_running_requests=1,
            enable_metrics=True, incremental_streaming_output=True, stream_interval=5)  # fmt: skip


def test_abort_request_ends_a_stream_with_abort_and_its_slot_goes_to_the_queue(sim_server):
    sim = sim_server(**LONG)

    async def scenario():
        async with httpx.AsyncClient(base_url=sim.url, timeout=30) as c:
            body = {"text": "loop", "rid": "looping", "stream": True, "sampling_params": {"max_new_tokens": 100000}}
            async with c.stream("POST", "/generate", json=body) as r:
                lines = r.aiter_lines()
                first = json.loads((await anext(lines))[6:])
                # One slot: the next request waits behind the stream.
                queued = asyncio.create_task(c.post("/generate", json={
                    "text": "next", "rid": "next", "sampling_params": {"max_new_tokens": 20}}))  # fmt: skip
                while _running(sim) != (1, 1):
                    await asyncio.sleep(0.02)
                assert (await c.post("/abort_request", json={"rid": "looping"})).status_code == 200
                rest = [line async for line in lines]
            return first, rest, await queued

    first, rest, queued = asyncio.run(scenario())
    evs, last = events(rest)
    assert first["meta_info"]["completion_tokens"] == 1 and last == "data: [DONE]"
    meta = evs[-1]["meta_info"]
    assert meta["finish_reason"] == {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    # What it generated until the abort, and one more step's token: every id sent once.
    ids = first["output_ids"] + [i for e in evs for i in e["output_ids"]]
    assert meta["completion_tokens"] == len(ids) > 1 and meta["prompt_tokens"] > 0
    # The queued request got the slot and ran to its end.
    assert queued.status_code == 200 and queued.json()["meta_info"]["finish_reason"]["type"] == "length"
    # As SGLang counts them: the aborted running request is a finished request, and an aborted one.
    assert _running(sim) == (0, 0) and _counts(sim.url) == (2, 1)


def test_a_chat_stream_aborted_by_rid_still_sends_the_ids_it_asked_for(sim_server):
    # SGLang's chat route sends the sglext ids after a graceful abort (one without an error status) as after a
    # finish: what the request generated until the abort, as many as its usage counts.
    sim = sim_server(**LONG)

    async def scenario():
        async with httpx.AsyncClient(base_url=sim.url, timeout=30) as c:
            body = {"messages": [{"role": "user", "content": "loop"}], "rid": "chat-row", "stream": True,
                    "max_tokens": 100000, "return_output_ids_in_sglext": True,
                    "stream_options": {"include_usage": True}}  # fmt: skip
            async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                lines = r.aiter_lines()
                head = [await anext(lines), await anext(lines)]  # the role chunk, then the first delta
                assert (await c.post("/abort_request", json={"rid": "chat-row"})).status_code == 200
                return head + [line async for line in lines]

    evs, last = events(asyncio.run(scenario()))
    *deltas, ids, usage = evs
    assert last == "data: [DONE]" and deltas[-1]["choices"][0]["finish_reason"] == "abort"
    assert ids["choices"] == [] and list(ids["sglext"]) == ["output_ids"]
    assert len(ids["sglext"]["output_ids"][0]) == usage["usage"]["completion_tokens"] > 0
    assert _running(sim) == (0, 0)


def test_a_closed_stream_is_aborted_and_frees_its_slot(sim_server):
    sim = sim_server(**LONG)
    body = {"text": "gone", "stream": True, "sampling_params": {"max_new_tokens": 100000}}
    with httpx.Client(timeout=30) as c, c.stream("POST", sim.url + "/generate", json=body) as r:
        lines = r.iter_lines()  # kept: a dropped line iterator closes the response
        assert next(lines).startswith("data: ")
        assert _running(sim) == (1, 0)
    # The connection is closed: the request is aborted at once and the next one runs.
    started = time.monotonic()
    done = httpx.post(sim.url + "/generate", json={"text": "next", "sampling_params": {"max_new_tokens": 20}},
                      timeout=30)  # fmt: skip
    assert done.status_code == 200 and done.json()["meta_info"]["finish_reason"]["type"] == "length"
    assert time.monotonic() - started < 10
    assert _running(sim) == (0, 0) and sim.server_info()["sim_occupancy"]["aborted_requests"] == 1
    assert _counts(sim.url) == (2, 1)


# -- how runaways loop --------------------------------------------------------------------------------
VARIED = build_model("reference", runaway_rate=0.1, loop_shape="varied")


def _varied_runaways(n: int = 3000, seed: int = 11) -> list[tuple[list[int], object]]:
    """(prompt ids, drawn sample) of the runaways among n fresh samples of n prompts."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = chat_prompt_ids([{"role": "user", "content": f"task {i}"}])
        drawn = fresh_sample(prompt, 0, VARIED, rng.getrandbits(64), True)
        if drawn.sample.runaway:
            out.append((prompt, drawn))
    return out


def test_varied_loops_span_periods_of_one_to_a_thousand_tokens_early_and_late_exact_and_near():
    drawn = _varied_runaways()
    assert len(drawn) >= 200
    periods, onsets, near_shares = [], [], []
    for _, d in drawn:
        plan = plan_request(d, 16384, False)
        onset, period = plan.loop
        ids = np.array(output_ids(plan, plan.target))
        # Body index j is response index j + 2 (after <think> and a newline); the loop holds to the cap.
        body = ids[2:]
        assert period <= LOOP_PERIOD_MAX + 8 and onset >= 4
        if onset + 3 * period > body.size:
            continue
        copies = body[onset + period :]
        same = copies == body[onset + np.arange(copies.size) % period]  # each token against the first copy's
        differing = (~same).sum()
        n_copies = copies.size / period
        if d.sample.loop_variants == 0:
            assert differing == 0  # an exact loop
        else:
            # A near-exact loop: at most one token changed a copy, and some copies changed one.
            assert differing <= n_copies + 1
            near_shares.append(differing / n_copies)
        assert "</think>" not in decode(ids.tolist())  # it never leaves its thinking
        periods.append(period)
        onsets.append(onset)
    periods, onsets = np.array(periods), np.array(onsets)
    assert periods.min() <= 2 and periods.max() >= 600  # a token repeated ... a block of hundreds
    assert (periods < 10).mean() > 0.2 and (periods > 100).mean() > 0.2  # log-uniform: every scale
    assert onsets.min() < 60 and onsets.max() > 3000  # early and late
    assert len(near_shares) > 0.3 * len(periods) and max(near_shares) > 0.2


def test_a_varied_loop_is_continued_as_the_same_loop():
    # A row cut inside a near-exact loop, sent back as a continuation, goes on looping as that sample.
    prompt, drawn = next((p, d) for p, d in _varied_runaways(600) if d.sample.loop_variants > 0)
    plan = plan_request(drawn, 4096, False)
    found = continued_sample(prompt + output_ids(plan, 3000), 0, VARIED)
    assert found is not None and found.sample == drawn.sample and found.generated == 3000
    more = plan_request(found, 1096, False)
    assert output_ids(more, 1096) == output_ids(plan, 4096)[3000:]


def test_the_loop_shape_is_a_launch_flag(sim_server):
    sim = sim_server(sim_runaway_rate=0.03, sim_loop_shape="varied")
    resolved = sim.server_info()["sim_length_model_resolved"]
    assert resolved["loop_shape"] == "varied" and resolved["runaway_rate"] == 0.03
    # The law is not recalibrated by it: the same median as phrase loops.
    assert resolved["median"] == build_model("reference", runaway_rate=0.03).median


def test_abort_request_aborts_the_rid_and_the_ids_it_prefixes_as_sglangs_scheduler(sim_server):
    sim = sim_server(**{**LONG, "max_running_requests": 4})

    async def scenario():
        async with httpx.AsyncClient(base_url=sim.url, timeout=30) as c:
            body = {"text": "x", "sampling_params": {"max_new_tokens": 100000}}
            runs = {rid: asyncio.create_task(c.post("/generate", json={**body, "rid": rid}))
                    for rid in ("row-1", "row-10", "row-2")}  # fmt: skip
            while _running(sim) != (3, 0):
                await asyncio.sleep(0.02)
            # Not itself in flight: SGLang's tokenizer manager drops it, however many ids it prefixes.
            assert (await c.post("/abort_request", json={"rid": "row-"})).status_code == 200
            assert _running(sim) == (3, 0)
            assert (await c.post("/abort_request", json={"rid": "row-1"})).status_code == 200
            aborted = {rid: (await runs[rid]).json()["meta_info"]["finish_reason"] for rid in ("row-1", "row-10")}
            left = _running(sim)
            await c.post("/abort_request", json={"abort_all": True})
            await runs["row-2"]
            return aborted, left

    aborted, left = asyncio.run(scenario())
    assert all(reason["type"] == "abort" for reason in aborted.values()) and left == (1, 0)


def test_a_rid_in_flight_is_refused_on_a_stream_with_an_error_event(sim_server):
    sim = sim_server(**LONG)

    async def scenario():
        async with httpx.AsyncClient(base_url=sim.url, timeout=30) as c:
            body = {"text": "x", "rid": "twice", "sampling_params": {"max_new_tokens": 100000}}
            first = asyncio.create_task(c.post("/generate", json=body))
            while _running(sim) != (1, 0):
                await asyncio.sleep(0.02)
            plain = await c.post("/generate", json=body)
            streamed = await c.post("/generate", json={**body, "stream": True})
            await c.post("/abort_request", json={"rid": "twice"})
            await first
            return plain, streamed

    plain, streamed = asyncio.run(scenario())
    assert plain.status_code == 400 and plain.json()["error"]["message"] == "Duplicate request ID detected: twice"
    evs, last = events(streamed.text.splitlines())
    assert streamed.status_code == 200 and last == "data: [DONE]"
    assert evs == [{"error": {"message": "Duplicate request ID detected: twice", "type": "invalid_request_error",
                              "code": 400, "retryable": False}}]  # fmt: skip


def test_the_chat_route_streams_a_chunk_per_event_at_the_interval(sim_server):
    sim = sim_server(sim_length_model="fixed:300", enable_deterministic_inference=True, reasoning_parser="qwen3",
                     stream_interval=10)  # fmt: skip
    body = {"messages": [{"role": "user", "content": "chunks"}], "max_tokens": 250, "seed": 3}
    whole = httpx.post(sim.url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
    with httpx.stream("POST", sim.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        chunks, last = events(r.iter_lines())
    assert last == "data: [DONE]"
    deltas = [c["choices"][0]["delta"] for c in chunks]
    # The role chunk, a chunk per event with new text (25 events at 10 tokens), and the finish.
    assert 20 <= len(chunks) - 2 <= 25, len(chunks)
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == whole["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == whole["content"]
