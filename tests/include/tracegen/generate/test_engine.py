"""The chunk engine against real stand-ins over HTTP: the 4096 -> 8192 pivot, server faults, S3 outages
during commits, context overflow and malformed dataset rows (docs/architecture.md, "Data invariants").

Every test ends with the same checks (`assert_healthy`): ledger invariants hold, done indices equal the
unique indices across committed parts, no index is committed twice under one cap.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from engine_support.helpers import (
    assert_healthy,
    direct_and_pivot,
    endpoints,
    engine,
    make_config,
    metric,
    prepare,
    prompt,
    root_of,
    run_engine,
    write_dataset,
)

from tracegen.export import export_dataset
from tracegen.generate.engine import ChunkInterrupted, InvalidRowError
from tracegen.simulator.lengths import CALIBRATIONS, draw
from tracegen.status import dataset_status, format_status
from tracegen.store.current import current_rows
from tracegen.store.records import FAILED, INVALID, OK, REJECTED, GeneratedRow, unpack_token_ids
from tracegen.store.root import OutputRoot
from tracegen.store.storage import S3Storage, StorageError

FAST = dict(sim_time_scale=2000, sim_length_model="short", log_level="warning", enable_metrics=True)
REQS = "sglang:num_requests_total"


def _messages(i: int):
    return prompt(i)["messages"]


# ---- the 4096 -> 8192 pivot ---------------------------------------------------------------------------


def test_pivot_4096_to_8192_sends_only_truncated_and_unfinished(tmp_path, sim_server):
    # The reference job's calibration: ~18% of samples truncate at 4096, ~2% at 8192. Every request draws a fresh
    # sample, as SGLang does, so nothing below relies on a prompt repeating its length.
    sim = sim_server(sim_time_scale=20000, log_level="warning", enable_metrics=True, max_running_requests=128)
    n_rows, first = 240, 160
    dataset = write_dataset(tmp_path / "prompts.jsonl", n_rows)
    out, spool = tmp_path / "out", tmp_path / "spool"
    c4 = make_config(dataset, out, max_tokens=4096)
    prepare(c4, "run-4096")
    servers = endpoints(sim, in_flight=64)
    # The operator stops the 4096 run two thirds of the way through (rows [0, 160) committed).
    s4 = run_engine(c4, "run-4096", servers, spool, range(first))
    assert s4.generated == first
    output_root = root_of(c4)
    f4 = assert_healthy(output_root, n_rows, c4)
    cut = f4["finish_reason"] == "length"
    truncated = set(f4.loc[cut, "index"].tolist())
    assert (f4.loc[cut, "completion_tokens"] == 4096).all() and (f4.loc[~cut, "completion_tokens"] < 4096).all()
    assert 10 <= len(truncated) <= 60, "the reference job's calibration should truncate ~18% at 4096"

    c8 = make_config(dataset, out, max_tokens=8192, truncated_policy="regenerate")
    prepare(c8, "run-8192")
    sent_before = metric(sim.url, REQS)
    s8 = run_engine(c8, "run-8192", servers, spool, range(n_rows))
    sent = metric(sim.url, REQS) - sent_before
    expected = truncated | set(range(first, n_rows))
    assert sent == len(expected) == s8.generated
    assert s8.already_done == n_rows - len(expected)
    f8 = assert_healthy(output_root, n_rows, c8)
    mine = f8[f8["run_id"] == "run-8192"]
    assert set(mine["index"].tolist()) == expected
    assert (mine["max_tokens"] == 8192).all()
    # Under 8192 a row is cut only at 8192 tokens.
    cut8 = mine["finish_reason"] == "length"
    assert (mine.loc[cut8, "completion_tokens"] == 8192).all() and (mine.loc[~cut8, "completion_tokens"] < 8192).all()
    still_cut = set(mine.loc[cut8, "index"].tolist())
    # The 4096 truncations are kept for audit history, superseded at export.
    assert len(f8[(f8["run_id"] == "run-4096") & (f8["finish_reason"] == "length")]) == len(truncated)

    for include_truncated in (False, True):
        dest = tmp_path / f"export-{include_truncated}"
        result = export_dataset(str(out), str(dest), include_truncated=include_truncated)
        rows = _read_jsonl_export(dest)
        idx = [r["index"] for r in rows]
        assert len(idx) == len(set(idx)) == result.rows
        # No `length` row that could have finished under 8192: every length row left is an 8192 cut.
        lengths = [r for r in rows if r["finish_reason"] == "length"]
        assert {r["index"] for r in lengths if r["max_tokens"] == 8192} == (still_cut if include_truncated else set())
        assert all(r["max_tokens"] == 8192 for r in lengths)
        if include_truncated:
            assert set(idx) == set(range(n_rows))
        else:
            assert not lengths and set(idx) == set(range(n_rows)) - still_cut
        for r in rows:
            assert r["messages"][-1]["role"] == "assistant"
            assert r["max_tokens"] == (8192 if r["index"] in expected else 4096)


def test_pivot_with_keep_regenerates_nothing(tmp_path, sim_server):
    sim = sim_server(sim_time_scale=20000, log_level="warning", enable_metrics=True, max_running_requests=128)
    n_rows = 120
    dataset = write_dataset(tmp_path / "prompts.jsonl", n_rows)
    out, spool = tmp_path / "out", tmp_path / "spool"
    c4 = make_config(dataset, out, max_tokens=4096)
    prepare(c4, "run-4096")
    servers = endpoints(sim, in_flight=64)
    run_engine(c4, "run-4096", servers, spool, range(n_rows))
    f4 = root_of(c4).snapshots.frame()
    assert (f4["finish_reason"] == "length").sum() > 0

    c8 = make_config(dataset, out, max_tokens=8192, truncated_policy="keep")
    prepare(c8, "run-8192-keep")
    sent_before = metric(sim.url, REQS)
    s8 = run_engine(c8, "run-8192-keep", servers, spool, range(n_rows))
    assert metric(sim.url, REQS) == sent_before
    assert s8.generated == 0 and s8.already_done == n_rows
    f8 = assert_healthy(root_of(c8), n_rows, c8)
    assert len(f8) == n_rows


GEN_TOKENS = "sglang:generation_tokens_total"
# The stand-in splits thinking from answer as SGLang's qwen3 parser does, so /separate_reasoning is real.
PIVOT_SIM = dict(sim_time_scale=20000, log_level="warning", enable_metrics=True, max_running_requests=128,
                 reasoning_parser="qwen3")


def _parts_rows(output_root: OutputRoot, run_id: str) -> dict[int, GeneratedRow]:
    """Every row `run_id` committed, read from the parts, by index."""
    out = {}
    for key in output_root.commits.entries():
        if f"/{run_id}/" in key:
            out.update({r.index: r for r in output_root.commits.read_part(output_root.commits.read_entry(key)["part"])})
    return out


def test_pivot_with_extend_sends_only_continuations_and_pays_only_the_new_tokens(tmp_path, sim_server):
    sim = sim_server(**PIVOT_SIM)
    n_rows = 240
    dataset = write_dataset(tmp_path / "prompts.jsonl", n_rows)
    out, spool = tmp_path / "out", tmp_path / "spool"
    c4 = make_config(dataset, out, max_tokens=4096)
    prepare(c4, "run-4096")
    servers = endpoints(sim, in_flight=64)
    run_engine(c4, "run-4096", servers, spool, range(n_rows))
    output_root = root_of(c4)
    first = _parts_rows(output_root, "run-4096")
    truncated = {i for i, r in first.items() if r.finish_reason == "length"}
    assert 20 <= len(truncated) <= 80, "the reference job's calibration should truncate ~18% at 4096"
    assert all(r.has_token_ids for r in first.values()), "every row keeps what a continuation needs"

    c8 = make_config(dataset, out, max_tokens=8192)  # the default policy: extend
    assert c8.truncated_policy == "extend"
    prepare(c8, "run-8192")
    sent, tokens = metric(sim.url, REQS), metric(sim.url, GEN_TOKENS)
    s8 = run_engine(c8, "run-8192", servers, spool, range(n_rows))
    sent, tokens = metric(sim.url, REQS) - sent, metric(sim.url, GEN_TOKENS) - tokens
    f8 = assert_healthy(output_root, n_rows, c8)
    ext = _parts_rows(output_root, "run-8192")
    assert set(ext) == truncated and s8.generated == s8.extended == len(truncated) and s8.already_done == n_rows - len(truncated)
    # One generation request per truncated row (a continuation), and only the tokens past 4096 paid for.
    new_tokens = sum(r.completion_tokens - 4096 for r in ext.values())
    assert sent == len(truncated) and tokens == new_tokens == s8.completion_tokens
    assert s8.prefix_tokens_reused == 4096 * len(truncated)
    for i, row in ext.items():
        cut = first[i]
        assert row.status == OK and row.max_tokens == 8192 and row.pivot == "extended"
        # The same sample, finished: the new response starts with the truncated one's exact tokens.
        ids = unpack_token_ids(row.response_token_ids)
        assert ids[:4096] == unpack_token_ids(cut.response_token_ids) and len(ids) == row.completion_tokens
        assert row.prompt_token_ids == cut.prompt_token_ids and row.prompt_tokens == cut.prompt_tokens
        # A cut row is at the cap; a row at the cap may still have stopped: SGLang's EOS beats the length cap when it
        # is the last token the cap allows (`Req.update_finish_state`), and the stand-in samples that too.
        assert 4096 < row.completion_tokens <= 8192 and (row.finish_reason != "length" or row.completion_tokens == 8192)
        # Seamless text: the truncated row's thinking (and answer, if it had begun) carry on unchanged. A cut
        # inside a character decodes to U+FFFD there, as SGLang's detokenizer does; the whole decoding holds
        # the character.
        assert row.reasoning_content.startswith(cut.reasoning_content.rstrip("\ufffd"))
        assert (row.content or "").startswith((cut.content or "").rstrip("\ufffd"))
        assert row.provenance["supersedes"]["index"] == i and row.provenance["supersedes"]["max_tokens"] == 4096
        assert row.provenance["supersedes"]["part"] in set(f8.loc[f8["run_id"] == "run-4096", "part"])
        assert (row.provenance["tokens_before"], row.provenance["tokens_after"]) == (4096, row.completion_tokens)
    # The extended rows supersede their truncations; the ledger says what the pivot did.
    best = current_rows(f8).set_index("index")
    assert (best.loc[sorted(truncated), "run_id"] == "run-8192").all()
    mine = f8[f8["run_id"] == "run-8192"]
    assert (mine["pivot"] == "extended").all() and (mine["prefix_tokens"] == 4096).all()
    assert "extended" in str(dataset_status(str(out))["pivot"]) and dataset_status(str(out))["pivot"]["tokens_saved"] == 4096 * len(truncated)
    # A row cut inside its thinking went on thinking: some continuations close the thinking they were in.
    in_thinking = [i for i in truncated if not first[i].content]
    assert in_thinking and any(ext[i].content for i in in_thinking)


def test_extend_pivot_equals_one_uninterrupted_run_row_for_row_and_in_the_export(tmp_path, sim_server):
    # Deterministic inference: a prompt's sample is the same on every request, so the run at 8192 and the
    # pivot 4096 -> 8192 must produce identical rows, and the export must hold one seamless completion.
    sim = sim_server(**PIVOT_SIM, enable_deterministic_inference=True)
    n_rows = 160
    dataset = write_dataset(tmp_path / "prompts.jsonl", n_rows)
    c8, p8, s = direct_and_pivot(dataset, tmp_path, endpoints(sim, in_flight=64), n_rows)
    assert s.extended > 10 and s.regenerated == 0

    exports = {}
    for name, root in (("direct", c8.output_uri), ("pivot", p8.output_uri)):
        dest = tmp_path / f"export-{name}"
        export_dataset(str(root), str(dest), include_truncated=True, with_token_ids=True)
        exports[name] = {r["index"]: r for r in _read_jsonl_export(dest)}
    assert sorted(exports["direct"]) == sorted(exports["pivot"]) == list(range(n_rows))
    extended = [i for i, r in exports["pivot"].items() if r["extended"]]
    assert len(extended) == s.extended
    for i in range(n_rows):
        a, b = exports["direct"][i], exports["pivot"][i]
        # Thinking, answer, finish, counts and token ids: exactly the uninterrupted generation's.
        assert b["messages"][-1] == a["messages"][-1], f"row {i}"
        for key in ("finish_reason", "completion_tokens", "reasoning_tokens", "prompt_tokens",
                    "prompt_token_ids", "response_token_ids"):
            assert b[key] == a[key], (i, key)
        assert len(b["response_token_ids"]) == b["completion_tokens"]
    manifest = json.loads((tmp_path / "export-pivot" / "manifest.json").read_text())
    assert manifest["extended_rows"] == s.extended and manifest["with_token_ids"] is True


def test_truncated_rows_without_token_ids_are_regenerated_and_say_so(tmp_path, sim_server, caplog):
    sim = sim_server(**PIVOT_SIM)
    n_rows = 200
    dataset = write_dataset(tmp_path / "prompts.jsonl", n_rows)
    servers = endpoints(sim, in_flight=64)
    c4 = make_config(dataset, tmp_path / "first", max_tokens=4096)
    prepare(c4, "run-4096")
    run_engine(c4, "run-4096", servers, tmp_path / "spool", range(n_rows))
    first = _parts_rows(root_of(c4), "run-4096")
    # The same rows in another root, the even ones as tracegen stored them before it kept token ids.
    old = make_config(dataset, tmp_path / "old", max_tokens=4096)
    prepare(old, "run-4096")
    rows = [GeneratedRow.from_json({**r.to_json(), **({"prompt_token_ids": None, "response_token_ids": None}
                                                      if i % 2 == 0 else {})}) for i, r in sorted(first.items())]
    root_of(old).commits.commit(rows, "run-4096", 0, "seg-old")
    truncated = {i for i, r in first.items() if r.finish_reason == "length"}
    bare = {i for i in truncated if i % 2 == 0}
    assert bare and truncated - bare

    c8 = make_config(dataset, tmp_path / "old", max_tokens=8192)
    prepare(c8, "run-8192")
    tokens = metric(sim.url, GEN_TOKENS)
    with caplog.at_level(logging.WARNING, logger="tracegen.generate.extend"):
        s8 = run_engine(c8, "run-8192", servers, tmp_path / "spool", range(n_rows))
    output_root = root_of(c8)
    assert_healthy(output_root, n_rows, c8)
    new = _parts_rows(output_root, "run-8192")
    assert set(new) == truncated and s8.extended == len(truncated - bare) and s8.regenerated == len(bare)
    for i in bare:
        assert new[i].pivot == "fallback-regenerated" and "no token ids" in new[i].provenance["reason"]
        assert new[i].provenance["supersedes"]["index"] == i and new[i].has_token_ids  # it has them now
    assert all(new[i].pivot == "extended" for i in truncated - bare)
    # The regenerated rows paid all their tokens; the extended ones only their new ones.
    spent = sum(new[i].completion_tokens for i in bare) + sum(new[i].completion_tokens - 4096 for i in truncated - bare)
    assert metric(sim.url, GEN_TOKENS) - tokens == spent == s8.completion_tokens
    assert any("cannot be extended" in m and "no token ids" in m for m in caplog.messages)
    status = dataset_status(str(tmp_path / "old"))
    assert status["pivot"]["fallback_regenerated"] == len(bare) and "had no token ids" in format_status(status)


def _read_jsonl_export(dest) -> list[dict]:
    import gzip

    manifest = json.loads((dest / "manifest.json").read_text())
    rows = []
    for shard in manifest["shards"]:
        rows += [json.loads(line) for line in gzip.decompress((dest / shard["name"]).read_bytes()).splitlines()]
    return rows


# ---- server faults ------------------------------------------------------------------------------------

N_FAULT = 80


def _fault_root(tmp_path, run_id="run-f", **params):
    dataset = write_dataset(tmp_path / "prompts.jsonl", N_FAULT)
    config = make_config(dataset, tmp_path / "out", **params)
    prepare(config, run_id)
    return config


def _all_ok(config, n_rows=N_FAULT):
    frame = assert_healthy(root_of(config), n_rows, config)
    assert sorted(frame["index"].tolist()) == list(range(n_rows)), "each index exactly once"
    assert (frame["status"] == OK).all(), frame[frame["status"] != OK][["index", "status", "error"]].head()
    assert set(frame["finish_reason"]) <= {"stop", "length", "tool_calls"}
    return frame


@pytest.mark.parametrize(
    ("faults", "params"),
    [
        pytest.param(dict(sim_error_rate=0.3, sim_error_status=503), {}, id="5xx"),
        pytest.param(dict(sim_drop_rate=0.3), {}, id="dropped-connections"),
        pytest.param(dict(sim_hang_rate=0.15), dict(request_deadline_s=1.0), id="hangs-short-deadline"),
        pytest.param(dict(sim_abort_rate=0.3), {}, id="abort-finishes"),
    ],
)
def test_transient_faults_are_retried_until_every_row_is_ok(tmp_path, sim_server, faults, params):
    sim = sim_server(**FAST, **faults, sim_fault_seed=3)
    config = _fault_root(tmp_path, max_attempts=12, **params)
    summary = run_engine(config, "run-f", endpoints(sim), tmp_path / "spool", range(N_FAULT))
    frame = _all_ok(config)
    assert summary.statuses == {OK: N_FAULT}
    # The faults really happened: some rows needed more than one attempt.
    assert (frame["attempt"] > 1).any()


def test_crashed_server_work_moves_to_the_healthy_one(tmp_path, sim_server):
    # It crashes on its fourth request: the engine opens 8 at once to each server, so it always gets that far
    # (a later crash could miss, when a loaded machine lets the healthy server take the rest first).
    crashing = sim_server(**FAST, sim_crash_after=3)
    healthy = sim_server(**FAST)
    config = _fault_root(tmp_path)
    run_engine(config, "run-f", endpoints(crashing, healthy, in_flight=8), tmp_path / "spool", range(N_FAULT))
    frame = _all_ok(config)
    assert crashing.proc.wait(30) != 0, "the stand-in should have crashed"
    assert (frame["server"] == healthy.url).sum() >= N_FAULT - 3


def test_wedged_server_work_moves_to_the_healthy_one(tmp_path, sim_server):
    wedged = sim_server(**FAST, sim_wedge_after=5)
    healthy = sim_server(**FAST)
    config = _fault_root(tmp_path, request_deadline_s=2.0)
    run_engine(config, "run-f", endpoints(wedged, healthy, in_flight=8), tmp_path / "spool", range(N_FAULT))
    frame = _all_ok(config)
    assert wedged.alive()  # wedged, not dead: /health kept answering 200
    assert (frame["server"] == wedged.url).sum() <= 5


def test_whole_fleet_gone_stops_with_a_clear_error_and_a_clean_ledger(tmp_path, sim_server):
    dying = sim_server(**FAST, sim_crash_after=30)
    config = _fault_root(tmp_path, part_rows=5)
    spool = tmp_path / "spool"
    with pytest.raises(ChunkInterrupted, match=r"stopped early \(fatal client error: .*after committing \d+ rows"):
        run_engine(config, "run-f", endpoints(dying, in_flight=4), spool, range(N_FAULT), all_down_fatal_s=1.0,
                   quarantine_after=2)
    output_root = root_of(config)
    frame = assert_healthy(output_root, N_FAULT, config)
    assert 0 < len(frame) <= 30
    assert not frame.duplicated("index").any()
    # A new server (the fleet task restarted it): the retry resumes and finishes the chunk.
    fresh = sim_server(**FAST)
    summary = run_engine(config, "run-f", endpoints(fresh), spool, range(N_FAULT))
    assert summary.already_done + summary.generated + summary.recovered_rows >= N_FAULT - (frame["status"] == FAILED).sum()
    frame = assert_healthy(output_root, N_FAULT, config)
    assert set(frame.loc[frame["status"] == OK, "index"]) == set(range(N_FAULT))


def test_context_overflow_is_rejected_once_and_not_retried(tmp_path, sim_server):
    sim = sim_server(**FAST, context_length=1000)
    long_rows = {3: 5000, 11: 8000}  # characters: ~1,250 and ~2,000 prompt tokens, over the 1,000 context
    bad = {i: json.dumps({"messages": [{"role": "user", "content": "x" * n}]}) for i, n in long_rows.items()}
    dataset = write_dataset(tmp_path / "prompts.jsonl", 40, bad=bad)
    config = make_config(dataset, tmp_path / "out", max_tokens=200)
    prepare(config, "run-ctx")
    servers, spool = endpoints(sim), tmp_path / "spool"
    summary = run_engine(config, "run-ctx", servers, spool, range(40))
    assert summary.statuses == {OK: 38, REJECTED: 2}
    frame = assert_healthy(root_of(config), 40, config)
    rejected = frame[frame["status"] == REJECTED]
    assert sorted(rejected["index"]) == sorted(long_rows)
    assert (rejected["attempt"] == 1).all(), "a context overflow must not be retried"
    assert rejected["error"].str.contains("HTTP 400").all()
    # Recorded once: a second attempt at the same cap sends nothing for them.
    again = run_engine(config, "run-ctx", servers, spool, range(40))
    assert again.generated == 0 and again.already_done == 40


# ---- S3 unavailable during a commit -------------------------------------------------------------------


def _s3_storage(uri: str, deadline_s: float) -> S3Storage:
    bucket, _, prefix = uri[len("s3://"):].partition("/")
    return S3Storage(bucket, prefix, retry_deadline_s=deadline_s, backoff_initial_s=0.05, backoff_max_s=0.2)


class _Collect(logging.Handler):
    """Records of one logger, attached directly: Airflow's logging set-up (loaded with the S3 hook)
    replaces root handlers, so pytest's caplog does not see them."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_s3_outage_during_commits_is_ridden_out(tmp_path, sim_server, s3, s3_uri):
    # Slow enough (~3 s of generation) that the outage starts and ends while rows are still coming in.
    sim = sim_server(sim_time_scale=8, sim_length_model="short", log_level="warning", max_running_requests=64)
    n_rows = 300
    dataset = write_dataset(tmp_path / "prompts.jsonl", n_rows)
    config = make_config(dataset, s3_uri, part_rows=10, part_seconds=0.1)
    prepare(config, "run-s3")
    # Commits give up after 0.3 s, so the outage (the first commit's whole attempt) makes it fail and the
    # engine must carry the sealed segments over to a later flush (in production the storage's own 120 s
    # retry usually hides a blip).
    output_root = OutputRoot(_s3_storage(s3_uri, 0.3))
    eng = _engine_with_outage(config, output_root, sim, tmp_path, s3, outage_s=None)
    collect, engine_log = _Collect(), logging.getLogger("tracegen.generate.engine")
    engine_log.addHandler(collect)
    try:
        summary = eng.run(np.arange(n_rows))
    finally:
        engine_log.removeHandler(collect)
    assert any("commit failed, will retry" in m for m in collect.messages), "no commit hit the outage"
    assert summary.interrupted is None and summary.statuses == {OK: n_rows}
    # The ledger is the truth. (summary.committed_rows can undercount here: a segment whose entry PUT
    # reached S3 but whose reply was cut by the outage is later found committed and only discarded.)
    frame = assert_healthy(output_root, n_rows, config)
    assert sorted(frame["index"]) == list(range(n_rows))
    assert not any((tmp_path / "spool").rglob("*.jsonl"))


