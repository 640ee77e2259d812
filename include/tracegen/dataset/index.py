"""The one-time index pass over a dataset file, so each chunk task reads only its own rows.

A dataset is cut into *blocks*: runs of consecutive rows that can be read without reading
anything before them. The index records, per block, its first row and (for JSONL) its byte
offset, plus `n_rows` and a sha256 fingerprint of the file's bytes computed in the same pass.

- Plain JSONL: a checkpoint every `stride` rows (offset of that row's line). A chunk reads from
  the checkpoint at or before its first row to the one after its last row: O(chunk) bytes plus
  at most 2*(stride-1) neighbouring lines. Sparse checkpoints keep the index small (a 1M-row
  file at stride 32 gives ~31k offsets, tens of KB) because every mapped task loads it.
- gzip JSONL: gzip cannot seek inside a stream, but independent *members* can be read alone.
  A multi-member file whose members end on line boundaries and hold <= `max_block_rows` rows
  is indexed in place (member offsets are the blocks). Anything else (the common single-stream
  `.gz`) is rewritten once as a multi-member copy of `stride`-row members into `cache_uri`;
  the index then points at the copy (`data_uri`) while the fingerprint stays the original's.
- Parquet: row groups are the blocks. Row groups larger than `max_block_rows` (pyarrow's default
  is a million rows) get the same treatment: a one-time copy with small row groups.

Blank lines are not rows; a row's index is its position among the non-blank lines (or Parquet
rows), which is stable because the fingerprint pins the bytes.

Each block's bytes are hashed too (`block_hashes`, 8 bytes of sha256 a block; for Parquet also the footer,
`footer_hash`): a chunk hashes the bytes it reads and refuses a block that is not what was indexed, whatever
the file's size and modification time say (`dataset.blocks`). An index stored before blocks were hashed has
none; the blocks are hashed again from the file when it is loaded, checked against its fingerprint
(`dataset.blocks.with_block_hashes`), and a run's first task stores the index again with them.

The pass also reads every row's id and refuses a dataset where two rows share one (`dataset.row_ids`).

Rows of the file are conversations; the run generates *prompt rows* (`dataset.turns`). Read one prompt row
per conversation (`turns` last or first) they are the same rows. Under `turns=each` or `chain` a conversation is one
prompt row per assistant turn: the pass decodes every row and records where each conversation's prompt rows
start (`turn_starts`), so a prompt row's conversation is one binary search away and a chunk of prompt rows
still reads only the blocks of its own conversations. The index records its `Reading`: the same file read
another way numbers its rows otherwise.

Reading rows with an index, from a file checked to be the one indexed, is `dataset.blocks`.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import io
import json
import logging
import os
import tempfile
import zlib
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tracegen.common.locations import shown_location
from tracegen.dataset.conversation import columnar_id, decode
from tracegen.dataset.folder import FolderSource, open_dataset_source, write_copy
from tracegen.dataset.reading import Reading
from tracegen.dataset.row_ids import RowIds, line_id
from tracegen.dataset.scan import SCAN_BLOCK, fingerprint_source, gunzip_stream, is_row, scan, split_rows
from tracegen.dataset.source import (
    ByteSource,
    DatasetError,
    SourceFile,
    open_source,
    source_identity,
    split_uri,
)
from tracegen.dataset.turns import prompt_count

log = logging.getLogger(__name__)

FORMATS = ("jsonl", "jsonl.gz", "parquet")
INDEX_SCHEMA = 1
DEFAULT_STRIDE = 32
DEFAULT_MAX_BLOCK_ROWS = 4096
PARQUET_COPY_ROW_GROUP = 512


def default_cache_dir() -> str:
    """Where seekable copies go when the caller names no cache: worker-local, so say so in logs."""
    return os.environ.get("TRACEGEN_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "tracegen", "datasets"
    )


def _pack(values: np.ndarray) -> str:
    deltas = np.diff(values.astype(np.int64), prepend=np.int64(0))
    return base64.b64encode(zlib.compress(deltas.astype("<i8").tobytes(), 9)).decode("ascii")


def _unpack(text: str) -> np.ndarray:
    try:
        raw = zlib.decompress(base64.b64decode(text))
    except (ValueError, zlib.error) as exc:
        raise DatasetError(f"dataset index: corrupt block table ({exc})") from None
    return np.cumsum(np.frombuffer(raw, dtype="<i8")).astype(np.int64)


def block_digest(data: bytes | memoryview) -> int:
    """A block's hash: the first 8 bytes of its sha256, as an unsigned integer (an index holds one per block,
    and every chunk task loads the index: 8 bytes keep it small; an edit is not an adversary searching for a
    collision). sha256: hardware-accelerated where blake2b is not, so the index pass pays least for it."""
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little")


def _pack_hashes(values: np.ndarray) -> str:
    return base64.b64encode(values.astype("<u8").tobytes()).decode("ascii")


def _unpack_hashes(text: str) -> np.ndarray:
    try:
        raw = base64.b64decode(text, validate=True)
    except ValueError as exc:
        raise DatasetError(f"dataset index: corrupt block hashes ({exc})") from None
    if len(raw) % 8:
        raise DatasetError("dataset index: corrupt block hashes (not 8 bytes a block)")
    return np.frombuffer(raw, dtype="<u8").astype(np.uint64)


@dataclass
class DatasetIndex:
    """What a chunk task needs to read rows [start, stop) of a dataset without scanning it."""

    source_uri: str  # the dataset as the operator named it
    data_uri: str  # what is actually read: the source, or its seekable copy
    format: str  # one of FORMATS, of data_uri
    n_rows: int
    fingerprint: str  # "sha256:<hex>" of source_uri's bytes
    source_size: int
    data_size: int
    block_rows: np.ndarray  # first row of each block, ascending
    block_offsets: np.ndarray | None = None  # byte offset of each block in data_uri (JSONL, gzip)
    stride: int = DEFAULT_STRIDE
    notes: list[str] = field(default_factory=list)
    # source_uri's version when it was indexed: "mtime_ns:<n>" (local) or "etag:<etag>" (S3); None for an
    # index written before versions were recorded (then a read re-hashes the file once per process).
    source_version: str | None = None
    # block_digest of each block's bytes in data_uri (its span, `block_span`); None in an index stored before
    # blocks were hashed.
    block_hashes: np.ndarray | None = None
    # Parquet: block_digest of the footer (the metadata that says where each row group's pages are).
    footer_hash: int | None = None
    # How rows become prompt rows; an index stored before readings were recorded was read the default way.
    reading: Reading = field(default_factory=Reading)
    # Under an expanding reading (turns=each): each conversation's first prompt row, ascending; None when
    # every conversation is one prompt row.
    turn_starts: np.ndarray | None = None
    n_prompt_rows: int = -1  # prompt rows in all; -1: one per row of the file (n_rows)
    # False for an index stored before readings were recorded: its rows were read as `messages` only, a final
    # assistant message sent as part of the prompt (`dataset.stored.bind_index` checks such a root once).
    reading_recorded: bool = True

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise DatasetError(f"dataset index: format {self.format!r} is not one of {FORMATS}")
        if self.n_rows < 0:
            raise DatasetError(f"dataset index: n_rows {self.n_rows} < 0")
        if not self.fingerprint.startswith("sha256:"):
            raise DatasetError(f"dataset index: fingerprint {self.fingerprint!r} is not sha256:<hex>")
        self.block_rows = np.asarray(self.block_rows, dtype=np.int64)
        if self.block_offsets is not None:
            self.block_offsets = np.asarray(self.block_offsets, dtype=np.int64)
            if len(self.block_offsets) != len(self.block_rows):
                raise DatasetError("dataset index: block_rows and block_offsets differ in length")
        if self.format != "parquet" and self.block_offsets is None:
            raise DatasetError(f"dataset index: format {self.format} needs block_offsets")
        if self.block_hashes is not None:
            self.block_hashes = np.asarray(self.block_hashes, dtype=np.uint64)
            if len(self.block_hashes) != len(self.block_rows) or self.block_offsets is None:
                raise DatasetError("dataset index: block_hashes need one hash and one offset per block")
        if len(self.block_rows) and (np.any(np.diff(self.block_rows) < 0) or self.block_rows[0] != 0):
            raise DatasetError("dataset index: block_rows must start at 0 and never decrease")
        if self.turn_starts is None:
            if self.n_prompt_rows not in (-1, self.n_rows):
                raise DatasetError("dataset index: prompt rows differ from rows without a turn table")
            self.n_prompt_rows = self.n_rows
        else:
            self.turn_starts = np.asarray(self.turn_starts, dtype=np.int64)
            starts = self.turn_starts
            if (len(starts) != self.n_rows or (len(starts) and (starts[0] != 0 or np.any(np.diff(starts) < 1)
                                                                   or starts[-1] >= self.n_prompt_rows))):
                raise DatasetError("dataset index: the turn table needs one first prompt row per row, from 0, "
                                   "each conversation at least one prompt row")

    def conversations(self, prompt_rows: np.ndarray) -> np.ndarray:
        """The row of the file (conversation) each prompt row comes from."""
        prompt_rows = np.asarray(prompt_rows, dtype=np.int64)
        if self.turn_starts is None:
            return prompt_rows
        return np.searchsorted(self.turn_starts, prompt_rows, side="right") - 1

    def first_prompt_row(self, row: int) -> int:
        """The first prompt row of the file's row `row`."""
        return row if self.turn_starts is None else int(self.turn_starts[row])

    def prompt_rows_of(self, row: int) -> int:
        """How many prompt rows the file's row `row` is."""
        if self.turn_starts is None:
            return 1
        stop = int(self.turn_starts[row + 1]) if row + 1 < self.n_rows else self.n_prompt_rows
        return stop - int(self.turn_starts[row])

    @property
    def n_blocks(self) -> int:
        return len(self.block_rows)

    def blocks_for(self, start: int, stop: int) -> tuple[int, int]:
        """Block range [lo, hi) covering rows [start, stop)."""
        if not 0 <= start <= stop <= self.n_rows:
            raise DatasetError(f"dataset {self.source_uri}: rows [{start}, {stop}) outside [0, {self.n_rows})")
        if start == stop:
            return 0, 0
        lo = int(np.searchsorted(self.block_rows, start, side="right")) - 1
        hi = int(np.searchsorted(self.block_rows, stop - 1, side="right"))
        return lo, hi

    def block_row_range(self, b: int) -> tuple[int, int]:
        """Rows [first, stop) of block `b`."""
        return int(self.block_rows[b]), int(self.block_rows[b + 1]) if b + 1 < self.n_blocks else self.n_rows

    def block_span(self, lo: int, hi: int) -> tuple[int, int]:
        """Byte range [begin, end) of blocks [lo, hi) in data_uri (JSONL and gzip)."""
        assert self.block_offsets is not None
        begin = int(self.block_offsets[lo])
        end = int(self.block_offsets[hi]) if hi < self.n_blocks else self.data_size
        return begin, end

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": INDEX_SCHEMA,
            "source_uri": self.source_uri,
            "data_uri": self.data_uri,
            "format": self.format,
            "n_rows": self.n_rows,
            "fingerprint": self.fingerprint,
            "source_size": self.source_size,
            "data_size": self.data_size,
            "stride": self.stride,
            "n_blocks": self.n_blocks,
            "block_rows": _pack(self.block_rows),
            "block_offsets": None if self.block_offsets is None else _pack(self.block_offsets),
            "notes": self.notes,
            "source_version": self.source_version,
            "block_hashes": None if self.block_hashes is None else _pack_hashes(self.block_hashes),
            "footer_hash": self.footer_hash,
            "reading": self.reading.to_json(),
            "turn_starts": None if self.turn_starts is None else _pack(self.turn_starts),
            "n_prompt_rows": self.n_prompt_rows,
        }

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_json(), indent=1).encode()

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DatasetIndex:
        if not isinstance(data, dict) or data.get("schema") != INDEX_SCHEMA:
            raise DatasetError(f"dataset index: unknown schema {data.get('schema') if isinstance(data, dict) else data!r}")
        try:
            index = cls(
                source_uri=data["source_uri"],
                data_uri=data["data_uri"],
                format=data["format"],
                n_rows=int(data["n_rows"]),
                fingerprint=data["fingerprint"],
                source_size=int(data["source_size"]),
                data_size=int(data["data_size"]),
                block_rows=_unpack(data["block_rows"]),
                block_offsets=None if data["block_offsets"] is None else _unpack(data["block_offsets"]),
                stride=int(data["stride"]),
                notes=list(data.get("notes", [])),
                source_version=data.get("source_version"),
                block_hashes=None if data.get("block_hashes") is None else _unpack_hashes(data["block_hashes"]),
                footer_hash=data.get("footer_hash"),
                reading=Reading.from_json(data.get("reading")),
                turn_starts=None if data.get("turn_starts") is None else _unpack(data["turn_starts"]),
                n_prompt_rows=int(data.get("n_prompt_rows", -1)),
                reading_recorded="reading" in data,
            )
        except KeyError as exc:
            raise DatasetError(f"dataset index: missing field {exc.args[0]!r}") from None
        except ValueError as exc:  # a stored reading no longer valid
            raise DatasetError(f"dataset index: {exc}") from None
        if index.n_blocks != data.get("n_blocks", index.n_blocks):
            raise DatasetError("dataset index: block table length does not match n_blocks")
        return index

    @classmethod
    def from_bytes(cls, raw: bytes) -> DatasetIndex:
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise DatasetError(f"dataset index: not JSON ({exc})") from None
        return cls.from_json(data)

    def save(self, uri: str, aws_conn_id: str = "aws_default") -> None:
        """Store the index as one small file (local path, file:// or s3://), atomically."""
        _put(uri, self.to_bytes(), aws_conn_id)

    @classmethod
    def load(cls, uri: str, aws_conn_id: str = "aws_default") -> DatasetIndex:
        source = open_source(uri, aws_conn_id)
        return cls.from_bytes(source.read(0, source.size()))


