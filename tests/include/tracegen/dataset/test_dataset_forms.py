"""Input forms (OpenAI messages, ShareGPT, a prompt string, mapped field names), the turns generated
(last, first, each), the one rule that no prompt ends with an assistant message, ids never floats, and a
dataset most of whose rows cannot be used stopped before any GPU time."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from tracegen.dataset.index import DatasetIndex, build_index
from tracegen.dataset.reader import (
    CountingSource,
    InvalidRow,
    PromptRow,
    open_source,
    read_indices,
    read_rows,
)
from tracegen.dataset.reading import Reading
from tracegen.dataset.source import DatasetError
from tracegen.dataset.stored import DATASET_INDEX_KEY, EarlierReadingError, ReadingMismatchError, bind_index
from tracegen.dataset.usable import DatasetUnusableError, check_usable
from tracegen.store.records import INVALID
from tracegen.store.root import open_root

SYSTEM = "You are a coding agent."
TOOLS = [{"name": "run", "description": "run a shell command",
          "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}]


def sharegpt_row(i: int) -> dict[str, Any]:
    """A LLaMA-Factory style ShareGPT row: a tool call and its result, then the final answer."""
    return {
        "id": f"c{i}",
        "system": SYSTEM,
        "tools": json.dumps(TOOLS),
        "conversations": [
            {"from": "human", "value": f"list the files of project {i}"},
            {"from": "function_call", "value": json.dumps({"name": "run", "arguments": {"cmd": "ls"}})},
            {"from": "observation", "value": "a.py b.py"},
            {"from": "gpt", "value": "There are two files: a.py and b.py."},
        ],
    }


def sft_row(i: int, turns: int = 3) -> dict[str, Any]:
    """An SFT row in OpenAI form: `turns` user/assistant exchanges, ending with the original answer."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    for t in range(turns):
        messages.append({"role": "user", "content": f"question {t} of {i}"})
        messages.append({"role": "assistant", "content": f"answer {t} of {i}"})
    return {"id": f"conv{i}", "messages": messages}


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def rows_of(uri: str, reading: Reading) -> list[PromptRow | InvalidRow]:
    index = build_index(uri, reading=reading, stride=4)
    return list(read_rows(index, 0, index.n_prompt_rows))


def test_sharegpt_from_value_rows_read_as_openai_messages_with_tool_calls_bound_to_their_results(tmp_path):
    rows = rows_of(write_jsonl(tmp_path / "sg.jsonl", [sharegpt_row(0)]), Reading())
    assert len(rows) == 1 and isinstance(rows[0], PromptRow), rows
    row = rows[0]
    assert row.id == "c0"
    assert [m["role"] for m in row.messages] == ["system", "user", "assistant", "tool"]
    call = row.messages[2]["tool_calls"][0]
    assert call["function"] == {"name": "run", "arguments": json.dumps({"cmd": "ls"})}
    assert row.messages[3] == {"role": "tool", "content": "a.py b.py", "tool_call_id": call["id"]}
    # Bare function definitions given as JSON text become OpenAI tools.
    assert row.tools == [{"type": "function", "function": TOOLS[0]}]


def test_sharegpt_role_content_rows_with_tool_calls_as_json_text(tmp_path):
    calls = [{"id": "x1", "type": "function", "function": {"name": "run", "arguments": "{\"cmd\": \"pwd\"}"}}]
    row = {"conversations": [
        {"role": "user", "content": "where am I?"},
        {"role": "assistant", "content": None, "tool_calls": json.dumps(calls)},
        {"role": "tool", "content": "/home", "tool_call_id": "x1"},
    ]}
    (got,) = rows_of(write_jsonl(tmp_path / "rc.jsonl", [row]), Reading(form="sharegpt"))
    assert isinstance(got, PromptRow), got
    assert got.messages[1]["tool_calls"] == calls and got.messages[-1]["role"] == "tool"


