"""`turns=chain` as the dataset reads it: the prompt rows `each` gives, a conversation with a tool call or a
tool result refused on every turn with its reason (so `prepare_run`'s sample stops a tool-heavy dataset), and
the history a turn is sent with once the model's own earlier answers replace the dataset's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tracegen.dataset.index import build_index
from tracegen.dataset.reader import InvalidRow, PromptRow, read_rows
from tracegen.dataset.reading import Reading
from tracegen.dataset.turns import chained_messages
from tracegen.dataset.usable import DatasetUnusableError, check_usable
from tracegen.sample_data import CHAT_SAMPLE_DATASET, CHAT_SAMPLE_ROWS, CHAT_SAMPLE_TURNS, SFT_SAMPLE_DATASET

CHAIN = Reading(turns="chain")


def sft_row(i: int, turns: int = 3) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}]
    for t in range(turns):
        messages += [{"role": "user", "content": f"question {t} of {i}"},
                     {"role": "assistant", "content": f"answer {t} of {i}"}]
    return {"id": f"conv{i}", "messages": messages}


def sharegpt_row(i: int) -> dict[str, Any]:
    """A tool call and its result, then the final answer."""
    return {"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"list the files of project {i}"},
        {"from": "function_call", "value": json.dumps({"name": "run", "arguments": {"cmd": "ls"}})},
        {"from": "observation", "value": "a.py b.py"},
        {"from": "gpt", "value": "There are two files: a.py and b.py."}]}


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_chain_reads_the_turns_each_reads_and_knows_each_turn_s_conversation(tmp_path):
    uri = write_jsonl(tmp_path / "sft.jsonl", [sft_row(0), sft_row(1, turns=2)])
    index = build_index(uri, reading=CHAIN, stride=2)
    assert CHAIN.expands and CHAIN.chained and not Reading(turns="each").chained
    assert (index.n_rows, index.n_prompt_rows) == (2, 5)
    assert index.conversations([0, 1, 2, 3, 4]).tolist() == [0, 0, 0, 1, 1]
    rows = list(read_rows(index, 0, 5))
    each = list(read_rows(build_index(uri, reading=Reading(turns="each"), stride=2), 0, 5))
    assert [(r.id, r.messages) for r in rows] == [(r.id, r.messages) for r in each]
    assert rows[1].id == "conv0#turn-2"


def test_a_conversation_with_tool_calls_is_invalid_on_every_turn_naming_why(tmp_path):
    uri = write_jsonl(tmp_path / "mixed.jsonl", [sft_row(0, turns=2), sharegpt_row(1)])
    rows = list(read_rows(build_index(uri, reading=CHAIN), 0, 4))
    assert [type(r) for r in rows] == [PromptRow, PromptRow, InvalidRow, InvalidRow]
    assert rows[2].reason.startswith("turn 1 of row 1: messages[1] is an assistant tool call: turns=chain")
    assert rows[3].reason.startswith("turn 2 of row 1: ")
    # The same rows read another way are prompts.
    assert all(isinstance(r, PromptRow) for r in read_rows(build_index(uri, reading=Reading(turns="each")), 0, 4))


def test_a_tool_heavy_dataset_is_stopped_before_any_gpu_time_under_chain():
    index = build_index(str(SFT_SAMPLE_DATASET), reading=CHAIN)
    with pytest.raises(DatasetUnusableError) as caught:
        check_usable(index, 50.0, seed=0)
    message = str(caught.value)
    assert f"{index.n_prompt_rows} of {index.n_prompt_rows} sampled rows (100.0%)" in message
    assert "is an assistant tool call: turns=chain cannot regenerate" in message
    assert "turns=chain" in message


def test_the_bundled_chat_sample_chains_whole():
    index = build_index(str(CHAT_SAMPLE_DATASET), reading=CHAIN)
    assert (index.n_rows, index.n_prompt_rows) == (CHAT_SAMPLE_ROWS, CHAT_SAMPLE_TURNS)
    assert check_usable(index, 0.0, seed=0).invalid == 0
    counts = [index.prompt_rows_of(r) for r in range(index.n_rows)]
    assert min(counts) == 2 and max(counts) == 4


def test_a_chained_prompt_holds_the_model_s_answers_content_only():
    prompt = sft_row(0)["messages"][:5]  # system, q0, a0, q1, a1 ... cut before a1: turn 2's prompt is [:4]
    prompt = prompt[:4]
    got = chained_messages(prompt, ["my own answer"])
    assert got[2] == {"role": "assistant", "content": "my own answer"}
    assert got[:2] == prompt[:2] and got[3] == prompt[3] and prompt[2]["content"] == "answer 0 of 0"
    with pytest.raises(ValueError, match="1 earlier assistant turns, 0 answers"):
        chained_messages(prompt, [])
