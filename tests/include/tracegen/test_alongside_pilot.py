"""The first chunks run beside the pilot (docs/benchmarks.md, occupancy: no GPU idles while the pilot's stragglers finish and
the gate audits), and must never spend GPU time the gate refuses: the engine's stop check, the pilot
gate watch, and the known-long-first order that shortens chunk tails. Real stand-ins over HTTP.
"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from engine_support.helpers import (
    assert_healthy,
    endpoints,
    engine,
    make_config,
    prepare,
    root_of,
    run_engine,
    write_dataset,
)

from tracegen.generate.chunk import GateClosed, generate_chunk_work
from tracegen.generate.engine import ChunkInterrupted
from tracegen.generate.gate_watch import PilotGateWatch
from tracegen.run import PILOT_REPORT
from tracegen.run.plan import ChunkWork, pilot_indices

SLOW = dict(sim_length_model="short", log_level="warning", max_running_requests=8)


def _pilot_report(config, run_id: str, verdict: str, reason: str = "truncation 18.0% > 5.0%") -> None:
    doc = {"verdict": {"verdict": verdict, "reason": reason}, "run": {"config": config.to_json()}}
    root_of(config).run_files.put(run_id, PILOT_REPORT, json.dumps(doc).encode())


def test_a_stop_check_stops_the_chunk_keeps_what_finished_and_a_resume_completes(tmp_path, sim_server):
    sim = sim_server(sim_time_scale=1, **SLOW)  # ~20 rows/s: the chunk is still running when stopped
    n_rows = 200
    config = make_config(write_dataset(tmp_path / "p.jsonl", n_rows), tmp_path / "out")
    prepare(config, "run-1")
    seen: list[tuple[int, int]] = []

    def check(truncated: int, judged: int) -> str | None:
        seen.append((truncated, judged))
        return "the gate said stop" if judged >= 10 else None

    eng = engine(config, "run-1", endpoints(sim, in_flight=8), tmp_path / "spool")
    eng.stop_check, eng.stop_check_interval_s = check, 0.3
    with pytest.raises(ChunkInterrupted) as info:
        eng.run(np.arange(n_rows))
    assert info.value.reason == "the gate said stop"
    assert seen and seen[-1][1] >= 10 and all(t <= j for t, j in seen)
    frame = assert_healthy(root_of(config), n_rows, config)
    assert 10 <= len(frame) < n_rows
    assert len(frame) == eng.summary.committed_rows

    fast = sim_server(sim_time_scale=20000, **SLOW)  # the resume need not be slow
    resumed = run_engine(config, "run-1", endpoints(fast, in_flight=8), tmp_path / "spool", np.arange(n_rows))
    assert resumed.already_done == len(frame)
    final = assert_healthy(root_of(config), n_rows, config)
    assert final["index"].is_unique and len(final) == n_rows


def test_rows_cut_off_under_a_lower_cap_are_sent_first(tmp_path, sim_server):
    sim = sim_server(sim_time_scale=20000, sim_length_model="short", log_level="warning")
    n_rows = 60
    dataset = write_dataset(tmp_path / "p.jsonl", n_rows)
    low = make_config(dataset, tmp_path / "out", max_tokens=100)
    prepare(low, "run-100")
    # The second half first, under the low cap; the first half is never generated before the pivot.
    run_engine(low, "run-100", endpoints(sim, in_flight=16), tmp_path / "spool", range(30, n_rows))
    f100 = root_of(low).snapshots.frame()
    cut = sorted(f100.loc[f100["finish_reason"] == "length", "index"].tolist())
    assert 2 <= len(cut) <= 20

    high = make_config(dataset, tmp_path / "out", max_tokens=400, truncated_policy="regenerate",
                       part_rows=1000, part_seconds=600)
    prepare(high, "run-400")
    # One request at a time, so the order rows finish in is the order they were sent in.
    run_engine(high, "run-400", endpoints(sim, in_flight=1), tmp_path / "spool", range(n_rows))
    root = root_of(high)
    (part,) = root.snapshots.frame().query("run_id == 'run-400'")["part"].unique()
    sent = [row.index for row in root.commits.read_part(part)]
    # Dataset order would send rows 0..29 first; the known-long rows (all past 30) go ahead of them.
    assert sent == cut + list(range(30))


def test_the_watch_follows_the_pilot_verdict_then_stops_reading(tmp_path):
    config = make_config(write_dataset(tmp_path / "p.jsonl", 10), tmp_path / "out", pilot_size=5)
    spec = prepare(config, "run-1")
    watch = PilotGateWatch(spec, root_of(config))
    assert watch(0, 0) is None  # no verdict yet, nothing judged
    _pilot_report(config, "run-1", "pass")
    assert watch(0, 0) is None
    _pilot_report(config, "run-1", "stop")  # settled on the first verdict: no further reads
    assert watch(0, 0) is None

    stop = PilotGateWatch(replace(spec, run_id="run-2"), root_of(config))
    _pilot_report(config, "run-2", "stop", "truncation 18.0% > 5.0% at max_tokens=4096")
    assert stop(0, 0) == "the pilot gate stopped the run: truncation 18.0% > 5.0% at max_tokens=4096"
    assert stop.closed == stop(0, 0)


def test_before_the_verdict_the_chunks_own_rows_close_the_watch_only_on_strong_evidence(tmp_path):
    config = make_config(write_dataset(tmp_path / "p.jsonl", 10), tmp_path / "out", pilot_size=5,
                         truncation_threshold=0.05)
    spec = prepare(config, "run-1")
    root = root_of(config)
    assert PilotGateWatch(spec, root)(60, 299) is None  # 20% but under the gate's minimum sample
    assert PilotGateWatch(spec, root)(20, 300) is None  # 6.7%: not clearly over 5%
    watch = PilotGateWatch(spec, root)
    assert "this chunk's own rows close the gate" in watch(54, 300)  # 18%, the reference job's rate
    warn = make_config(write_dataset(tmp_path / "p.jsonl", 10), tmp_path / "out", gate_mode="warn")
    assert PilotGateWatch(replace(spec, config=warn), root)(300, 300) is None  # gate_mode=warn never stops a chunk


def test_a_chunk_beside_the_pilot_leaves_the_pilot_rows_to_the_pilot(tmp_path, sim_server):
    sim = sim_server(sim_time_scale=20000, sim_length_model="short", log_level="warning")
    n_rows = 100
    config = make_config(write_dataset(tmp_path / "p.jsonl", n_rows), tmp_path / "out", pilot_size=30,
                         max_tokens=400)
    spec = prepare(config, "run-1")
    work = ChunkWork(chunk=0, start=0, stop=n_rows, remaining=n_rows)
    summary = generate_chunk_work(spec, work, alongside_pilot=True, endpoints=endpoints(sim))
    pilot = set(pilot_indices(config, n_rows).tolist())
    assert len(pilot) == 30
    frame = assert_healthy(root_of(config), n_rows, config)
    assert set(frame["index"]) == set(range(n_rows)) - pilot
    assert summary.generated == n_rows - 30

    # Past the gate a chunk covers its whole range: pilot rows left undone are generated there.
    generate_chunk_work(spec, work, endpoints=endpoints(sim))
    assert set(assert_healthy(root_of(config), n_rows, config)["index"]) == set(range(n_rows))


def test_a_chunk_beside_the_pilot_does_not_start_once_the_gate_said_stop(tmp_path, sim_server):
    sim = sim_server(sim_time_scale=20000, sim_length_model="short", log_level="warning")
    config = make_config(write_dataset(tmp_path / "p.jsonl", 50), tmp_path / "out", pilot_size=10)
    spec = prepare(config, "run-1")
    _pilot_report(config, "run-1", "stop")
    work = ChunkWork(chunk=0, start=0, stop=50, remaining=50)
    with pytest.raises(GateClosed, match="not started: the pilot gate stopped the run"):
        generate_chunk_work(spec, work, alongside_pilot=True, endpoints=endpoints(sim))
    assert len(root_of(config).snapshots.frame()) == 0
