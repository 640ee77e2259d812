"""Dataset reader: index offsets, O(chunk) reads, bad rows as results, fingerprints, S3, the bundled sample."""

from __future__ import annotations

import gzip
import hashlib
import json
import zlib
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tracegen.dataset.index import write_multimember_gzip
from tracegen.dataset.reader import (
    CountingSource,
    DatasetError,
    DatasetIndex,
    InvalidRow,
    PromptRow,
    build_index,
    open_source,
    parse_row,
    read_indices,
    read_rows,
)
from tracegen.sample_data import SAMPLE_DATASET, SAMPLE_ROWS
from tracegen.sample_data.make_sample import write as write_sample

N = 1000
STRIDE = 16


def make_rows(n: int = N, pad: int = 60) -> list[dict[str, Any]]:
    # Varied line lengths so offsets are not a multiple of anything; hex filler so compression
    # (gzip, Parquet) cannot shrink the file to nothing and hide what a chunk read costs.
    def filler(i: int) -> str:
        return (hashlib.sha256(str(i).encode()).hexdigest() * 30)[: (i * 37) % pad]

    return [
        {
            "id": f"r{i}",
            "category": ["bug", "sql", "tools"][i % 3],
            "messages": [{"role": "user", "content": f"prompt {i} " + filler(i)}],
        }
        for i in range(n)
    ]


