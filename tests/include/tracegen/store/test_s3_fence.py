"""The fence holds under the S3 client's own retries: a guarded write is never sent past its deadline, by
tracegen or by botocore (docs/reliability.md, "Fencing").

Writer A reaches moto through a proxy that swallows ledger-entry PUTs (sent, never answered), on an Airflow
connection that keeps botocore's own retry defaults (legacy mode, up to five attempts) with a 15 s read
timeout. Writer B reaches moto through the plain proxy. A's lease has a 6 s TTL, so its fence's deadline is
3 s after its last renewal and B may take the root 6 s after it.
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.parse
from collections.abc import Iterator

import pytest
from fixtures.s3 import HoldingProxy, S3Server

from tracegen.cli import main as cli
from tracegen.store.lease import RootLease
from tracegen.store.records import OK, GeneratedRow
from tracegen.store.root import OutputRoot
from tracegen.store.storage import Fenced, LocalStorage, open_storage

TTL_S = 6.0
HOSTILE_CONN = "aws_hostile"
# Longer than A's lease: botocore's own re-send of a swallowed PUT comes after B has taken the root.
OPERATOR_READ_TIMEOUT_S = 15


@pytest.fixture(scope="module")
def hostile(s3: S3Server) -> Iterator[HoldingProxy]:
    proxy = HoldingProxy(int(urllib.parse.urlparse(s3.direct_endpoint).port or 0))
    conn = json.loads(s3.conn_json)
    conn["extra"] = {**conn["extra"], "endpoint_url": f"http://127.0.0.1:{proxy.port}",
                     "config_kwargs": {"read_timeout": OPERATOR_READ_TIMEOUT_S,
                                       "retries": {"mode": "legacy", "max_attempts": 5}}}
    env = f"AIRFLOW_CONN_{HOSTILE_CONN.upper()}"
    os.environ[env] = json.dumps(conn)
    try:
        yield proxy
    finally:
        os.environ.pop(env, None)
        proxy.close()


def _rows(run_id: str, indices) -> list[GeneratedRow]:
    return [GeneratedRow(index=i, status=OK, max_tokens=4096, run_id=run_id, chunk=0, finish_reason="stop",
                         completion_tokens=10, content=f"row {i} of {run_id}") for i in indices]


def _committed(root: OutputRoot) -> list[int]:
    return sorted(int(i) for _, entry in root.commits.read_entries(root.commits.entries())
                  for i in entry["columns"]["index"])


class _Commit(threading.Thread):
    """Writer A's commit of rows 0-2 under its lease's fence, in the background; its outcome kept."""

    def __init__(self, root: OutputRoot, lease: RootLease) -> None:
        super().__init__(daemon=True)
        self.root, self.lease = root, lease
        self.outcome: object = None
        self.returned_at = 0.0

    def run(self) -> None:
        try:
            self.outcome = self.root.commits.commit(_rows("run-a", range(3)), "run-a", 0, "seg-a",
                                                    fence=self.lease.fence)
        except BaseException as exc:  # noqa: BLE001 - the outcome is the test's to judge
            self.outcome = exc
        self.returned_at = time.monotonic()


def _start_writer_a(s3: S3Server, s3_uri: str, hostile: HoldingProxy, swallow: int) -> tuple[_Commit, float]:
    root_a = OutputRoot(open_storage(s3_uri, aws_conn_id=HOSTILE_CONN))
    lease = RootLease(root_a.storage, "writer A", "chunk 0", ttl_s=TTL_S)
    lease.acquire()
    where = urllib.parse.urlparse(s3_uri)
    hostile.hold(f"PUT /{where.netloc}{where.path}ledger/".encode(), times=swallow)  # path-style, as on loopback
    started = time.monotonic()
    commit = _Commit(root_a, lease)
    commit.start()
    deadline = time.monotonic() + 20
    while not hostile.swallowed:
        assert time.monotonic() < deadline and commit.is_alive(), f"A's entry PUT never came: {commit.outcome!r}"
        time.sleep(0.02)
    return commit, started


def _writer_b_takes_the_root_and_commits_what_is_left(s3_uri: str) -> OutputRoot:
    root_b = OutputRoot(open_storage(s3_uri))
    lease = RootLease(root_b.storage, "writer B", "chunk 0", ttl_s=TTL_S)
    lease.acquire(wait_s=60)
    left = sorted(set(range(3)) - set(_committed(root_b)))  # B plans from the ledger, as a chunk task does
    if left:
        root_b.commits.commit(_rows("run-b", left), "run-b", 0, "seg-b", fence=lease.fence)
    lease.release()
    return root_b


def test_a_swallowed_entry_put_is_not_resent_after_another_writer_took_the_root(s3, s3_uri, hostile) -> None:
    """A's entry PUT is lost in the network; B takes the root once A's lease is stale and commits rows 0-2.
    A must not land its entry afterwards (botocore's legacy retries re-sent it at the read timeout, 15 s:
    rows 0-2 were then committed twice at one cap): its commit ends `Fenced`, saying its last attempt got
    no answer, and every row is in the ledger once."""
    commit, _ = _start_writer_a(s3, s3_uri, hostile, swallow=1)
    root_b = _writer_b_takes_the_root_and_commits_what_is_left(s3_uri)
    commit.join(timeout=120)
    assert not commit.is_alive()
    # Once A's call has returned, nothing more of it can be sent: what the ledger holds now is final.
    assert isinstance(commit.outcome, Fenced), commit.outcome
    assert "no answer" in str(commit.outcome)
    assert _committed(root_b) == [0, 1, 2]
    assert cli(["verify", s3_uri]) == 0
    assert hostile.forwarded == []  # A's entry PUT was sent once, into the void, and never again


def test_no_attempt_of_a_guarded_put_is_sent_past_its_deadline(s3, s3_uri, hostile) -> None:
    """Every entry PUT of A is swallowed (a network that loses them all): each attempt A sends, by tracegen's
    loop or inside botocore, is sent before its fence's deadline (half the 6 s TTL after the renewal), and
    A's commit gives up by the deadline plus one read timeout at most (the attempt in flight)."""
    commit, started = _start_writer_a(s3, s3_uri, hostile, swallow=100)
    commit.join(timeout=120)
    assert isinstance(commit.outcome, Fenced), commit.outcome
    deadline = started + TTL_S / 2
    assert hostile.swallowed and all(t <= deadline for t in hostile.swallowed), \
        [round(t - started, 2) for t in hostile.swallowed]
    # Without its own bound, the client's read timeout (15 s) would hold the commit long after its deadline.
    assert commit.returned_at - started < TTL_S
    hostile.hold(b"", times=0)


