"""The export of a `turns=chain` run (the bundled chat sample on a Qwen3-like stand-in), and both drafter
trainers' own loaders reading it.

- `messages`: one row per turn, its history the model's own earlier answers (what it was sent), never the
  dataset's;
- `conversations`: one row per conversation, every regenerated assistant turn (with its thinking), read by
  SpecForge's `preprocess_conversations` (all turns trained: the manifest says `train_only_last_turn` false)
  and speculators' `_render_conversation_rows` (one training row per assistant turn);
- `tokens`: one row per conversation, the last turn's prompt ids then its response's, the loss mask 1 over
  every regenerated assistant turn (its answer as the later prompts hold it, `<|im_end|>` included) and 0
  elsewhere; SpecForge's `prepare_prompt_tasks` and speculators' `load_and_preprocess_dataset` read every
  row whole.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from engine_support.helpers import endpoints, make_config, prepare, root_of, run_engine  # noqa: E402
from fixtures.simulator import start_sim_server  # noqa: E402

from tracegen.dataset.reader import read_indices  # noqa: E402
from tracegen.dataset.stored import load_index  # noqa: E402
from tracegen.export import export_dataset  # noqa: E402
from tracegen.sample_data import CHAT_SAMPLE_DATASET, CHAT_SAMPLE_ROWS, CHAT_SAMPLE_TURNS  # noqa: E402
from tracegen.simulator.bpe import TOKENIZER_DIR  # noqa: E402
from tracegen.store.current import current_rows  # noqa: E402

QWEN3_SIM = dict(model_path="Qwen/Qwen3.6-27B", served_model_name="qwen3.6-27b", reasoning_parser="qwen3",
                 context_length=40960, sim_time_scale=20000, sim_length_model="short", sim_runaway_rate=0.0)
IM_END = 151645


@pytest.fixture(scope="module")
def chain_run(tmp_path_factory):
    """The chat sample generated with turns=chain: (root, the committed rows by index, the index)."""
    tmp = tmp_path_factory.mktemp("chain-run")
    dataset = tmp / "chat.jsonl"
    shutil.copy(CHAT_SAMPLE_DATASET, dataset)
    sim = start_sim_server(tmp, **QWEN3_SIM)
    try:
        config = make_config(dataset, tmp / "output", turns="chain", max_tokens=4096)
        prepare(config, "run-chain")
        run_engine(config, "run-chain", endpoints(sim), tmp / "spool", range(CHAT_SAMPLE_TURNS))
    finally:
        sim.stop()
    root = root_of(config)
    frame = current_rows(root.snapshots.frame())
    rows = {}
    for part in set(frame["part"]):
        rows.update({r.index: r for r in root.commits.read_part(part)})
    assert len(rows) == CHAT_SAMPLE_TURNS and all(r.finish_reason == "stop" for r in rows.values())
    return tmp / "output", rows, load_index(root)


def _export(chain_run, dest: Path, layout: str) -> tuple[dict, list]:
    export_dataset(str(chain_run[0]), str(dest), layout=layout)
    manifest = json.loads((dest / "manifest.json").read_text())
    if layout == "messages":
        import gzip
        lines = [ln for shard in manifest["shards"] for ln in gzip.decompress((dest / shard["name"]).read_bytes())
                 .decode().splitlines()]
    else:
        lines = (dest / manifest["data_file"]).read_text().splitlines()
    return manifest, [json.loads(ln) for ln in lines]


def _turns(index, conv: int) -> range:
    first = index.first_prompt_row(conv)
    return range(first, first + index.prompt_rows_of(conv))


def test_the_messages_layout_shows_each_turn_with_the_history_the_model_was_sent(chain_run, tmp_path):
    _, rows, index = chain_run
    manifest, docs = _export(chain_run, tmp_path / "messages", "messages")
    assert manifest["rows"] == len(docs) == CHAT_SAMPLE_TURNS and manifest["turns"] == "chain"
    dataset = {p.index: p for p in read_indices(index, range(CHAT_SAMPLE_TURNS))}
    for doc in docs:
        i = doc["index"]
        conv = int(index.conversations([i])[0])
        earlier = [rows[j].content for j in _turns(index, conv) if j < i]
        shown = [m["content"] for m in doc["messages"][:-1] if m["role"] == "assistant"]
        assert shown == earlier, i  # the model's own answers
        originals = [m["content"] for m in dataset[i].messages if m["role"] == "assistant"]
        assert not set(shown) & set(originals), i  # never the dataset's
        assert doc["messages"][-1]["content"] == rows[i].content


def test_the_trainer_layouts_hold_the_regenerated_conversations_and_both_trainers_read_them(
        chain_run, tmp_path, hf_cache):
    pytest.importorskip("specforge.data.prompt_builder", reason="requirements-trainers.txt is not installed")
    from specforge.data.preprocessing import preprocess_conversations
    from specforge.data.prompt_builder import prepare_prompt_tasks
    from specforge.data.template import TEMPLATE_REGISTRY
    from speculators.data_generation import preprocessing as speculators_pre
    from speculators.data_generation.preprocessing import load_and_preprocess_dataset
    from transformers import AutoTokenizer

    _, rows, index = chain_run
    tok = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))

    # tokens: the mask is 1 exactly over every regenerated turn.
    manifest, docs = _export(chain_run, tmp_path / "tokens", "tokens")
    assert manifest["rows"] == len(docs) == CHAT_SAMPLE_ROWS and manifest["left_out"]["no_token_ids"] == 0
    by_id = {}
    for conv in range(index.n_rows):
        turns = list(_turns(index, conv))
        doc = docs[conv]
        by_id[doc["id"]] = doc
        assert "#turn-" not in doc["id"]
        spans, start = [], None
        for k, bit in enumerate([*doc["loss_mask"], 0]):
            if bit and start is None:
                start = k
            if not bit and start is not None:
                spans.append(doc["input_ids"][start:k])
                start = None
        assert len(spans) == len(turns), doc["id"]
        for j, span in zip(turns[:-1], spans[:-1], strict=True):
            text = tok.decode(span, skip_special_tokens=False)
            # Its answer as the later prompts hold it (a leading newline merged with the generation prompt's).
            assert span[-1] == IM_END and text.lstrip("\n") == rows[j].content.lstrip("\n") + "<|im_end|>", text
        assert tok.decode(spans[-1]).count("</think>") == 1  # the last turn with its thinking
    settings = manifest["trainers"]["specforge"]
    tasks = prepare_prompt_tasks(settings["data.prompts_path"].removeprefix("file://"), None, chat_template=None,
                                 max_length=settings["data.max_length"], is_preformatted=False,
                                 train_only_last_turn=False, cache_dir=None, cache_key=None, num_proc=None,
                                 min_loss_tokens=1)
    assert len(tasks) == CHAT_SAMPLE_ROWS
    assert [(t["payload"]["input_ids"], t["payload"]["loss_mask"]) for t in tasks] == \
        [(d["input_ids"], d["loss_mask"]) for d in docs]
    spec = manifest["trainers"]["speculators"]
    loaded, _ = load_and_preprocess_dataset(str(TOKENIZER_DIR), [spec["--data"].removeprefix("file://")],
                                            seq_length=spec["--seq-length"], build_dataset_num_proc=1,
                                            token_freq_path=tmp_path / "token_freq.pt")
    assert sorted((item["input_ids"].tolist(), item["loss_mask"].tolist()) for item in loaded) == \
        sorted((d["input_ids"], d["loss_mask"]) for d in docs)

    # conversations: every regenerated turn, all trained.
    manifest, docs = _export(chain_run, tmp_path / "conversations", "conversations")
    assert manifest["rows"] == len(docs) == CHAT_SAMPLE_ROWS
    settings = manifest["trainers"]["specforge"]
    assert settings["data.train_only_last_turn"] is False
    for conv, doc in enumerate(docs):
        turns = list(_turns(index, conv))
        assistants = [m for m in doc["conversations"] if m["role"] == "assistant"]
        assert [m["content"] for m in assistants] == [rows[j].content for j in turns]
        assert [m.get("reasoning_content") for m in assistants] == [rows[j].reasoning_content for j in turns]
        assert doc["id"] in by_id
    specforge = preprocess_conversations(
        tok, [d["conversations"] for d in docs], TEMPLATE_REGISTRY.get("qwen3-thinking"), settings["data.max_length"],
        train_only_last_turn=False, tools=[[] for _ in docs])
    for conv, (ids, mask) in enumerate(zip(specforge["input_ids"], specforge["loss_mask"], strict=True)):
        trained = tok.decode([t for t, m in zip(ids[0].tolist(), mask[0].tolist(), strict=True) if m],
                             skip_special_tokens=False)
        for j in _turns(index, conv):  # every regenerated answer is trained on
            assert rows[j].content.strip() in trained, (conv, j)

    def render(endpoint, messages, *, add_generation_prompt, tools=None, truncate_prompt_tokens=None, **_):
        ids = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                      tokenize=True, return_dict=False)
        return ids[:truncate_prompt_tokens] if truncate_prompt_tokens else ids

    original = speculators_pre.render_conversation
    speculators_pre.render_conversation = render
    try:
        for i, doc in enumerate(docs):
            made = speculators_pre._render_conversation_rows(doc["conversations"], doc["tools"], i, "vllm",
                                                             manifest["trainers"]["speculators"]["--seq-length"])
            assert len(made) == index.prompt_rows_of(i)  # one training row per regenerated turn
    finally:
        speculators_pre.render_conversation = original


def test_a_regenerated_conversation_ends_before_its_first_turn_that_is_not_complete():
    from tracegen.export.layouts import chain_turns
    from tracegen.store.records import OK, GeneratedRow

    def row(i: int, finish: str) -> GeneratedRow:
        return GeneratedRow(index=i, status=OK, max_tokens=64, run_id="r", chunk=0, finish_reason=finish)

    assert [r.index for r in chain_turns([row(0, "stop"), row(1, "length"), row(2, "stop")])] == [0]
    assert chain_turns([row(0, "tool_calls")]) == []


def test_export_batches_never_split_a_conversation():
    import numpy as np
    import pandas as pd

    from tracegen.export.selection import conversation_batches

    class Index:
        starts = np.asarray([0, 3, 4, 9, 10])

        def conversations(self, rows):
            return np.searchsorted(self.starts, rows, side="right") - 1

    best = pd.DataFrame({"index": np.arange(12)})
    batches = [b["index"].tolist() for b in conversation_batches(best, 2, Index())]
    assert sum(batches, []) == list(range(12))
    assert [b[0] for b in batches] == [0, 3, 9]  # each starts a conversation, about 2 rows or more
