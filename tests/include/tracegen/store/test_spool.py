"""Spool: appends survive SIGKILL; every crash window of the commit protocol recovers exactly once."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tracegen.store.entries import encode_part, part_key
from tracegen.store.records import OK, GeneratedRow
from tracegen.store.root import OutputRoot
from tracegen.store.spool import Spool, SpoolBusyError, flush, recover
from tracegen.store.storage import LocalStorage, StorageError, open_storage

RUN = "run-1"
ROOT = Path(__file__).resolve().parents[3]


def row(index: int, chunk: int = 0) -> GeneratedRow:
    return GeneratedRow(index=index, status=OK, max_tokens=4096, run_id=RUN, chunk=chunk, finish_reason="stop",
                        content=f"answer {index} ✓", reasoning_content="think", completion_tokens=10 + index)


@pytest.fixture
def env(tmp_path: Path) -> tuple[Path, str, OutputRoot]:
    out = tmp_path / "out"
    return tmp_path / "spool", str(out), OutputRoot(LocalStorage(out))


def committed(root: OutputRoot) -> list[int]:
    return sorted(root.snapshots.frame()["index"].tolist())


def assert_exactly_once(root: OutputRoot, expected: list[int]) -> None:
    assert committed(root) == expected  # nothing lost, nothing twice
    assert root.repair.check_invariants() == []
    assert root.repair.orphan_parts() == []


def test_append_seal_commit_discard(env) -> None:
    spool_dir, out, root = env
    with Spool(out, RUN, 0, spool_dir) as spool:
        assert spool.seal() is None
        for i in range(5):
            spool.append(row(i))
        assert spool.current_rows == 5 and spool.should_seal(max_rows=5, max_age_s=60)
        assert not spool.should_seal(max_rows=6, max_age_s=60)
        assert spool.should_seal(max_rows=100, max_age_s=0)
        assert flush(spool, root.commits) == 5
        assert flush(spool, root.commits) == 0
        spool.append(row(5))
        assert flush(spool, root.commits) == 1
        assert spool.pending() == [] and [p.name for p in spool.dir.iterdir()] == [".lock"]
    assert_exactly_once(root, list(range(6)))
    assert root.commits.read_part(root.snapshots.frame()["part"].iloc[0])[0].content == "answer 0 ✓"


def test_segment_ids_are_fresh(env) -> None:
    spool_dir, out, _ = env
    with Spool(out, RUN, 0, spool_dir) as spool:
        ids = set()
        for i in range(5):
            spool.append(row(i))
            ids.add(spool.seal().id)
        assert len(ids) == 5


def test_crash_mid_line_drops_only_the_torn_row(env) -> None:
    spool_dir, out, root = env
    spool = Spool(out, RUN, 0, spool_dir)
    for i in range(3):
        spool.append(row(i))
    open_file = next(spool.dir.glob("open-*.jsonl"))
    with open(open_file, "ab") as f:  # the kill landed halfway through writing row 3
        f.write(b'{"index":3,"status":"ok","max_tok')
    spool.close()  # the process is gone; its lock with it

    spool = Spool(out, RUN, 0, spool_dir)
    [seg] = spool.pending()
    assert [r.index for r in seg.rows] == [0, 1, 2]
    assert spool.pending()[0].rows == seg.rows  # stable: asking again gives the same segment
    assert recover(spool, root.commits) == 3
    assert_exactly_once(root, [0, 1, 2])


def test_crash_between_part_and_entry_put(env) -> None:
    spool_dir, out, root = env
    spool = Spool(out, RUN, 0, spool_dir)
    for i in range(4):
        spool.append(row(i))
    seg = spool.seal()
    root.storage.put(part_key(RUN, 0, seg.id), encode_part(seg.rows))  # part PUT done, then the kill
    spool.close()
    assert committed(root) == [] and root.repair.orphan_parts() == [part_key(RUN, 0, seg.id)]

    spool = Spool(out, RUN, 0, spool_dir)
    assert recover(spool, root.commits) == 4
    assert spool.pending() == []
    assert_exactly_once(root, [0, 1, 2, 3])


def test_crash_between_entry_put_and_discard(env) -> None:
    spool_dir, out, root = env
    spool = Spool(out, RUN, 0, spool_dir)
    for i in range(4):
        spool.append(row(i))
    seg = spool.seal()
    root.commits.commit(seg.rows, RUN, 0, seg.id)  # committed, then the kill before discard
    spool.close()

    spool = Spool(out, RUN, 0, spool_dir)
    assert [s.id for s in spool.pending()] == [seg.id]
    assert recover(spool, root.commits) == 0  # already committed: discarded, not committed twice
    assert spool.pending() == []
    assert_exactly_once(root, [0, 1, 2, 3])


def test_crash_before_seal_and_mixed_leftovers(env) -> None:
    spool_dir, out, root = env
    spool = Spool(out, RUN, 0, spool_dir)
    spool.append(row(0))
    spool.seal()  # sealed, never committed
    spool.append(row(1))
    spool.append(row(2))  # unsealed when the kill hits
    spool.close()

    spool = Spool(out, RUN, 0, spool_dir)
    assert [len(s) for s in spool.pending()] == [1, 2]
    spool.append(row(3))  # new work after restart goes to a new segment, excluded from pending
    assert recover(spool, root.commits) == 3
    assert flush(spool, root.commits) == 1
    assert_exactly_once(root, [0, 1, 2, 3])


def test_sigkill_of_a_real_writer_loses_nothing_appended(env) -> None:
    spool_dir, out, root = env
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT / "include")!r})
        from tracegen.store.records import GeneratedRow
        from tracegen.store.spool import Spool
        spool = Spool({out!r}, "run-1", 0, {str(spool_dir)!r})
        i = 0
        while True:
            spool.append(GeneratedRow(index=i, status="ok", max_tokens=4096, run_id="run-1", chunk=0,
                                      finish_reason="stop", content="x" * 5000))
            print(i, flush=True)
            i += 1
            if i % 7 == 0:
                spool.seal()
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    acked = -1
    assert proc.stdout is not None
    for line in proc.stdout:
        acked = int(line)
        if acked >= 40:
            break
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()

    spool = Spool(out, RUN, 0, spool_dir)  # the lock died with the process
    recover(spool, root.commits)
    got = committed(root)
    # Every acknowledged append is committed. The writer keeps appending until the signal lands, so rows
    # past the last one read from the pipe may be there too, but only as a gap-free prefix, each once.
    assert got[: acked + 1] == list(range(acked + 1))
    assert got == list(range(len(got)))
    assert root.repair.check_invariants() == []


def test_one_live_holder_per_spool(env) -> None:
    spool_dir, out, _ = env
    with Spool(out, RUN, 0, spool_dir):
        with pytest.raises(SpoolBusyError, match="held by another"):
            Spool(out, RUN, 0, spool_dir)
        Spool(out, RUN, 1, spool_dir).close()  # another chunk is another spool
        Spool(out + "-other", RUN, 0, spool_dir).close()  # another output root too
    Spool(out, RUN, 0, spool_dir).close()


def test_a_failed_write_leaves_the_segment_whole(env, monkeypatch) -> None:
    """A full disk mid-line: the spool cuts the torn line back, so the rows appended after it are not glued
    to it and lost with it."""
    spool_dir, out, root = env
    real_write = os.write

    def torn(fd, data):
        real_write(fd, bytes(data[:7]))
        raise OSError(errno.ENOSPC, "No space left on device")

    with Spool(out, RUN, 0, spool_dir) as spool:
        spool.append(row(0))
        monkeypatch.setattr(os, "write", torn)
        with pytest.raises(OSError, match="No space left"):
            spool.append(row(1))
        monkeypatch.setattr(os, "write", real_write)
        spool.append(row(2))
        assert flush(spool, root.commits) == 2
    assert_exactly_once(root, [0, 2])


def test_append_rejects_rows_of_another_chunk(env) -> None:
    spool_dir, out, _ = env
    with Spool(out, RUN, 0, spool_dir) as spool, pytest.raises(ValueError, match="chunk 1"):
        spool.append(row(1, chunk=1))


def test_spooled_rows_survive_an_s3_outage(s3, s3_uri: str, tmp_path: Path) -> None:
    root = OutputRoot(open_storage(s3_uri, retry_deadline_s=0.5, backoff_initial_s=0.1, backoff_max_s=0.2))
    with Spool(s3_uri, RUN, 0, tmp_path) as spool:
        spool.append(row(0))
        with s3.proxy.outage(), pytest.raises(StorageError, match="attempts"):
            flush(spool, root.commits)  # gives up (short deadline here): the segment must stay spooled
        assert [len(s) for s in spool.pending()] == [1]
        spool.append(row(1))
        assert flush(spool, root.commits) == 2  # the next flush sends the stranded segment too
    assert committed(root) == [0, 1] and root.repair.check_invariants() == []
