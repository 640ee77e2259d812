"""Extending one truncated row, against a scripted SGLang on loopback: the requests it sends (/generate from
the exact ids with the remaining budget and the row's sampling params, /detokenize of all the ids, then the
server's own parsers on the whole raw text), the row it builds, the fallback for a row stored without token
ids, and for a server without /detokenize.

Then the pivot against the stand-in: prompts rich in non-ASCII, many rows cut at 4096 inside a
character, and 4096 -> 8192 with `extend` equal to one uninterrupted 8192 run byte for byte, in the parts and
in the export; joining the two texts instead (a server without /detokenize) leaves U+FFFD at those seams.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from engine_support.helpers import (
    assert_healthy,
    direct_and_pivot,
    endpoints,
    make_config,
    prepare,
    root_of,
    run_engine,
)
from fixtures.simulator import start_sim_server

from tracegen.audit import report
from tracegen.audit.stats import audit
from tracegen.dataset.reader import PromptRow
from tracegen.export import export_dataset
from tracegen.generate.extend import Extension, Superseded, extend_row, not_extendable, raw_text
from tracegen.sglang.client import ClientConfig, Outcome, Sampling, ServerEndpoint, SGLangClient
from tracegen.simulator.reasoning import separate_reasoning
from tracegen.simulator.tokens import tokenizer
from tracegen.status import dataset_status
from tracegen.store.records import (
    EXTENDED,
    FAILED,
    FALLBACK_REGENERATED,
    OK,
    GeneratedRow,
    pack_token_ids,
    unpack_token_ids,
)

FAST = dict(backoff_base_s=0.01, backoff_max_s=0.02, probe_interval_s=0.05, probe_timeout_s=2.0, jitter_seed=1)
TOOLS = [{"type": "function", "function": {"name": "run", "parameters": {"type": "object"}}}]
CALL = '<tool_call>\n{"name": "run", "arguments": {"cmd": "pytest"}}\n</tool_call>'
# What /detokenize makes of the row's ids and the continuation's: the whole raw text, decoded at once.
DECODED = "<think>\nthinking so far done\n</think>\n\nCalling." + CALL


def truncated(**fields: Any) -> GeneratedRow:
    base = dict(index=7, status=OK, max_tokens=4, run_id="r4", chunk=0, id="p7", finish_reason="length",
                content="", reasoning_content="\nthinking so far", completion_tokens=4, reasoning_tokens=4,
                prompt_tokens=3, category="code", prompt_token_ids=pack_token_ids([1, 2, 3]),
                response_token_ids=pack_token_ids([10, 11, 12, 13]))
    return GeneratedRow(**{**base, **fields})


class Scripted:
    """An SGLang with a reasoning and a tool-call parser; /generate aborts once, then finishes the row."""

    def __init__(self, tool_parser: str | None = "qwen25", reasoning_parser: str | None = "qwen3",
                 detokenize: bool = True) -> None:
        self.parsers = {"reasoning_parser": reasoning_parser, "tool_call_parser": tool_parser}
        self.seen: list[tuple[str, Any]] = []
        self.generated = 0
        self.detokenize = detokenize

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json() if request.method == "POST" else None
        self.seen.append((request.path, body))
        if request.path == "/server_info":
            return web.json_response({**self.parsers, "version": "0.5.23"})
        if request.path == "/generate":
            self.generated += 1
            if self.generated == 1:
                return web.json_response({"text": "", "meta_info": {"finish_reason": {"type": "abort"}}})
            return web.json_response({
                "text": " done\n</think>\n\nCalling." + CALL, "output_ids": [7, 8, 151645],
                "meta_info": {"finish_reason": {"type": "stop", "matched": 151645}, "prompt_tokens": 7,
                              "completion_tokens": 3, "reasoning_tokens": 1}})  # fmt: skip
        if request.path == "/detokenize" and self.detokenize:
            # The decoding of the row's ids and the new ones: what SGLang's tokenizer makes of them all.
            assert body == {"tokens": [10, 11, 12, 13, 7, 8, 151645]}
            return web.json_response({"text": DECODED})
        if request.path == "/separate_reasoning":
            reasoning, text = separate_reasoning(body["text"], body["reasoning_parser"])
            return web.json_response({"reasoning_text": reasoning, "text": text})
        if request.path == "/parse_function_call":
            normal, _, rest = body["text"].partition("<tool_call>")
            call = json.loads(rest.split("</tool_call>")[0])
            return web.json_response({"normal_text": normal, "calls": [
                {"tool_index": 0, "name": call["name"], "parameters": json.dumps(call["arguments"])}]})
        if request.path == "/v1/chat/completions":
            return web.json_response({
                "id": "c1", "choices": [{"index": 0, "finish_reason": "stop",
                                         "message": {"role": "assistant", "content": "fresh", "reasoning_content": "r"},
                                         "prompt_token_ids": [1, 2, 3], "response_token_ids": [5, 151645]}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 2}})  # fmt: skip
        return web.json_response({"detail": "Not Found"}, status=404)


def extend(server: Scripted, job: Extension, cap: int = 8, **client: Any) -> GeneratedRow:
    async def main() -> GeneratedRow:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", server.handle)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        try:
            async with SGLangClient([ServerEndpoint(url)], ClientConfig(**{**FAST, **client})) as sglang:
                sampling = Sampling(max_tokens=cap, temperature=0.6, top_p=0.95)
                return await extend_row(sglang, job, sampling=sampling, model="m", run_id="r8", chunk=3)
        finally:
            await runner.cleanup()

    return asyncio.run(main())


SUPERSEDED = Superseded(7, 4, "parts/r4/c00000-a.jsonl.gz")


def test_a_row_cut_in_its_thinking_continues_it_and_splits_like_the_chat_route() -> None:
    server = Scripted()
    prompt = PromptRow(7, [{"role": "user", "content": "fix it"}], tools=TOOLS, id="p7")
    # The row was sampled at 0.7 / 0.9 / top-k 5 / min-p 0.1 by its run; this run samples at its defaults.
    sampled = Sampling(4, temperature=0.7, top_p=0.9, top_k=5, min_p=0.1)
    row = extend(server, Extension(truncated(), SUPERSEDED, prompt, sampled))

    generate = [body for path, body in server.seen if path == "/generate"]
    assert len(generate) == 2  # the abort was tried again, like any transient failure
    # Its exact ids, the budget left under the new cap, and the sampling params it was drawn with.
    # Cut inside its thinking: the server counts the continuation's thinking as such.
    assert generate[-1] == {"input_ids": [1, 2, 3, 10, 11, 12, 13], "stream": False, "require_reasoning": True,
                            "sampling_params": {"max_new_tokens": 4, "temperature": 0.7, "top_p": 0.9,
                                                "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.0}}
    # The whole text is the server's decoding of all the ids; then its own split of it.
    assert [p for p, _ in server.seen if p != "/generate"] == [
        "/server_info", "/detokenize", "/separate_reasoning", "/parse_function_call"]
    assert ("/separate_reasoning", {"text": DECODED, "reasoning_parser": "qwen3"}) in server.seen
    assert ("/parse_function_call", {"text": "\n\nCalling." + CALL, "tools": TOOLS, "tool_call_parser": "qwen25"}) \
        in server.seen
    assert row.status == OK and row.max_tokens == 8 and row.run_id == "r8" and row.chunk == 3
    assert row.reasoning_content == "\nthinking so far done\n" and row.content == "\n\nCalling."
    assert row.finish_reason == "tool_calls"
    [call] = row.tool_calls
    assert call["function"] == {"name": "run", "arguments": '{"cmd": "pytest"}'} and call["id"].startswith("call_")
    assert (row.completion_tokens, row.reasoning_tokens, row.prompt_tokens) == (7, 5, 3)
    assert unpack_token_ids(row.response_token_ids) == [10, 11, 12, 13, 7, 8, 151645]
    assert row.prompt_token_ids == truncated().prompt_token_ids
    assert row.provenance == {"action": EXTENDED, "policy": "extend", "supersedes": SUPERSEDED.ref(),
                              "tokens_before": 4, "tokens_after": 7, "new_tokens": 3,
                              "sampling": {"temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.1,
                                           "repetition_penalty": 1.0}, "text": "decoded"}
    assert (row.pivot, row.prefix_tokens, row.new_tokens) == (EXTENDED, 4, 3)
    assert row.ledger_values()["pivot"] == EXTENDED and row.ledger_values()["prefix_tokens"] == 4


def test_without_parsers_the_text_stays_whole_as_the_chat_route_leaves_it() -> None:
    server = Scripted(tool_parser=None, reasoning_parser=None)
    # A server without a reasoning parser left the thinking inline in content.
    source = truncated(content="<think>\nthinking so far", reasoning_content=None)
    row = extend(server, Extension(source, SUPERSEDED, None, Sampling(4)))
    assert [p for p, _ in server.seen if p in ("/separate_reasoning", "/parse_function_call")] == []
    assert row.content == DECODED
    assert row.reasoning_content is None and row.tool_calls is None and row.finish_reason == "stop"


def test_a_server_without_detokenize_gets_the_texts_joined_and_the_row_says_so() -> None:
    # An older SGLang answers /detokenize 404: not a fatal misconfiguration, the row is extended from the
    # joined texts and records that its seam may hold U+FFFD.
    server = Scripted(tool_parser=None, detokenize=False)
    row = extend(server, Extension(truncated(), SUPERSEDED, None, Sampling(4)))
    assert ("/detokenize", {"tokens": [10, 11, 12, 13, 7, 8, 151645]}) in server.seen
    assert row.status == OK and row.provenance["text"] == "joined"
    joined = "<think>\nthinking so far" + " done\n</think>\n\nCalling." + CALL
    assert ("/separate_reasoning", {"text": joined, "reasoning_parser": "qwen3"}) in server.seen


def test_a_failing_detokenize_fails_the_row() -> None:
    class Broken(Scripted):
        async def handle(self, request: web.Request) -> web.Response:
            if request.path == "/detokenize":
                return web.json_response({"detail": "tokenizer down"}, status=503)
            return await super().handle(request)

    row = extend(Broken(tool_parser=None), Extension(truncated(), SUPERSEDED, None, Sampling(4)), max_attempts=2,
                 quarantine_after=5)
    assert row.status == FAILED and "/detokenize" in row.error


def test_a_row_without_token_ids_is_generated_again_and_says_so() -> None:
    server = Scripted()
    prompt = PromptRow(7, [{"role": "user", "content": "fix it"}], id="p7")
    source = truncated(prompt_token_ids=None, response_token_ids=None)
    assert "no token ids" in not_extendable(source)
    row = extend(server, Extension(source, SUPERSEDED, prompt, Sampling(4)))
    assert [p for p, _ in server.seen] == ["/server_info", "/v1/chat/completions"]  # not streamed: whole
    assert row.status == OK and row.content == "fresh" and row.completion_tokens == 2
    assert row.provenance["action"] == FALLBACK_REGENERATED and "no token ids" in row.provenance["reason"]
    assert row.provenance["supersedes"] == SUPERSEDED.ref() and row.prefix_tokens == 0


def test_ids_that_do_not_match_the_row_are_not_continued() -> None:
    assert not_extendable(truncated()) is None
    assert "do not match" in not_extendable(truncated(completion_tokens=5))


def test_a_failed_split_fails_the_row_so_a_later_run_extends_it_again() -> None:
    class Broken(Scripted):
        async def handle(self, request: web.Request) -> web.Response:
            if request.path == "/separate_reasoning":
                return web.json_response({"detail": "parser down"}, status=503)
            return await super().handle(request)

    row = extend(Broken(tool_parser=None), Extension(truncated(), SUPERSEDED, None, Sampling(4)), max_attempts=2,
                 quarantine_after=5)
    assert row.status == FAILED and "/separate_reasoning" in row.error and "continuing the row cut at 4" in row.error


def test_raw_text_rebuilds_what_the_parser_split() -> None:
    assert raw_text(truncated()) == "<think>\nthinking so far"
    answered = truncated(content="\n\nThe fix", reasoning_content="\nthought\n")
    assert raw_text(answered) == "<think>\nthought\n</think>\n\nThe fix"
    assert separate_reasoning(raw_text(answered), "qwen3") == ("\nthought\n", "\n\nThe fix")
    # A parser that trims can leave content "" right after </think>: the token counts say the answer began.
    assert raw_text(truncated(reasoning_tokens=3)).endswith("</think>")
    assert raw_text(truncated(reasoning_content=None, content="plain")) == "plain"


# ---- the pivot on the stand-in, prompts rich in non-ASCII -----------------------------------------
RICH_SIM = dict(sim_time_scale=20000, log_level="warning", max_running_requests=128, reasoning_parser="qwen3",
                enable_deterministic_inference=True, sim_truncated_share=0.5)
RICH_ROWS = 420


def rich_prompt(i: int) -> dict[str, Any]:
    """A user who writes Chinese, with emoji and arrows: the stand-in answers in its CJK-rich register."""
    return {"id": f"z{i}", "category": "code" if i % 2 else "chat", "messages": [
        {"role": "system", "content": "You are a careful coding assistant."},
        {"role": "user", "content": f"任务 {i}：请修复函数 f{i} 中失败的测试 🙏 → 返回值应该是 x × {i}，谢谢！"}]}


def write_rich_dataset(path, n: int):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps(rich_prompt(i), ensure_ascii=False) + "\n")
    return path


def rows_of(output_root, run_id: str) -> dict[int, GeneratedRow]:
    out = {}
    for key in output_root.commits.entries():
        if f"/{run_id}/" in key:
            out.update({r.index: r for r in output_root.commits.read_part(output_root.commits.read_entry(key)["part"])})
    return out


def exported(root, dest) -> dict[int, dict]:
    export_dataset(str(root), str(dest), include_truncated=True, with_token_ids=True)
    manifest = json.loads((dest / "manifest.json").read_text())
    rows = []
    for shard in manifest["shards"]:
        rows += [json.loads(line) for line in gzip.decompress((dest / shard["name"]).read_bytes()).splitlines()]
    return {r["index"]: r for r in rows}


def cut_inside_a_character(row: GeneratedRow) -> bool:
    """The row's response ids end inside a UTF-8 character (its text ends in U+FFFD)."""
    tok = tokenizer()
    # The ids' bytes: an added token's are its content (ASCII, whole characters).
    data = b"".join(tok.token_bytes[i] if i < tok.size else tok.library.id_to_token(i).encode()
                    for i in unpack_token_ids(row.response_token_ids))
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return exc.reason == "unexpected end of data"
    return False


