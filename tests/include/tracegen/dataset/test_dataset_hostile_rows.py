"""Hostile dataset rows: one bad row never stops a chunk.

A JSONL line of 200 KB of `[` made `json.loads` raise RecursionError, which `parse_row` did not catch: the
error named no row, every retry of the chunk failed on it and the chunk's later rows were never generated.
Now ANY exception while a row is parsed makes that row an `InvalidRow` naming its index, recorded `invalid`
like any malformed line (or, under `invalid_rows=fail`, the chunk stops naming the row); a row nested deeper
than `MAX_ROW_DEPTH` is refused the same way, since serialising it again on the way to a server would fail
out of any row's reach. Checked through the path a user takes: the file indexed, a chunk read, and the
engine generating the chunk against a stand-in.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from engine_support.helpers import (
    assert_healthy,
    endpoints,
    make_config,
    prepare,
    prompt,
    root_of,
    run_engine,
    write_dataset,
)

from tracegen.dataset.reader import InvalidRow, PromptRow, build_index, parse_row, read_indices, read_rows
from tracegen.generate.engine import InvalidRowError
from tracegen.store.records import INVALID, OK

N = 12
BRACKETS = "[" * 200_000  # the finding's line: 200 KB of `[`
DEEP_OBJECT = '{"messages": ' + "[" * 200_000  # the same inside an object
# Parses (below Python's recursion limit) but is far deeper than any chat request: the arguments of a tool
# call nested 900 levels; the request body built from it would not serialise.
_deep = "[" * 900 + "]" * 900
DEEP_ARGUMENTS = (
    '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": null, "tool_calls": '
    '[{"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": ' + _deep + "}}}]}, "
    '{"role": "tool", "tool_call_id": "c1", "content": "done"}]}'
)
HOSTILE = {3: BRACKETS, 6: DEEP_OBJECT, 9: DEEP_ARGUMENTS}


def _write(path: Path, fmt: str, bad: dict[int, str]) -> Path:
    lines = [bad[i] if i in bad else json.dumps(prompt(i)) for i in range(N)]
    if fmt == "jsonl":
        path.write_text("".join(line + "\n" for line in lines))
    elif fmt == "jsonl.gz":
        path.write_bytes(gzip.compress("".join(line + "\n" for line in lines).encode()))
    else:  # Parquet: `messages` as a JSON string column (nested JSON is stored so), the hostile ones raw
        def column(i: int) -> str:
            if i not in bad:
                return json.dumps(prompt(i)["messages"])
            raw = bad[i].removeprefix('{"messages": ')
            return raw[:-1] if raw.endswith("}") and raw != bad[i] else raw

        messages = [column(i) for i in range(N)]
        pq.write_table(pa.table({"id": [f"p{i}" for i in range(N)], "messages": messages}), path)
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "jsonl.gz", "parquet"])
def test_a_hostile_row_is_invalid_naming_its_row_and_the_chunk_reads_on(tmp_path, fmt):
    path = _write(tmp_path / f"prompts.{fmt}", fmt, HOSTILE)
    index = build_index(str(path), cache_uri=str(tmp_path / "cache"))  # the indexing pass counts every row
    assert index.n_rows == N
    rows = list(read_rows(index, 0, N))  # a chunk's read
    assert [r.index for r in rows] == list(range(N))
    bad = {r.index: r.reason for r in rows if isinstance(r, InvalidRow)}
    assert set(bad) == set(HOSTILE), bad
    assert all(isinstance(r, PromptRow) for r in rows if r.index not in HOSTILE)
    for reason in bad.values():
        assert "nested" in reason, reason
        assert len(reason) < 300, "the reason must not quote the row"
    # A sample read (the pilot's) takes the same path.
    assert [type(r) for r in read_indices(index, [2, 3, 9, 10])] == [PromptRow, InvalidRow, InvalidRow, PromptRow]


@pytest.mark.parametrize("raw", [BRACKETS, DEEP_OBJECT, DEEP_ARGUMENTS, b"\xff\xfe{", "\ud800"])
def test_parse_row_turns_any_failure_into_an_invalid_row(raw):
    row = parse_row(41, raw)
    assert isinstance(row, InvalidRow) and row.index == 41, row


def test_parse_row_catches_an_unexpected_exception_from_a_check(monkeypatch):
    from tracegen.dataset import reader

    def boom(messages):
        raise KeyError("surprise")

    monkeypatch.setattr(reader, "_check_messages", boom)
    row = parse_row(5, json.dumps(prompt(5)))
    assert isinstance(row, InvalidRow) and row.index == 5 and "KeyError" in row.reason


FAST = dict(sim_time_scale=2000, sim_length_model="short", log_level="warning", enable_metrics=True)


def test_the_engine_records_hostile_rows_invalid_and_generates_the_others(tmp_path, sim_server):
    sim = sim_server(**FAST)
    n = 30
    hostile = {4: BRACKETS, 11: DEEP_OBJECT, 17: DEEP_ARGUMENTS}
    dataset = write_dataset(tmp_path / "prompts.jsonl", n, bad=hostile)
    config = make_config(dataset, tmp_path / "out", invalid_rows="record", part_rows=5)
    prepare(config, "run-hostile")
    summary = run_engine(config, "run-hostile", endpoints(sim), tmp_path / "spool", range(n))
    assert summary.statuses == {OK: n - len(hostile), INVALID: len(hostile)}
    frame = assert_healthy(root_of(config), n, config)
    invalid = frame[frame["status"] == INVALID].set_index("index")
    assert sorted(invalid.index) == sorted(hostile)
    assert all("nested" in invalid.loc[i, "error"] for i in hostile), invalid["error"].tolist()
    assert set(frame.loc[frame["status"] == OK, "index"]) == set(range(n)) - set(hostile)
    # Done: a retry of the chunk sends nothing again.
    assert run_engine(config, "run-hostile", endpoints(sim), tmp_path / "spool", range(n)).generated == 0


def test_under_fail_the_chunk_stops_naming_the_hostile_row(tmp_path, sim_server):
    sim = sim_server(**FAST)
    dataset = write_dataset(tmp_path / "prompts.jsonl", 20, bad={13: BRACKETS})
    config = make_config(dataset, tmp_path / "out", invalid_rows="fail", part_rows=5)
    prepare(config, "run-fail")
    with pytest.raises(InvalidRowError, match=r"row 13: .*nested"):
        run_engine(config, "run-fail", endpoints(sim), tmp_path / "spool", range(20))
