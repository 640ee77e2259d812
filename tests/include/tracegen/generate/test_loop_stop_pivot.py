"""The online loop stop on the pivot's continuations, against a stand-in that streams incrementally and loops as
models do (periods from one token to a thousand, near-variants, onsets early and late): a continuation that
falls into a loop is stopped on the server while it loops, committed as a row of its own kind (finish `loop`,
where it was stopped, its score), and from then on is a runaway to everything that reads the ledger: never
continued, left out of the gate's count, a floor of the cap table, and left to `runaway_policy` by the export."""

from __future__ import annotations

import gzip
import json

from engine_support.helpers import endpoints, make_config, metric, prepare, root_of, run_engine, write_dataset

from tracegen.audit.runaway_rows import find_runaways
from tracegen.audit.stats import gate_counts
from tracegen.audit.token_account import token_account
from tracegen.export import export_dataset
from tracegen.run import plan
from tracegen.store.current import current_rows
from tracegen.store.records import LOOP, OK

SIM = dict(sim_time_scale=20000, log_level="warning", enable_metrics=True, sim_length_model="short",
           sim_runaway_rate=0.5, sim_loop_shape="varied", sim_truncated_share=0.6, reasoning_parser="qwen3",
           incremental_streaming_output=True, stream_interval=16)
N_ROWS, LOW, HIGH = 120, 128, 8192


def test_a_continuation_that_loops_is_stopped_and_is_a_runaway_from_then_on(tmp_path, sim_server):
    sim = sim_server(**SIM)
    dataset = write_dataset(tmp_path / "prompts.jsonl", N_ROWS)
    out = tmp_path / "out"
    low = make_config(dataset, out, max_tokens=LOW)
    prepare(low, "run-low")
    run_engine(low, "run-low", endpoints(sim, in_flight=32), tmp_path / "spool", range(N_ROWS))
    high = make_config(dataset, out, max_tokens=HIGH, truncated_policy="extend")
    prepare(high, "run-high")
    aborted = metric(sim.url, "sglang:num_aborted_requests_total")
    summary = run_engine(high, "run-high", endpoints(sim, in_flight=32), tmp_path / "spool2", range(N_ROWS))
    assert summary.extended > 0
    root = root_of(high)
    frame = root.snapshots.frame()
    cur = current_rows(frame)
    stopped = cur[(cur["finish_reason"] == LOOP) & (cur["status"] == OK)]
    assert len(stopped) > 0, "no continuation looped: the test proved nothing"
    # Each was aborted on the server unless it had already run to its end there (at this time scale a request
    # can finish before its first events are read: the client-level test sees the slot freed), and each was
    # stopped far short of the cap, with its score kept.
    assert metric(sim.url, "sglang:num_aborted_requests_total") - aborted <= len(stopped)
    assert (stopped["completion_tokens"] < HIGH).all() and (stopped["runaway_score"] >= 0.5).all()
    rows = {r.index: r for part in set(stopped["part"]) for r in root.commits.read_part(part)
            if r.finish_reason == LOOP}
    for row in rows.values():
        how = row.provenance["stopped"]
        assert how["at_token"] == row.completion_tokens and how["onset"] < how["at_token"] and how["period"] >= 1
        assert row.provenance["action"] == "extended" and row.has_token_ids
    # From then on a runaway: never continued at a higher cap, judged a runaway, left out of the gate's count.
    loops = set(stopped["index"])
    assert not loops & set(plan.remaining(frame, range(N_ROWS), 2 * HIGH, "extend").tolist())
    assert loops <= set(find_runaways(root, frame))
    judged_without = gate_counts(frame[~frame["index"].isin(loops)], HIGH)[1]
    assert gate_counts(frame, HIGH)[1] == judged_without
    dest = tmp_path / "export"
    manifest = export_dataset(str(out), str(dest), include_truncated=True, check_prefixes=False)
    written = set()
    for shard in sorted(dest.glob("shard-*.jsonl.gz")):
        written |= {json.loads(line)["index"] for line in gzip.decompress(shard.read_bytes()).splitlines()}
    assert manifest.rows == len(written) and not loops & written  # runaway_policy=drop
    # Every token the fleet generated is in one place, the stopped loops among the runaways.
    acct = token_account(frame)
    assert acct["generated"] == acct["kept"] + acct["truncated_left_out"] + acct["runaway"] + acct["superseded"]
    assert acct["stopped_rows"] == len(stopped) and acct["superseded"] == 0 and acct["runaway"] >= acct["stopped_tokens"]
