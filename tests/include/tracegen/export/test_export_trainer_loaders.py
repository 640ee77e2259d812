"""The drafter trainers' own loaders read an export of a `make demo`-sized run as it is.

SpecForge 0.2.0 and speculators 0.9.0 are installed from requirements-trainers.txt (their data loaders and
what those import, CPU torch). The `tokens` layout goes through the very functions their CLIs call:
SpecForge's `prepare_prompt_tasks` (`data.prompts_path`) and speculators' `load_and_preprocess_dataset`
(`prepare-data --data DIR`), at the settings the manifest names. Every row must come back, none cut or
dropped, and on every row the mask's boundary is the prompt's length as the server counted it
(`prompt_tokens`) and its 1s count the completion's tokens (`completion_tokens`, the stop token included).

The `conversations` layout is read by the loaders (`datasets.load_dataset("json")`, the columns SpecForge
hands to its chat-template call, speculators' conversation normalisation) and tokenized by each trainer's own
conversation-form preprocessing with the target's tokenizer and chat template: the stand-in's, the Hugging
Face folder `simulator/tokenizer/` (its ids are the stand-in's for any text, `test_sim_hf_tokenizer`, and
its `chat_template.jinja` is Qwen3's). SpecForge: `preprocess_conversations` (what `build_eagle3_dataset`
maps over the rows) with its `qwen3-thinking` template and `train_only_last_turn`. speculators:
`_render_conversation_rows` (what `prepare-data` runs per conversation), whose renders go to a vLLM
server's `/v1/chat/completions/render`; here that call renders locally as vLLM does, the tokenizer's chat
template then its encoding, on every row (`test_export_trainer_conversations.py`, a module of its own so
that it runs beside this one under xdist).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

# The trainers load through Hugging Face `datasets`: its cache goes to a throwaway place, and nothing is
# looked up on a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from tracegen.dataset.stored import load_index  # noqa: E402
from tracegen.simulator.bpe import TOKENIZER_DIR  # noqa: E402
from tracegen.store.current import current_mask  # noqa: E402
from tracegen.store.ledger_rows import ledger_rows  # noqa: E402
from tracegen.store.root import open_root  # noqa: E402

pytest.importorskip("specforge.data.prompt_builder", reason="requirements-trainers.txt is not installed")


@pytest.fixture(scope="module")
def counted(demo_run) -> dict[str, tuple[int, int, str]]:
    """Row id -> (prompt_tokens, completion_tokens, finish_reason) of each exported index, from the ledger."""
    output_root = open_root(str(demo_run.root))
    frame = ledger_rows(output_root, ("index", "status", "finish_reason", "max_tokens", "prompt_tokens",
                                      "completion_tokens", "committed_at"))
    cur = frame.loc[current_mask(frame)]
    by_index = {int(i): (int(p), int(c), str(f)) for i, p, c, f in
                zip(cur["index"], cur["prompt_tokens"], cur["completion_tokens"], cur["finish_reason"], strict=True)}
    ids = {}
    with open(load_index(output_root).source_uri.removeprefix("file://")) as f:
        for i, line in enumerate(f):
            ids[str(json.loads(line).get("id") or f"index-{i}")] = i
    return {rid: by_index[i] for rid, i in ids.items() if i in by_index}


def _check_mask(input_ids, loss_mask, expect: tuple[int, int, str], where: str) -> None:
    prompt_tokens, completion_tokens, _ = expect
    ones = sum(loss_mask)
    boundary = list(loss_mask).index(1)
    assert boundary == prompt_tokens, f"{where}: mask boundary {boundary}, prompt_tokens {prompt_tokens}"
    assert ones == completion_tokens, f"{where}: {ones} masked-in tokens, completion_tokens {completion_tokens}"
    assert len(input_ids) == len(loss_mask) == prompt_tokens + completion_tokens, f"{where}: cut"
    assert list(loss_mask) == [0] * prompt_tokens + [1] * completion_tokens, where


def test_the_tokens_manifest_says_whose_ids_and_how_long(tokens_export, demo_run):
    _, manifest, rows = tokens_export
    assert len(rows) == manifest["rows"] and manifest["left_out"]["no_token_ids"] == 0
    # Every finished row's ids end with the stop token SGLang kept (<|im_end|>), and the mask covers it.
    eot = manifest["end_of_turn"]
    assert eot["token_id"] == 151645 and eot["all_finished_rows_end_with_it"]
    assert eot["finished_rows_with_ids"] == sum(v for k, v in manifest["finish_reasons"].items() if k != "length")
    assert all(r["input_ids"][-1] == 151645 and r["loss_mask"][-1] == 1 for r in rows)
    total = manifest["lengths"]["total"]
    assert total["max"] == max(len(r["input_ids"]) for r in rows) and total["p50"] <= total["p99"] <= total["max"]
    assert manifest["trainers"]["specforge"]["data.max_length"] == total["max"]
    assert manifest["trainers"]["speculators"]["--seq-length"] == total["max"]
    prov = manifest["provenance"]
    servers = prov["servers"]
    assert servers["agree"] and sorted(servers["servers"]) == sorted(demo_run.urls)
    assert (servers["model_path"], servers["served_model_name"], servers["sglang_version"]) == (
        "Qwen/Qwen3.6-27B", "qwen3.6-27b", "0.5.23")
    assert servers["tokenizer_path"] == "Qwen/Qwen3.6-27B" and "chat_template" in servers["server_args"]
    assert prov["fleet"]["sha256"] and prov["sampling"]["max_tokens"] == 8192 and prov["runs"] == ["run-4096", "run-8192"]
    counts = manifest["provenance_counts"]
    assert counts["extended"] > 0 and sum(counts.values()) == manifest["rows"]


def test_specforge_reads_every_token_row_whole(tokens_export, counted, tmp_path):
    from specforge.data.prompt_builder import prepare_prompt_tasks

    dest, manifest, rows = tokens_export
    settings = manifest["trainers"]["specforge"]
    path = settings["data.prompts_path"].removeprefix("file://")

    def load(path: str, max_length: int):
        return prepare_prompt_tasks(path, None, chat_template=None, max_length=max_length, is_preformatted=False,
                                    train_only_last_turn=False, cache_dir=None, cache_key=None, num_proc=None,
                                    min_loss_tokens=1)

    tasks = load(path, settings["data.max_length"])
    assert len(tasks) == len(rows) == manifest["rows"]  # none dropped
    for row, task in zip(rows, tasks, strict=True):
        payload = task["payload"]
        assert payload["input_ids"] == row["input_ids"] and payload["loss_mask"] == row["loss_mask"]  # none cut
        _check_mask(payload["input_ids"], payload["loss_mask"], counted[row["id"]], f"specforge row {row['id']}")
    # At SpecForge's default (2048) long rows are cut without a word, and a row whose prompt fills the window
    # is dropped (no loss token left): the setting matters. On the first 300 rows, to keep the test short.
    sample = tmp_path / "sample.jsonl"
    sample.write_text("".join(json.dumps(r) + "\n" for r in rows[:300]))
    short = load(str(sample), 2048)
    kept = [r for r in rows[:300] if r["loss_mask"][:2048].count(1) >= 1]
    assert len(short) == len(kept)
    cut = sum(len(t["payload"]["input_ids"]) < len(r["input_ids"]) for r, t in zip(kept, short, strict=True))
    assert cut == sum(len(r["input_ids"]) > 2048 for r in kept) > 0


def test_speculators_reads_every_token_row_whole(tokens_export, counted, hf_cache, tmp_path):
    from speculators.data_generation.preprocessing import load_and_preprocess_dataset

    dest, manifest, rows = tokens_export
    settings = manifest["trainers"]["speculators"]
    # prepare-data's --model: the target's processor (only decoded for its sample print here).
    dataset, _ = load_and_preprocess_dataset(
        str(TOKENIZER_DIR), [settings["--data"].removeprefix("file://")], seq_length=settings["--seq-length"],
        build_dataset_num_proc=1, token_freq_path=tmp_path / "token_freq.pt")
    assert len(dataset) == len(rows) == manifest["rows"]  # none dropped
    by_ids = {tuple(r["input_ids"]): r for r in rows}
    seen = set()
    for item in dataset:
        ids, mask = item["input_ids"].tolist(), item["loss_mask"].tolist()
        row = by_ids[tuple(ids)]  # whole: a cut row would not be found
        assert int(item["seq_len"]) == len(row["input_ids"])
        _check_mask(ids, mask, counted[row["id"]], f"speculators row {row['id']}")
        seen.add(row["id"])
    assert len(seen) == len(rows)


def test_the_conversations_layout_loads_as_both_trainers_read_it(demo_run, counted, hf_cache, export_layout,
                                                                tmp_path):
    from datasets import load_dataset
    from speculators.data_generation.preprocessing import _normalize_conversation, load_raw_dataset

    manifest = export_layout(demo_run, tmp_path / "export", "conversations")
    settings = manifest["trainers"]
    path = settings["specforge"]["data.train_data_path"].removeprefix("file://")
    # SpecForge: load_dataset("json") as `_prepare_raw_prompts` does; `build_eagle3_dataset` pops
    # conversations, id and tools and passes every other column to the chat-template call: there is none.
    data = load_dataset("json", data_files=path, split="train")
    assert len(data) == manifest["rows"] and sorted(data.column_names) == ["conversations", "id", "tools"]
    assert settings["specforge"]["data.train_only_last_turn"] is True
    assert settings["specforge"]["rows_without_system_prompt"] == manifest["prompts"]["rows_without_system_prompt"]
    # speculators: its loader reads the folder the manifest names, and keeps the generated turn as it is.
    raw, _ = load_raw_dataset(settings["speculators"]["--data"].removeprefix("file://"))
    assert len(raw) == manifest["rows"]
    rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
    history = 0
    for row in rows:
        turns = _normalize_conversation(row["conversations"])
        last = turns[-1]
        assert last["role"] == "assistant" and last.get("reasoning_content"), row["id"]
        assert row["conversations"][-1]["content"] == last["content"]
        history += any(t["role"] == "assistant" for t in turns[:-1])
        assert row["id"] in counted
    assert history == manifest["prompts"]["rows_with_assistant_history"]
    assert settings["speculators"]["--seq-length"] >= manifest["lengths"]["total"]["max"]
