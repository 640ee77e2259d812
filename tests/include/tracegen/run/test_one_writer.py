"""One writer per output root: the scheduled rerun leaves a live run's root alone, takes no orders from
records planted in the root, and every writer holds the root's lease while it generates (`store.lease`)."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import replace

import pytest
from engine_support.helpers import (
    KnownRuns,
    endpoints,
    engine,
    make_config,
    prepare,
    root_of,
    write_dataset,
)

from tracegen.generate.gate_watch import continuous_gate, continuous_sample
from tracegen.run import QUESTION_FILE, RUN_FILE
from tracegen.run.rerun import RerunRefused, RerunWork, run_for_rerun, unfinished_work
from tracegen.run.run_spec import RunSpec
from tracegen.store.lease import LEASE_PREFIX, RootHeld, RootLease, fresh_holders, holding_root
from tracegen.store.records import OK, GeneratedRow
from tracegen.store.storage import open_storage

N_ROWS = 400


def run(tmp_path, run_id: str = "run-1", n_rows: int = N_ROWS, **params) -> RunSpec:
    tmp_path.mkdir(parents=True, exist_ok=True)
    config = make_config(write_dataset(tmp_path / "d.jsonl", n_rows), tmp_path / "out",
                         **{"pilot_size": 0, "chunk_size": 100, "gate_mode": "ask", **params})
    return prepare(config, run_id)


def commit(spec: RunSpec, indices, *, cap: int | None = None, tokens=lambda i: 100, chunk: int = 1) -> None:
    cap = cap or spec.config.max_tokens
    rows = [GeneratedRow(index=int(i), status=OK, max_tokens=cap, run_id=spec.run_id, chunk=chunk,
                         finish_reason="length" if tokens(i) >= cap else "stop", completion_tokens=min(tokens(i), cap),
                         content="done", server="gpu0", latency_s=1.0) for i in indices]
    root_of(spec.config).commits.commit(rows, spec.run_id, chunk, f"seg-{chunk}-{int(indices[0])}")


def question_asked(spec: RunSpec) -> None:
    root_of(spec.config).run_files.put(spec.run_id, QUESTION_FILE, b"{}")


def continuous_gate_holds(spec: RunSpec) -> None:
    # Every row of the continuous gate's sample truncated: the gate is closed with confidence.
    commit(spec, [i for i in sorted(continuous_sample(spec)) if i >= 50], tokens=lambda i: 10**6)
    assert continuous_gate(spec, root_of(spec.config)) is not None


@pytest.mark.parametrize(("state", "situation"), [
    ("queued", None),
    ("running", None),  # generating its fan-out
    ("running", question_asked),  # deferred at the reviewer's question
    ("running", continuous_gate_holds),  # chunks held by the continuous gate, no question written yet
])
def test_a_live_run_owns_its_root(tmp_path, state, situation, caplog) -> None:
    spec = run(tmp_path)
    commit(spec, range(0, 50))
    if situation is not None:
        situation(spec)
    root = spec.config.output_uri
    output_root = root_of(spec.config)
    with caplog.at_level(logging.INFO, logger="tracegen.run.rerun"):
        assert unfinished_work(root, KnownRuns(output_root, {"run-1": state})) == []
    assert f"run run-1 is {state} in Airflow" in caplog.text
    item = RerunWork(root, "run-1", spec.layout.chunks(N_ROWS)[0])
    with pytest.raises(RerunRefused, match=f"run run-1 is {state}"):
        run_for_rerun(item, KnownRuns(output_root, {"run-1": state}))


@pytest.mark.parametrize("state", ["failed", "success"])
def test_a_run_that_ended_is_finished_by_the_rerun(tmp_path, state) -> None:
    spec = run(tmp_path)
    commit(spec, range(0, 50))
    work = unfinished_work(spec.config.output_uri, KnownRuns(root_of(spec.config), {"run-1": state}))
    assert sum(w.work.remaining for w in work) == N_ROWS - 50


def test_a_fresh_lease_of_another_writer_holds_the_root_until_it_expires(tmp_path, caplog) -> None:
    """A run whose worker and scheduler died together is not live in Airflow's metadata, but its lease
    holds the root until it expires; then the rerun finishes the run."""
    spec = run(tmp_path)
    output_root = root_of(spec.config)
    known = KnownRuns(output_root, {"run-1": "failed"})
    other = RootLease(output_root.storage, "another deployment's run", "gpu-box-2 chunk 7", ttl_s=300)
    other.acquire()
    with caplog.at_level(logging.INFO, logger="tracegen.run.rerun"):
        assert unfinished_work(spec.config.output_uri, known) == []
    assert "gpu-box-2 chunk 7" in caplog.text  # the one that yields names the holder
    # The holder died: nobody renews its lease. Past the TTL it no longer holds the root.
    stale = time.time() - 301
    os.utime(output_root.storage.root / other.key, (stale, stale))
    assert sum(w.work.remaining for w in unfinished_work(spec.config.output_uri, known)) == N_ROWS


def test_the_tasks_of_one_rerun_run_share_the_root_and_another_rerun_yields_to_them(tmp_path) -> None:
    """A rerun run maps one task per chunk, all writing as one lease owner: a task that starts while its
    siblings generate goes on (it would otherwise skip its chunk until the next scheduled rerun); a task of
    another owner yields, naming the holder."""
    spec = run(tmp_path)
    output_root = root_of(spec.config)
    known = KnownRuns(output_root, {"run-1": "failed"})
    first, second, *_ = unfinished_work(spec.config.output_uri, known)
    sibling = RootLease(output_root.storage, "tracegen_rerun_failed run R", "chunk 0000", ttl_s=300)
    sibling.acquire()
    assert run_for_rerun(second, known, writer="tracegen_rerun_failed run R").run_id == "run-1"
    with pytest.raises(RerunRefused, match="chunk 0000"):
        run_for_rerun(second, known, writer="tracegen_rerun_failed run S")
    with pytest.raises(RerunRefused, match="chunk 0000"):
        run_for_rerun(first, known)  # no owner of its own: every fresh lease is another's


def test_a_planted_lease_delays_by_one_ttl_at_most_and_chooses_nothing(tmp_path) -> None:
    storage = open_storage(str(tmp_path / "out"))
    key = f"{LEASE_PREFIX}{'0' * 16}.{'1' * 32}.json"
    storage.put(key, json.dumps({"holder": "evil\x1b[2J", "expires_at": "2999-01-01"}).encode())
    (holder,) = fresh_holders(storage, ttl_s=300)
    assert "\x1b" not in holder.describe()  # its text only names it, printable
    # What the object says of its expiry is ignored: its age is the storage's, against the reader's TTL.
    old = time.time() - 400
    os.utime(storage.root / key, (old, old))
    assert fresh_holders(storage, ttl_s=300) == []
    # Stamped in the future (a clock-skew trick to hold forever): not a holder either.
    future = time.time() + 10 * 86_400
    os.utime(storage.root / key, (future, future))
    assert fresh_holders(storage, ttl_s=300) == []


def test_planted_records_choose_nothing(tmp_path) -> None:
    """The newest record in the root no longer drives the rerun: a run Airflow does not know is ignored,
    and a known run's config is Airflow's, whatever its run.json says."""
    spec = run(tmp_path)
    output_root = root_of(spec.config)
    airflow_spec = spec
    # A planted newer run, and the real run's record rewritten: temperature 2.0, a 40,000 cap, regenerate.
    evil = replace(spec, run_id="x", created_at=spec.created_at + 1000,
                   config=replace(spec.config, temperature=2.0, max_tokens=40_000, truncated_policy="regenerate"))
    output_root.run_files.put("x", RUN_FILE, json.dumps(evil.to_json()).encode())
    rewritten = replace(evil, run_id="run-1")
    output_root.run_files.put("run-1", RUN_FILE, json.dumps(rewritten.to_json()).encode())
    known = KnownRuns(output_root, {"run-1": "failed"}, specs={"run-1": airflow_spec})
    (first, *_) = work = unfinished_work(spec.config.output_uri, known)
    assert {w.run_id for w in work} == {"run-1"}
    taken = run_for_rerun(first, known)
    assert (taken.config.temperature, taken.config.max_tokens, taken.config.truncated_policy) == (
        spec.config.temperature, spec.config.max_tokens, spec.config.truncated_policy)


def test_a_run_of_another_dataset_is_ignored(tmp_path) -> None:
    spec = run(tmp_path)
    other = run(tmp_path / "elsewhere", run_id="run-2", n_rows=N_ROWS + 1)
    output_root = root_of(spec.config)
    known = KnownRuns(output_root, {"run-1": "failed", "run-2": "running"}, specs={"run-2": other})
    output_root.run_files.put("run-2", RUN_FILE, json.dumps(other.to_json()).encode())  # planted here
    # run-2 is live, but of another root and dataset: it neither owns this root nor is finished here.
    work = unfinished_work(spec.config.output_uri, known)
    assert {w.run_id for w in work} == {"run-1"}


def test_writers_of_one_owner_share_the_root_and_others_yield(tmp_path) -> None:
    storage = open_storage(str(tmp_path / "out"))
    with holding_root(storage, "run A", "chunk 1", ttl_s=60) as a1, holding_root(storage, "run A", "chunk 2", ttl_s=60):
        assert a1.held
        with pytest.raises(RootHeld, match="chunk 1|chunk 2"):
            with holding_root(storage, "rerun B", "rerun chunk 3", ttl_s=60):
                pass
    assert storage.list(LEASE_PREFIX) == []  # released when the tasks end
    with holding_root(storage, "rerun B", "rerun chunk 3", ttl_s=60) as b:
        assert b.held


def test_racing_writers_never_both_hold(tmp_path) -> None:
    storage = open_storage(str(tmp_path / "out"))
    for trial in range(30):
        leases = [RootLease(storage, f"owner {k}", f"trial {trial}", ttl_s=60) for k in range(4)]
        barrier = threading.Barrier(len(leases))

        def race(lease: RootLease, barrier: threading.Barrier = barrier) -> None:
            barrier.wait()
            lease.try_acquire()

        threads = [threading.Thread(target=race, args=(lease,)) for lease in leases]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sum(lease.held for lease in leases) <= 1, trial
        for lease in leases:
            lease.release()


def test_a_lease_on_s3_is_exclusive(s3_uri) -> None:
    storage = open_storage(s3_uri)
    with holding_root(storage, "run A", "chunk 1", ttl_s=60):
        with pytest.raises(RootHeld, match="chunk 1"):
            RootLease(storage, "rerun B", "rerun chunk", ttl_s=60).acquire()
    assert storage.create("lock", b"one") and not storage.create("lock", b"two")
    assert storage.get("lock") == b"one"


def test_a_chunk_engine_of_another_writer_yields_before_sending_anything(tmp_path, sim_server) -> None:
    sim = sim_server()
    spec = run(tmp_path)
    storage = root_of(spec.config).storage
    with holding_root(storage, "tracegen_generate run live-run", "chunk 0003", ttl_s=60):
        e = engine(spec.config, "run-1", endpoints(sim), tmp_path / "spool")
        e.writer, e.lease_wait_s = "tracegen_rerun_failed run r1", 0
        with pytest.raises(RootHeld, match="live-run, chunk 0003|chunk 0003"):
            e.run(range(0, 20))
    assert root_of(spec.config).commits.entries() == []


def test_a_record_is_looked_up_by_its_airflow_run_id_and_must_be_that_runs(tmp_path) -> None:
    """Airflow spells run ids with ':' and '+'; the root stores their file-safe form, so a record names the
    DagRun to ask about. A planted record naming a real run is not that run's: Airflow's run must be the
    one stored under the record's directory."""
    config = make_config(write_dataset(tmp_path / "d.jsonl", N_ROWS), tmp_path / "out", pilot_size=0, chunk_size=100)
    from engine_support.helpers import fleet_ref

    from tracegen.run.prepare import prepare_run

    airflow_id = "manual__2026-12-01T17:00:00+00:00"
    spec, _ = prepare_run(config, "manual__2026-12-01T17_00_00_00_00", fleet_ref(), airflow_run_id=airflow_id)
    output_root = root_of(config)
    known = KnownRuns(output_root, {}, specs={airflow_id: spec})
    known.states[airflow_id] = "failed"
    work = unfinished_work(config.output_uri, known)
    assert {w.run_id for w in work} == {spec.run_id} and sum(w.work.remaining for w in work) == N_ROWS
    # The same hint in a record planted under another name: Airflow's run is not stored there; ignored.
    planted = replace(spec, run_id="planted", created_at=spec.created_at + 10)
    output_root.run_files.put("planted", RUN_FILE, json.dumps(planted.to_json()).encode())
    assert {w.run_id for w in unfinished_work(config.output_uri, known)} == {spec.run_id}


