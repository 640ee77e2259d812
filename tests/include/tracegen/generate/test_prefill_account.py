"""What prefill cost, through the chunk engine against the stand-in over HTTP: each committed row records the
prompt tokens the server found in its prefix cache, where the server says (`/generate` always; the chat route
with --enable-cache-report), and the report and `status --json` sum them from the ledger; a server that does not
say leaves the rows unknown, never 0."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from engine_support.helpers import endpoints, make_config, prepare, root_of, run_engine

from tracegen.cli import main
from tracegen.run.run_record import read_run_record
from tracegen.run.run_report import audit_and_report
from tracegen.status import format_status
from tracegen.store.records import OK

# One long prompt, asked twice: the second time the server holds all of it but its last token in its cache.
LONG = [{"role": "system", "content": "You review code carefully."},
        {"role": "user", "content": "Explain what this module does.\n" + "".join(
            f"def step_{i}(state):\n    return state + {i} * state\n" for i in range(120))}]


def _dataset(path: Path) -> Path:
    path.write_text("".join(json.dumps({"id": f"same-{i}", "messages": LONG}) + "\n" for i in range(2)))
    return path


@pytest.mark.parametrize(("route", "flags", "reported"), [
    ("chat", {"enable_cache_report": True}, True),
    # Without --enable-cache-report: /generate reports its cache whatever the flags (the chat route would not).
    ("generate, streamed and watched", {"incremental_streaming_output": True, "stream_interval": 8}, True),
    ("chat without --enable-cache-report", {}, False),
], ids=["chat", "generate-streamed", "chat-unreported"])
def test_the_same_long_prompt_twice_is_found_cached_in_the_ledger_report_and_status(
        tmp_path, sim_server, capsys, route, flags, reported):
    sim = sim_server(sim_length_model="fixed:20", sim_time_scale=2000, log_level="warning", **flags)
    config = make_config(_dataset(tmp_path / "prompts.jsonl"), tmp_path / "out", max_tokens=256)
    prepare(config, "run-1")
    # One request at a time: the second row's prompt reaches the server once the first is in its cache.
    run_engine(config, "run-1", endpoints(sim, in_flight=1), tmp_path / "spool", [0, 1])
    root = root_of(config)
    frame = root.snapshots.frame().sort_values("index")
    assert (frame["status"] == OK).all() and len(frame) == 2, frame[["index", "status", "error"]]
    sent = frame["prompt_tokens"].tolist()
    assert sent[0] == sent[1] > 1000
    rows = {r.index: r for key in root.commits.entries()
            for r in root.commits.read_part(root.commits.read_entry(key)["part"])}

    report = audit_and_report(read_run_record(root, "run-1"), name="report")
    doc = json.loads(Path(report.json_uri.removeprefix("file://")).read_text())
    html = Path(report.html_uri.removeprefix("file://")).read_text()
    assert main(["status", str(tmp_path / "out"), "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    prefills = (doc["run"]["token_account"]["prefill"], status["token_account"]["prefill"])

    if not reported:
        assert frame["cached_tokens"].isna().all() and [rows[0].cached_tokens, rows[1].cached_tokens] == [None, None]
        for prefill in prefills:
            assert prefill == {"rows": 2, "sent": 2 * sent[0], "known_rows": 0, "known_sent": 0, "cached": 0,
                               "computed": 0, "cached_share": None, "unknown_rows": 2}
        for text in (doc["summary"], html, format_status(status)):
            assert f"{2 * sent[0]:,} prompt tokens sent over 2 rows; cache not reported for 2 rows" in text
        return
    first, second = rows[0].cached_tokens, rows[1].cached_tokens
    # The first found at most what an earlier request shared of the chat template; the second, all but the last.
    assert first is not None and first < 100 and second == sent[1] - 1, route
    assert frame["cached_tokens"].tolist() == [first, second]
    cached = first + second
    for prefill in prefills:
        assert prefill == {"rows": 2, "sent": 2 * sent[0], "known_rows": 2, "known_sent": 2 * sent[0],
                           "cached": cached, "computed": 2 * sent[0] - cached,
                           "cached_share": round(cached / (2 * sent[0]), 4), "unknown_rows": 0}
    line = (f"{2 * sent[0]:,} prompt tokens sent over 2 rows: {cached:,} found cached "
            f"({cached / (2 * sent[0]):.1%}), {2 * sent[0] - cached:,} computed")
    assert f"prefill: {line}" in doc["summary"] and line in html and f"prefill:     {line}" in format_status(status)


def test_a_continuation_sends_the_prompt_and_the_kept_ids_and_finds_them_cached(tmp_path, sim_server):
    sim = sim_server(sim_length_model="fixed:200", sim_time_scale=2000, log_level="warning", enable_cache_report=True)
    dataset = _dataset(tmp_path / "prompts.jsonl")
    servers = endpoints(sim, in_flight=1)
    low = make_config(dataset, tmp_path / "out", max_tokens=64)
    prepare(low, "run-64")
    run_engine(low, "run-64", servers, tmp_path / "spool", [0])
    high = make_config(dataset, tmp_path / "out", max_tokens=256, truncated_policy="extend")
    prepare(high, "run-256")
    run_engine(high, "run-256", servers, tmp_path / "spool", [0])
    root = root_of(high)
    [cut, whole] = sorted((r for key in root.commits.entries()
                           for r in root.commits.read_part(root.commits.read_entry(key)["part"])),
                          key=lambda r: r.max_tokens)
    assert (cut.finish_reason, whole.pivot, whole.prefix_tokens) == ("length", "extended", 64)
    assert whole.prompt_tokens == cut.prompt_tokens and whole.prompt_sent == cut.prompt_tokens + 64
    # The server holds the first request's prompt and all it generated but its last token (never run through
    # the model): that much of the continuation is not computed again.
    assert whole.cached_tokens == whole.prompt_sent - 1
    report = audit_and_report(read_run_record(root, "run-256"), name="report")
    prefill = json.loads(Path(report.json_uri.removeprefix("file://")).read_text())["run"]["token_account"]["prefill"]
    assert (prefill["sent"], prefill["cached"]) == (cut.prompt_sent + whole.prompt_sent,
                                                    cut.cached_tokens + whole.cached_tokens)
