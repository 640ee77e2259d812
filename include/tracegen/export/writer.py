"""The chosen rows written under one export's names: gzipped JSONL or Parquet shards of the messages layout,
or a trainer layout's one file, streamed (`sink`). Each part is read once per batch, hashed as read, and each
row encoded into its shard as it is shaped (`layouts`), so memory follows a batch, not the export; what the
rows add up to (`Figures`) goes into the manifest."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import time
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pandas as pd

from tracegen.dataset.blocks import open_data
from tracegen.dataset.reader import InvalidRow, read_indices
from tracegen.export import layouts as L
from tracegen.export import manifest as M
from tracegen.export.errors import ExportError
from tracegen.export.replace import remove
from tracegen.export.selection import batches, conversation_batches
from tracegen.export.sink import FileSink
from tracegen.store.layout import MEASURE_CHUNK
from tracegen.store.records import (
    EXTENDED,
    FALLBACK_REGENERATED,
    REGENERATED,
    RESAMPLED,
    GeneratedRow,
)
from tracegen.store.repair import PartDamageError
from tracegen.store.root import OutputRoot
from tracegen.store.storage import Storage

log = logging.getLogger(__name__)


class Figures:
    """What the rows written add up to: counts, lengths, how the prompts are shaped, the last token ids."""

    def __init__(self) -> None:
        self.rows = 0
        self.finish_reasons: dict[str, int] = {}
        self.extended = 0
        self.no_token_ids = 0
        self.prompt_len: list[np.ndarray] = []
        self.response_len: list[np.ndarray] = []
        self.last_ids: dict[str, dict[str, int]] = {}  # finish reason -> last response id -> rows
        self.without_system = 0
        self.with_history = 0
        self.max_turns = 0
        self.provenance = dict.fromkeys(("first_generation", "extended", "measured", "regenerated", "resampled"), 0)

        self._batch_len: tuple[list[int], list[int]] = ([], [])  # the current batch's, until `end_batch`

    def add(self, prompt: Any, row: GeneratedRow, s: L.Shaped) -> None:
        self.rows += 1
        fr = str(row.finish_reason)
        self.finish_reasons[fr] = self.finish_reasons.get(fr, 0) + 1
        self.extended += row.pivot == EXTENDED
        how = _how(row)
        self.provenance[how] = self.provenance.get(how, 0) + 1
        if s.last_id is not None:
            ids = self.last_ids.setdefault(fr, {})
            ids[str(s.last_id)] = ids.get(str(s.last_id), 0) + 1
        system, history = L.prompt_shape(prompt)
        self.without_system += not system
        self.with_history += history > 0
        self.max_turns = max(self.max_turns, len(prompt.messages or []) + 1)
        self._batch_len[0].append(s.prompt_len)
        self._batch_len[1].append(s.response_len)

    def end_batch(self) -> None:
        """A batch's lengths as arrays: a million rows' lengths are two int64 arrays, not Python lists."""
        p, r = self._batch_len
        self.prompt_len.append(np.asarray(p, dtype=np.int64))
        self.response_len.append(np.asarray(r, dtype=np.int64))
        self._batch_len = ([], [])

    def to_json(self) -> dict[str, Any]:
        p = np.concatenate(self.prompt_len) if self.prompt_len else np.zeros(0, np.int64)
        r = np.concatenate(self.response_len) if self.response_len else np.zeros(0, np.int64)
        return {
            "lengths": M.lengths(p, r),
            "prompts": {"rows_without_system_prompt": self.without_system,
                        "rows_with_assistant_history": self.with_history, "max_turns": self.max_turns},
        }


def _how(row: GeneratedRow) -> str:
    pivot = row.pivot
    if pivot is None:
        return "first_generation"
    if pivot == EXTENDED:
        return "measured" if row.chunk == MEASURE_CHUNK else "extended"
    if pivot == RESAMPLED:
        return "resampled"
    return "regenerated" if pivot in (REGENERATED, FALLBACK_REGENERATED) else str(pivot)


def write_rows(job: Any, best: pd.DataFrame, export_id: str) -> tuple[list[dict[str, Any]], Figures]:
    """The chosen rows written under this export's names: shards of the messages layout, or a trainer
    layout's one file, streamed. Returns (the files written, as the manifest lists them; what they hold).
    On any failure nothing written stays, and the previous export (if any) is untouched. `job`: the
    `job.ExportJob`."""
    root, index, dest, lock, fmt, layout = job.root, job.index, job.dest, job.lock, job.fmt, job.layout
    shards: list[dict[str, Any]] = []
    figures = Figures()
    sink = FileSink(dest, L.data_file(export_id, layout)) if layout != L.MESSAGES else None
    written = 0
    refreshed = time.monotonic()
    source = open_data(index, job.record.config.aws_conn_id) if len(best) else None
    try:
        if index.reading.chained:  # a conversation's turns are shaped together: never split between batches
            chunks = conversation_batches(best, job.shard_rows, index)
        else:
            chunks = batches(best, job.shard_rows, by_part=sink is not None)
        for shard_no, batch in enumerate(chunks):
            # Each row encoded as it is shaped: a shard holds its compressed bytes, never its rows as dicts.
            encoder = Encoder(fmt if sink is None else "plain")
            for prompt, row, shaped in _shaped_batch(root, index, source, batch, layout, job.with_token_ids, dest):
                if shaped is None:
                    figures.no_token_ids += 1
                    continue
                encoder.add(shaped.doc)
                figures.add(prompt, row, shaped)
            figures.end_batch()
            data = encoder.finish()
            if sink is None:
                name = f"shard-{export_id}-{shard_no:05d}.{'jsonl.gz' if fmt == 'jsonl' else 'parquet'}"
                dest.put(name, data)
                first_last = batch["index"].to_numpy(np.int64)
                shards.append({"name": name, "rows": encoder.rows, "sha256": hashlib.sha256(data).hexdigest(),
                               "first_index": int(first_last[0]), "last_index": int(first_last[-1])})
                log.info("export: %s (%d rows)", dest.uri_for(name), encoder.rows)
            else:
                sink.write(data)
            written += encoder.rows
            del encoder, data
            # Still ours (a holder that stopped refreshing may have been taken over): after every shard, and
            # every few seconds while a trainer layout's file is written part by part.
            if sink is None or time.monotonic() - refreshed > 5.0:
                lock.refresh()
                refreshed = time.monotonic()
                if sink is not None:
                    log.info("export: %d rows written to %s", written, dest.uri_for(sink.key))
        if sink is not None:
            sink.publish()
            shards.append({"name": sink.key, "rows": written, "sha256": sink.sha256.hexdigest(), "bytes": sink.size})
            sink = None
    except BaseException:
        # Nothing lists these files; the previous export (if any) is untouched.
        if sink is not None:
            sink.abort()
        remove(dest, [s["name"] for s in shards])
        raise
    return shards, figures


def _shaped_batch(root: OutputRoot, index: Any, source: Any, batch: pd.DataFrame, layout: str,
                  with_token_ids: bool, dest: Storage) -> Iterator[tuple[Any, GeneratedRow, L.Shaped | None]]:
    """`_shaped` of a batch, a damaged part refused with what to do about it."""
    try:
        yield from _shaped(root, index, source, batch, layout, with_token_ids)
    except PartDamageError as exc:
        d = exc.damage
        raise ExportError(
            f"part {root.storage.uri_for(d.part)} is not what its ledger entry {d.entry} committed: "
            f"{d.problem}; not exported, and nothing was published ({dest.uri} holds what it held); "
            f"`python -m tracegen verify {root.storage.uri}` lists the damaged parts, `--retire` makes "
            "their rows work again for the next run or rerun"
        ) from exc


def _shaped(root: OutputRoot, index: Any, source: Any, batch: pd.DataFrame, layout: str,
            with_token_ids: bool) -> Iterator[tuple[Any, GeneratedRow, L.Shaped | None]]:
    """A batch's generated rows joined with their prompts and shaped, in index order, reading each of its
    parts once and only the dataset blocks holding its prompts (None: a tokens row without ids)."""
    generated: dict[int, GeneratedRow] = {}
    for part, group in batch.groupby("part", sort=False, observed=True):
        wanted = {(int(i), str(r)) for i, r in zip(group["index"], group["run_id"], strict=True)}
        for row in root.repair.read_verified_part(str(part)):  # hashed as read: a damaged part raises
            if (row.index, row.run_id) in wanted:
                generated[row.index] = row
    if index.reading.chained:
        yield from _shaped_chain(index, source, batch, generated, layout, with_token_ids)
        return
    for prompt in read_indices(index, batch["index"].to_numpy(np.int64), source=source):
        row = generated.pop(prompt.index, None)
        if row is None or isinstance(prompt, InvalidRow):
            continue
        yield prompt, row, L.shape(layout, prompt, row, with_token_ids)


def _shaped_chain(index: Any, source: Any, batch: pd.DataFrame, generated: dict[int, GeneratedRow], layout: str,
                  with_token_ids: bool) -> Iterator[tuple[Any, GeneratedRow, L.Shaped | None]]:
    """A batch of whole conversations under `turns=chain`, each shaped from its chosen turns (`L.shape_chain`):
    those from its first turn on without a gap, as the model generated them one after the other (a turn
    after a gap, whose earlier turn's row is not exported, cannot be shown with the history it was sent)."""
    indices = batch["index"].to_numpy(np.int64)
    convs = index.conversations(indices)
    prompts = {p.index: p for p in read_indices(index, indices, source=source)}
    for conv in pd.unique(convs):
        first = index.first_prompt_row(int(conv))
        turns: list[Any] = []
        rows: list[GeneratedRow] = []
        for i in range(first, first + index.prompt_rows_of(int(conv))):
            prompt, row = prompts.get(i), generated.get(i)
            if row is None or prompt is None or isinstance(prompt, InvalidRow):
                break
            turns.append(prompt)
            rows.append(row)
        if rows:
            yield from L.shape_chain(layout, turns, rows, with_token_ids)


class Encoder:
    """A shard's bytes (`jsonl`: gzipped, `parquet`), or plain JSONL lines for a trainer layout's file, a row
    at a time.

    JSONL rows are encoded as they are added: a gzipped shard holds only its compressed bytes so far (zlib's
    own gzip framing, wbits=31, is what `gzip.compress(data, mtime=0)` writes, and deflate's output does not
    depend on how its input is split: the bytes are the same as compressing the shard's text at once). A
    Parquet shard is one table, built from its rows at the end."""

    def __init__(self, fmt: str) -> None:
        self.fmt, self.rows = fmt, 0
        self._out: list[bytes] = []
        self._gzip = zlib.compressobj(9, zlib.DEFLATED, 31) if fmt == "jsonl" else None
        self._docs: list[Any] = []  # a Parquet shard's rows (the messages layout's: dicts)

    def add(self, doc: dict[str, Any] | str) -> None:
        self.rows += 1
        if self.fmt == "parquet":
            self._docs.append(doc)
            return
        line = (doc if isinstance(doc, str) else json.dumps(doc, ensure_ascii=False, separators=(",", ":")))
        data = (line + "\n").encode("utf-8")
        if self._gzip is not None:
            data = self._gzip.compress(data)
        if data:
            self._out.append(data)

    def finish(self) -> bytes:
        if self.fmt == "parquet":
            return _parquet(self._docs)
        if self._gzip is not None:
            self._out.append(self._gzip.flush())
        return b"".join(self._out)


def _parquet(rows: list[dict[str, Any]]) -> bytes:
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