class RowPass:
    """What the index pass learns from each row of the file, in order: its id (`RowIds`) and, under an
    expanding reading, how many prompt rows it is (decoded as the reader decodes it, `dataset.conversation`,
    so the two agree on every conversation)."""

    def __init__(self, uri: str, reading: Reading) -> None:
        self.reading = reading
        self.ids = RowIds(uri, reading.fields.get("id", "id"))
        self.counts: array | None = array("q") if reading.expands else None

    @property
    def rows(self) -> int:
        return self.ids.rows

    def clear(self) -> None:
        self.ids.clear()
        if self.counts is not None:
            self.counts = array("q")

    def add_line(self, line: bytes) -> None:
        if self.counts is None:
            self.ids.add_line(line)
            return
        self.add_item(line)

    def add_item(self, item: bytes | dict[str, Any], columnar: bool = False) -> None:
        conversation = decode(item, self.reading, columnar=columnar)
        if isinstance(conversation, str):  # one invalid prompt row, as the reader makes it
            own = line_id(item, self.ids.field) if isinstance(item, bytes) else None
            self.ids.add(own)
            if self.counts is not None:
                self.counts.append(1)
            return
        self.ids.add(conversation.own_id)
        if self.counts is not None:
            self.counts.append(prompt_count(conversation.messages, self.reading.turns))

    def check(self) -> None:
        self.ids.check()

    def turn_table(self) -> tuple[np.ndarray | None, int]:
        """(each conversation's first prompt row, prompt rows in all); (None, rows) when not expanding."""
        if self.counts is None:
            return None, self.rows
        counts = np.frombuffer(self.counts, dtype=np.int64) if len(self.counts) else np.zeros(0, np.int64)
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64) if counts.size else counts
        return starts, int(counts.sum())