def test_a_renewal_whose_write_outlasts_the_ttl_loses_the_lease(tmp_path) -> None:
    """A put that retries past the TTL (an S3 outage) left the lease void to other writers meanwhile: the
    holder must not go on as if it still held the root."""
    from tracegen.store.lease import LeaseLost

    storage = open_storage(str(tmp_path / "out"))
    lease = RootLease(storage, "run A", "chunk 1", ttl_s=0.5)
    lease.acquire()
    slow_put = storage.put

    def put(key: str, data: bytes) -> None:
        time.sleep(0.7)
        slow_put(key, data)

    storage.put = put
    with pytest.raises(LeaseLost):
        lease.renew()
    assert not lease.held


@pytest.mark.parametrize("holder_meanwhile", [False, True])
def test_a_take_whose_write_waited_past_half_the_ttl_is_withdrawn_and_looked_at_again(tmp_path, holder_meanwhile):
    """The write that takes the root waited on the root's lock (its holder was stopped inside it) for most of a
    TTL: the lease would be stale before its first renewal, so it is withdrawn and the root looked at again.
    The holder it waited for, continued and fresh again, keeps the root; otherwise the second write takes it."""
    storage = open_storage(str(tmp_path / "out"))
    lease = RootLease(storage, "writer B", "chunk 0", ttl_s=1.0)
    plain_swap, writes = storage.swap, []

    def swap(key: str, data: bytes, expected: str | None, *, deadline: float | None = None) -> str | None:
        writes.append(key)
        if len(writes) == 1:
            if holder_meanwhile:
                RootLease(storage, "writer A", "writer A, chunk 0", ttl_s=60).acquire()
            time.sleep(0.6)
        return plain_swap(key, data, expected, deadline=deadline)

    storage.swap = swap
    if holder_meanwhile:
        with pytest.raises(RootHeld, match="writer A"):
            lease.acquire()
        assert not lease.held and lease.key not in storage.list(LEASE_PREFIX)
        return
    lease.acquire()
    assert lease.held and writes == [lease.key, lease.key]
    lease.renew()  # fresh: the renewal counts from the second write
    assert storage.list(LEASE_PREFIX) == [lease.key]