def jsonl_bytes(rows: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


def write_format(tmp: Path, fmt: str, rows: list[dict[str, Any]]) -> Path:
    if fmt == "jsonl":
        path = tmp / "data.jsonl"
        path.write_bytes(jsonl_bytes(rows))
    elif fmt == "gzip-single":
        path = tmp / "data.jsonl.gz"
        path.write_bytes(gzip.compress(jsonl_bytes(rows)))
    elif fmt == "gzip-members":
        path = tmp / "members.jsonl.gz"
        with open(path, "wb") as out:
            write_multimember_gzip((json.dumps(r).encode() for r in rows), out, 50)
    elif fmt == "parquet":
        path = tmp / "data.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=100)
    elif fmt == "parquet-big-groups":
        path = tmp / "big.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)  # one row group holding every row
    else:
        raise AssertionError(fmt)
    return path


FORMATS = ["jsonl", "gzip-single", "gzip-members", "parquet", "parquet-big-groups"]


def index_for(tmp: Path, fmt: str, rows: list[dict[str, Any]], **kw: Any) -> DatasetIndex:
    path = write_format(tmp, fmt, rows)
    kw.setdefault("stride", STRIDE)
    kw.setdefault("max_block_rows", 200)
    return build_index(str(path), cache_uri=str(tmp / "cache"), **kw)


# ---------------------------------------------------------------- offsets


def test_jsonl_checkpoints_point_at_the_right_lines(tmp_path: Path) -> None:
    rows = make_rows()
    index = index_for(tmp_path, "jsonl", rows)
    raw = (tmp_path / "data.jsonl").read_bytes()
    assert index.n_rows == N and index.data_uri == index.source_uri
    assert index.n_blocks == -(-N // STRIDE)
    for block, (first, offset) in enumerate(zip(index.block_rows, index.block_offsets, strict=True)):
        assert first == block * STRIDE
        assert offset == 0 or raw[offset - 1 : offset] == b"\n"
        line = raw[offset : raw.index(b"\n", offset)]
        assert json.loads(line)["id"] == f"r{first}"


def test_multimember_gzip_is_indexed_in_place_member_by_member(tmp_path: Path) -> None:
    rows = make_rows()
    index = index_for(tmp_path, "gzip-members", rows)
    raw = (tmp_path / "members.jsonl.gz").read_bytes()
    assert index.data_uri == index.source_uri and not index.notes  # no copy needed
    assert list(index.block_rows) == list(range(0, N, 50))
    for b, first in enumerate(index.block_rows):
        begin, end = index.block_span(b, b + 1)
        member = zlib.decompress(raw[begin:end], 31)  # each member decompresses on its own
        assert json.loads(member.split(b"\n")[0])["id"] == f"r{first}"


def test_single_stream_gzip_gets_a_seekable_copy_with_the_original_fingerprint(tmp_path: Path) -> None:
    rows = make_rows()
    index = index_for(tmp_path, "gzip-single", rows)
    original = (tmp_path / "data.jsonl.gz").read_bytes()
    assert index.fingerprint == "sha256:" + hashlib.sha256(original).hexdigest()
    assert index.data_uri.startswith(str(tmp_path / "cache")) and index.notes
    copy = Path(index.data_uri).read_bytes()
    assert zlib.decompress(copy, 31) != b""  # first member alone
    assert gzip.decompress(copy) == jsonl_bytes(rows)  # same rows, same bytes per line
    assert list(index.block_rows) == list(range(0, N, STRIDE))


def test_gzip_members_not_on_line_boundaries_get_a_copy(tmp_path: Path) -> None:
    data = jsonl_bytes(make_rows(100))
    cut = data.index(b"prompt 40")  # inside row 40
    path = tmp_path / "split.jsonl.gz"
    path.write_bytes(gzip.compress(data[:cut], mtime=0) + gzip.compress(data[cut:], mtime=0))
    index = build_index(str(path), cache_uri=str(tmp_path / "cache"), stride=8, max_block_rows=200)
    assert index.data_uri != str(path) and "spans two gzip members" in index.notes[0]
    assert [r.id for r in read_rows(index, 35, 45)] == [f"r{i}" for i in range(35, 45)]


def test_parquet_blocks_are_row_groups(tmp_path: Path) -> None:
    index = index_for(tmp_path, "parquet", make_rows())
    meta = pq.ParquetFile(tmp_path / "data.parquet").metadata
    assert index.data_uri == index.source_uri
    assert meta.num_row_groups == index.n_blocks == 10
    assert list(index.block_rows) == list(range(0, N, 100))


def test_parquet_with_huge_row_groups_gets_a_copy_with_small_ones(tmp_path: Path) -> None:
    index = index_for(tmp_path, "parquet-big-groups", make_rows())
    assert index.data_uri.endswith(".seekable.parquet")
    meta = pq.ParquetFile(index.data_uri).metadata
    assert max(meta.row_group(i).num_rows for i in range(meta.num_row_groups)) <= 200
    assert index.n_blocks == meta.num_row_groups


# ---------------------------------------------------------------- reading


@pytest.mark.parametrize("fmt", FORMATS)
def test_read_rows_returns_exactly_the_slice(tmp_path: Path, fmt: str) -> None:
    rows = make_rows()
    index = index_for(tmp_path, fmt, rows)
    loaded = DatasetIndex.from_bytes(index.to_bytes())  # what a mapped task sees
    assert loaded.n_rows == N and loaded.fingerprint == index.fingerprint
    for start, stop in [(0, 0), (0, 1), (0, N), (N - 1, N), (15, 17), (16, 32), (333, 777), (999, 1000)]:
        got = list(read_rows(loaded, start, stop))
        assert [r.index for r in got] == list(range(start, stop)), (fmt, start, stop)
        for r in got:
            assert isinstance(r, PromptRow)
            assert r.id == f"r{r.index}" and r.messages == rows[r.index]["messages"]
            assert r.category == rows[r.index]["category"]
    with pytest.raises(DatasetError, match=r"outside \[0, 1000\)"):
        list(read_rows(loaded, 10, N + 1))


@pytest.mark.parametrize("fmt", ["jsonl", "gzip-single", "gzip-members", "parquet"])
def test_reading_a_chunk_reads_only_its_bytes(tmp_path: Path, fmt: str) -> None:
    rows = make_rows(4000, pad=900)
    index = index_for(tmp_path, fmt, rows)
    total = index.data_size
    start, stop = 2010, 2210  # 5% of the rows, not block-aligned
    src = CountingSource(open_source(index.data_uri))
    got = list(read_rows(index, start, stop, source=src))
    assert [r.index for r in got] == list(range(start, stop))
    lo, hi = index.blocks_for(start, stop)
    if fmt != "parquet":
        begin, end = index.block_span(lo, hi)
        assert src.bytes_read == end - begin  # exactly the covering blocks, nothing else
        assert hi - lo <= (stop - start) // int(index.block_rows[1]) + 2
    else:
        # Footer + the covering row groups' column chunks.
        meta = pq.ParquetFile(index.data_uri).metadata
        groups = sum(meta.row_group(g).total_byte_size for g in range(lo, hi))
        assert src.bytes_read <= groups + 2 * meta.serialized_size + 65536
    # Parquet pays a fixed ~64 KB speculative footer read on top; the test file is small.
    assert src.bytes_read < (0.25 if fmt == "parquet" else 0.15) * total, (fmt, src.bytes_read, total)


def test_read_indices_reads_only_the_blocks_holding_them(tmp_path: Path) -> None:
    index = index_for(tmp_path, "jsonl", make_rows(4000, pad=900))
    want = [3999, 7, 2500, 8, 2501, 7]
    src = CountingSource(open_source(index.data_uri))
    got = list(read_indices(index, want, source=src))
    assert [r.index for r in got] == [7, 8, 2500, 2501, 3999]
    assert all(r.id == f"r{r.index}" for r in got)
    assert src.requests == 3 and src.bytes_read < 0.02 * index.data_size
    with pytest.raises(DatasetError, match="row 4000 outside"):
        list(read_indices(index, [4000]))


def test_index_round_trips_and_stays_small(tmp_path: Path) -> None:
    index = index_for(tmp_path, "jsonl", make_rows(20_000, pad=10), stride=32)
    target = tmp_path / "out" / "dataset_index.json"
    index.save(str(target))
    loaded = DatasetIndex.load(str(target))
    assert loaded.to_json() == index.to_json()
    assert (loaded.block_offsets == index.block_offsets).all()
    assert target.stat().st_size < 8_000  # 625 checkpoints, delta-packed


# ---------------------------------------------------------------- bad input


BAD_LINES: list[tuple[bytes, str]] = [
    (b'{"messages": [{"role": "user", "content": "fine"}]}', ""),
    (b'{"messages": [{"role": "user", "content": "unterminated}', "malformed JSON"),
    (b'{"id": "no-messages"}', "row is in no form tracegen reads"),
    (b'{"messages": "hello"}', "'messages' must be a list, got str"),
    (b'{"messages": []}', "'messages' is empty"),
    (b'{"messages": [{"role": "robot", "content": "x"}]}', "messages[0].role 'robot' is not one of"),
    (b'{"messages": [{"role": "user", "content": 42}]}', "messages[0].content must be a string"),
    (b'{"messages": [{"role": "user"}]}', "messages[0] (user) has no content"),
    (b'{"messages": ["just text"]}', "messages[0] must be an object"),
    (b'[1, 2, 3]', "row must be a JSON object, got list"),
    (b'{"messages": [{"role": "user", "content": "x"}], "tools": {"a": 1}}', "'tools' must be a list"),
    (b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}', "tools[0] needs"),
    (b'{"messages": [{"role": "user", "content": [{"text": "no type"}]}]}', "content[0].type None is not one of"),
    (b'{"messages": [{"role": "user", "content": "x"}], "id": 3.5}', "id must be a string or an integer"),
    (b'{"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": null, '
     b'"tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}, '
     b'{"role": "tool", "tool_call_id": "c1", "content": "ok"}], "tools": [{"type": "function", '
     b'"function": {"name": "f", "parameters": {}}}], "id": 7, "metadata": {"source": "swe"}}', ""),
]


def test_bad_rows_come_back_as_invalid_rows_naming_index_and_reason(tmp_path: Path) -> None:
    # Blank lines are not rows: indices count only the non-blank lines.
    body = b"\n\n".join(line for line, _ in BAD_LINES) + b"\n   \n"
    path = tmp_path / "bad.jsonl"
    path.write_bytes(body)
    index = build_index(str(path), stride=4)
    assert index.n_rows == len(BAD_LINES)
    got = list(read_rows(index, 0, index.n_rows))
    for i, ((_, reason), row) in enumerate(zip(BAD_LINES, got, strict=True)):
        assert row.index == i
        if reason:
            assert isinstance(row, InvalidRow), (i, row)
            assert reason in row.reason, (i, row.reason)
        else:
            assert isinstance(row, PromptRow), (i, row)
    last = got[-1]
    assert isinstance(last, PromptRow) and last.id == "7" and last.category == "swe" and last.tools


def test_parquet_rows_with_json_string_columns_and_null_struct_fields(tmp_path: Path) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    table = pa.table({
        "messages": [json.dumps(msgs), "not json", None],
        "tools": [None, None, None],
        "source": ["a", "b", "c"],
    })
    path = tmp_path / "s.parquet"
    pq.write_table(table, path)
    rows = list(read_rows(build_index(str(path)), 0, 3))
    assert isinstance(rows[0], PromptRow) and rows[0].messages == msgs and rows[0].category == "a"
    assert isinstance(rows[1], InvalidRow) and "not JSON" in rows[1].reason
    assert isinstance(rows[2], InvalidRow) and rows[2].reason.startswith("row is in no form tracegen reads")
    # Struct columns fill absent keys with nulls; they must not reach the request.
    nested = pa.Table.from_pylist([{"messages": [{"role": "user", "content": "x", "name": None}]}])
    pq.write_table(nested, tmp_path / "n.parquet")
    row = next(read_rows(build_index(str(tmp_path / "n.parquet")), 0, 1))
    assert isinstance(row, PromptRow) and row.messages == [{"role": "user", "content": "x"}]


def test_parse_row_never_raises_on_junk() -> None:
    for junk in [b"", b"null", b"\xff\xfe", b'{"messages": null}', "{}", {"messages": [None]}]:
        assert isinstance(parse_row(3, junk), InvalidRow)


def test_missing_or_unreadable_files_raise_naming_the_uri(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DatasetError, match=f"{missing}: file not found"):
        build_index(str(missing))
    with pytest.raises(DatasetError, match="a folder, but neither a Hugging Face dataset"):
        build_index(str(tmp_path))
    with pytest.raises(DatasetError, match="unsupported scheme 'ftp'"):
        build_index("ftp://host/x.jsonl")
    truncated = tmp_path / "cut.jsonl.gz"
    truncated.write_bytes(gzip.compress(jsonl_bytes(make_rows(50)))[:-30])
    with pytest.raises(DatasetError, match=f"{truncated}: truncated gzip"):
        build_index(str(truncated), cache_uri=str(tmp_path / "c"))
    corrupt = tmp_path / "corrupt.jsonl.gz"
    good = gzip.compress(jsonl_bytes(make_rows(50)))
    corrupt.write_bytes(good[:20] + b"\x00" * 40 + good[60:])
    with pytest.raises(DatasetError, match=f"{corrupt}: corrupt gzip"):
        build_index(str(corrupt), cache_uri=str(tmp_path / "c"))
    bad_parquet = tmp_path / "bad.parquet"
    bad_parquet.write_bytes(b"PAR1" + b"\x00" * 100)
    with pytest.raises(DatasetError, match="not a readable Parquet file"):
        build_index(str(bad_parquet))


def test_fingerprint_follows_the_bytes_and_a_changed_file_is_refused(tmp_path: Path) -> None:
    rows = make_rows(100)
    path = write_format(tmp_path, "jsonl", rows)
    first = build_index(str(path))
    assert build_index(f"file://{path}").fingerprint == first.fingerprint
    rows[42]["messages"][0]["content"] += "!"
    path.write_bytes(jsonl_bytes(rows))
    second = build_index(str(path))
    assert second.fingerprint != first.fingerprint and second.n_rows == first.n_rows
    with pytest.raises(DatasetError, match="changed since it was indexed"):
        list(read_rows(first, 0, 10))


# ---------------------------------------------------------------- S3 (moto server through the real hook)


@pytest.mark.parametrize("fmt", ["jsonl", "gzip-single", "parquet"])
def test_s3_index_and_chunk_reads(tmp_path: Path, s3_uri: str, fmt: str) -> None:
    from tracegen.store.storage import open_storage

    rows = make_rows(2000, pad=400)
    local = write_format(tmp_path, fmt, rows)
    store = open_storage(s3_uri)
    store.put("in/" + local.name, local.read_bytes())
    uri = s3_uri.rstrip("/") + "/in/" + local.name
    index = build_index(uri, cache_uri=s3_uri.rstrip("/") + "/cache", stride=STRIDE, max_block_rows=200)
    assert index.n_rows == 2000
    assert index.fingerprint == "sha256:" + hashlib.sha256(local.read_bytes()).hexdigest()
    if fmt == "gzip-single":
        assert index.data_uri.startswith(s3_uri.rstrip("/") + "/cache/")
    index.save(s3_uri.rstrip("/") + "/dataset_index.json")
    loaded = DatasetIndex.load(s3_uri.rstrip("/") + "/dataset_index.json")
    src = CountingSource(open_source(loaded.data_uri))
    got = list(read_rows(loaded, 1200, 1300, source=src))
    assert [r.id for r in got] == [f"r{i}" for i in range(1200, 1300)]
    # Parquet adds a fixed ~64 KB speculative footer read, large next to this small file.
    assert src.bytes_read < 0.2 * loaded.data_size + (65536 if fmt == "parquet" else 0)
    with pytest.raises(DatasetError, match="object not found"):
        build_index(s3_uri.rstrip("/") + "/in/missing.jsonl")


# ---------------------------------------------------------------- the bundled sample


def test_sample_dataset_loads_and_validates_fully() -> None:
    assert SAMPLE_DATASET.stat().st_size < 2_000_000
    index = build_index(str(SAMPLE_DATASET))
    assert index.n_rows == SAMPLE_ROWS
    assert index.data_uri == str(SAMPLE_DATASET)  # multi-member: seekable in place, no copy
    rows = list(read_rows(index, 0, index.n_rows))
    invalid = [r for r in rows if isinstance(r, InvalidRow)]
    assert invalid == []
    categories = {r.category for r in rows}
    assert {"bug_report", "tool_use", "sql", "ci_failure", "code_review"} <= categories
    assert len({r.id for r in rows}) == SAMPLE_ROWS
    assert len({json.dumps(r.messages) for r in rows}) == SAMPLE_ROWS  # no duplicate prompts
    with_tools = [r for r in rows if r.tools]
    assert len(with_tools) > 300
    for r in with_tools:  # every tool the transcript calls is declared
        declared = {t["function"]["name"] for t in r.tools}
        called = {c["function"]["name"] for m in r.messages for c in m.get("tool_calls") or []}
        assert called <= declared
    lengths = sorted(len(json.dumps(r.messages)) for r in rows)
    assert lengths[-1] > 5 * lengths[len(lengths) // 2] / 2  # varied lengths, a long tail


def test_sample_dataset_is_reproducible_byte_for_byte(tmp_path: Path) -> None:
    out = tmp_path / "sample.jsonl.gz"
    write_sample(out)
    assert out.read_bytes() == SAMPLE_DATASET.read_bytes(), "rerun make_sample.py and commit the file"