@pytest.fixture(scope="module")
def rich_runs(tmp_path_factory):
    """The rich dataset at 8192 in one go, and at 4096 then extended to 8192, on one deterministic stand-in."""
    tmp = tmp_path_factory.mktemp("rich")
    sim = start_sim_server(tmp, **RICH_SIM)
    try:
        dataset = write_rich_dataset(tmp / "prompts.jsonl", RICH_ROWS)
        direct, pivot, summary = direct_and_pivot(dataset, tmp, endpoints(sim, in_flight=64), RICH_ROWS)
        yield tmp, direct, pivot, summary
    finally:
        sim.stop(signal.SIGKILL)


def test_extend_from_rows_cut_inside_characters_equals_one_uninterrupted_run_byte_for_byte(rich_runs):
    tmp, direct, pivot, summary = rich_runs
    assert_healthy(root_of(pivot), RICH_ROWS, pivot)
    cut = {i: r for i, r in rows_of(root_of(pivot), "run-4096").items() if r.finish_reason == "length"}
    extended = rows_of(root_of(pivot), "run-pivot")
    uninterrupted = rows_of(root_of(direct), "run-8192")
    assert set(extended) == set(cut) and summary.extended == len(cut) and summary.regenerated == 0
    # First: many of the rows cut at 4096 were cut inside a character, their text ending in U+FFFD.
    inside = [i for i, r in cut.items() if cut_inside_a_character(r)]
    print(f"{len(cut)} rows cut at 4096 and extended, {len(inside)} of them inside a character")
    assert len(inside) >= 20, f"{len(inside)} of {len(cut)} rows cut inside a character"
    assert all((cut[i].reasoning_content or "") .endswith("\ufffd") or (cut[i].content or "").endswith("\ufffd")
               for i in inside)
    # The ledger's parts: every extended row is the uninterrupted row, byte for byte.
    for i, b in extended.items():
        a = uninterrupted[i]
        assert b.status == OK and b.provenance["text"] == "decoded"
        for key in ("content", "reasoning_content", "tool_calls", "finish_reason", "completion_tokens",
                    "reasoning_tokens", "prompt_tokens", "prompt_token_ids", "response_token_ids"):
            assert getattr(b, key) == getattr(a, key), (i, key)
    # The export: the same bytes, and no U+FFFD anywhere the uninterrupted run has none.
    one, two = exported(direct.output_uri, tmp / "export-direct"), exported(pivot.output_uri, tmp / "export-pivot")
    assert sorted(one) == sorted(two) == list(range(RICH_ROWS))
    for i in range(RICH_ROWS):
        a, b = json.dumps(one[i]["messages"], ensure_ascii=False), json.dumps(two[i]["messages"], ensure_ascii=False)
        assert a.encode() == b.encode(), i
        assert ("\ufffd" in b) <= ("\ufffd" in a), i
        for key in ("finish_reason", "completion_tokens", "reasoning_tokens", "response_token_ids"):
            assert two[i][key] == one[i][key], (i, key)