# ---------------------------------------------------------------- writing helpers


def _put(uri: str, data: bytes, aws_conn_id: str) -> None:
    root, key = split_uri(uri)
    if key is None:
        os.makedirs(os.path.dirname(root), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(root), prefix=".tmp-")
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, root)
        return
    from tracegen.store.storage import open_storage

    open_storage(root, aws_conn_id=aws_conn_id).put(key, data)


def _publish(tmp_path: str, uri: str, aws_conn_id: str) -> None:
    root, key = split_uri(uri)
    if key is None:
        os.makedirs(os.path.dirname(root), exist_ok=True)
        os.replace(tmp_path, root)
        return
    # The storage interface takes whole objects; a seekable copy is about the size of the
    # compressed source, so this holds it in memory once, at index time only.
    with open(tmp_path, "rb") as fh:
        _put(uri, fh.read(), aws_conn_id)
    os.unlink(tmp_path)


def write_multimember_gzip(lines: Iterable[bytes], out: io.BufferedIOBase, rows_per_member: int) -> list[int]:
    """Write rows as independent gzip members of `rows_per_member` rows; returns member offsets.

    mtime=0 and no file name keep the bytes deterministic (the sample dataset is byte-reproducible).
    """
    offsets: list[int] = []
    pos = 0
    batch: list[bytes] = []

    def flush() -> None:
        nonlocal pos
        member = gzip.compress(b"".join(batch), compresslevel=9, mtime=0)
        offsets.append(pos)
        out.write(member)
        pos += len(member)
        batch.clear()

    for line in lines:
        batch.append(line if line.endswith(b"\n") else line + b"\n")
        if len(batch) >= rows_per_member:
            flush()
    if batch:
        flush()
    return offsets