def test_s3_down_at_the_final_commit_fails_clearly_and_the_spool_keeps_the_rows(tmp_path, sim_server, s3, s3_uri):
    sim = sim_server(**FAST)
    n_rows = 60
    dataset = write_dataset(tmp_path / "prompts.jsonl", n_rows)
    config = make_config(dataset, s3_uri, part_rows=1000, part_seconds=3600)  # one commit, at the end
    prepare(config, "run-s3")
    output_root = OutputRoot(_s3_storage(s3_uri, 0.3))
    spool = tmp_path / "spool"
    eng = _engine_with_outage(config, output_root, sim, tmp_path, s3, outage_s=600)  # S3 stays down
    try:
        with pytest.raises(StorageError, match=r"S3 .*failed after \d+ attempts"):
            eng.run(np.arange(n_rows))
    finally:
        s3.proxy.up()
    assert len(list(spool.rglob("seg-*.jsonl"))) == 1, "the sealed segment must stay in the spool"
    assert output_root.commits.entries() == [] and output_root.repair.check_invariants() == []
    sent_before = metric(sim.url, REQS)
    summary = run_engine(config, "run-s3", endpoints(sim), spool, range(n_rows), root=output_root)
    assert summary.recovered_rows == n_rows and summary.generated == 0
    assert metric(sim.url, REQS) == sent_before, "rows kept in the spool must not be generated again"
    frame = assert_healthy(output_root, n_rows, config)
    assert sorted(frame["index"]) == list(range(n_rows))


