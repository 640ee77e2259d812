"""The final dataset: one row per index (the row that supersedes the others), in a layout a drafter
trainer reads as it is (`layouts`): tracegen's own `messages` shards (the default), or one plain JSONL file
of `tokens` (`input_ids` + `loss_mask`) or `conversations` for SpecForge and speculators, with a manifest
that names the file to pass to each trainer and the settings that keep every row whole (`manifest`).

Rows still truncated (`finish_reason == "length"`) are left out unless asked for: they would teach
the drafter the wrong ending. A row extended past a lower cap (truncated_policy=extend) is one seamless
completion here, split into thinking, answer and tool calls as an uninterrupted generation is, and its
token ids are the whole completion's. The manifest says how many rows were written, left out and why, with
a sha256 per file, whose tokens these are (model, fleet, servers, sampling, cap decisions) and how long
the rows are.

Memory is bounded: the ledger is read with the export's columns only (`store.ledger_rows`), the rows are
written a shard of indices at a time (each part read once per shard, hashed as read, each row encoded into its
shard as it is shaped), and a trainer layout's single file is streamed to disk and moved or uploaded into place
(`sink`).

An export never clobbers: the output root must lie under the operator's read (or write) prefixes and the
destination under their write prefixes (`tracegen.locations`; the command line, the operator's own tool,
skips that check); a destination that holds anything needs `overwrite`, and then only an export of the
same output root is replaced (its manifest's `source`), unless `force`; a destination inside the output
root (or holding it) is refused. All of that is checked before anything is written. Files are written
under names of their own export, so the manifest, published last in one atomic PUT, switches readers from
the previous export to the new one. Only then are the previous export's files removed; a failed export
leaves the previous one as it was.

Every part is checked against its ledger entry as it is read (size and sha256 of the bytes read): a part
that is not what was committed stops the export, naming it, before a byte of it is published.

One export at a time per destination (`lock`): an export holds `export.lock` in the destination while it
writes, and publishes its manifest only over the one it read at the start; it then removes only the files
that manifest listed (and files no manifest lists whose export began longer than LOCK_STALE_S before, the
leftovers of a killed export).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import re
import time
import uuid
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pandas as pd

from tracegen import locations
from tracegen.audit.runaway_rows import find_runaways
from tracegen.dataset.blocks import check_unchanged, open_data
from tracegen.dataset.reader import InvalidRow, read_indices
from tracegen.dataset.stored import load_index
from tracegen.export import layouts as L
from tracegen.export import manifest as M
from tracegen.export.errors import ExportError, ExportLockError
from tracegen.export.lock import LOCK, LOCK_STALE_S, MANIFEST, DestinationLock
from tracegen.export.sink import FileSink
from tracegen.run.records import latest_run
from tracegen.store.current import current_mask
from tracegen.store.layout import MEASURE_CHUNK
from tracegen.store.ledger_rows import ledger_rows
from tracegen.store.records import (
    COMPLETE,
    EXTENDED,
    FALLBACK_REGENERATED,
    OK,
    REGENERATED,
    RESAMPLED,
    GeneratedRow,
)
from tracegen.store.repair import PartDamageError
from tracegen.store.root import OutputRoot, open_root
from tracegen.store.storage import LocalStorage, Storage, open_storage

__all__ = ["EXPORT_COLUMNS", "FORMATS", "LAYOUTS", "LOCK", "LOCK_STALE_S", "MANIFEST", "DestinationLock", "ExportError",
           "ExportLockError", "ExportResult", "export_dataset"]

log = logging.getLogger(__name__)

FORMATS = ("jsonl", "parquet")
# What an export reads of each ledger row: supersession's columns (`current_mask`), the part and run a row is
# read back from, and the runaway score, so judging truncated rows for loops (include_truncated) reads only
# the parts of rows committed before the ledger kept the score (`find_runaways`), not every truncated row's.
EXPORT_COLUMNS = ("index", "status", "finish_reason", "max_tokens", "run_id", "part", "runaway_score", "committed_at")
LAYOUTS = L.LAYOUTS
# Files of any export: this version's shards (`shard-<export id>-00000`), earlier ones' (`shard-00000`), and
# a trainer layout's data file (`data-<export id>/<layout>.jsonl`).
_SHARD_RE = re.compile(
    r"shard-(?:(?P<time>\d{8}T\d{6}Z)-[0-9a-f]{8}-)?\d{5}\.(?:jsonl\.gz|parquet)"
    r"|data-(?P<dtime>\d{8}T\d{6}Z)-[0-9a-f]{8}/(?:tokens|conversations)\.jsonl"
)


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
    operator's prefixes (`tracegen.locations`); only the operator's own command line turns it off."""
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
    if _nested(output_uri, dest_uri):
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
        return _export(root, record, index, dest, lock, fmt=fmt, layout=layout, shard_rows=shard_rows,
                       include_truncated=include_truncated, overwrite=overwrite or force, force=force,
                       with_token_ids=with_token_ids)
    finally:
        lock.release()