def test_a_prompt_string_field_and_mapped_field_names(tmp_path):
    uri = write_jsonl(tmp_path / "qa.jsonl", [{"uid": 10 + i, "question": f"q{i}", "sys": "be brief"} for i in range(3)])
    reading = Reading(fields={"prompt": "question", "id": "uid", "system": "sys"})
    rows = rows_of(uri, reading)
    assert [r.id for r in rows] == ["10", "11", "12"]
    assert rows[1].messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q1"}]
    # The ids checked for clashes are the mapped ones.
    clash = write_jsonl(tmp_path / "clash.jsonl", [{"uid": 1, "question": "a"}, {"uid": 1, "question": "b"}])
    with pytest.raises(DatasetError, match="rows share an id"):
        build_index(clash, reading=reading)


def test_a_row_in_no_known_form_names_the_forms_and_its_own_fields(tmp_path):
    (row,) = rows_of(write_jsonl(tmp_path / "x.jsonl", [{"instruction": "hi", "output": "yo"}]), Reading())
    assert isinstance(row, InvalidRow)
    for word in ("'messages'", "'conversations'", "'prompt'", "'instruction'", "'output'", "dataset_fields"):
        assert word in row.reason
    # A named form says which field it reads the row by.
    (row,) = rows_of(write_jsonl(tmp_path / "y.jsonl", [sft_row(0)]), Reading(form="sharegpt"))
    assert isinstance(row, InvalidRow) and "missing 'conversations'" in row.reason


def test_last_regenerates_the_final_assistant_turn_and_first_keeps_the_first_user_turn(tmp_path):
    uri = write_jsonl(tmp_path / "sft.jsonl", [sft_row(0)])
    (last,) = rows_of(uri, Reading(turns="last"))
    assert isinstance(last, PromptRow)
    assert [m["role"] for m in last.messages] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert last.messages[-1]["content"] == "question 2 of 0"
    (first,) = rows_of(write_jsonl(tmp_path / "sft2.jsonl", [sft_row(0)]), Reading(turns="first"))
    assert [m["role"] for m in first.messages] == ["system", "user"]


def test_no_prompt_ever_ends_with_an_assistant_message():
    with pytest.raises(ValueError, match="is an assistant message"):
        PromptRow(index=0, messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}])


def test_two_assistant_messages_in_a_row_cannot_be_cut_there(tmp_path):
    row = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                        {"role": "assistant", "content": "b"}]}
    (got,) = rows_of(write_jsonl(tmp_path / "aa.jsonl", [row]), Reading(turns="last"))
    assert isinstance(got, InvalidRow) and "messages[1] is an assistant message" in got.reason