def test_final_flush_commits_a_segment_stranded_by_an_earlier_failed_commit(tmp_path):
    """A mid-run commit that failed (S3 down longer than the storage retries) leaves a sealed segment in
    the spool; if no row arrives after it, the end-of-chunk flush must still commit it, not report success
    with rows only on the worker's disk."""
    import asyncio

    from tracegen.store.claims import ChunkClaim
    from tracegen.store.lease import holding_root
    from tracegen.store.records import GeneratedRow
    from tracegen.store.spool import Spool

    dataset = write_dataset(tmp_path / "prompts.jsonl", 5)
    config = make_config(dataset, str(tmp_path / "out"))
    prepare(config, "run-strand")
    eng = engine(config, "run-strand", endpoints(), tmp_path / "spool")
    eng.spool = Spool(config.output_uri, "run-strand", 0, base_dir=str(tmp_path / "spool"))
    for i in range(5):
        eng.spool.append(GeneratedRow(index=i, status=OK, finish_reason="stop", max_tokens=config.max_tokens,
                                      run_id="run-strand", chunk=0, content="done"))
    eng.spool.seal()  # what a failed mid-run commit leaves behind; no rows pending after it
    storage = root_of(config).storage
    # What `arun` holds before any commit: the root's lease and the chunk's claim (commits are fenced by both).
    with holding_root(storage, eng.writer, "test chunk 0") as lease:
        eng.lease = lease
        eng.claim = ChunkClaim(storage, "run-strand", 0, eng.attempt, "test chunk 0", ttl_s=lease.ttl_s)
        eng.claim.take()
        asyncio.run(eng._commit_segment(final=True))
    eng.spool.close()
    assert sorted(root_of(config).snapshots.frame()["index"]) == [0, 1, 2, 3, 4]
    assert eng.summary.committed_rows == 5
    assert not any((tmp_path / "spool").rglob("seg-*.jsonl"))


