"""Storage: both backends (a local dir, and moto S3 through the real S3Hook) behave the same."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import pytest

from tracegen.store.storage import (
    LocalStorage,
    S3Storage,
    Storage,
    StorageError,
    StorageKeyError,
    open_storage,
)


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    if request.param == "local":
        return open_storage(f"file://{tmp_path}/out")
    return open_storage(request.getfixturevalue("s3_uri"), retry_deadline_s=5)


def test_round_trip_and_listing(store: Storage) -> None:
    store.put("a/b/one.json", b'{"x": 1}')
    store.put("a/b/two.json", b"22")
    store.put("a/c.txt", b"c")
    store.put("top", b"")
    assert store.get("a/b/one.json") == b'{"x": 1}'
    assert store.get("top") == b""
    assert store.size("a/b/two.json") == 2
    assert store.exists("a/c.txt") and not store.exists("a/nope")
    assert store.list() == ["a/b/one.json", "a/b/two.json", "a/c.txt", "top"]
    assert store.list("a/b/") == ["a/b/one.json", "a/b/two.json"]
    assert store.list("a/b/t") == ["a/b/two.json"]
    assert store.list("a/") == ["a/b/one.json", "a/b/two.json", "a/c.txt"]
    assert store.list("zzz/") == []
    store.put("a/b/one.json", b"replaced")
    assert store.get("a/b/one.json") == b"replaced"
    store.delete("a/b/one.json")
    store.delete("a/b/one.json")  # idempotent
    assert store.list("a/b/") == ["a/b/two.json"]
    assert store.uri_for("a/c.txt").endswith("/a/c.txt") and store.uri_for("x").startswith(store.uri)


def test_ranges(store: Storage) -> None:
    store.put("r.bin", bytes(range(100)))
    assert store.get_range("r.bin", 10, 5) == bytes([10, 11, 12, 13, 14])
    assert store.get_range("r.bin", 95, 50) == bytes(range(95, 100))
    assert store.get_range("r.bin", 100, 10) == b""
    assert store.get_range("r.bin", 200, 10) == b""
    assert store.get_range("r.bin", 3, 0) == b""
    with pytest.raises(ValueError, match="non-negative"):
        store.get_range("r.bin", -1, 3)


def test_missing_key_errors_name_the_object(store: Storage) -> None:
    for call in (
        lambda: store.get("missing/key"),
        lambda: store.size("missing/key"),
        lambda: store.get_range("missing/key", 0, 4),
    ):
        with pytest.raises(StorageKeyError) as info:
            call()
        assert "missing/key" in str(info.value)
        assert isinstance(info.value, KeyError)


@pytest.mark.parametrize("key", ["", "/abs", "a/../b", "a//b", "./a", "a\\b", ".tmp-x"])
def test_bad_keys_rejected(tmp_path: Path, key: str) -> None:
    with pytest.raises(ValueError, match="key"):
        LocalStorage(tmp_path).put(key, b"x")


def test_open_storage_uris(tmp_path: Path) -> None:
    assert isinstance(open_storage(str(tmp_path)), LocalStorage)
    assert open_storage(f"file://{tmp_path}").uri == tmp_path.as_uri() + "/"
    s3 = open_storage("s3://my-bucket/some/prefix/")
    assert isinstance(s3, S3Storage) and s3.uri == "s3://my-bucket/some/prefix/"
    assert open_storage("s3://my-bucket").uri == "s3://my-bucket/"
    for bad in ("relative/dir", "http://x/y", "s3:///nobucket", "file://host/x", "", "s3://B_ad/x"):
        with pytest.raises(ValueError):
            open_storage(bad)


def test_local_put_is_atomic_and_leaves_no_temp(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path)
    big = os.urandom(1 << 20)
    store.put("x/obj", b"old")
    seen: set[bytes] = set()
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            seen.add(store.get("x/obj")[:3])

    t = threading.Thread(target=reader)
    t.start()
    for _ in range(20):
        store.put("x/obj", big)
        store.put("x/obj", b"old")
    stop.set()
    t.join()
    # A reader only ever sees a whole object: b"old" or the big one, never an empty/partial file.
    assert seen <= {b"old", big[:3]}
    assert [p.name for p in (tmp_path / "x").iterdir()] == ["obj"]


def test_local_list_hides_crashed_writer_temp_files(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path)
    store.put("d/real", b"1")
    (tmp_path / "d" / ".tmp-abandoned").write_bytes(b"half")
    assert store.list() == ["d/real"]


def test_s3_put_survives_an_outage(s3, s3_uri: str, caplog: pytest.LogCaptureFixture) -> None:
    store = open_storage(s3_uri, retry_deadline_s=30, backoff_initial_s=0.1, backoff_max_s=0.5)
    store.put("warm", b"1")  # open a pooled connection first: the outage must cut it too
    restored = s3.proxy.outage_for(2.0)
    with caplog.at_level(logging.WARNING, logger="tracegen.store.s3_storage"):
        store.put("during/outage", b"payload")
    restored.join()
    assert any("transient error" in r.getMessage() for r in caplog.records)  # the outage really bit
    assert store.get("during/outage") == b"payload"


def test_s3_gives_up_with_a_clear_error(s3, s3_uri: str) -> None:
    store = open_storage(s3_uri, retry_deadline_s=1.0, backoff_initial_s=0.1, backoff_max_s=0.2)
    with s3.proxy.outage(), pytest.raises(StorageError) as info:
        store.put("never/written", b"x")
    msg = str(info.value)
    assert "never/written" in msg and s3.bucket in msg and "attempts" in msg
    assert not isinstance(info.value, StorageKeyError)


def test_s3_permanent_error_is_not_retried(s3, caplog: pytest.LogCaptureFixture) -> None:
    store = open_storage(f"s3://no-such-bucket-{os.getpid()}/x", retry_deadline_s=30)
    with caplog.at_level(logging.WARNING, logger="tracegen.store.s3_storage"), pytest.raises(StorageError) as info:
        store.put("k", b"x")
    assert "no-such-bucket" in str(info.value) and "NoSuchBucket" in str(info.value)
    assert not [r for r in caplog.records if "transient error" in r.getMessage()]
