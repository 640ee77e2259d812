"""Measuring the tail against the stand-in (`tracegen.generate.measure`): the pilot's truncated rows, and
only those, are continued from their exact tokens to one cap; only the new tokens are paid for; the budget
bounds the worst case and lowers the cap for every row rather than leaving some out; the measured rows are
rows of the dataset at the cap finally chosen, never generated again; the pilot's gate is unchanged by
them and its cap table and suggestion read them.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from engine_support.helpers import (
    FAST_CLIENT,
    assert_healthy,
    endpoints,
    make_config,
    metric,
    prepare,
    root_of,
    run_engine,
    write_dataset,
)

from tracegen.audit.stats import gate_counts
from tracegen.generate.engine import PILOT_CHUNK, ChunkOptions
from tracegen.generate.measure import (
    MEASURE_CHUNK,
    choose_cap,
    context_limit,
    measure_tail,
    read_measurement,
    worst_case_tokens,
)
from tracegen.run import plan
from tracegen.run.run_report import audit_and_report
from tracegen.sglang.client import ClientConfig
from tracegen.store.current import current_rows
from tracegen.store.records import OK, unpack_token_ids

SIM = dict(sim_time_scale=20000, log_level="warning", enable_metrics=True, max_running_requests=128,
           reasoning_parser="qwen3")
REQS, GEN_TOKENS = "sglang:num_requests_total", "sglang:generation_tokens_total"
N_ROWS, PILOT = 200, 160


def _options(tmp_path, config):
    cc = ClientConfig(request_deadline_s=config.request_deadline_s, max_attempts=config.max_attempts, **FAST_CLIENT)
    return ChunkOptions(spool_dir=str(tmp_path / "spool"), client_config=cc, progress_interval_s=3600)


def _pilot_run(tmp_path, sim, **params):
    """A run at 4096 whose pilot has been generated: (config, spec, servers, pilot indices)."""
    dataset = write_dataset(tmp_path / "prompts.jsonl", N_ROWS)
    config = make_config(dataset, tmp_path / "out", max_tokens=4096, pilot_size=PILOT, **params)
    spec = prepare(config, "run-4096")
    servers = endpoints(sim, in_flight=64)
    pilot = plan.pilot_indices(config, N_ROWS)
    run_engine(config, "run-4096", servers, tmp_path / "spool", pilot, chunk=PILOT_CHUNK)
    return config, spec, servers, pilot


def _rows(root, chunk):
    out = {}
    for key in root.commits.entries():
        entry = root.commits.read_entry(key)
        if f"/c{chunk}-" in entry["part"]:
            out.update({r.index: r for r in root.commits.read_part(entry["part"])})
    return out


def test_measuring_continues_exactly_the_pilots_truncated_rows_and_pays_only_new_tokens(tmp_path, sim_server):
    sim = sim_server(**SIM)
    config, spec, servers, pilot = _pilot_run(tmp_path, sim, measure_budget_tokens=1_000_000_000)
    root = root_of(config)
    first = _rows(root, PILOT_CHUNK)
    truncated = {i for i, r in first.items() if r.finish_reason == "length"}
    assert 10 <= len(truncated) <= 60, "the reference job's calibration truncates ~18% at 4096"
    gate_before = gate_counts(root.snapshots.frame(), 4096)

    sent, tokens = metric(sim.url, REQS), metric(sim.url, GEN_TOKENS)
    m = measure_tail(spec, context_length=None, endpoints=servers, options=_options(tmp_path, config))
    sent, tokens = metric(sim.url, REQS) - sent, metric(sim.url, GEN_TOKENS) - tokens
    assert m.cap == 16384 and "is over the 5.0% threshold" in m.trigger
    assert set(m.indices) == truncated
    measured = _rows(root, MEASURE_CHUNK)
    assert set(measured) == truncated
    # One continuation per truncated row, and only the tokens past each row's 4096-token prefix paid for.
    new_tokens = sum(r.completion_tokens - 4096 for r in measured.values())
    assert sent == len(truncated) and tokens == new_tokens == m.outcome["new_tokens"]
    assert m.outcome["prefix_tokens_reused"] == 4096 * len(truncated)
    assert new_tokens <= m.worst_case_tokens == len(truncated) * (16384 - 4096) <= m.budget_tokens
    for i, row in measured.items():
        cut = first[i]
        assert row.status == OK and row.max_tokens == 16384 and row.pivot == "extended"
        assert unpack_token_ids(row.response_token_ids)[:4096] == unpack_token_ids(cut.response_token_ids)
        # The prompt is the truncated row's, counted once; the completion counts the whole sample.
        assert row.prompt_token_ids == cut.prompt_token_ids and row.prompt_tokens == cut.prompt_tokens
        assert row.completion_tokens == len(unpack_token_ids(row.response_token_ids)) > 4096
        # Cut rows are at the cap; a stop may land on the cap's last token too (SGLang's EOS beats the length cap).
        assert row.finish_reason != "length" or row.completion_tokens == 16384
    o = m.outcome
    assert o["finished"] + o["still_truncated"] == len(truncated) and o["finished"] > 0
    assert read_measurement(root, spec.run_id).outcome == o
    assert_healthy(root, N_ROWS, config)
    # The gate at the run's cap says what it said before: a row continued past 4096 was cut at 4096.
    assert gate_counts(root.snapshots.frame(), 4096) == gate_before

    # A retried task takes up the stored decision and sends nothing more.
    before = metric(sim.url, REQS)
    again = measure_tail(spec, context_length=None, endpoints=servers, options=_options(tmp_path, config))
    assert again.cap == 16384 and again.indices == m.indices and metric(sim.url, REQS) == before
    assert _rows(root, MEASURE_CHUNK).keys() == measured.keys()

    # The reviewer chooses 8192: the measured rows are the dataset's rows there, none generated again.
    c8 = make_config(tmp_path / "prompts.jsonl", tmp_path / "out", max_tokens=8192, pilot_size=PILOT)
    frame = root.snapshots.frame()
    assert plan.remaining(frame, pilot, 8192, "extend").size == 0
    before = metric(sim.url, REQS)
    s8 = run_engine(c8, "run-4096", servers, tmp_path / "spool", pilot, chunk=PILOT_CHUNK)
    assert s8.generated == 0 and s8.already_done == PILOT and metric(sim.url, REQS) == before
    # And at 16384 too; above the measure cap, only the rows still cut there are continued.
    assert plan.remaining(frame, pilot, 16384, "extend").size == 0
    still = {i for i, r in measured.items() if r.finish_reason == "length"}
    assert set(plan.remaining(frame, pilot, 32768, "extend").tolist()) == still
    cur = current_rows(frame)
    cur = cur[cur["index"].isin(truncated)]
    assert (cur["chunk"] == MEASURE_CHUNK).all()


def test_the_pilot_report_reads_the_measured_rows(tmp_path, sim_server):
    sim = sim_server(**SIM)
    config, spec, servers, pilot = _pilot_run(tmp_path, sim, measure_budget_tokens=1_000_000_000)
    measure_tail(spec, context_length=None, endpoints=servers, options=_options(tmp_path, config))
    outcome = audit_and_report(spec, name="pilot-report", indices=pilot)
    assert outcome.verdict == "stop"
    report = json.loads(root_of(config).run_files.get(spec.run_id, "pilot-report.json"))
    tail = report["measurement"]["tail"]
    assert tail["cap"] == 16384 and tail["outcome"]["new_tokens"] > 0
    table = report["cap_table"]
    observed = [r["cap"] for r in table["rows"] if r["basis"] == "observed"]
    assert 8192 in observed and report["measurement"]["observed_up_to"] == max(observed)
    rec = table["recommended_cap"]
    if rec is not None and rec <= 16384:
        assert "measured: " in outcome.reason and f"truncated at {rec:,}" in outcome.reason
    html = root_of(config).run_files.get(spec.run_id, "pilot-report.html").decode()
    assert "Measured and modelled" in html and "new tokens" in html
    # The audit's own truncation figure counts rows still cut; the rows measuring took past the run's cap
    # are counted and explained beside it, so a STOP verdict never sits over an unexplained "0% truncated".
    past = report["audit"]["truncation"]["past_cap"]
    assert past == tail["outcome"]["measured"] > 0  # every measured row was cut at 4096, so ran past it
    # What the pivot did and what measuring did are told apart.
    assert report["audit"]["pivot"]["extended_measuring"] == tail["outcome"]["measured"]
    assert any("ran past 4096 tokens" in n for n in report["audit"]["notes"]) and "ran past 4096 tokens" in html


def test_a_budget_short_of_the_top_cap_takes_every_row_to_a_lower_one(tmp_path, sim_server):
    sim = sim_server(**SIM)
    config, spec, servers, _ = _pilot_run(tmp_path, sim)
    root = root_of(config)
    truncated = {i for i, r in _rows(root, PILOT_CHUNK).items() if r.finish_reason == "length"}
    # Enough for every row to 8192, not to 12288.
    budget = len(truncated) * (8192 - 4096) + 100
    spec = prepare(make_config(tmp_path / "prompts.jsonl", tmp_path / "out", max_tokens=4096, pilot_size=PILOT,
                               measure_budget_tokens=budget), "run-budget")
    tokens = metric(sim.url, GEN_TOKENS)
    m = measure_tail(spec, context_length=None, endpoints=servers, options=_options(tmp_path, config))
    assert m.cap == 8192 and set(m.indices) == truncated and "over the budget" in m.reason
    assert metric(sim.url, GEN_TOKENS) - tokens == m.outcome["new_tokens"] <= budget
    measured = _rows(root, MEASURE_CHUNK)
    assert set(measured) == truncated and all(r.max_tokens == 8192 for r in measured.values())


def test_no_measurement_within_the_threshold_or_when_never(tmp_path, sim_server):
    sim = sim_server(**SIM)
    config, spec, servers, _ = _pilot_run(tmp_path, sim, truncation_threshold=0.9)
    m = measure_tail(spec, context_length=None, endpoints=servers,
                     options=ChunkOptions(spool_dir=str(tmp_path / "spool")))
    assert m.cap is None and m.indices == [] and "within the threshold" in m.reason
    never = prepare(make_config(tmp_path / "prompts.jsonl", tmp_path / "out", max_tokens=4096, pilot_size=PILOT,
                                measure_tail="never"), "run-never")
    assert measure_tail(never, context_length=None, endpoints=servers).reason == "measure_tail=never"
    assert not _rows(root_of(config), MEASURE_CHUNK)


# ---- the cap choice, as pure functions ------------------------------------------------------------


def test_choose_cap_is_the_largest_candidate_the_worst_case_budget_covers():
    prefixes, bare = np.full(10, 4096), np.zeros(10, bool)
    assert choose_cap(prefixes, bare, run_cap=4096, budget=10**9, limit=None)[0] == 16384
    assert choose_cap(prefixes, bare, run_cap=4096, budget=10 * 8192, limit=None)[:2] == (12288, 10 * 8192)
    assert choose_cap(prefixes, bare, run_cap=4096, budget=10 * 8192 - 1, limit=None)[0] == 8192
    cap, _, _, why = choose_cap(prefixes, bare, run_cap=4096, budget=1000, limit=None)
    assert cap is None and "even to 5,120" in why
    # The context clips the candidates: prompt + cap must fit.
    assert context_limit([100, 2000], 16384) == 14384
    assert choose_cap(prefixes, bare, run_cap=4096, budget=10**9, limit=14384)[0] == 14384
    assert choose_cap(prefixes, bare, run_cap=16384, budget=10**9, limit=None, candidates=(8192, 16384))[0] is None
    # The ladder is relative to the run's cap: a pilot at 128 (lengths scaled down 32x) measures to 512.
    assert choose_cap(np.full(10, 128), bare, run_cap=128, budget=10**9, limit=None)[0] == 512
    # A row without token ids is generated again from scratch: it costs the whole cap.
    assert worst_case_tokens(8192, np.array([4096, 4096]), np.array([False, True])) == 4096 + 8192


@pytest.mark.parametrize("value", [-1, 999, 100_000_000_001, 1.5, True])
def test_the_budget_rule_refuses(value):
    from functools import partial

    from tracegen.config import ConfigError, RunConfig

    config = partial(RunConfig, dataset_uri="/data/prompts.jsonl", output_uri="/data/out")
    with pytest.raises(ConfigError, match="measure_budget_tokens"):
        config(measure_budget_tokens=value)
    assert config(measure_budget_tokens=0).measure_budget_tokens == 0
    assert config(measure_budget_tokens=1_000).measure_budget_tokens == 1_000
    with pytest.raises(ConfigError, match="measure_tail"):
        config(measure_tail="sometimes")
    with pytest.raises(ConfigError, match="runaway_policy"):
        config(runaway_policy="ignore")