# ---------------------------------------------------------------- block hashes


def parquet_footer_span(src: ByteSource) -> tuple[int, int]:
    """Byte range [begin, end) of a Parquet file's footer: its metadata, length and closing magic."""
    size = src.size()
    tail = src.read(size - 8, 8) if size >= 12 else b""
    if len(tail) != 8 or tail[4:] != b"PAR1":
        raise DatasetError(f"dataset {src.uri}: not a Parquet file (no footer)")
    length = int.from_bytes(tail[:4], "little")
    if length + 12 > size:
        raise DatasetError(f"dataset {src.uri}: Parquet footer of {length} bytes in a file of {size}")
    return size - 8 - length, size


def hash_blocks(index: DatasetIndex, src: ByteSource) -> str:
    """Set `index.block_hashes` (and a Parquet footer's hash) from the bytes of `src`, its data_uri, read
    once in order. Returns the fingerprint of those bytes: when `src` is the indexed file itself, the caller
    compares it with the index's, so the hashes are known to describe the bytes the index describes."""
    size = src.size()
    if size != index.data_size:
        raise DatasetError(f"dataset {index.data_uri}: size {size} differs from the indexed {index.data_size}; "
                           "index it again")
    if index.block_offsets is None:
        raise DatasetError(f"dataset index of {index.source_uri}: no block offsets to hash blocks by; index it again")
    starts = index.block_offsets
    ends = np.append(starts[1:], size)
    n = index.n_blocks
    hashes = np.zeros(n, dtype=np.uint64)
    whole = hashlib.sha256()
    hasher = hashlib.sha256()
    b = pos = 0
    for piece in scan(src, whole):
        view = memoryview(piece)
        end = pos + len(piece)
        # Blocks are contiguous from the first one's start to the end of the file: a piece feeds the current
        # block, ends it when it reaches its end, and goes on with the next.
        while b < n:
            lo, hi = max(pos, int(starts[b])), min(end, int(ends[b]))
            if hi > lo:
                hasher.update(view[lo - pos : hi - pos])
            if ends[b] > end:
                break
            hashes[b] = int.from_bytes(hasher.digest()[:8], "little")
            hasher = hashlib.sha256()
            b += 1
        pos = end
    for rest in range(b, n):  # blocks of no bytes at the end
        hashes[rest] = int.from_bytes(hasher.digest()[:8], "little")
    index.block_hashes = hashes
    if index.format == "parquet":
        begin, end = parquet_footer_span(src)
        index.footer_hash = block_digest(src.read(begin, end - begin))
    return "sha256:" + whole.hexdigest()