def test_each_makes_one_prompt_row_per_assistant_turn_with_its_real_history(tmp_path):
    tail = {"id": "open", "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                       {"role": "user", "content": "c"}]}
    uri = write_jsonl(tmp_path / "each.jsonl", [sft_row(0), sharegpt_row(1), tail, sft_row(3, turns=1)])
    index = build_index(uri, reading=Reading(turns="each"), stride=2)
    # 3 turns, 2 (the tool call and the answer), 1 + the open user turn, 1.
    assert (index.n_rows, index.n_prompt_rows) == (4, 8)
    rows = list(read_rows(index, 0, index.n_prompt_rows))
    assert all(isinstance(r, PromptRow) for r in rows), rows
    assert [r.index for r in rows] == list(range(8))
    assert [r.id for r in rows] == ["conv0#turn-1", "conv0#turn-2", "conv0#turn-3", "c1#turn-1", "c1#turn-2",
                                    "open#turn-1", "open#turn-2", "conv3#turn-1"]
    assert [len(r.messages) for r in rows[:3]] == [2, 4, 6]
    assert rows[2].messages[-2] == {"role": "assistant", "content": "answer 1 of 0"}  # the real history
    assert rows[4].messages[-1]["role"] == "tool"
    # Any slice and any sample read the same rows as the whole pass, under the same indices.
    assert list(read_rows(index, 3, 6)) == rows[3:6]
    assert list(read_indices(index, [7, 1, 4])) == [rows[1], rows[4], rows[7]]
    # The stored index keeps the reading and the turn table.
    again = DatasetIndex.from_bytes(index.to_bytes())
    assert again.reading == Reading(turns="each") and again.n_prompt_rows == 8
    assert again.turn_starts.tolist() == [0, 3, 5, 7]


def test_each_reads_only_the_conversations_of_its_slice(tmp_path):
    uri = write_jsonl(tmp_path / "many.jsonl", [sft_row(i, turns=10) for i in range(400)])
    index = build_index(uri, reading=Reading(turns="each"), stride=8)
    assert index.n_prompt_rows == 4000
    whole = Path(uri).stat().st_size
    counting = CountingSource(open_source(uri))
    got = list(read_rows(index, 2000, 2050, source=counting))
    assert [r.index for r in got] == list(range(2000, 2050))
    assert got[0].id == "conv200#turn-1"
    # 5 conversations, read in blocks of 8: at most 3 blocks.
    per_row = whole / 400
    assert counting.bytes_read <= 3 * 8 * per_row * 1.2


def test_parquet_from_pandas_with_a_null_id_keeps_integer_ids(tmp_path):
    frame = pd.DataFrame({"id": [1, None, 3, 4],
                          "prompt": ["a", "b", "c", "d"]})
    assert frame["id"].dtype == np.float64  # what pandas does to an integer column with a null
    path = tmp_path / "p.parquet"
    frame.to_parquet(path)
    rows = rows_of(str(path), Reading())
    assert all(isinstance(r, PromptRow) for r in rows), rows
    assert [r.id for r in rows] == ["1", None, "3", "4"]


def test_a_dataset_most_of_whose_rows_cannot_be_used_stops_before_any_gpu_time(tmp_path):
    rows = [{"instruction": f"do {i}", "output": "ok"} for i in range(30)] + [sft_row(i) for i in range(10)]
    index = build_index(write_jsonl(tmp_path / "alpaca.jsonl", rows), reading=Reading())
    with pytest.raises(DatasetUnusableError) as caught:
        check_usable(index, 50.0, seed=0)
    message = str(caught.value)
    assert "30 of 40 sampled rows (75.0%)" in message
    assert "30 x row is in no form tracegen reads" in message
    assert message.count("row is in no form") >= 4  # the reason, and three examples
    verdict = check_usable(index, 100.0, seed=0)  # the operator asked to go on
    assert verdict.invalid == 30


def test_the_root_refuses_its_dataset_read_another_way(tmp_path):
    uri = write_jsonl(tmp_path / "sft.jsonl", [sft_row(i) for i in range(5)])
    root = open_root(str(tmp_path / "out"))
    assert bind_index(root, uri, "aws_default", Reading(turns="each")).n_prompt_rows == 15
    assert bind_index(root, uri, "aws_default", Reading(turns="each")).n_prompt_rows == 15
    with pytest.raises(ReadingMismatchError, match="turns=last"):
        bind_index(root, uri, "aws_default", Reading(turns="last"))


def test_a_hugging_face_dataset_saved_to_disk_is_read_from_its_arrow_files(tmp_path):
    datasets = pytest.importorskip("datasets")  # the trainers' requirements bring it; its layout is the point
    rows = [sharegpt_row(i) for i in range(700)]
    folder = tmp_path / "hf"
    datasets.Dataset.from_list(rows).save_to_disk(str(folder), num_shards=3)
    index = build_index(str(folder), reading=Reading(turns="each"), cache_uri=str(tmp_path / "cache"))
    assert (index.n_rows, index.n_prompt_rows) == (700, 1400)
    assert index.data_uri != str(folder) and index.format == "parquet"
    got = list(read_rows(index, 1200, 1202))
    assert [r.id for r in got] == ["c600#turn-1", "c600#turn-2"]
    assert got[1].messages[-1]["role"] == "tool"
    # A shard rewritten is a changed dataset, refused before a row of it is read.
    shard = sorted(folder.glob("*.arrow"))[0]
    shard.write_bytes(shard.read_bytes()[:-8] + b"\0" * 8)
    with pytest.raises(DatasetError, match="changed since it was indexed"):
        list(read_rows(index, 0, 2))


def test_a_folder_of_parquet_shards_is_one_dataset_in_shard_order(tmp_path):
    folder = tmp_path / "shards"
    folder.mkdir()
    for s in range(3):
        pd.DataFrame({"id": [f"s{s}-{i}" for i in range(50)],
                      "prompt": [f"p{s}-{i}" for i in range(50)]}).to_parquet(folder / f"part-{s:05d}.parquet")
    index = build_index(str(folder), cache_uri=str(tmp_path / "cache"))
    assert index.n_prompt_rows == 150
    got = list(read_indices(index, [0, 75, 149]))
    assert [r.id for r in got] == ["s0-0", "s1-25", "s2-49"]
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("no data here")
    with pytest.raises(DatasetError, match="neither a Hugging Face dataset"):
        build_index(str(tmp_path / "notes"))


@pytest.mark.parametrize("layout", ["parquet-shards", "hugging-face"])
def test_a_dataset_folder_on_s3_is_read_as_the_local_one(tmp_path, s3_uri, layout):
    from tracegen.store.storage import open_storage

    folder = tmp_path / "local"
    if layout == "hugging-face":
        datasets = pytest.importorskip("datasets")
        datasets.Dataset.from_list([sharegpt_row(i) for i in range(120)]).save_to_disk(str(folder), num_shards=3)
    else:
        folder.mkdir()
        for s in range(3):
            pd.DataFrame({"id": [f"c{s * 40 + i}" for i in range(40)],
                          "prompt": [f"p{s}-{i}" for i in range(40)]}).to_parquet(folder / f"part-{s:05d}.parquet")
    store = open_storage(s3_uri)
    for f in sorted(folder.rglob("*")):
        if f.is_file():
            store.put(f"in/ds/{f.relative_to(folder)}", f.read_bytes())
    uri = s3_uri.rstrip("/") + "/in/ds"
    local = build_index(str(folder), cache_uri=str(tmp_path / "cache"))
    for named in (uri, uri + "/"):
        remote = build_index(named, cache_uri=s3_uri.rstrip("/") + "/cache")
        # The same bytes in the same order: the same fingerprint, rows and ids as the local folder's.
        assert remote.fingerprint == local.fingerprint and remote.n_rows == local.n_rows == 120
        assert [r.id for r in read_indices(remote, [0, 41, 119])] == ["c0", "c41", "c119"]
    # A shard rewritten on S3 is a changed dataset, refused before a row of it is read.
    shard = sorted(k for k in store.list("in/ds/") if k.endswith((".parquet", ".arrow")))[0]
    store.put(shard, store.get(shard)[:-8] + b"\0" * 8)
    with pytest.raises(DatasetError, match="changed since it was indexed"):
        list(read_rows(remote, 0, 2))
    with pytest.raises(DatasetError, match="object not found, nor a folder"):
        build_index(s3_uri.rstrip("/") + "/in/nothing")


def test_the_bundled_sft_sample_reads_in_every_turn_mode_and_is_reproducible(tmp_path):
    from tracegen.sample_data import SFT_SAMPLE_DATASET, SFT_SAMPLE_ROWS
    from tracegen.sample_data.make_sft_sample import write

    assert write(tmp_path / "again.jsonl").read_bytes() == SFT_SAMPLE_DATASET.read_bytes()
    counts = {}
    for turns in ("last", "first", "each"):
        index = build_index(str(SFT_SAMPLE_DATASET), reading=Reading(turns=turns))
        rows = list(read_rows(index, 0, index.n_prompt_rows))
        assert all(isinstance(r, PromptRow) for r in rows), [r for r in rows if isinstance(r, InvalidRow)][:1]
        assert all(r.messages[-1]["role"] in ("user", "tool") for r in rows)
        counts[turns] = index.n_prompt_rows
    assert counts["last"] == counts["first"] == SFT_SAMPLE_ROWS
    # Each conversation: two tool calls and an answer, then 0 to 2 follow-up answers.
    assert 3 * SFT_SAMPLE_ROWS <= counts["each"] <= 5 * SFT_SAMPLE_ROWS


def _example_rows(tmp_path, doc: str, section: str) -> list:
    text = (Path(__file__).resolve().parents[4] / doc).read_text()
    block = text.split(section, 1)[1].split("```jsonl\n", 1)[1].split("```", 1)[0]
    path = tmp_path / "example.jsonl"
    path.write_text(block)
    rows = rows_of(str(path), Reading())
    assert all(isinstance(r, PromptRow) for r in rows), rows
    return rows


def test_the_docs_example_rows_of_each_form_read_as_prompts(tmp_path):
    rows = _example_rows(tmp_path, "docs/usage.md", "## Bring the dataset you have")
    assert [r.id for r in rows] == ["a1", "b7", "c3", "42"]
    assert [r.messages[-1]["role"] for r in rows] == ["user", "tool", "tool", "user"]


def _as_before_readings(root) -> None:
    """The root's stored index as an earlier tracegen wrote it: no reading recorded."""
    data = json.loads(root.storage.get(DATASET_INDEX_KEY))
    del data["reading"]
    root.storage.put(DATASET_INDEX_KEY, json.dumps(data).encode())


def test_a_root_filled_before_readings_is_refused_where_its_rows_answered_other_prompts(tmp_path):
    from engine_support.store_rows import RUN, row

    prompt_only = {"id": "open", "messages": [{"role": "user", "content": "hi"}]}
    rows = [prompt_only, sft_row(1), sharegpt_row(2), {"id": "p", "prompt": "Explain the GIL."}, {**prompt_only, "id": "open2"}]
    uri = write_jsonl(tmp_path / "mixed.jsonl", rows)
    root = open_root(str(tmp_path / "out"))
    bind_index(root, uri, "aws_default")
    # Committed under the earlier reading: row 0 answered, row 1 answered its own final answer, rows 2 and 3
    # recorded invalid (only `messages` was read), row 4 not generated yet.
    root.commits.commit([row(0), row(1), row(2, status=INVALID), row(3, status=INVALID)], RUN, 0, "seg")
    _as_before_readings(root)
    with pytest.raises(EarlierReadingError) as err:
        bind_index(root, uri, "aws_default")
    text = str(err.value)
    assert "1 rows (1) end with an assistant message" in text and "2 rows (2, 3) were recorded invalid" in text
    assert "new output_uri" in text
    assert not DatasetIndex.from_bytes(root.storage.get(DATASET_INDEX_KEY)).reading_recorded  # nothing changed

    # A root whose committed rows read the same both ways goes on, its index now with the reading recorded.
    other = open_root(str(tmp_path / "out2"))
    bind_index(other, uri, "aws_default")
    other.commits.commit([row(0), row(4)], RUN, 0, "seg")
    _as_before_readings(other)
    assert bind_index(other, uri, "aws_default").n_prompt_rows == 5
    assert DatasetIndex.from_bytes(other.storage.get(DATASET_INDEX_KEY)).reading_recorded
def test_the_readmes_example_rows_read_as_prompts(tmp_path):
    rows = _example_rows(tmp_path, "README.md", "## An input row")
    assert [r.id for r in rows] == ["a1", "42"]
