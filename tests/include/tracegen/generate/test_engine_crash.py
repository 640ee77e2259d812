"""Crash safety of the chunk engine: SIGKILL at random moments, SIGTERM, then resume (docs/architecture.md, "Data invariants").

The chunk runs in a real subprocess (engine_support/chunk_driver.py) against a real stand-in over HTTP,
with small parts so kills land before, during and after commits. After every kill: nothing committed
before is lost or changed, no index is committed twice under one cap, every part parses and matches its
entry, done == unique committed indices; and finally a resumed run finishes the chunk.
"""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from engine_support.helpers import (
    assert_healthy,
    endpoints,
    make_config,
    prepare,
    root_of,
    run_engine,
    start_driver,
    write_dataset,
)

from tracegen.store.records import OK, unpack_token_ids

# Slow enough (time scale 5, ~60-token completions) that one attempt generates only part of the chunk,
# so most kills land mid-generation and mid-commit rather than after the chunk is done.
SLOW_SIM = dict(sim_time_scale=8, sim_length_model="short", max_running_requests=64, log_level="warning")


def _entries_snapshot(root) -> dict[str, list]:
    """Entry key -> its ledger rows (what "committed" means); compared across kills."""
    return {k: root.commits.read_entry(k)["columns"]["index"] for k in root.commits.entries()}