def row_group_starts(meta: Any) -> np.ndarray:
    """Where each row group's first page starts: its blocks' offsets (a dictionary page comes first)."""
    starts = []
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        first = []
        for c in range(group.num_columns):
            column = group.column(c)
            dictionary = column.dictionary_page_offset if column.has_dictionary_page else None
            first.append(dictionary if dictionary else column.data_page_offset)
        starts.append(min(first) if first else 4)
    return np.asarray(starts, dtype=np.int64)


# ---------------------------------------------------------------- the index pass


def sniff_format(source: ByteSource) -> str:
    """Format by content, not extension: gzip magic, Parquet magic, else JSONL."""
    head = source.read(0, 4)
    if head[:2] == b"\x1f\x8b":
        return "jsonl.gz"
    if head == b"PAR1":
        return "parquet"
    return "jsonl"


def build_index(
    uri: str,
    *,
    cache_uri: str | None = None,
    stride: int = DEFAULT_STRIDE,
    max_block_rows: int = DEFAULT_MAX_BLOCK_ROWS,
    aws_conn_id: str = "aws_default",
    source: ByteSource | None = None,
    reading: Reading | None = None,
) -> DatasetIndex:
    """Scan the dataset once: row count, block table, sha256 fingerprint (and a seekable copy if needed);
    under `reading` (the default reading when None), each conversation's prompt rows.

    `cache_uri` is the directory (local or s3://) for seekable copies; pass a location every
    worker can read, e.g. `<output_root>/cache`. `source` overrides how bytes are read (tests
    count bytes through it).
    """
    if stride < 1 or max_block_rows < stride:
        raise DatasetError(f"build_index: need 1 <= stride ({stride}) <= max_block_rows ({max_block_rows})")
    src = source or open_dataset_source(uri, aws_conn_id)
    before = source_identity(src)
    reading = reading or Reading()
    ids = RowPass(uri, reading)
    fmt = "folder" if isinstance(src, FolderSource) else sniff_format(src)
    if fmt == "folder":
        index = _index_folder(uri, src, max_block_rows, cache_uri, aws_conn_id, ids)
    elif fmt == "jsonl":
        index = _index_jsonl(uri, src, stride, ids)
    elif fmt == "jsonl.gz":
        index = _index_gzip(uri, src, stride, max_block_rows, cache_uri, aws_conn_id, ids)
    else:
        index = _index_parquet(uri, src, max_block_rows, cache_uri, aws_conn_id, ids)
    if ids.rows != index.n_rows:
        raise DatasetError(f"dataset {uri}: {ids.rows} ids read for {index.n_rows} rows; index it again")
    ids.check()
    index.reading = reading
    index.turn_starts, index.n_prompt_rows = ids.turn_table()
    index.__post_init__()  # the turn table checked like a stored one
    hashed = hash_blocks(index, src if index.data_uri == uri else open_source(index.data_uri, aws_conn_id))
    if index.data_uri == uri and hashed != index.fingerprint:
        raise DatasetError(f"dataset {uri}: the file changed while it was being indexed; index it again")
    # The version recorded must be that of the bytes hashed: a file written to during the pass has neither.
    if source_identity(src) != before:
        raise DatasetError(f"dataset {uri}: the file changed while it was being indexed; index it again")
    index.source_version = before[1]
    log.info(
        "indexed %s: %d rows (%d prompt rows, %s), %d blocks, format %s, %s%s",
        shown_location(uri), index.n_rows, index.n_prompt_rows, reading.describe(), index.n_blocks, index.format,
        index.fingerprint[:19],
        f", reading copy {shown_location(index.data_uri)}" if index.data_uri != uri else "",
    )
    return index