def _engine_with_outage(config, output_root, sim, tmp_path, s3, outage_s: float | None):
    """An engine whose first commit attempt starts an S3 outage of `outage_s` seconds, or (None) one that
    lasts exactly that attempt: however slow the machine, that commit fails and the later ones do not."""
    eng = engine(config, "run-s3", endpoints(sim, in_flight=12), tmp_path / "spool", root=output_root)
    original = eng._commit_segment
    started = []

    async def commit_with_outage(final: bool = False):
        if started:
            await original(final=final)
            return
        if outage_s is not None:
            started.append(s3.proxy.outage_for(outage_s))
            await original(final=final)
            return
        started.append(s3.proxy.down())
        try:
            await original(final=final)
        finally:
            s3.proxy.up()

    eng._commit_segment = commit_with_outage
    return eng


# ---- malformed dataset rows ---------------------------------------------------------------------------

BAD_ROWS = {
    4: '{"messages": [{"role": "user", "content": "unterminated',
    9: json.dumps({"question": "no form tracegen knows"}),
    13: json.dumps({"messages": "a string, not a list"}),
    17: json.dumps({"messages": [{"role": 7, "content": "role is not a string"}]}),
    21: json.dumps([1, 2, 3]),
}
BAD_REASONS = {4: "malformed JSON", 9: "row is in no form tracegen reads", 13: "'messages' must be a list",
               17: "role 7 is not one of", 21: "row must be a JSON object"}