class _Figures:
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


def _end_of_turn(last_ids: dict[str, dict[str, int]]) -> dict[str, Any]:
    """Whether the response ids of finished rows end with one stop token, as SGLang returns them."""
    finished = {fr: ids for fr, ids in last_ids.items() if fr in COMPLETE}
    counts: dict[str, int] = {}
    for ids in finished.values():
        for tok, n in ids.items():
            counts[tok] = counts.get(tok, 0) + n
    total = sum(counts.values())
    top = max(counts.items(), key=lambda kv: kv[1]) if counts else None
    return {
        "finished_rows_with_ids": total,
        "last_token_ids": dict(sorted(counts.items(), key=lambda kv: -kv[1])[:5]),
        "token_id": int(top[0]) if top else None,
        "all_finished_rows_end_with_it": bool(top and top[1] == total),
        "loss_mask_covers_it": True,
        "note": "SGLang keeps the matched stop token (the model's end of turn, e.g. <|im_end|>) in a finished "
                "row's output ids; the tokens layout keeps it, under loss_mask 1, so the drafter learns where "
                "the target stops. A row cut at the cap (finish_reason length) has no stop token.",
    }


def _export(root: OutputRoot, record: Any, index: Any, dest: Storage, lock: DestinationLock, *, fmt: str,
            layout: str, shard_rows: int, include_truncated: bool, overwrite: bool, force: bool,
            with_token_ids: bool) -> ExportResult:
    """The export proper, while `lock` holds `dest`."""
    started = time.time()
    before = [k for k in dest.list("") if k != LOCK]
    if before and not overwrite:
        raise ExportError(
            f"export destination {dest.uri} is not empty ({len(before)} objects, e.g. {before[0]}); nothing "
            "was written: replace_existing_export=true (--overwrite) replaces an export of the same output root"
        )
    # What this export replaces: it publishes only over this manifest, and removes only its files.
    previous, previous_version = lock.read_manifest()
    if before and not force:
        _check_replaceable(root, dest, previous, before)
    replaced = _manifest_shards(dest, previous)
    choice = _choose_rows(root, record.config.runaway_policy, include_truncated)
    export_id = f"{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}-{uuid.uuid4().hex[:8]}"
    shards, figures = _write_rows(root, record, index, dest, lock, choice.best, export_id, fmt=fmt,
                                  layout=layout, shard_rows=shard_rows, with_token_ids=with_token_ids)
    manifest_uri = dest.uri_for(MANIFEST)
    try:
        manifest = _manifest(root, record, index, choice, export_id, layout, fmt, with_token_ids,
                             include_truncated, figures, shards, dest)
        body = json.dumps(manifest, indent=2).encode()
        # The publish: readers switch here, if the manifest is still the one this export replaces.
        lock.publish(body, previous_version)
    except BaseException:
        _remove(dest, [s["name"] for s in shards])
        raise
    # Only files of the manifest replaced, and leftovers of a killed export no manifest lists (older than
    # any live export's): another export's files, or a file someone keeps here, are not ours to remove.
    listed = {s["name"] for s in shards}
    leftovers = [k for k in before if k not in replaced and _older_export(k, started - LOCK_STALE_S)]
    _remove(dest, sorted((set(replaced) | set(leftovers)) - listed))
    return ExportResult(dest.uri, figures.rows, len(shards), manifest_uri, export_id=export_id, layout=layout,
                        sha256=hashlib.sha256(body).hexdigest(),
                        data_uri=dest.uri_for(shards[0]["name"]) if layout != L.MESSAGES and shards else None)


@dataclass(frozen=True)
class _Choice:
    """The rows an export writes, and what it leaves out and why."""

    best: pd.DataFrame  # the chosen ledger rows, one per index, in index order
    ledger_figures: dict[str, int]  # the whole ledger's, for the manifest
    policy: str  # the newest run's runaway_policy
    runaways: list[int]  # indices of truncated rows whose tail loops (judged only with include_truncated)
    left_out_truncated: int
    left_out_runaway: int