def _wait_for_work(root, spool: Path, entries_before: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(f.stat().st_size for f in spool.rglob("*.jsonl")) or len(root.commits.entries()) > entries_before:
            return
        time.sleep(0.05)


def _kill_trials(tmp_path: Path, sim_server, trials: int, n_rows: int, seed: int) -> dict[str, Any]:
    sim = sim_server(**SLOW_SIM)
    dataset = write_dataset(tmp_path / "prompts.jsonl", n_rows)
    config = make_config(dataset, tmp_path / "out", part_rows=15, part_seconds=0.15)
    prepare(config, "run-crash")
    servers = endpoints(sim, in_flight=24)
    root = root_of(config)
    rng = random.Random(seed)
    before = _entries_snapshot(root)
    stats = {"trials": 0, "recovered_rows": 0, "kills_with_spool_left": 0, "killed_mid_work": 0}
    spool = tmp_path / "spool"
    for trial in range(trials):
        driver = start_driver(config, "run-crash", servers, spool, 0, n_rows, tmp_path, tag=f"t{trial}")
        # Kill after imports (seconds of interpreter start-up would otherwise absorb most kills), spread
        # over recovery, planning, generation and commits.
        driver.wait_ready()
        # From the first finished row on (in the spool or committed), so kills land while rows are in flight
        # and parts are being committed whatever the machine's load, not while the task is still starting.
        _wait_for_work(root, spool, len(before), timeout=30)
        time.sleep(rng.uniform(0.0, 1.2))
        driver.kill(signal.SIGKILL)
        rc = driver.proc.wait(30)
        stats["trials"] += 1
        committed = len(root.snapshots.frame())
        stats.setdefault("committed_after_kill", []).append(committed)
        stats["killed_mid_work"] += rc != 0 and committed < n_rows  # the chunk was cut, not finished
        if rc == 0:  # finished before the kill: still a valid trial of the checks below
            _, summary, _ = driver.wait()
            stats["recovered_rows"] += summary["recovered_rows"]
        stats["kills_with_spool_left"] += any(spool.rglob("*.jsonl"))
        after = _entries_snapshot(root)
        lost = {k for k in before if k not in after or after[k] != before[k]}
        assert not lost, f"trial {trial}: committed entries lost or changed: {sorted(lost)[:3]}"
        assert_healthy(root, n_rows, config)
        before = after

    # Resume: the chunk finishes, committing what the last kill left in the spool.
    driver = start_driver(config, "run-crash", servers, spool, 0, n_rows, tmp_path, tag="resume")
    rc, summary, err = driver.wait()
    assert rc == 0, err
    stats["recovered_rows"] += summary["recovered_rows"]
    frame = assert_healthy(root, n_rows, config)
    assert sorted(frame["index"].unique().tolist()) == list(range(n_rows))
    assert len(frame) == n_rows, "an index was committed more than once"
    assert (frame["status"] == OK).all()
    assert not any(spool.rglob("*.jsonl")), "the finished chunk left rows in its spool"
    return stats


def test_sigkill_at_random_moments_loses_and_duplicates_nothing(tmp_path, sim_server):
    stats = _kill_trials(tmp_path, sim_server, trials=15, n_rows=700, seed=20260301)
    print(stats)
    # The checks above prove something only about kills that cut the chunk while it worked.
    assert stats["killed_mid_work"] >= stats["trials"] // 2, stats
    assert stats["kills_with_spool_left"] + stats["recovered_rows"] > 0, "no kill ever caught rows in flight"


@pytest.mark.slow
def test_sigkill_soak(tmp_path, sim_server):
    stats = _kill_trials(tmp_path, sim_server, trials=120, n_rows=8000, seed=7)
    print(stats)
    assert stats["killed_mid_work"] >= stats["trials"] // 2, stats


def test_sigkill_during_extension_loses_and_duplicates_nothing_and_a_resume_extends_again(tmp_path, sim_server):
    # The "short" model is the reference job's at 1/40: cap 100 plays 4096 (18% cut), 200 plays 8192. The first run
    # is fast; the pivot runs slowly on a second stand-in with the same seed and length flags, which
    # finishes the samples the first one started (the ids name their sample), so kills land mid-extension.
    fast = sim_server(sim_time_scale=2000, sim_length_model="short", max_running_requests=128, log_level="warning",
                      reasoning_parser="qwen3")
    slow = sim_server(**SLOW_SIM, reasoning_parser="qwen3")
    n_rows = 1500
    dataset = write_dataset(tmp_path / "prompts.jsonl", n_rows)
    out, spool = tmp_path / "out", tmp_path / "spool"
    first = make_config(dataset, out, max_tokens=100)
    prepare(first, "run-100")
    run_engine(first, "run-100", endpoints(fast, in_flight=64), spool, range(n_rows))
    root = root_of(first)
    cut = {r.index: r for key in root.commits.entries() for r in root.commits.read_part(root.commits.read_entry(key)["part"])
           if r.finish_reason == "length"}
    assert len(cut) > 150

    pivot = make_config(dataset, out, max_tokens=200, part_rows=5, part_seconds=0.1)
    prepare(pivot, "run-200")
    servers = endpoints(slow, in_flight=24)
    rng = random.Random(20260316)
    before = _entries_snapshot(root)
    partial, committed = 0, []
    for trial in range(8):
        driver = start_driver(pivot, "run-200", servers, spool, 0, n_rows, tmp_path, tag=f"x{trial}")
        driver.wait_ready()
        # Killed once this try has committed something, at a random moment after: a loaded machine may take
        # seconds before its first commit, and a kill before it proves nothing about half-done extensions.
        _wait_for_work(root, tmp_path / "no-spool", len(before), timeout=60)
        time.sleep(rng.uniform(0.0, 0.6))
        driver.kill(signal.SIGKILL)
        driver.proc.wait(30)
        after = _entries_snapshot(root)
        lost = {k for k in before if k not in after or after[k] != before[k]}
        assert not lost, f"trial {trial}: committed entries lost or changed: {sorted(lost)[:3]}"
        frame = assert_healthy(root, n_rows, pivot)  # no index twice under one cap, parts match entries
        extended = frame[frame["run_id"] == "run-200"]
        assert set(extended["index"]) <= set(cut) and (extended["pivot"] == "extended").all()
        partial += 0 < len(extended) < len(cut)
        committed.append(len(extended))
        before = after
    print({"truncated": len(cut), "extended_after_each_kill": committed})
    assert partial, "no kill landed while the extensions were half done: the test proved nothing"

    driver = start_driver(pivot, "run-200", servers, spool, 0, n_rows, tmp_path, tag="resume")
    rc, summary, err = driver.wait()
    assert rc == 0, err
    frame = assert_healthy(root, n_rows, pivot)
    mine = frame[frame["run_id"] == "run-200"]
    assert sorted(mine["index"]) == sorted(cut), "each truncated row extended exactly once"
    assert (mine["pivot"] == "extended").all() and (mine["prefix_tokens"] == 100).all()
    rows = {r.index: r for key in root.commits.entries() if "/run-200/" in key
            for r in root.commits.read_part(root.commits.read_entry(key)["part"])}
    for i, row in rows.items():
        # Every extension, before a kill or after the resume, started from the committed truncated row.
        assert row.provenance["supersedes"]["max_tokens"] == 100 and row.provenance["tokens_before"] == 100
        assert unpack_token_ids(row.response_token_ids)[:100] == unpack_token_ids(cut[i].response_token_ids)
    assert not any(spool.rglob("*.jsonl"))


def test_sigterm_commits_finished_rows_and_resume_finishes(tmp_path, sim_server):
    sim = sim_server(**SLOW_SIM)
    n_rows = 800
    dataset = write_dataset(tmp_path / "prompts.jsonl", n_rows)
    config = make_config(dataset, tmp_path / "out", part_rows=500, part_seconds=30.0)
    prepare(config, "run-term")
    servers = endpoints(sim, in_flight=24)
    root = root_of(config)
    spool = tmp_path / "spool"
    driver = start_driver(config, "run-term", servers, spool, 0, n_rows, tmp_path, tag="term")
    # Wait until rows reach the spool (parts are large, so nothing is committed yet), then SIGTERM.
    deadline = time.monotonic() + 60
    while not any(p.stat().st_size for p in spool.rglob("open-*.jsonl")):
        assert driver.proc.poll() is None, driver.err.read_text()
        assert time.monotonic() < deadline, "no row reached the spool within 60 s"
        time.sleep(0.05)
    time.sleep(0.3)
    assert root.commits.entries() == [], "part_rows=500/part_seconds=30 should not have committed yet"
    driver.kill(signal.SIGTERM)
    rc, summary, err = driver.wait(60)
    assert rc == 3, err
    assert "stopped early (SIGTERM received)" in err
    assert summary["interrupted"] == "SIGTERM received"
    frame = assert_healthy(root, n_rows, config)
    # What finished before the signal was committed on the way out, not left for the next attempt.
    assert 0 < len(frame) == summary["committed_rows"] < n_rows
    assert not any(spool.rglob("*.jsonl"))

    driver = start_driver(config, "run-term", servers, spool, 0, n_rows, tmp_path, tag="resume")
    rc, summary2, err = driver.wait()
    assert rc == 0, err
    assert summary2["already_done"] == len(frame)
    assert summary2["generated"] == n_rows - len(frame)
    frame = assert_healthy(root, n_rows, config)
    assert len(frame) == n_rows and frame["index"].nunique() == n_rows