def _index_jsonl(uri: str, src: ByteSource, stride: int, ids: RowPass) -> DatasetIndex:
    hasher = hashlib.sha256()
    raw = SourceFile(src, on_read=lambda _pos, data: hasher.update(data))
    size = raw.size()
    offsets: list[int] = []
    pos = row = 0
    for line in io.BufferedReader(raw, buffer_size=SCAN_BLOCK):
        if is_row(line):
            if row % stride == 0:
                offsets.append(pos)
            ids.add_line(line)
            row += 1
        pos += len(line)
    if pos != size:
        raise DatasetError(f"dataset {uri}: read {pos} bytes of {size}; did the file change during indexing?")
    return DatasetIndex(
        source_uri=uri, data_uri=uri, format="jsonl", n_rows=row, fingerprint="sha256:" + hasher.hexdigest(),
        source_size=size, data_size=size, block_rows=np.arange(len(offsets), dtype=np.int64) * stride,
        block_offsets=np.asarray(offsets, dtype=np.int64), stride=stride,
    )


class _NeedsCopy(Exception):
    """The gzip file is not seekable in place (why is the message)."""


def _index_gzip(
    uri: str, src: ByteSource, stride: int, max_block_rows: int, cache_uri: str | None, aws_conn_id: str,
    ids: RowPass,
) -> DatasetIndex:
    try:
        return _index_gzip_in_place(uri, src, max_block_rows, ids)
    except _NeedsCopy as why:
        reason = str(why)
        ids.clear()  # the copy's pass reads every row again
    cache = cache_uri or default_cache_dir()
    log.warning(
        "dataset %s is not seekable as it is (%s): writing a seekable multi-member copy (%d rows per member) "
        "into %s, once%s", shown_location(uri), reason, stride, shown_location(cache),
        "" if cache_uri else " (worker-local cache: pass cache_uri under the output root for remote workers)",
    )
    hasher = hashlib.sha256()
    local_dir = split_uri(cache)[0] if split_uri(cache)[1] is None else None
    if local_dir:
        os.makedirs(local_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=local_dir, prefix=".tracegen-copy-", suffix=".jsonl.gz")
    n_rows = 0

    def counted(rows: Iterator[bytes]) -> Iterator[bytes]:
        nonlocal n_rows
        for line in rows:
            n_rows += 1
            ids.add_line(line)
            yield line

    try:
        with os.fdopen(fd, "wb") as out:
            offsets = write_multimember_gzip(
                counted(split_rows(gunzip_stream(uri, scan(src, hasher)))), out, stride
            )
            out.flush()
            os.fsync(out.fileno())
            data_size = out.tell()
        fingerprint = "sha256:" + hasher.hexdigest()
        data_uri = cache.rstrip("/") + f"/{fingerprint[7:39]}.seekable.jsonl.gz"
        _publish(tmp, data_uri, aws_conn_id)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return DatasetIndex(
        source_uri=uri, data_uri=data_uri, format="jsonl.gz", n_rows=n_rows, fingerprint=fingerprint,
        source_size=src.size(), data_size=data_size,
        block_rows=np.arange(len(offsets), dtype=np.int64) * stride,
        block_offsets=np.asarray(offsets, dtype=np.int64), stride=stride,
        notes=[f"seekable copy of {uri}: {reason}"],
    )


