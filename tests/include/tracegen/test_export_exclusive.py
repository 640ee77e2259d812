"""One export at a time per destination, through `python -m tracegen export` in real processes.

Export A runs in its own process with one hook: after writing its first shard it says so (a `ready` file)
and waits for a `go` file, so it is mid-export, holding the destination, for as long as a test needs.
Export B is a plain `python -m tracegen export ... --overwrite` into the same destination meanwhile.

Without a lock both would exit 0: B removes every shard it listed at its start (A's first shard among them),
and A then publishes a manifest listing a shard that no longer exists. So B refuses, naming A (host, pid),
A publishes, and every shard of the published manifest exists and matches its sha256. A lock whose holder
died is taken over once stale (then the old holder publishes nothing), and a manifest changed under an
export is never published over. Locally and on S3 (moto's server: conditional PUTs).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from engine_support.helpers import ROOT, make_config, prepare, root_of, write_dataset

from tracegen.store.records import OK, GeneratedRow

# Export A: the CLI with a pause before its second shard (after the first is written and the lock refreshed).
PAUSED_EXPORT = """
import pathlib, sys, time
import tracegen.export.writer as writer
ready, go = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
finish, calls = writer.Encoder.finish, []
def paused(encoder):
    calls.append(1)
    if len(calls) == 2:
        ready.touch()
        deadline = time.monotonic() + 120
        while not go.exists():
            if time.monotonic() > deadline:
                raise SystemExit("never told to go on")
            time.sleep(0.05)
    return finish(encoder)