def test_joined_texts_leave_u_fffd_at_the_seams_the_decoding_does_not(rich_runs, monkeypatch):
    # Today's join, forced by a server without /detokenize: the rows cut inside a character get U+FFFD where
    # the character was, and say their seam may hold it; the other rows are exact either way.
    tmp, direct, pivot, _ = rich_runs

    async def absent(self, ids):
        return Outcome(rejected="HTTP 404: Not Found", attempt=1)

    monkeypatch.setattr(SGLangClient, "detokenize", absent)
    sim = start_sim_server(tmp, **RICH_SIM)
    try:
        root = tmp / "joined"
        shutil.copytree(pivot.output_uri, root)
        for run in ("run-pivot",):
            shutil.rmtree(root / "parts" / run, ignore_errors=True)
            shutil.rmtree(root / "ledger" / run, ignore_errors=True)
        shutil.rmtree(root / "ledger-snapshots", ignore_errors=True)
        config = make_config(Path(pivot.dataset_uri), root, max_tokens=8192)
        prepare(config, "run-join")
        run_engine(config, "run-join", endpoints(sim, in_flight=64), tmp / "spool-join", range(RICH_ROWS))
    finally:
        sim.stop(signal.SIGKILL)
    cut = {i: r for i, r in rows_of(root_of(pivot), "run-4096").items() if r.finish_reason == "length"}
    joined = rows_of(root_of(config), "run-join")
    uninterrupted = rows_of(root_of(direct), "run-8192")
    assert set(joined) == set(cut)
    inside = {i for i, r in cut.items() if cut_inside_a_character(r)}
    for i, row in joined.items():
        assert row.provenance["text"] == "joined"
        text, truth = (row.reasoning_content or "") + row.content, \
            (uninterrupted[i].reasoning_content or "") + uninterrupted[i].content
        assert (text == truth) == (i not in inside), i
        if i in inside:
            assert text.count("\ufffd") == truth.count("\ufffd") + 1
    # The ledger records how each text was made, and the report counts such rows (the decoded pivot has none).
    frame = root_of(config).snapshots.frame()
    assert int(frame.loc[frame["run_id"] == "run-join", "text_joined"].sum()) == len(joined)
    decoded = root_of(pivot).snapshots.frame()
    assert audit(decoded, 8192, run_id="run-pivot").pivot["joined_seams"] == 0 and not decoded["text_joined"].any()
    report_json, html = report.render_report(audit(frame, 8192, run_id="run-join"))
    # status reads the ledger through the bounded reader, which keeps the column too.
    assert dataset_status(str(root))["pivot"]["joined_seams"] == len(joined)
    assert report_json["audit"]["pivot"]["joined_seams"] == len(joined)
    assert "joined from two decodings" in html and "seams may hold U+FFFD" in report_json["summary"]
