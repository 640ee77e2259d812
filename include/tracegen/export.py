"""The final dataset: one row per index (the row that supersedes the others), in the shape drafter
training reads — the prompt's messages with the generated assistant turn appended, thinking kept.

Rows still truncated (`finish_reason == "length"`) are left out unless asked for: they would teach
the drafter the wrong ending. The manifest says how many rows were written, left out and why, with a
sha256 per shard, so a reader can check what they downloaded.

An export never clobbers: a destination that holds anything needs `overwrite`, one inside the output
root (or holding it) is refused, and shards are written under names of their own export, so the
manifest, published last in one atomic PUT, switches readers from the previous export to the new one.
Only then are the previous export's shards removed; a failed export leaves the previous one as it was.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import logging
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import numpy as np
import pandas as pd

from tracegen import plan
from tracegen.dataset.reader import InvalidRow, read_rows
from tracegen.dataset.stored import load_index
from tracegen.run.records import latest_run
from tracegen.store.ledger import Ledger
from tracegen.store.records import OK, GeneratedRow
from tracegen.store.storage import Storage, open_storage

log = logging.getLogger(__name__)

FORMATS = ("jsonl", "parquet")
MANIFEST = "manifest.json"
# Shards of any export, this version's (`shard-<export id>-00000`) or earlier ones' (`shard-00000`).
_SHARD_RE = re.compile(r"shard-(?:\d{8}T\d{6}Z-[0-9a-f]{8}-)?\d{5}\.(?:jsonl\.gz|parquet)")


class ExportError(RuntimeError):
    pass


@dataclass(frozen=True)
class ExportResult:
    dest: str
    rows: int
    shards: int
    manifest_uri: str


def export_dataset(
    output_uri: str,
    dest_uri: str,
    *,
    fmt: str = "jsonl",
    shard_rows: int = 10_000,
    include_truncated: bool = False,
    overwrite: bool = False,
    aws_conn_id: str = "aws_default",
) -> ExportResult:
    """Export the output root's final dataset to `dest_uri`. A destination that is not empty needs
    `overwrite`; then the previous export there stays complete until the new manifest replaces it."""
    if fmt not in FORMATS:
        raise ExportError(f"format {fmt!r} is not one of {FORMATS}")
    if shard_rows < 1:
        raise ExportError(f"shard_rows must be >= 1, got {shard_rows}")
    # Before either storage is opened: opening a local destination creates its directory.
    if _nested(output_uri, dest_uri):
        raise ExportError(
            f"export destination {dest_uri} is inside the output root {output_uri} (or holds it); "
            "export beside the root, never into it"
        )
    ledger = Ledger(open_storage(output_uri, aws_conn_id=aws_conn_id))
    record = latest_run(ledger, aws_conn_id)
    if record is None:
        raise ExportError(f"{output_uri}: no run has been planned here; nothing to export")
    index = load_index(ledger)
    dest = open_storage(dest_uri, aws_conn_id=aws_conn_id)
    before = dest.list("")
    if before and not overwrite:
        raise ExportError(
            f"export destination {dest.uri} is not empty ({len(before)} objects, e.g. {before[0]}); "
            "pass --overwrite (overwrite=True) to replace the export there"
        )
    frame = ledger.frame()
    best = plan.best_rows(frame) if len(frame) else frame
    best = best[best["status"] == OK]
    truncated = best["finish_reason"] == "length"
    left_out_truncated = 0 if include_truncated else int(truncated.sum())
    if not include_truncated:
        best = best[~truncated]
    best = best.sort_values("index").reset_index(drop=True)

    export_id = f"{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}-{uuid.uuid4().hex[:8]}"
    shards, counts = [], {"rows": 0, "finish_reasons": {}}
    indices = best["index"].to_numpy(dtype=np.int64)
    try:
        for shard_no, start in enumerate(range(0, len(best), shard_rows)):
            part = best.iloc[start : start + shard_rows]
            rows = list(_rows(ledger, index, part, record.config.aws_conn_id))
            data = _encode(rows, fmt)
            name = f"shard-{export_id}-{shard_no:05d}.{'jsonl.gz' if fmt == 'jsonl' else 'parquet'}"
            dest.put(name, data)
            shards.append({"name": name, "rows": len(rows), "sha256": hashlib.sha256(data).hexdigest(),
                           "first_index": int(indices[start]), "last_index": int(indices[start + len(rows) - 1])})
            counts["rows"] += len(rows)
            for r in rows:
                counts["finish_reasons"][r["finish_reason"]] = counts["finish_reasons"].get(r["finish_reason"], 0) + 1
            log.info("export: %s (%d rows)", dest.uri_for(name), len(rows))
    except BaseException:
        # Nothing lists these shards; the previous export (if any) is untouched.
        _remove(dest, [s["name"] for s in shards])
        raise

    cur = frame[frame["index"].isin(best["index"])] if len(frame) else frame
    manifest = {
        "schema": 1,
        "export_id": export_id,
        "source": ledger.storage.uri,
        "dataset": ledger.dataset(),
        "newest_run": record.run_id,
        "max_tokens": record.config.max_tokens,
        "format": fmt,
        "rows": counts["rows"],
        "dataset_rows": index.n_rows,
        "finish_reasons": counts["finish_reasons"],
        "left_out": {
            "truncated": left_out_truncated,
            "not_ok_or_missing": int(index.n_rows - counts["rows"] - left_out_truncated),
        },
        "superseded_ledger_rows": int(len(frame) - frame["index"].nunique()) if len(frame) else 0,
        "ledger_rows_for_exported": int(len(cur)),
        "shards": shards,
    }
    manifest_uri = dest.uri_for(MANIFEST)
    dest.put(MANIFEST, json.dumps(manifest, indent=2).encode())  # the publish: readers switch here
    # Only shards of earlier exports: another file someone keeps in the destination is not ours to remove.
    listed = {s["name"] for s in shards}
    _remove(dest, [k for k in before if _SHARD_RE.fullmatch(k) and k not in listed])
    return ExportResult(dest.uri, counts["rows"], len(shards), manifest_uri)


def _remove(dest: Storage, keys: list[str]) -> None:
    for key in keys:
        try:
            dest.delete(key)
        except Exception as exc:  # a cleanup failure must not hide the export's own outcome
            log.warning("export: could not remove %s: %s", dest.uri_for(key), exc)


def _location(uri: str) -> tuple[str, str]:
    """(namespace, '/'-terminated path) of a storage URI: two locations nest when one path prefixes the other."""
    parsed = urlparse(uri)
    if uri.startswith("/") or parsed.scheme == "file":
        path = Path(uri if uri.startswith("/") else unquote(parsed.path)).resolve()
        return "file", str(path).rstrip("/") + "/"
    if parsed.scheme == "s3":
        prefix = parsed.path.strip("/")
        return f"s3://{parsed.netloc}", f"{prefix}/" if prefix else ""
    return uri, ""


def _nested(a: str, b: str) -> bool:
    (space_a, path_a), (space_b, path_b) = _location(a), _location(b)
    return space_a == space_b and (path_a.startswith(path_b) or path_b.startswith(path_a))


def _rows(ledger: Ledger, index, best: pd.DataFrame, aws_conn_id: str) -> Iterator[dict[str, Any]]:
    """Join the chosen generated rows with their prompts, in index order, reading each part once."""
    generated: dict[int, GeneratedRow] = {}
    for part, group in best.groupby("part", sort=False):
        wanted = {(int(i), r) for i, r in zip(group["index"], group["run_id"], strict=True)}
        for row in ledger.read_part(str(part)):
            if (row.index, row.run_id) in wanted:
                generated[row.index] = row
    lo, hi = int(best["index"].min()), int(best["index"].max()) + 1
    for prompt in read_rows(index, lo, hi, aws_conn_id=aws_conn_id):
        row = generated.get(prompt.index)
        if row is None or isinstance(prompt, InvalidRow):
            continue
        assistant: dict[str, Any] = {"role": "assistant", "content": row.content or ""}
        if row.reasoning_content:
            assistant["reasoning_content"] = row.reasoning_content
        if row.tool_calls:
            assistant["tool_calls"] = row.tool_calls
        yield {
            "index": row.index,
            "id": prompt.id,
            "messages": [*prompt.messages, assistant],
            "tools": prompt.tools,
            "category": prompt.category,
            "finish_reason": row.finish_reason,
            "prompt_tokens": row.prompt_tokens,
            "completion_tokens": row.completion_tokens,
            "reasoning_tokens": row.reasoning_tokens,
            "max_tokens": row.max_tokens,
            "run_id": row.run_id,
        }


def _encode(rows: list[dict[str, Any]], fmt: str) -> bytes:
    if fmt == "jsonl":
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        return gzip.compress(text.encode("utf-8"), mtime=0)
    import pyarrow as pa
    import pyarrow.parquet as pq

    # Nested message structures vary row to row (tool calls, content parts): store them as JSON text.
    table = pa.Table.from_pylist(
        [{**r, "messages": json.dumps(r["messages"], ensure_ascii=False),
          "tools": json.dumps(r["tools"]) if r["tools"] is not None else None} for r in rows]
    )
    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()