def _index_gzip_in_place(uri: str, src: ByteSource, max_block_rows: int, ids: RowPass) -> DatasetIndex:
    hasher = hashlib.sha256()
    offsets = [0]
    first_rows = [0]
    state = {"row": 0, "member_rows": 0, "carry": b"", "dangling": False}

    def member_end(end: int) -> None:
        # A member must end on a line boundary, or be the last one: else a row spans two members.
        if is_row(state["carry"]):
            ids.add_line(state["carry"])
            state["row"] += 1
            state["dangling"] = True
        state["carry"] = b""
        state["member_rows"] = 0
        offsets.append(end)
        first_rows.append(state["row"])

    for out in gunzip_stream(uri, scan(src, hasher), member_end):
        if state["dangling"]:
            raise _NeedsCopy("a row spans two gzip members")
        lines = (state["carry"] + out).split(b"\n")
        state["carry"] = lines.pop()
        n = 0
        for line in lines:
            if is_row(line):
                ids.add_line(line)
                n += 1
        state["row"] += n
        state["member_rows"] += n
        if state["member_rows"] > max_block_rows:
            raise _NeedsCopy(
                "single gzip stream" if len(offsets) == 1 else f"a gzip member holds > {max_block_rows} rows"
            )
    if is_row(state["carry"]):  # stream without a final member end is caught as truncation above
        ids.add_line(state["carry"])
        state["row"] += 1
    size = src.size()
    # The last recorded offset is the end of the file, not a block start.
    if offsets[-1] == size:
        offsets.pop()
        first_rows.pop()
    return DatasetIndex(
        source_uri=uri, data_uri=uri, format="jsonl.gz", n_rows=state["row"],
        fingerprint="sha256:" + hasher.hexdigest(), source_size=size, data_size=size,
        block_rows=np.asarray(first_rows, dtype=np.int64), block_offsets=np.asarray(offsets, dtype=np.int64),
        stride=max_block_rows,
    )


