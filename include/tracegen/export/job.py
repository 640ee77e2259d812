"""One export from start to publish: the request checked (`export_dataset`), then, while the destination's
lock is held, the rows chosen (`selection`), written (`writer`), described (`manifest`) and published, and
what the new manifest replaced removed (`replace`)."""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from tracegen.common import locations
from tracegen.dataset.blocks import check_unchanged
from tracegen.dataset.stored import load_index
from tracegen.export import layouts as L
from tracegen.export import manifest as M
from tracegen.export.errors import ExportError
from tracegen.export.lock import LOCK, LOCK_STALE_S, MANIFEST, DestinationLock
from tracegen.export.replace import check_replaceable, manifest_shards, nested, older_export, remove
from tracegen.export.selection import choose_rows
from tracegen.export.writer import write_rows
from tracegen.run.run_record import latest_run
from tracegen.store.root import OutputRoot, open_root
from tracegen.store.storage import Storage, open_storage

FORMATS = ("jsonl", "parquet")
LAYOUTS = L.LAYOUTS


@dataclass(frozen=True)
class ExportJob:
    """One export as asked, with what it reads and where it writes: the output root, its newest run's record
    and the dataset's index; the destination and the lock held on it; and how the rows are written."""

    root: OutputRoot
    record: Any
    index: Any
    dest: Storage
    lock: DestinationLock
    fmt: str = "jsonl"
    layout: str = L.MESSAGES
    shard_rows: int = 10_000
    include_truncated: bool = False
    overwrite: bool = False
    force: bool = False
    with_token_ids: bool = False


@dataclass(frozen=True)
class ExportResult:
    dest: str
    rows: int
    shards: int
    manifest_uri: str
    export_id: str = ""
    layout: str = L.MESSAGES
    sha256: str = ""  # the manifest's
    data_uri: str | None = None  # a trainer layout's file


def export_dataset(
    output_uri: str,
    dest_uri: str,
    *,
    fmt: str = "jsonl",
    layout: str = L.MESSAGES,
    shard_rows: int = 10_000,
    include_truncated: bool = False,
    overwrite: bool = False,
    force: bool = False,
    check_prefixes: bool = True,
    with_token_ids: bool = False,
    aws_conn_id: str = "aws_default",
) -> ExportResult:
    """Export the output root's final dataset to `dest_uri`. A destination that is not empty needs
    `overwrite`, which replaces only an export of this same output root (or the leftovers of a killed
    export); `force` replaces whatever export is there. The previous export stays complete until the new
    manifest replaces it. `check_prefixes`: the output root and the destination must lie under the
    operator's prefixes (`tracegen.common.locations`); only the operator's own command line turns it off."""
    if layout not in LAYOUTS:
        raise ExportError(f"layout {layout!r} is not one of {LAYOUTS}")
    if fmt not in FORMATS or (layout != L.MESSAGES and fmt != "jsonl"):
        raise ExportError(f"format {fmt!r} is not one of {FORMATS if layout == L.MESSAGES else ('jsonl',)}"
                          f" (layout {layout}: trainers read plain JSONL)")
    if shard_rows < 1:
        raise ExportError(f"shard_rows must be >= 1, got {shard_rows}")
    # Before either storage is opened: opening a local destination creates its directory.
    if check_prefixes:
        try:
            locations.check(output_uri, access=locations.READ, name="output_uri")
            locations.check(dest_uri, access=locations.WRITE, name="dest_uri")
        except locations.LocationRefused as exc:
            raise ExportError(str(exc)) from None
    if nested(output_uri, dest_uri):
        raise ExportError(
            f"export destination {dest_uri} is inside the output root {output_uri} (or holds it); "
            "export beside the root, never into it"
        )
    root = open_root(output_uri, aws_conn_id)
    record = latest_run(root, aws_conn_id)
    if record is None:
        raise ExportError(f"{output_uri}: no run has been planned here; nothing to export")
    index = load_index(root, aws_conn_id)
    # Before the destination is touched: an edited dataset would pair these completions with other prompts.
    # An export reads about every row anyway, so the whole file is hashed: its size and version cannot vouch.
    check_unchanged(index, aws_conn_id, rehash=True)
    dest = open_storage(dest_uri, aws_conn_id=aws_conn_id)
    lock = DestinationLock.of(dest)
    lock.acquire()
    try:
        return run_export(ExportJob(root, record, index, dest, lock, fmt=fmt, layout=layout, shard_rows=shard_rows,
                                    include_truncated=include_truncated, overwrite=overwrite or force, force=force,
                                    with_token_ids=with_token_ids))
    finally:
        lock.release()


def run_export(job: ExportJob) -> ExportResult:
    """The export proper, while `job.lock` holds `job.dest`."""
    dest, lock, layout = job.dest, job.lock, job.layout
    started = time.time()
    before = [k for k in dest.list("") if k != LOCK]
    if before and not job.overwrite:
        raise ExportError(
            f"export destination {dest.uri} is not empty ({len(before)} objects, e.g. {before[0]}); nothing "
            "was written: replace_existing_export=true (--overwrite) replaces an export of the same output root"
        )
    # What this export replaces: it publishes only over this manifest, and removes only its files.
    previous, previous_version = lock.read_manifest()
    if before and not job.force:
        check_replaceable(job.root, dest, previous, before)
    replaced = manifest_shards(dest, previous)
    choice = choose_rows(job.root, job.record.config.runaway_policy, job.include_truncated)
    export_id = f"{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}-{uuid.uuid4().hex[:8]}"
    shards, figures = write_rows(job, choice.best, export_id)
    manifest_uri = dest.uri_for(MANIFEST)
    try:
        manifest = M.build(job, choice, export_id, figures, shards)
        body = json.dumps(manifest, indent=2).encode()
        # The publish: readers switch here, if the manifest is still the one this export replaces.
        lock.publish(body, previous_version)
    except BaseException:
        remove(dest, [s["name"] for s in shards])
        raise
    # Only files of the manifest replaced, and leftovers of a killed export no manifest lists (older than
    # any live export's): another export's files, or a file someone keeps here, are not ours to remove.
    listed = {s["name"] for s in shards}
    leftovers = [k for k in before if k not in replaced and older_export(k, started - LOCK_STALE_S)]
    remove(dest, sorted((set(replaced) | set(leftovers)) - listed))
    return ExportResult(dest.uri, figures.rows, len(shards), manifest_uri, export_id=export_id, layout=layout,
                        sha256=hashlib.sha256(body).hexdigest(),
                        data_uri=dest.uri_for(shards[0]["name"]) if layout != L.MESSAGES and shards else None)