def _choose_rows(root: OutputRoot, policy: str, include_truncated: bool) -> _Choice:
    """Each index's current row, if it is OK and, unless asked for, not truncated; runaways left out as
    `policy` says. The ledger's frame is dropped on return: memory while writing follows a batch."""
    frame = ledger_rows(root, EXPORT_COLUMNS)
    # One mask over the ledger's rows, then one copy of the chosen rows in index order: memory holds the
    # ledger's columns and the chosen rows, never a chain of filtered copies.
    chosen = current_mask(frame) if len(frame) else np.zeros(0, dtype=bool)
    chosen &= (frame["status"] == OK).to_numpy(bool)
    truncated = chosen & (frame["finish_reason"] == "length").to_numpy(bool)
    left_out_truncated = 0 if include_truncated else int(truncated.sum())
    runaways: list[int] = []
    if include_truncated and truncated.any():
        # Truncated rows whose tail loops: no cap finishes them. Judged only when truncated rows are
        # exported (otherwise they are left out with the rest). 'keep' exports them; 'drop' does not, nor
        # 'resample' the ones whose fresh sample looped again.
        runaways = sorted(find_runaways(root, frame))
        if policy != "keep":
            chosen &= ~np.isin(frame["index"].to_numpy(np.int64), runaways)
    left_out_runaway = len(runaways) if policy != "keep" else 0
    if not include_truncated:
        chosen &= ~truncated
    positions = np.flatnonzero(chosen)
    index_col = frame["index"].to_numpy(np.int64)
    positions = positions[np.argsort(index_col[positions], kind="stable")]
    best = frame.take(positions).reset_index(drop=True)
    ledger_figures = {
        "superseded_ledger_rows": int(len(frame) - len(np.unique(index_col))) if len(frame) else 0,
        "ledger_rows_for_exported": int(np.isin(index_col, best["index"].to_numpy(np.int64)).sum()),
    }
    return _Choice(best, ledger_figures, policy, runaways, left_out_truncated, left_out_runaway)


def _write_rows(root: OutputRoot, record: Any, index: Any, dest: Storage, lock: DestinationLock,
                best: pd.DataFrame, export_id: str, *, fmt: str, layout: str, shard_rows: int,
                with_token_ids: bool) -> tuple[list[dict[str, Any]], _Figures]:
    """The chosen rows written under this export's names: shards of the messages layout, or a trainer
    layout's one file, streamed. Returns (the files written, as the manifest lists them; what they hold).
    On any failure nothing written stays, and the previous export (if any) is untouched."""
    shards: list[dict[str, Any]] = []
    figures = _Figures()
    sink = FileSink(dest, L.data_file(export_id, layout)) if layout != L.MESSAGES else None
    written = 0
    refreshed = time.monotonic()
    source = open_data(index, record.config.aws_conn_id) if len(best) else None
    try:
        for shard_no, batch in enumerate(_batches(best, shard_rows, by_part=sink is not None)):
            # Each row encoded as it is shaped: a shard holds its compressed bytes, never its rows as dicts.
            encoder = _Encoder(fmt if sink is None else "plain")
            for prompt, row, shaped in _shaped_batch(root, index, source, batch, layout, with_token_ids, dest):
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
        _remove(dest, [s["name"] for s in shards])
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


def _manifest(root: OutputRoot, record: Any, index: Any, choice: _Choice, export_id: str, layout: str, fmt: str,
              with_token_ids: bool, include_truncated: bool, figures: _Figures, shards: list[dict[str, Any]],
              dest: Storage) -> dict[str, Any]:
    fig = figures.to_json()
    doc: dict[str, Any] = {
        "schema": 2,
        "export_id": export_id,
        "source": root.storage.uri,
        "dataset": root.run_files.dataset(),
        "newest_run": record.run_id,
        "max_tokens": record.config.max_tokens,
        "layout": layout,
        "format": fmt,
        "rows": figures.rows,
        "dataset_rows": index.n_rows,
        "finish_reasons": figures.finish_reasons,
        "extended_rows": figures.extended,
        # How the rows written came to be: a first generation, or which kind of replacement.
        "provenance_counts": figures.provenance,
        "with_token_ids": with_token_ids or layout == L.TOKENS,
        "left_out": {
            "truncated": choice.left_out_truncated,
            "runaway": choice.left_out_runaway,
            "not_ok_or_missing": int(index.n_rows - len(choice.best) - choice.left_out_truncated
                                     - choice.left_out_runaway),
            # The tokens layout cannot write a row whose server returned no ids.
            **({"no_token_ids": figures.no_token_ids} if layout == L.TOKENS else {}),
        },
        # Judged when truncated rows are exported (include_truncated): the runaways among them, and the policy.
        "runaway_policy": choice.policy,
        "runaway_rows": len(choice.runaways) if include_truncated else None,
        "runaway_indices": choice.runaways[:1000],
        **choice.ledger_figures,
        **fig,
        "provenance": M.provenance(root, record, record.config.aws_conn_id),
        "shards": shards,
    }
    if layout == L.TOKENS:
        doc["end_of_turn"] = _end_of_turn(figures.last_ids)
    if layout != L.MESSAGES and shards:
        doc["data_file"] = shards[0]["name"]
        doc["data_dir"] = L.data_dir(export_id)
        file_uri = dest.uri_for(shards[0]["name"])
        doc["trainers"] = M.trainer_settings(layout, file_uri, file_uri.rsplit("/", 1)[0] + "/", fig)
    return doc


