"""The client's streamed /generate against the stand-in, which streams and aborts as SGLang 0.5.23 does: the
streamed answer is the unstreamed one, cumulative or incremental, at any interval; a watch's verdict aborts the
request on the server at once (its slot goes to the next request) and the answer holds every id received; a
broken or refused stream ends as an unstreamed failure or refusal would."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tracegen.sglang.client import ClientConfig, ServerEndpoint, SGLangClient
from tracegen.sglang.settings import Sampling
from tracegen.sglang.stream import STOPPED, EventReader, StreamAssembly, StreamFailed, StreamRejected
from tracegen.sglang.wire import MalformedResponse

FAST = dict(backoff_base_s=0.01, backoff_max_s=0.02, request_deadline_s=30.0)
SAMPLING = Sampling(max_tokens=250, temperature=0.7, top_p=0.95, seed=7)
PROMPT = list(range(100, 140))


class Never:
    def __init__(self) -> None:
        self.fed: list[int] = []

    def feed(self, new_ids):
        self.fed.extend(new_ids)


class After:
    """Stops the request once `n` ids arrived."""

    def __init__(self, n: int) -> None:
        self.n, self.seen = n, 0

    def feed(self, new_ids):
        self.seen += len(new_ids)
        return {"after": self.seen} if self.seen >= self.n else None


def _generate(url: str, watch=None, max_new_tokens: int = 250, attempts: int = 3):
    async def main():
        async with SGLangClient([ServerEndpoint(url, max_in_flight=4)], ClientConfig(max_attempts=attempts, **FAST)) as c:
            return await c.generate(PROMPT, max_new_tokens=max_new_tokens, sampling=SAMPLING, watch=watch)

    return asyncio.run(main())


def _metrics(url: str) -> dict[str, float]:
    found = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("sglang:num_"):
            found[line.split("{", 1)[0]] = float(line.rsplit(" ", 1)[1])
    return found


@pytest.mark.parametrize("flags", [{}, {"incremental_streaming_output": True, "stream_interval": 7}],
                         ids=["cumulative", "incremental-7"])
def test_a_streamed_generate_is_the_unstreamed_one(sim_server, flags):
    sim = sim_server(sim_length_model="fixed:300", enable_deterministic_inference=True, reasoning_parser="qwen3",
                     **flags)
    whole = _generate(sim.url)
    watch = Never()
    streamed = _generate(sim.url, watch=lambda: watch)
    assert whole.value is not None and streamed.value is not None, (whole, streamed)
    a, b = whole.value, streamed.value
    assert (b.output_ids, b.text, b.finish_reason) == (a.output_ids, a.text, a.finish_reason) == (a.output_ids, a.text,
                                                                                                   "length")
    assert (b.prompt_tokens, b.completion_tokens, b.reasoning_tokens) == (a.prompt_tokens, a.completion_tokens,
                                                                          a.reasoning_tokens)
    assert watch.fed == a.output_ids and b.stopped is None  # every id fed once, in order


def test_a_verdict_aborts_the_request_and_frees_its_slot_at_once(sim_server):
    sim = sim_server(sim_time_scale=10, sim_length_model="fixed:100000", context_length=200000,
                     max_running_requests=1, enable_metrics=True, incremental_streaming_output=True, stream_interval=5)
    out = _generate(sim.url, watch=lambda: After(40), max_new_tokens=90000)
    g = out.value
    assert g is not None and g.finish_reason == STOPPED and g.stopped == {"after": len(g.output_ids)}
    assert 40 <= len(g.output_ids) < 40 + 5 and g.completion_tokens == len(g.output_ids) and g.prompt_tokens > 0
    # The server aborted it: counted as SGLang counts an aborted running request, and its one slot is free
    # for the next request, which runs to its end (90,000 tokens at this time scale would take minutes).
    # The stand-in counts the abort when the aborted request's handler ends, a moment after its slot is free.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (sim.server_info()["internal_states"][0]["num_running_reqs"]
                                           or _metrics(sim.url)["sglang:num_aborted_requests_total"] != 1):
        time.sleep(0.05)
    assert sim.server_info()["internal_states"][0]["num_running_reqs"] == 0
    assert _metrics(sim.url)["sglang:num_aborted_requests_total"] == 1
    short = httpx.post(sim.url + "/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 20}},
                       timeout=30).json()
    assert short["meta_info"]["finish_reason"]["type"] == "length"


def test_a_refused_stream_is_rejected_and_a_broken_one_fails_after_its_attempts(sim_server):
    sim = sim_server(sim_length_model="fixed:300", context_length=1000)
    # A prompt over the context: the stand-in refuses it as SGLang does on a stream, with an error event.
    async def over():
        async with SGLangClient([ServerEndpoint(sim.url)], ClientConfig(max_attempts=3, **FAST)) as c:
            return await c.generate(list(range(2000)), max_new_tokens=10, sampling=SAMPLING, watch=Never)

    refused = asyncio.run(over())
    assert refused.value is None and refused.rejected and refused.attempt == 1, refused


def test_the_assembly_reads_both_modes_and_refuses_what_sglang_never_sends():
    def ev(ids, count, finish=None, text=""):
        return json.dumps({"text": text, "output_ids": ids, "meta_info": {
            "prompt_tokens": 3, "completion_tokens": count, "finish_reason": finish}}).encode()  # fmt: skip

    cumulative = StreamAssembly(cap=10)
    assert cumulative.feed_event(ev([1, 2], 2, text="ab")) == [1, 2]
    assert cumulative.feed_event(ev([1, 2, 3], 3, text="abc")) == [3]
    assert cumulative.feed_event(ev([1, 2, 3, 4], 4, {"type": "stop"}, text="abcd")) == [4]
    assert cumulative.feed_event(b"[DONE]") == [] and cumulative.done
    r = cumulative.result()
    assert (r.output_ids, r.text, r.finish_reason, r.completion_tokens) == ([1, 2, 3, 4], "abcd", "stop", 4)

    incremental = StreamAssembly(cap=4)
    for ids, count, text in (([1, 2], 2, "ab"), ([3], 3, "c"), ([4], 4, "d")):
        incremental.feed_event(ev(ids, count, {"type": "length"} if count == 4 else None, text))
    r = incremental.result()
    assert (r.output_ids, r.text, r.finish_reason) == ([1, 2, 3, 4], "abcd", "length") and incremental.incremental

    with pytest.raises(StreamFailed, match="do not extend"):
        a = StreamAssembly()
        a.feed_event(ev([1, 2], 2))
        a.feed_event(ev([9, 2, 3], 3))
    with pytest.raises(StreamFailed, match="after the one that finished"):
        a = StreamAssembly()
        a.feed_event(ev([1], 1, {"type": "stop"}))
        a.feed_event(ev([1, 2], 2))
    with pytest.raises(StreamFailed, match="without a finish_reason"):
        a = StreamAssembly(cap=5)
        a.feed_event(ev([1], 1))
        a.result()
    with pytest.raises(StreamFailed, match="not JSON"):
        StreamAssembly().feed_event(b"{half")
    with pytest.raises(StreamRejected, match="HTTP 400"):
        StreamAssembly().feed_event(json.dumps({"error": {"message": "too long", "code": 400}}).encode())
    with pytest.raises(StreamFailed, match="server reported an error"):
        StreamAssembly().feed_event(json.dumps({"error": {"message": "oom", "code": 503}}).encode())


def test_events_split_anywhere_are_read_whole():
    body = b"data: {\"a\": 1}\n\ndata: [DONE]\n\n"
    for cut in range(1, len(body)):
        reader = EventReader(line_limit=1 << 20)
        assert reader.feed(body[:cut]) + reader.feed(body[cut:]) == [b'{"a": 1}', b"[DONE]"]


def test_a_stream_s_cached_count_is_its_meta_info_s_and_held_to_its_prompt():
    def ev(ids, count, cached, finish=None):
        meta = {"prompt_tokens": 3, "completion_tokens": count, "finish_reason": finish}
        if cached is not None:
            meta["cached_tokens"] = cached
        return json.dumps({"text": "x", "output_ids": ids, "meta_info": meta}).encode()

    whole = StreamAssembly(cap=4)
    whole.feed_event(ev([1, 2], 2, 2))
    whole.feed_event(ev([3], 3, 2, {"type": "stop"}))
    assert whole.result().cached_tokens == 2
    stopped = StreamAssembly(cap=4)
    stopped.feed_event(ev([1], 1, 1))
    assert stopped.stopped({"loop": True}).cached_tokens == 1
    # A server that does not say: unknown, never 0.
    silent = StreamAssembly(cap=4)
    silent.feed_event(ev([1], 1, None, {"type": "stop"}))
    assert silent.result().cached_tokens is None
    lying = StreamAssembly(cap=4)
    lying.feed_event(ev([1], 1, 7, {"type": "stop"}))
    with pytest.raises(MalformedResponse, match=r"meta_info.cached_tokens is 7, above prompt_tokens \(3\)"):
        lying.result()