def test_guarded_writes_go_out_once_with_timeouts_within_the_time_left(s3, s3_uri) -> None:
    """What each guarded attempt is sent with, whatever the operator's connection says: botocore makes one
    attempt and its connect and read timeouts end by the deadline; unguarded calls keep retries of their own."""
    storage = open_storage(s3_uri, aws_conn_id="aws_default")
    configs = []
    real = storage._guarded_client

    def recording(time_left_s: float):
        client = real(time_left_s)
        configs.append((time_left_s, client.meta.config))
        return client

    storage._guarded_client = recording
    storage.put_guarded("ledger/x.json", b"{}", {}, time.monotonic() + 5.0)
    assert storage.get("ledger/x.json") == b"{}"
    ((left, config),) = configs
    assert config.retries["total_max_attempts"] == 1
    assert config.connect_timeout <= left <= 5.0 and config.read_timeout <= left
    assert storage.client.meta.config.retries["mode"] == "standard"


def test_a_swap_past_its_deadline_is_not_written(tmp_path) -> None:
    storage = LocalStorage(str(tmp_path / "root"))
    version = storage.swap("lease/a.json", b"one", None)
    with pytest.raises(Fenced):
        storage.swap("lease/a.json", b"two", version, deadline=time.monotonic() - 0.1)
    assert storage.get("lease/a.json") == b"one"
