"""The output root is data: local storage never follows a link out of the root, and
opening a root to read it creates nothing.

Links planted inside the root (a report pointing at /proc/self/environ, a run directory pointing at /etc)
are refused by every read, skipped by every listing, and never written or deleted through. The root's own
path is the operator's configuration: a root that is itself a link is followed. Only writers create.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tracegen.store.root import OutputRoot
from tracegen.store.storage import (
    LocalStorage,
    StorageKeyError,
    StorageLinkError,
    StorageRootError,
    open_storage,
)

SECRET = b"TRACEGEN_TEST_SECRET=do-not-serve-me"


@pytest.fixture
def planted(tmp_path: Path) -> tuple[LocalStorage, Path, Path]:
    """A root with one real run file, a file link and a directory link to things outside it."""
    outside = tmp_path / "outside"
    (outside / "dir").mkdir(parents=True)
    (outside / "secret.txt").write_bytes(SECRET)
    (outside / "dir" / "report.json").write_bytes(SECRET)
    store = open_storage(str(tmp_path / "out"))
    assert isinstance(store, LocalStorage)
    store.put("runs/good/report.json", b"{}")
    (tmp_path / "out" / "runs" / "evil").mkdir()
    (tmp_path / "out" / "runs" / "evil" / "report.json").symlink_to("/proc/self/environ")
    (tmp_path / "out" / "runs" / "evil" / "report.html").symlink_to(outside / "secret.txt")
    (tmp_path / "out" / "runs" / "evil_dir").symlink_to(outside / "dir", target_is_directory=True)
    return store, tmp_path / "out", outside


def test_reads_refuse_links_inside_the_root(planted) -> None:
    store, _, _ = planted
    for key in ("runs/evil/report.json", "runs/evil/report.html", "runs/evil_dir/report.json"):
        with pytest.raises(StorageLinkError, match="symbolic link") as err:
            store.get(key)
        assert isinstance(err.value, StorageKeyError)  # to a reader, not an object
        assert SECRET.decode() not in str(err.value) and "outside" not in str(err.value)  # the target is not told
        with pytest.raises(StorageLinkError):
            store.get_range(key, 0, 10)
        with pytest.raises(StorageKeyError):
            store.size(key)
        assert not store.exists(key)
    assert store.get("runs/good/report.json") == b"{}"


def test_listings_skip_links_and_never_enter_a_linked_directory(planted) -> None:
    store, _, _ = planted
    assert store.list() == ["runs/good/report.json"]
    assert store.list("runs/") == ["runs/good/report.json"]
    assert store.list("runs/evil/") == [] and store.list("runs/evil_dir/") == []
    assert store.sizes("runs/") == {"runs/good/report.json": 2}
    # What the ledger, status and the review pages see through it: one run, its one file.
    assert OutputRoot(store).run_files.runs() == ["good"]


def test_writes_and_deletes_never_go_through_a_link(planted) -> None:
    store, root, outside = planted
    with pytest.raises(StorageLinkError, match="runs/evil_dir is a symbolic link"):
        store.put("runs/evil_dir/new.json", b"x")
    with pytest.raises(StorageLinkError):
        store.create("runs/evil_dir/lock", b"x")
    with pytest.raises(StorageLinkError):
        store.delete("runs/evil_dir/report.json")
    assert sorted(p.name for p in (outside / "dir").iterdir()) == ["report.json"]
    assert (outside / "dir" / "report.json").read_bytes() == SECRET
    # A link at the key itself is replaced by the object, the file it pointed at is untouched.
    store.put("runs/evil/report.html", b"<html>ours</html>")
    assert (outside / "secret.txt").read_bytes() == SECRET
    assert not (root / "runs" / "evil" / "report.html").is_symlink()
    assert store.get("runs/evil/report.html") == b"<html>ours</html>"


@pytest.mark.timeout(30)
def test_a_fifo_is_no_object_and_does_not_hang_a_reader(tmp_path: Path) -> None:
    store = open_storage(str(tmp_path / "out"))
    store.put("runs/r/run.json", b"{}")
    os.mkfifo(tmp_path / "out" / "runs" / "r" / "report.json")
    assert store.list("runs/") == ["runs/r/run.json"]
    with pytest.raises(StorageLinkError, match="not a regular file"):
        store.get("runs/r/report.json")


def test_a_root_that_is_itself_a_link_is_the_operators_choice(tmp_path: Path) -> None:
    (tmp_path / "volume").mkdir()
    (tmp_path / "root-link").symlink_to(tmp_path / "volume", target_is_directory=True)
    store = open_storage(f"file://{tmp_path}/root-link", must_exist=True)
    store.put("runs/r/run.json", b"{}")
    assert (tmp_path / "volume" / "runs" / "r" / "run.json").read_bytes() == b"{}"
    assert store.list() == ["runs/r/run.json"] and store.get("runs/r/run.json") == b"{}"


def test_opening_a_missing_root_creates_nothing(tmp_path: Path) -> None:
    missing = tmp_path / "typo"
    store = open_storage(str(missing))
    assert store.list() == [] and not store.exists("dataset.json")
    with pytest.raises(StorageKeyError):
        store.get("dataset.json")
    assert OutputRoot(store).run_files.runs() == [] and OutputRoot(store).run_files.dataset() is None
    assert not missing.exists()
    with pytest.raises(StorageRootError, match=f"output root {missing} does not exist"):
        open_storage(str(missing), must_exist=True)
    assert not missing.exists()
    # Only a writer creates the root, with its first object.
    store.put("dataset.json", b"{}")
    assert (missing / "dataset.json").read_bytes() == b"{}"
    open_storage(str(missing), must_exist=True)


def test_a_dangling_root_link_is_named_and_never_created(tmp_path: Path) -> None:
    link = tmp_path / "root-link"
    link.symlink_to(tmp_path / "unmounted" / "out")
    with pytest.raises(StorageRootError, match="symbolic link to .*unmounted/out.*missing"):
        open_storage(str(link), must_exist=True)
    store = open_storage(str(link))
    assert store.list() == []
    # A dangling link is often a volume not mounted: a writer refuses rather than write beside it.
    with pytest.raises(StorageRootError, match="not creating it"):
        store.put("dataset.json", b"{}")
    assert not (tmp_path / "unmounted").exists()


def test_s3_read_only_opens_create_nothing(s3, s3_uri: str) -> None:
    store = open_storage(s3_uri + "never-written", must_exist=True, retry_deadline_s=5)
    assert store.list() == [] and not store.exists("dataset.json")
    assert OutputRoot(store).run_files.runs() == []
    assert open_storage(s3_uri, retry_deadline_s=5).list() == []
