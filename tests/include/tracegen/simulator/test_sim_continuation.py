"""Continuing a truncated row: prompt ids + response ids sent back to /generate finish the same sample.

The statistical claim: generating at cap 4096 and continuing every truncated row to 8192 gives the
same length distribution as generating at 8192 directly, while regenerating truncated rows from
scratch does not (it keeps only the samples that happened to be short). Checked on the sampling
functions the server itself calls, with fixed seeds, then over HTTP on a few requests.
"""

from __future__ import annotations

import random
import signal

import httpx
import numpy as np
import pytest
from fixtures.simulator import start_sim_server
from scipy import stats

from tracegen.audit.runaway import is_runaway
from tracegen.simulator.lengths import (
    DEFAULT_MODEL,
    LengthModel,
    build_model,
    continued_sample,
    draw,
    fresh_sample,
)
from tracegen.simulator.protocol import output_ids, plan_request
from tracegen.simulator.protocol import text as request_text
from tracegen.simulator.tokens import (
    EOS_TOKEN_ID,
    THINK_END_ID,
    THINK_ID,
    chat_prompt_ids,
    detokenize,
    register_of,
)
from tracegen.simulator.tokens import text_ids as decode_ids

N_PER_ARM = 3000
LOW, HIGH = 4096, 8192


def msgs(i: int) -> list[dict]:
    return [{"role": "user", "content": f"fix the failing test in module {i}"}]


# -- token ids ------------------------------------------------------------------------------------------
def test_a_response_is_found_again_from_its_own_ids():
    ids = chat_prompt_ids(msgs(1))
    drawn = fresh_sample(ids, 0, DEFAULT_MODEL, 123, True)
    plan = plan_request(drawn, 20_000, False)
    response = output_ids(plan, plan.target)
    assert output_ids(plan_request(drawn, 100, False), 100) == response[:100]
    for n in (6, 7, 37, 300, plan.target - 1):
        found = continued_sample(ids + response[:n], 0, DEFAULT_MODEL)
        assert found is not None and found.generated == n and found.sample == drawn.sample
        assert (found.register, found.origin, found.thinking) == (drawn.register, drawn.origin, drawn.thinking)
    for n in range(6):  # <think>, \n and fewer than 4 ids of text: nothing to look up
        assert continued_sample(ids + response[:n], 0, DEFAULT_MODEL) is None
    assert continued_sample(ids, 0, DEFAULT_MODEL) is None
    # The ids are a tokenization of the text: <think>, \n, then stream tokens, </think> where thinking ends.
    assert response[:2] == [THINK_ID, decode_ids("\n")[0]] and response[plan.reasoning - 1] == THINK_END_ID


def test_ids_the_stand_in_did_not_produce_sample_afresh():
    ids = chat_prompt_ids(msgs(2))
    drawn = fresh_sample(ids, 0, DEFAULT_MODEL, 7, True)
    response = output_ids(plan_request(drawn, 200, False), 200)
    edited = list(response)
    edited[120] = (edited[120] + 1) % 4096
    assert continued_sample(ids + edited, 0, DEFAULT_MODEL) is None
    assert continued_sample(ids + response[:150] + [EOS_TOKEN_ID], 0, DEFAULT_MODEL) is None  # a finished one
    other = continued_sample(chat_prompt_ids(msgs(3)) + response, 0, DEFAULT_MODEL)  # glued to another prompt
    assert other is None or other.sample != drawn.sample
    # Another --sim-seed is another model: the same text from that origin, another sample of its length.
    other_seed = continued_sample(ids + response, 1, DEFAULT_MODEL)
    assert other_seed is None or other_seed.sample != drawn.sample
    rng = random.Random(0)
    assert all(continued_sample([rng.randrange(151_936) for _ in range(400)], 0, DEFAULT_MODEL) is None
               for _ in range(50))


