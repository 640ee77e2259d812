"""The stand-in's prefill and prefix cache: the radix tree (match, split, locks, LRU eviction, pages), the
engine's prefill time (decodes wait for it unless mixed, a cached prefix is not computed again), and what a
server reports: `cached_tokens` on /generate, `prompt_tokens_details` on the chat route."""

from __future__ import annotations

import httpx
import pytest

from tracegen.simulator.batching import BatchEngine, Job, PrefillModel, StepModel
from tracegen.simulator.radix_cache import RadixCache


def test_match_is_the_longest_cached_prefix_in_whole_pages():
    cache = RadixCache(capacity=1000)
    cache.insert(list(range(10)))
    assert cache.match(list(range(10)), limit=9)[0] == 9  # the last prompt token is always computed
    assert cache.match([0, 1, 2, 99])[0] == 3  # splits the node where the prompts part
    assert cache.match([5, 6])[0] == 0 and cache.size == 10
    paged = RadixCache(capacity=1000, page_size=4)
    paged.insert(list(range(10)))  # the trailing 2 tokens fill no page: not kept
    assert paged.size == 8 and paged.match(list(range(10)), limit=9)[0] == 8
    assert paged.match([0, 1, 2, 3, 4, 5, 99])[0] == 4


def test_eviction_takes_unlocked_leaves_least_recently_used_first():
    cache = RadixCache(capacity=30)
    a, b = cache.insert([1] * 10), cache.insert([2] * 10)
    cache.insert([3] * 10)
    cache.lock(a)
    cache.match([2] * 10)  # b is used after c
    cache.insert([4] * 10)  # over capacity: the least recently used unlocked leaf (c) goes; a is locked
    assert cache.match([1] * 10)[0] == 10 and cache.match([2] * 10)[0] == 10 and cache.match([3] * 10)[0] == 0
    assert cache.size == 30 and cache.evicted == 10
    cache.unlock(a)
    assert b.lock_ref == 0


def _engine(mixed: bool = False, cache: RadixCache | None = None) -> BatchEngine:
    # 1,000 prompt tokens a second; decode steps of 10 ms.
    return BatchEngine(4, StepModel(0.01, 0.0), prefill=PrefillModel(1000.0, 100, mixed), cache=cache)


def test_a_prompt_is_prefilled_before_it_decodes_and_decodes_wait_for_it():
    engine = _engine()
    first = Job("a", target=100, prompt_ids=list(range(500)))
    engine.submit(first, 0.0)
    engine.advance(0.5)  # 500 prompt tokens at 1,000 a second
    assert first.state == "running" and engine.produced(first) == 0
    engine.submit(Job("b", target=100, prompt_ids=list(range(1000, 1200))), 0.5)
    engine.advance(0.7)  # b's 200 tokens of prefill: a, by default, gains nothing meanwhile
    assert engine.produced(first) == 0
    engine.advance(0.8)
    assert engine.produced(first) == 10


def test_mixed_chunks_carry_the_decodes():
    engine = _engine(mixed=True)
    first = Job("a", target=100, prompt_ids=list(range(100)))
    engine.submit(first, 0.0)
    engine.advance(0.1)
    engine.submit(Job("b", target=100, prompt_ids=list(range(1000, 1200))), 0.1)
    engine.advance(0.3)  # each step: one 100-token chunk (0.1 s) and a decode step (0.01 s)
    assert engine.produced(first) == 1


def test_a_cached_prefix_is_not_computed_again():
    cache = RadixCache(capacity=100_000)
    engine = _engine(cache=cache)
    prompt = list(range(3000))
    first = Job("a", target=5, prompt_ids=prompt, output_ids_of=lambda n: [7] * n)
    engine.submit(first, 0.0)
    engine.advance(10.0)
    again = Job("b", target=5, prompt_ids=prompt)
    engine.submit(again, 10.0)
    engine.advance(20.0)
    longer = Job("c", target=5, prompt_ids=[*prompt, *[7] * 4, 42])
    engine.submit(longer, 20.0)
    engine.advance(30.0)
    assert (first.cached_tokens, again.cached_tokens, longer.cached_tokens) == (0, 2999, 3004)
    assert first.finished == pytest.approx(3.0 + 0.05) and again.finished == pytest.approx(10.001 + 0.05)
    assert engine.prompt_tokens_computed == 3000 + 1 + 1 and all(n.lock_ref == 0 for n in cache.root.children.values())


def test_the_server_reports_what_its_cache_held(sim_server):
    sim = sim_server(sim_length_model="fixed:20", enable_cache_report=True, sim_time_scale=1000)
    prompt = list(range(10, 3010))
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 4}}
    metas = [httpx.post(sim.url + "/generate", json=body, timeout=30).json()["meta_info"] for _ in range(2)]
    assert [m["cached_tokens"] for m in metas] == [0, 2999]
    assert [m["cached_tokens_details"] for m in metas] == [None, {"device": 2999, "host": 0}]
    chat = {"messages": [{"role": "user", "content": "the same question twice"}], "max_tokens": 4}
    usages = [httpx.post(sim.url + "/v1/chat/completions", json=chat, timeout=30).json()["usage"] for _ in range(2)]
    assert usages[0]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert usages[1]["prompt_tokens_details"] == {"cached_tokens": usages[1]["prompt_tokens"] - 1}
    # Without --enable-cache-report SGLang's usage has no details.
    plain = sim_server(sim_length_model="fixed:20", sim_time_scale=1000)
    assert httpx.post(plain.url + "/v1/chat/completions", json=chat, timeout=30).json()["usage"][
        "prompt_tokens_details"] is None  # fmt: skip