def _check_replaceable(root: OutputRoot, dest: Storage, previous: bytes | None, before: list[str]) -> None:
    """An export replaces only an export of its own output root, as the published manifest's `source` names
    it, or the unpublished files of killed exports; anything else is refused (only `force` replaces it)."""
    forced = "; nothing was written (from a shell, the operator's --force replaces it)"
    if previous is None:
        other = [k for k in before if not _SHARD_RE.fullmatch(k)]
        if other:
            raise ExportError(f"export destination {dest.uri} holds {len(other)} objects that are no export "
                              f"(e.g. {other[0]}) and no {MANIFEST}: not replaced{forced}")
        return
    try:
        source = json.loads(previous)["source"]
    except (ValueError, KeyError, TypeError):
        source = None
    if not isinstance(source, str):
        raise ExportError(f"{dest.uri_for(MANIFEST)} does not name the output root it exports: not replaced{forced}")
    if not locations.same_place(source, root.storage.uri):
        raise ExportError(
            f"export destination {dest.uri} holds the export of another output root ({source[:300]}), not of "
            f"{root.storage.uri}: an export replaces only an export of the same root; choose another "
            f"destination{forced}"
        )


def _manifest_shards(dest: Storage, manifest: bytes | None) -> list[str]:
    """The shard names a published manifest lists (a name that is not a shard's is never removed)."""
    if manifest is None:
        return []
    try:
        names = [s["name"] for s in json.loads(manifest)["shards"]]
    except (ValueError, KeyError, TypeError) as exc:
        log.warning("export: %s does not parse (%s); only unlisted shards of killed exports are removed",
                    dest.uri_for(MANIFEST), exc)
        return []
    return [n for n in names if isinstance(n, str) and _SHARD_RE.fullmatch(n)]


def _older_export(key: str, cutoff: float) -> bool:
    """A shard whose export began before `cutoff` (epoch seconds); False for other keys and undated names."""
    m = _SHARD_RE.fullmatch(key)
    stamp = m and (m["time"] or m["dtime"])
    if not stamp:
        return False
    return datetime.strptime(stamp, "%Y%m%dT%H%M%SZ").replace(tzinfo=UTC).timestamp() < cutoff


def _remove(dest: Storage, keys: list[str]) -> None:
    for key in keys:
        try:
            dest.delete(key)
            if "/" in key and isinstance(dest, LocalStorage):  # a data file's folder, now empty
                (dest.root / key.rsplit("/", 1)[0]).rmdir()
        except Exception as exc:  # a cleanup failure must not hide the export's own outcome
            log.warning("export: could not remove %s: %s", dest.uri_for(key), exc)


def _nested(a: str, b: str) -> bool:
    try:
        return locations.location(a).nests(locations.location(b))
    except ValueError:
        return False


def _batches(best: pd.DataFrame, shard_rows: int, by_part: bool) -> Iterator[pd.DataFrame]:
    """The chosen rows a batch at a time: `shard_rows` consecutive indices (a shard of the messages layout),
    or one part's rows (a trainer layout's file, streamed: memory follows a part, whatever the row count),
    parts in the order of their first index, so a chunk's rows come out in index order."""
    if not by_part:
        for start in range(0, len(best), shard_rows):
            yield best.iloc[start : start + shard_rows]
        return
    codes = best["part"].cat.codes.to_numpy() if isinstance(best["part"].dtype, pd.CategoricalDtype) else \
        pd.factorize(best["part"])[0]
    order = np.argsort(codes, kind="stable")  # best is in index order: each group stays so
    bounds = np.flatnonzero(np.diff(codes[order])) + 1
    groups = np.split(order, bounds) if len(order) else []
    groups.sort(key=lambda g: int(best["index"].iat[g[0]]))
    for g in groups:
        yield best.iloc[g]


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
    for prompt in read_indices(index, batch["index"].to_numpy(np.int64), source=source):
        row = generated.pop(prompt.index, None)
        if row is None or isinstance(prompt, InvalidRow):
            continue
        yield prompt, row, L.shape(layout, prompt, row, with_token_ids)


class _Encoder:
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