def test_decoding_all_the_ids_is_the_whole_text_and_joining_texts_is_not():
    """A prefix cut inside a character: SGLang's first text ends in U+FFFD and the continuation's (decoded
    after the prefix's last ids) starts after the character, so joined texts lose it; decoding the whole
    id sequence does not."""
    rich = [{"role": "user", "content": "请修复这个模块里失败的测试，谢谢 🙏"}]
    ids = chat_prompt_ids(rich)
    assert register_of(ids) == "intl"
    seams = 0
    for number in range(60):
        drawn = fresh_sample(ids, 0, DEFAULT_MODEL, number, True)
        whole = plan_request(drawn, 20_000, False)
        full_text = request_text(whole, whole.target)
        assert "\ufffd" not in full_text  # a natural completion ends on whole characters
        for cut in (50, 51, 52, whole.reasoning - 1, whole.target - 2):
            if not 6 <= cut < whole.target - 1:
                continue
            first = plan_request(drawn, cut, False)
            prefix = output_ids(first, cut)
            rest = plan_request(continued_sample(ids + prefix, 0, DEFAULT_MODEL), 20_000, False)
            assert prefix + output_ids(rest, rest.target) == output_ids(whole, whole.target)
            assert detokenize(ids, prefix + output_ids(rest, rest.target), True) == full_text
            joined = request_text(first, cut) + request_text(rest, rest.target)
            if request_text(first, cut).endswith("\ufffd"):
                seams += 1
                assert joined != full_text and joined.count("\ufffd") == 1
            else:
                assert joined == full_text
    assert seams >= 5


# -- the statistical claim --------------------------------------------------------------------------------
def generate_then_continue(model: LengthModel, prompts: range, rng: random.Random) -> tuple[np.ndarray, int]:
    """Cap LOW; every row cut there is continued to HIGH from its exact ids. Checks each continuation
    finishes the sample it came from (length = that sample's natural length, capped at HIGH)."""
    finals, continued = [], 0
    for i in prompts:
        ids = chat_prompt_ids(msgs(i))
        drawn = fresh_sample(ids, 0, model, rng.getrandbits(64), True)
        first = plan_request(drawn, LOW, False)
        if first.finish != "length":
            finals.append(first.target)
            continue
        found = continued_sample(ids + output_ids(first, LOW), 0, model)
        assert found is not None and found.generated == LOW and found.sample == drawn.sample
        rest = plan_request(found, HIGH - LOW, False)
        assert LOW + rest.target == min(drawn.sample.total, HIGH)
        finals.append(LOW + rest.target)
        continued += 1
    return np.array(finals), continued


def generate_directly(model: LengthModel, prompts: range, rng: random.Random) -> np.ndarray:
    return np.array([
        plan_request(fresh_sample(chat_prompt_ids(msgs(i)), 0, model, rng.getrandbits(64), True), HIGH, False).target
        for i in prompts
    ])  # fmt: skip


def regenerate_from_scratch(model: LengthModel, prompts: range, rng: random.Random) -> np.ndarray:
    finals = []
    for i in prompts:
        ids = chat_prompt_ids(msgs(i))
        first = plan_request(fresh_sample(ids, 0, model, rng.getrandbits(64), True), LOW, False)
        if first.finish == "length":
            first = plan_request(fresh_sample(ids, 0, model, rng.getrandbits(64), True), HIGH, False)
        finals.append(first.target)
    return np.array(finals)


@pytest.mark.parametrize(
    ("law", "model"),
    [("reference", DEFAULT_MODEL), ("logt+runaway", build_model("reference", kind="logt", runaway_rate=0.03))],
)
def test_continuing_truncated_rows_matches_generating_at_the_higher_cap(law, model):
    # Disjoint prompt sets (same population) so the two-sample KS test sees independent samples.
    continued, n_continued = generate_then_continue(model, range(N_PER_ARM), random.Random(1))
    direct = generate_directly(model, range(N_PER_ARM, 2 * N_PER_ARM), random.Random(2))
    ks = stats.ks_2samp(continued, direct)
    print(f"{law}: n={N_PER_ARM} per arm, {n_continued} continued, KS D={ks.statistic:.4f} p={ks.pvalue:.3f}")
    assert n_continued > 0.15 * N_PER_ARM
    assert ks.pvalue > 0.01, ks
    # Regenerating from scratch keeps only rows whose new sample was short: fewer pass 4096.
    regenerated = regenerate_from_scratch(model, range(N_PER_ARM), random.Random(3))
    share_direct, share_regen = (direct > LOW).mean(), (regenerated > LOW).mean()
    print(f"{law}: share > {LOW}: direct {share_direct:.3f}, regenerated {share_regen:.3f}")
    # Two-proportion z-test: at n = 3,000 per arm the SE of the difference is < 0.01.
    se = np.sqrt(share_direct * (1 - share_direct) / N_PER_ARM + share_regen * (1 - share_regen) / N_PER_ARM)
    assert share_direct - share_regen > 4 * se, (share_direct, share_regen, se)
    assert stats.ks_2samp(regenerated, direct).pvalue < 1e-6


# -- over HTTP -------------------------------------------------------------------------------------------
SHORT = LengthModel.parse("short")
SEED_FIELD = 42  # deterministic servers: a request without a seed draws sample 42, as SGLang defaults


