"""Fencing: a writer commits only while it provably holds what it writes into (docs/reliability.md, "Fencing").

Real processes (engine_support/chunk_driver.py) against a real stand-in: a writer paused with SIGSTOP past
its lease while another takes the root, and two attempts of one chunk on two "workers" (their own spools)
at once. After each: no index has two non-failed rows under one cap, the paused or superseded writer's
finished rows stayed in its spool, and an attempt that later recovers that spool commits none of them again.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from engine_support.helpers import (
    Driver,
    assert_healthy,
    endpoints,
    make_config,
    prepare,
    root_of,
    start_driver,
    write_dataset,
)

from tracegen.cli import main as cli
from tracegen.store.claims import Attempt, ChunkClaim, ChunkSuperseded, claim_key
from tracegen.store.lease import RootLease, owner_digest, stale_leases
from tracegen.store.records import OK, GeneratedRow
from tracegen.store.storage import Fenced, open_storage

TTL_S = 4
ENV = {"TRACEGEN_LEASE_TTL_S": str(TTL_S)}
# Slow enough that a writer has requests in flight and rows in its spool for seconds.
SLOW_SIM = dict(sim_time_scale=4, sim_length_model="short", max_running_requests=64, log_level="warning")
N_ROWS = 40
N_TRIES_ROWS = 160  # the older attempt must still be generating when the newer one has started


def _spooled(spool: Path) -> int:
    return sum(f.read_bytes().count(b"\n") for f in spool.rglob("*.jsonl"))


def _wait_for(what, timeout: float, driver: Driver | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        if driver is not None and driver.proc.poll() is not None:
            raise AssertionError(f"driver exited with {driver.proc.returncode}: {driver.err.read_text()[-2000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {timeout:.0f}s")
        time.sleep(0.05)


def _finish(driver: Driver, bound_s: float) -> bool:
    """Wait for `driver` to exit, up to `bound_s`; False if it still runs then (it waits on the root's lock)."""
    deadline = time.monotonic() + bound_s
    while driver.proc.poll() is None:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_a_writer_paused_past_its_lease_commits_nothing_once_another_took_the_root(tmp_path, sim_server) -> None:
    """Writer A is stopped (SIGSTOP) with rows in flight, for longer than its 4 s lease; writer B (another
    owner) takes the root and generates the same rows; A is continued. A must commit nothing more, keep its
    finished rows in its spool, and a later attempt on that spool commits none of them again."""
    sim = sim_server(**SLOW_SIM)
    dataset = write_dataset(tmp_path / "prompts.jsonl", N_ROWS)
    servers = endpoints(sim, in_flight=8)
    figures = []
    for rep in range(5):
        config = make_config(dataset, tmp_path / f"out{rep}", part_rows=4, part_seconds=0.3)
        prepare(config, "run-fence")
        root = root_of(config)
        spool_a, spool_b = tmp_path / f"spool-a{rep}", tmp_path / f"spool-b{rep}"
        a = start_driver(config, "run-fence", servers, spool_a, 0, N_ROWS, tmp_path, tag=f"a{rep}",
                         writer="writer A", lease_wait_s=0, env=ENV)
        a.wait_ready()
        # Stopped once it has committed some rows and has finished ones in its spool, requests in flight.
        _wait_for(lambda root=root: len(root.commits.entries()) > 0, 60, a)
        _wait_for(lambda spool=spool_a: _spooled(spool) > 0, 60, a)
        a.kill(signal.SIGSTOP)
        committed_before_pause = len(root.snapshots.frame())
        b = start_driver(config, "run-fence", servers, spool_b, 0, N_ROWS, tmp_path, tag=f"b{rep}",
                         writer="writer B", lease_wait_s=60, env=ENV)
        # B waits for A's lease to go stale; had A been stopped inside a commit's lock, B waits for it.
        b_alone = _finish(b, 30)
        a.kill(signal.SIGCONT)
        rc_b, summary_b, err_b = b.wait(120)
        rc_a, summary_a, err_a = a.wait(120)
        assert rc_b == 0, err_b[-3000:]
        duplicates = root.repair.duplicates()
        frame = root.snapshots.frame()
        left_in_spool = _spooled(spool_a)
        again = start_driver(config, "run-fence", servers, spool_a, 0, N_ROWS, tmp_path, tag=f"a{rep}-again",
                             writer="writer A", lease_wait_s=60, env=ENV)
        rc_again, summary_again, err_again = again.wait(120)
        figures.append({"rep": rep, "duplicates": len(duplicates), "a_committed": summary_a["committed_rows"],
                        "a_committed_before_pause": committed_before_pause, "b_committed": summary_b["committed_rows"],
                        "a_left_in_spool": left_in_spool, "a_again_committed": summary_again["committed_rows"],
                        "b_took_root_while_a_stopped": b_alone})
        print(f"fencing rep {rep}: {figures[-1]}")
        assert duplicates == [], duplicates
        # Stopped by its heartbeat (the lease went stale) or by its first commit's fence (the lease is gone).
        assert rc_a == 3 and "lease" in err_a, err_a[-3000:]
        # What A committed, it committed before it was stopped: B's rows are the rest.
        assert summary_a["committed_rows"] == committed_before_pause
        assert summary_b["committed_rows"] + committed_before_pause == len(frame)
        assert rc_again == 0, err_again[-3000:]
        assert summary_again["recovered_rows"] == 0 and summary_again["generated"] == 0
        assert _spooled(spool_a) == 0
        frame = assert_healthy(root, N_ROWS, config)
        assert sorted(frame["index"].tolist()) == list(range(N_ROWS)) and (frame["status"] == OK).all()
    print(f"fencing figures: {figures}")
    assert any(f["a_left_in_spool"] for f in figures), "A never had finished rows to keep: the test proved nothing"


def test_an_older_attempt_of_a_chunk_commits_nothing_once_a_newer_one_claimed_it(tmp_path, sim_server) -> None:
    """Two attempts of one chunk of one run (they share the root's lease) on two workers (two spools) at
    once, as when Airflow retries a task whose first try still runs: once the newer claimed the chunk, the
    older commits nothing, keeps its rows in its spool, and recovering that spool adds no duplicate."""
    sim = sim_server(**SLOW_SIM)
    dataset = write_dataset(tmp_path / "prompts.jsonl", N_TRIES_ROWS)
    servers = endpoints(sim, in_flight=4)
    config = make_config(dataset, tmp_path / "out", part_rows=3, part_seconds=0.3)
    prepare(config, "run-tries")
    root = root_of(config)
    storage = root.storage
    spool_1, spool_2 = tmp_path / "worker-1", tmp_path / "worker-2"
    older = start_driver(config, "run-tries", servers, spool_1, 0, N_TRIES_ROWS, tmp_path, tag="try1", env=ENV)
    older.wait_ready()
    _wait_for(lambda: len(root.commits.entries()) > 0, 60, older)
    claim = claim_key("run-tries", 0)
    first_claim = storage.get(claim)
    newer = start_driver(config, "run-tries", servers, spool_2, 0, N_TRIES_ROWS, tmp_path, tag="try2", env=ENV)
    _wait_for(lambda: storage.get(claim) != first_claim, 60, newer)
    rc_new, summary_new, err_new = newer.wait(180)
    rc_old, summary_old, err_old = older.wait(180)
    assert rc_new == 0, err_new[-3000:]
    duplicates = root.repair.duplicates()
    print(f"two attempts: older committed {summary_old['committed_rows']}, newer {summary_new['committed_rows']}, "
          f"older left {_spooled(spool_1)} rows in its spool, duplicates {len(duplicates)}")
    assert duplicates == [], duplicates
    assert rc_old == 3 and "claimed" in err_old, err_old[-3000:]
    assert summary_old["committed_rows"] + summary_new["committed_rows"] == len(root.snapshots.frame())
    again = start_driver(config, "run-tries", servers, spool_1, 0, N_TRIES_ROWS, tmp_path, tag="try3", env=ENV)
    rc, summary, err = again.wait(120)
    assert rc == 0, err[-3000:]
    assert summary["recovered_rows"] == 0 and summary["generated"] == 0
    frame = assert_healthy(root, N_TRIES_ROWS, config)
    assert sorted(frame["index"].tolist()) == list(range(N_TRIES_ROWS))


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_a_guarded_write_lands_only_while_its_guards_hold(backend, tmp_path, request) -> None:
    """The storage's conditional writes, on a directory and on a real S3 server (moto): swap and remove only
    at the version read, a guarded put refused once a guard changed or its deadline passed."""
    uri = str(tmp_path / "root") if backend == "local" else request.getfixturevalue("s3_uri")
    storage = open_storage(uri)
    v1 = storage.swap("lease/x.json", b"one", None)
    assert v1 is not None and storage.swap("lease/x.json", b"again", None) is None
    v2 = storage.swap("lease/x.json", b"two", v1)
    assert v2 is not None and v2 != v1 and storage.swap("lease/x.json", b"three", v1) is None
    assert storage.get("lease/x.json") == b"two"
    storage.put_guarded("ledger/a.json", b"entry", {"lease/x.json": v2}, time.monotonic() + 60)
    assert storage.get("ledger/a.json") == b"entry"
    with pytest.raises(Fenced, match="replaced or removed"):
        storage.put_guarded("ledger/b.json", b"entry", {"lease/x.json": v1}, time.monotonic() + 60)
    with pytest.raises(Fenced, match="deadline"):
        storage.put_guarded("ledger/c.json", b"entry", {"lease/x.json": v2}, time.monotonic() - 1)
    assert not storage.remove_if("lease/x.json", v1) and storage.exists("lease/x.json")
    assert storage.remove_if("lease/x.json", v2) and not storage.exists("lease/x.json")
    with pytest.raises(Fenced):
        storage.put_guarded("ledger/d.json", b"entry", {"lease/x.json": v2}, time.monotonic() + 60)
    assert not storage.exists("ledger/b.json") and not storage.exists("ledger/c.json")
    assert not storage.exists("ledger/d.json")


def test_a_taken_over_lease_fences_its_holder(tmp_path) -> None:
    """A holder past its TTL whose lease another owner removed on taking the root can neither renew nor
    commit; a renewal before the take-over makes the taker yield instead."""
    storage = open_storage(str(tmp_path / "root"))
    a = RootLease(storage, "writer A", "chunk 0", ttl_s=0.3)
    a.acquire()
    time.sleep(0.4)  # A "paused": its lease is past the TTL
    b = RootLease(storage, "writer B", "chunk 0", ttl_s=0.3)
    b.acquire()
    assert b.held and not storage.exists(a.key)
    with pytest.raises(Fenced), a.fence():
        pass
    # A holder whose own clock says it is fresh (a VM pause the clock did not see) is stopped by the storage.
    c = RootLease(storage, "writer C", "chunk 0", ttl_s=60)
    b.release()
    c.acquire()
    time.sleep(0.4)
    d = RootLease(storage, "writer D", "chunk 0", ttl_s=0.3)
    d.acquire()
    with pytest.raises(Fenced, match="removed or replaced"), c.fence():
        pass
    # A lease renewed after it was judged stale is not removed: the taker yields to it.
    c2 = RootLease(storage, "writer C2", "chunk 0", ttl_s=60)
    d.release()
    c2.acquire()
    time.sleep(0.4)
    stale = stale_leases(storage, 0.3, but=owner_digest("writer E"))
    c2.renew()
    assert not storage.remove_if(*stale[0]) and storage.exists(c2.key)


def test_a_newer_try_wins_the_claim_and_an_older_try_yields(tmp_path) -> None:
    storage = open_storage(str(tmp_path / "root"))
    first = ChunkClaim(storage, "run-1", 3, Attempt("dag/generate_chunk[3]", 1), "try 1", ttl_s=60)
    first.take()
    second = ChunkClaim(storage, "run-1", 3, Attempt("dag/generate_chunk[3]", 2), "try 2", ttl_s=60)
    second.take()
    with pytest.raises(ChunkSuperseded, match="try 2"):
        first.check()
    late = ChunkClaim(storage, "run-1", 3, Attempt("dag/generate_chunk[3]", 1), "try 1 again", ttl_s=60)
    with pytest.raises(ChunkSuperseded, match="claimed by try 2 of the same task"):
        late.take()
    second.check()  # still the newest
    # Another task of the same chunk (the answer's fan-out) claims it whatever the try numbers.
    ChunkClaim(storage, "run-1", 3, Attempt("dag/generate_at_decided_cap[0]", 1), "decided", ttl_s=60).take()
    with pytest.raises(ChunkSuperseded):
        second.check()


def test_verify_fails_naming_an_index_committed_twice_under_one_cap(tmp_path, capsys) -> None:
    dataset = write_dataset(tmp_path / "prompts.jsonl", 10)
    config = make_config(dataset, tmp_path / "out")
    prepare(config, "run-v")
    commits = root_of(config).commits

    def rows(indices, cap=4096):
        return [GeneratedRow(index=i, status=OK, max_tokens=cap, run_id="run-v", chunk=0, finish_reason="stop",
                             completion_tokens=10, content="x") for i in indices]

    commits.commit(rows(range(5)), "run-v", 0, "seg-a")
    commits.commit(rows([3], cap=8192), "run-v", 0, "seg-b")  # an extension's cap: not a duplicate
    assert cli(["verify", config.output_uri]) == 0
    commits.commit(rows([3, 7]), "run-v", 0, "seg-c")  # a second writer's row 3 at 4096
    assert cli(["verify", config.output_uri]) == 1
    out = capsys.readouterr().out
    assert "duplicate: index 3 committed twice under max_tokens=4096" in out and "index 7" not in out


def test_on_s3_a_commit_of_a_writer_whose_lease_was_taken_over_writes_no_entry(s3_uri) -> None:
    """The same fence through `Commits.commit` on a real S3 server (moto): after another owner removed the
    stale lease on taking the root, the old holder's commit raises `Fenced` and leaves no ledger entry."""
    from tracegen.store.root import OutputRoot

    root = OutputRoot(open_storage(s3_uri))
    # A believes it holds for half a minute (its clock stood still, as in a VM pause); B's TTL says A's
    # lease is stale after a second: only the storage's guard can stop A.
    a = RootLease(root.storage, "writer A", "chunk 0", ttl_s=60.0)
    a.acquire()
    rows = [GeneratedRow(index=i, status=OK, max_tokens=4096, run_id="run-s3", chunk=0, finish_reason="stop",
                         completion_tokens=10, content="x") for i in range(3)]
    root.commits.commit(rows, "run-s3", 0, "seg-before", fence=a.fence)
    time.sleep(1.2)
    b = RootLease(root.storage, "writer B", "chunk 0", ttl_s=1.0)
    b.acquire()
    assert b.held and not root.storage.exists(a.key)
    with pytest.raises(Fenced):
        root.commits.commit(rows, "run-s3", 0, "seg-after", fence=a.fence)
    assert [k.rsplit("/", 1)[-1] for k in root.commits.entries()] == ["c00000-seg-before.json"]