writer.Encoder.finish = paused
from tracegen.cli import main
sys.exit(main(sys.argv[3:]))
"""

ROWS = 12


def _row(i: int) -> GeneratedRow:
    return GeneratedRow(
        index=i, status=OK, max_tokens=4096, run_id="run-a", chunk=0, finish_reason="stop",
        content=f"answer {i}", reasoning_content=f"thinking {i}", prompt_tokens=30, completion_tokens=100,
        attempt=1, server="http://127.0.0.1:1",
    )  # fmt: skip


@pytest.fixture
def root(tmp_path) -> Path:
    dataset = write_dataset(tmp_path / "prompts.jsonl", ROWS)
    config = make_config(dataset, tmp_path / "out")
    prepare(config, "run-a")
    root_of(config).commits.commit([_row(i) for i in range(ROWS)], "run-a", 0, "seg-a")
    return tmp_path / "out"


def _env() -> dict[str, str]:
    # The S3 fixture's connection is in os.environ: the processes reach the same server.
    return {**os.environ, "PYTHONPATH": str(ROOT / "include")}


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tracegen", *argv], capture_output=True, text=True, cwd=ROOT,
                          env=_env(), timeout=180)


class Paused:
    """Export A, paused mid-export until `go()`."""

    def __init__(self, tmp_path: Path, *argv: str) -> None:
        self.ready, self.go_file = tmp_path / "ready", tmp_path / "go"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", PAUSED_EXPORT, str(self.ready), str(self.go_file), "export", *argv],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=_env(),
        )  # fmt: skip
        deadline = time.monotonic() + 120
        while not self.ready.exists():
            if self.proc.poll() is not None:
                raise AssertionError(f"export A ended before its pause: {self.proc.communicate()}")
            assert time.monotonic() < deadline, "export A never reached its pause"
            time.sleep(0.05)

    def go(self) -> tuple[int, str, str]:
        self.go_file.touch()
        out, err = self.proc.communicate(timeout=180)
        return self.proc.returncode, out, err

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


@pytest.fixture
def paused(tmp_path) -> Iterator[Callable[..., Paused]]:
    started: list[Paused] = []

    def start(*argv: str) -> Paused:
        started.append(Paused(tmp_path, *argv))
        return started[-1]

    yield start
    for p in started:
        p.kill()


# ---- the destination, local or S3 ------------------------------------------------------------------


class LocalDest:
    def __init__(self, path: Path) -> None:
        self.uri, self.path = str(path), path

    def files(self) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in self.path.iterdir()} if self.path.exists() else {}

    def age_lock(self, seconds: float) -> None:
        t = time.time() - seconds
        os.utime(self.path / "export.lock", (t, t))

    def put(self, key: str, data: bytes) -> None:
        (self.path / key).write_bytes(data)


class S3Dest:
    def __init__(self, s3, uri: str) -> None:
        import boto3

        self.uri = uri
        self.bucket, self.prefix = s3.bucket, uri.split(f"s3://{s3.bucket}/", 1)[1]
        self.client = boto3.client("s3", endpoint_url=s3.direct_endpoint, region_name="us-east-1",
                                   aws_access_key_id="testing-key", aws_secret_access_key="testing-secret")

    def files(self) -> dict[str, bytes]:
        out = {}
        for obj in self.client.list_objects_v2(Bucket=self.bucket, Prefix=self.prefix).get("Contents", []):
            body = self.client.get_object(Bucket=self.bucket, Key=obj["Key"])["Body"].read()
            out[obj["Key"][len(self.prefix):]] = body
        return out

    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self.prefix + key, Body=data)


@pytest.fixture(params=["local", "s3"])
def dest(request, tmp_path):
    if request.param == "local":
        return LocalDest(tmp_path / "export")
    s3 = request.getfixturevalue("s3")
    return S3Dest(s3, request.getfixturevalue("s3_uri") + "export/")


def _published(dest) -> tuple[dict, dict[str, bytes]]:
    """The manifest and every object; each shard it lists exists and matches its sha256, rows 0..ROWS-1."""
    files = dest.files()
    manifest = json.loads(files["manifest.json"])
    indices = []
    for shard in manifest["shards"]:
        assert shard["name"] in files, f"the manifest lists {shard['name']}, which does not exist"
        assert hashlib.sha256(files[shard["name"]]).hexdigest() == shard["sha256"], shard["name"]
        indices += [json.loads(line)["index"] for line in gzip.decompress(files[shard["name"]]).splitlines()]
    assert indices == list(range(ROWS)) and manifest["rows"] == ROWS
    return manifest, files


def test_a_second_export_into_a_held_destination_refuses_naming_the_holder(root, dest, paused):
    assert _cli("export", str(root), dest.uri, "--shard-rows", "4").returncode == 0  # a previous export
    previous, _ = _published(dest)

    a = paused(str(root), dest.uri, "--shard-rows", "3", "--overwrite")
    b = _cli("export", str(root), dest.uri, "--shard-rows", "5", "--overwrite")
    during = dest.files()
    code, out, err = a.go()
    assert code == 0, err

    # What was published is whole: every shard the manifest lists is there and matches its sha256.
    manifest, files = _published(dest)
    assert manifest["export_id"] != previous["export_id"] and len(manifest["shards"]) == 4
    # B refused, naming A, and published nothing.
    assert b.returncode == 2, b.stderr
    assert "is held by another export" in b.stderr and f"pid {a.proc.pid}" in b.stderr
    assert repr(socket.gethostname()) in b.stderr and "Traceback" not in b.stderr
    assert json.loads(during["manifest.json"]) == previous
    holder = json.loads(during["export.lock"])
    assert (holder["host"], holder["pid"]) == (socket.gethostname(), a.proc.pid)
    # The previous export's shards are gone, and so is the lock: the manifest and its shards are all there is.
    assert set(files) == {"manifest.json", *(s["name"] for s in manifest["shards"])}

    # Free again: the next export goes ahead.
    assert _cli("export", str(root), dest.uri, "--shard-rows", "6", "--overwrite").returncode == 0
    assert len(_published(dest)[0]["shards"]) == 2


def test_a_stale_lock_is_taken_over_and_its_holder_then_publishes_nothing(root, tmp_path, paused):
    dest = LocalDest(tmp_path / "export")
    assert _cli("export", str(root), dest.uri, "--shard-rows", "4").returncode == 0
    previous, before = _published(dest)

    a = paused(str(root), dest.uri, "--shard-rows", "3", "--overwrite")
    dest.age_lock(2 * 3600)  # as if A had died long ago: its lock was last written two hours back
    b = _cli("export", str(root), dest.uri, "--shard-rows", "6", "--overwrite")
    assert b.returncode == 0, b.stderr
    assert "taking over" in b.stderr
    manifest, files = _published(dest)
    assert len(manifest["shards"]) == 2
    # B removed the previous manifest's shards, not A's first shard (no manifest lists it; A is too young).
    assert not set(before) - {"manifest.json"} & set(files)
    assert len([k for k in files if k.startswith("shard-")]) == 3

    code, _, err = a.go()  # A finds its lock gone: it publishes nothing and removes its own shards
    assert code == 2 and "lost its lock" in err and "publishes nothing" in err, err
    after, files = _published(dest)
    assert after == manifest and previous["export_id"] != manifest["export_id"]
    assert set(files) == {"manifest.json", *(s["name"] for s in manifest["shards"])}


def test_a_manifest_changed_under_an_export_is_not_published_over(root, dest, paused):
    assert _cli("export", str(root), dest.uri, "--shard-rows", "4").returncode == 0
    a = paused(str(root), dest.uri, "--shard-rows", "3", "--overwrite")
    # Another writer that takes no lock (an older tracegen, a hand copy) publishes meanwhile.
    other = json.loads(dest.files()["manifest.json"]) | {"export_id": "someone-else"}
    dest.put("manifest.json", json.dumps(other).encode())
    code, _, err = a.go()
    assert code == 2 and "manifest.json changed while this export wrote" in err, err
    files = dest.files()
    assert json.loads(files["manifest.json"]) == other  # theirs stands, with its shards
    assert {k for k in files if k.startswith("shard-")} == {s["name"] for s in other["shards"]}
    assert "export.lock" not in files