@pytest.fixture(scope="module")
def det(tmp_path_factory):
    server = start_sim_server(
        tmp_path_factory.mktemp("simdet"),
        enable_deterministic_inference=True,
        reasoning_parser="qwen3",
        sim_length_model="short",
        context_length=4096,
    )
    yield server
    server.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    server = start_sim_server(
        tmp_path_factory.mktemp("simfresh"), reasoning_parser="qwen3", sim_length_model="short"
    )
    yield server
    server.stop(signal.SIGKILL)


def chat(server, messages, **extra) -> dict:
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": messages, **extra}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def generate(server, body: dict) -> dict:
    r = httpx.post(server.url + "/generate", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_each_request_is_a_fresh_sample(fresh, det):
    m = msgs(5)
    lengths = {chat(fresh, m, max_tokens=2000)["usage"]["completion_tokens"] for _ in range(6)}
    assert len(lengths) > 1, lengths
    seeded = {chat(det, m, max_tokens=2000, seed=9)["usage"]["completion_tokens"] for _ in range(3)}
    assert seeded == {draw(m, 0, SHORT, sample=9).total}
    by_seed = {chat(det, m, max_tokens=2000, seed=s)["usage"]["completion_tokens"] for s in range(6)}
    assert len(by_seed) > 1


@pytest.mark.parametrize("cut_in", ["thinking", "answer"])
def test_http_continuation_finishes_the_sample(det, cut_in):
    cap, new_cap = 100, 400
    for i in range(10_000):
        d = draw(msgs(i), 0, SHORT, sample=SEED_FIELD)
        inside = d.reasoning > cap if cut_in == "thinking" else d.reasoning < cap
        if cap < d.total < new_cap and inside:
            m = msgs(i)
            break
    first = chat(det, m, max_tokens=cap, return_token_ids=True)
    choice = first["choices"][0]
    prompt_ids, response_ids = choice["prompt_token_ids"], choice["response_token_ids"]
    assert choice["finish_reason"] == "length" and len(response_ids) == cap
    assert len(prompt_ids) == first["usage"]["prompt_tokens"]
    assert (choice["message"]["content"] == "") == (cut_in == "thinking")

    cont = generate(det, {
        "input_ids": prompt_ids + response_ids,
        "sampling_params": {"max_new_tokens": new_cap - cap, "temperature": 0.6, "top_p": 0.95},
    })  # fmt: skip
    meta = cont["meta_info"]
    assert meta["finish_reason"] == {"type": "stop", "matched": EOS_TOKEN_ID}
    assert meta["completion_tokens"] == d.total - cap == len(cont["output_ids"])
    assert meta["prompt_tokens"] == len(prompt_ids) + cap
    assert cont["output_ids"][-1] == EOS_TOKEN_ID

    # The same sample generated in one go: same ids, same text, same split, same reasoning count.
    whole = chat(det, m, max_tokens=new_cap, return_token_ids=True)["choices"][0]
    assert whole["response_token_ids"] == response_ids + cont["output_ids"]
    raw_first = chat(det, m, max_tokens=cap, separate_reasoning=False)["choices"][0]["message"]["content"]
    raw_whole = chat(det, m, max_tokens=new_cap, separate_reasoning=False)["choices"][0]["message"]["content"]
    # The whole text is the decoding of all the ids (/detokenize); these English prompts are cut on a whole
    # character, so the joined texts are the same.
    decoded = httpx.post(det.url + "/detokenize", json={"tokens": response_ids + cont["output_ids"]}).json()
    joined = raw_first + cont["text"]
    assert decoded["text"] == joined == raw_whole
    split = httpx.post(
        det.url + "/separate_reasoning", json={"text": joined, "reasoning_parser": "qwen3"}
    ).json()
    assert split == {
        "reasoning_text": whole["message"]["reasoning_content"],
        "text": whole["message"]["content"],
    }
    # A client holding only the parsed first response can rebuild its raw text losslessly.
    msg = choice["message"]
    rebuilt = "<think>" + msg["reasoning_content"] + ("</think>" + msg["content"] if msg["content"] else "")
    assert rebuilt == raw_first
    total_reasoning = first["usage"]["reasoning_tokens"] + meta["reasoning_tokens"]
    assert total_reasoning == d.reasoning


def test_http_continuation_on_a_fresh_server_is_the_same_sample_every_time(fresh):
    for i in range(200):
        first = chat(fresh, msgs(i), max_tokens=60, return_token_ids=True)
        if first["choices"][0]["finish_reason"] == "length":
            break
    ids = first["choices"][0]["prompt_token_ids"] + first["choices"][0]["response_token_ids"]
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 3000}}
    a, b = generate(fresh, body), generate(fresh, body)
    assert a["output_ids"] == b["output_ids"] and a["text"] == b["text"]
    assert a["meta_info"]["finish_reason"]["type"] == "stop"