def test_bad_rows_are_recorded_invalid_with_the_reason(tmp_path, sim_server):
    sim = sim_server(**FAST)
    dataset = write_dataset(tmp_path / "prompts.jsonl", 30, bad=BAD_ROWS)
    config = make_config(dataset, tmp_path / "out", invalid_rows="record")
    prepare(config, "run-bad")
    summary = run_engine(config, "run-bad", endpoints(sim), tmp_path / "spool", range(30))
    assert summary.statuses == {OK: 25, INVALID: 5}
    frame = assert_healthy(root_of(config), 30, config)
    invalid = frame[frame["status"] == INVALID].set_index("index")
    assert sorted(invalid.index) == sorted(BAD_ROWS)
    for i, reason in BAD_REASONS.items():
        assert reason in invalid.loc[i, "error"], (i, invalid.loc[i, "error"])
    # Invalid rows are done: nothing is sent for them again.
    again = run_engine(config, "run-bad", endpoints(sim), tmp_path / "spool", range(30))
    assert again.generated == 0


def test_bad_row_under_fail_names_the_row_and_damages_nothing(tmp_path, sim_server):
    sim = sim_server(**FAST)
    dataset = write_dataset(tmp_path / "prompts.jsonl", 30, bad={13: BAD_ROWS[13]})
    config = make_config(dataset, tmp_path / "out", invalid_rows="fail", part_rows=5)
    prepare(config, "run-fail")
    spool = tmp_path / "spool"
    run_engine(config, "run-fail", endpoints(sim), spool, range(10))  # committed before the bad row
    output_root = root_of(config)
    before = {k: output_root.commits.read_entry(k)["columns"] for k in output_root.commits.entries()}
    with pytest.raises(InvalidRowError, match=r"row 13: 'messages' must be a list"):
        run_engine(config, "run-fail", endpoints(sim), spool, range(30))
    after = {k: output_root.commits.read_entry(k)["columns"] for k in output_root.commits.entries()}
    assert all(after[k] == v for k, v in before.items()), "a committed entry changed"
    frame = assert_healthy(output_root, 30, config)
    assert 13 not in set(frame["index"])
    assert (frame["status"] == OK).all()
    assert set(range(10)) <= set(frame["index"])


def test_short_calibration_is_what_the_fast_tests_assume():
    # The fault tests use the "short" model at max_tokens=4096: nothing truncates, so OK rows are complete.
    assert max(draw(_messages(i), model=CALIBRATIONS["short"]).total for i in range(N_FAULT)) < 4096