def _index_parquet(
    uri: str, src: ByteSource, max_block_rows: int, cache_uri: str | None, aws_conn_id: str, ids: RowPass
) -> DatasetIndex:
    import pyarrow.parquet as pq

    fingerprint = fingerprint_source(src)
    try:
        pf = pq.ParquetFile(SourceFile(src))
        meta = pf.metadata
    except Exception as exc:  # pyarrow raises several types for a corrupt footer
        raise DatasetError(f"dataset {uri}: not a readable Parquet file ({exc})") from None
    sizes = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
    # The id column alone, a row group at a time: every row's id, without its prompt; under an expanding
    # reading every row, to count its prompt rows.
    id_column = ids.ids.field
    has_ids = id_column in pf.schema_arrow.names
    for g in range(meta.num_row_groups):
        if ids.counts is not None:
            for item in pf.read_row_group(g).to_pylist():
                ids.add_item(item, columnar=True)
        elif has_ids:
            for value in pf.read_row_group(g, columns=[id_column]).column(id_column).to_pylist():
                ids.ids.add(columnar_id(value))
        else:
            for _ in range(sizes[g]):
                ids.ids.add(None)
    if not sizes or max(sizes) <= max_block_rows:
        return DatasetIndex(
            source_uri=uri, data_uri=uri, format="parquet", n_rows=meta.num_rows, fingerprint=fingerprint,
            source_size=src.size(), data_size=src.size(),
            block_rows=np.concatenate([[0], np.cumsum(sizes[:-1])]).astype(np.int64) if sizes else np.zeros(0),
            block_offsets=row_group_starts(meta), stride=max_block_rows,
        )
    group_rows = min(PARQUET_COPY_ROW_GROUP, max_block_rows)
    cache = cache_uri or default_cache_dir()
    log.warning(
        "dataset %s has row groups of up to %d rows (> %d): writing a copy with %d-row groups into %s, once",
        shown_location(uri), max(sizes), max_block_rows, group_rows, shown_location(cache),
    )
    local_dir = split_uri(cache)[0] if split_uri(cache)[1] is None else None
    if local_dir:
        os.makedirs(local_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=local_dir, prefix=".tracegen-copy-", suffix=".parquet")
    os.close(fd)
    try:
        writer = None
        new_sizes: list[int] = []
        for batch in pf.iter_batches(batch_size=group_rows):
            if writer is None:
                writer = pq.ParquetWriter(tmp, batch.schema)
            writer.write_batch(batch, row_group_size=group_rows)
        if writer is not None:
            writer.close()
        copy_meta = pq.ParquetFile(tmp).metadata
        new_sizes = [copy_meta.row_group(i).num_rows for i in range(copy_meta.num_row_groups)]
        copy_starts = row_group_starts(copy_meta)
        data_size = os.path.getsize(tmp)
        data_uri = cache.rstrip("/") + f"/{fingerprint[7:39]}.seekable.parquet"
        _publish(tmp, data_uri, aws_conn_id)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return DatasetIndex(
        source_uri=uri, data_uri=data_uri, format="parquet", n_rows=meta.num_rows, fingerprint=fingerprint,
        source_size=src.size(), data_size=data_size,
        block_rows=np.concatenate([[0], np.cumsum(new_sizes[:-1])]).astype(np.int64),
        block_offsets=copy_starts, stride=group_rows, notes=[f"seekable copy of {uri}: row groups up to {max(sizes)} rows"],
    )


def _index_folder(
    uri: str, src: FolderSource, max_block_rows: int, cache_uri: str | None, aws_conn_id: str, ids: RowPass
) -> DatasetIndex:
    """A folder of shards (`dataset.folder`): one seekable Parquet copy of its rows, indexed as a Parquet
    file, fingerprinted and sized as the folder."""
    fingerprint = fingerprint_source(src)
    group_rows = min(PARQUET_COPY_ROW_GROUP, max_block_rows)
    cache = cache_uri or default_cache_dir()
    log.warning("dataset %s is a folder of %d %s files: writing its rows into one Parquet copy with %d-row "
                "groups into %s, once", shown_location(uri), len(src.files), src.kind, group_rows,
                shown_location(cache))
    local_dir = split_uri(cache)[0] if split_uri(cache)[1] is None else None
    if local_dir:
        os.makedirs(local_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=local_dir, prefix=".tracegen-copy-", suffix=".parquet")
    os.close(fd)
    try:
        write_copy(src, tmp, group_rows)
        copy = _index_parquet(tmp, open_source(tmp), max_block_rows, cache_uri, aws_conn_id, ids)
        data_uri = cache.rstrip("/") + f"/{fingerprint[7:39]}.seekable.parquet"
        _publish(tmp, data_uri, aws_conn_id)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return DatasetIndex(
        source_uri=uri, data_uri=data_uri, format="parquet", n_rows=copy.n_rows, fingerprint=fingerprint,
        source_size=src.size(), data_size=copy.data_size, block_rows=copy.block_rows,
        block_offsets=copy.block_offsets, stride=copy.stride,
        notes=[f"seekable copy of {uri}: a folder of {len(src.files)} {src.kind} files"],
    )