def test_http_ids_not_from_the_stand_in_are_a_fresh_prompt(det):
    ids = chat(det, msgs(6), max_tokens=60, return_token_ids=True)["choices"][0]
    tampered = ids["prompt_token_ids"] + ids["response_token_ids"][:-1] + [5]
    body = generate(det, {"input_ids": tampered, "sampling_params": {"max_new_tokens": 3000}})
    assert body["meta_info"]["completion_tokens"] == draw(tampered, 0, SHORT, sample=SEED_FIELD).total


def test_http_token_id_errors_match_sglang(det):
    url = det.url
    r = httpx.post(
        url + "/v1/chat/completions", json={"messages": msgs(1), "stream": True, "return_token_ids": True}
    )
    assert r.status_code == 400 and r.json()["message"] == (
        "return_token_ids is not supported with streaming on /v1/chat/completions. "
        "Please set stream=false when using return_token_ids=true."
    )
    r = httpx.post(
        url + "/v1/chat/completions",
        json={"messages": msgs(1), "stream": True, "return_prompt_token_ids": True},
    )
    assert (
        r.status_code == 400
        and "return_prompt_token_ids is not supported with streaming" in r.json()["message"]
    )
    only_prompt = chat(det, msgs(1), max_tokens=5, return_prompt_token_ids=True)["choices"][0]
    assert "prompt_token_ids" in only_prompt and "response_token_ids" not in only_prompt
    assert "prompt_token_ids" not in chat(det, msgs(1), max_tokens=5)["choices"][0]
    r = httpx.post(url + "/generate", json={"text": "x", "sampling_params": {"sampling_seed": 2**63}})
    assert r.status_code == 400 and "sampling_seed must be in" in r.json()["error"]["message"]


def test_separate_reasoning_endpoint(det):
    url = det.url + "/separate_reasoning"
    cases = {
        "<think>\nplan\n</think>\n\nanswer": ("\nplan\n", "\n\nanswer"),
        "<think>\nstill thinking": ("\nstill thinking", ""),
        "no tags at all": ("", "no tags at all"),
        "<think>a<tool_call>{}": ("a", "<tool_call>{}"),
    }
    for text, (reasoning, normal) in cases.items():
        assert httpx.post(url, json={"text": text, "reasoning_parser": "qwen3"}).json() == {
            "reasoning_text": reasoning, "text": normal,
        }  # fmt: skip
    forced = httpx.post(url, json={"text": "thinking</think>done", "reasoning_parser": "deepseek-r1"}).json()
    assert forced == {"reasoning_text": "thinking", "text": "done"}
    blocks = httpx.post(
        url, json={"text": "<think>r</think>t", "reasoning_parser": "qwen3", "return_blocks": True}
    )
    assert blocks.json()["blocks"] == [{"type": "reasoning", "text": "r"}, {"type": "text", "text": "t"}]
    unknown = httpx.post(url, json={"text": "x", "reasoning_parser": "nope"})
    assert unknown.status_code == 500 and unknown.text == "Internal Server Error"
    assert httpx.post(url, json={"reasoning_parser": "qwen3"}).status_code == 400


def test_runaway_samples_over_http(sim_server):
    model = build_model("short", runaway_rate=0.5, truncated_share=0.6)
    sim = sim_server(
        sim_length_model="short", sim_runaway_rate=0.5, sim_truncated_share=0.6, reasoning_parser="qwen3",
        enable_deterministic_inference=True,
    )  # fmt: skip
    info = httpx.get(sim.url + "/server_info").json()["sim_length_model_resolved"]
    assert info["runaway_rate"] == 0.5 and info["median"] == pytest.approx(model.median)
    seed = next(s for s in range(100) if draw(msgs(0), 0, model, sample=s).runaway)
    body = chat(sim, msgs(0), max_tokens=600, seed=seed, return_token_ids=True)
    msg = body["choices"][0]["message"]
    assert body["choices"][0]["finish_reason"] == "length" and msg["content"] == ""
    tail = body["choices"][0]["response_token_ids"][-300:]
    assert len({tuple(tail[i : i + 4]) for i in range(len(tail) - 3)}) < 70  # one short phrase, looping
    assert is_runaway(body["choices"][0]["response_token_ids"])
