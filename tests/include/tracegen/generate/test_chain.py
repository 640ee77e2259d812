"""`turns=chain` through the chunk engine on a stand-in: turn k is sent after turn k-1 is committed complete,
with the model's own answer in its history; a turn that is not complete holds the later ones pending (not
invalid) until a raised cap completes it; a resumed chunk generates nothing twice and builds its turns from
the ledger. The bundled chat sample: 12 conversations, 34 turns."""

from __future__ import annotations

import shutil

import httpx
import numpy as np
import pytest
from engine_support.helpers import (
    FAST_CLIENT,
    MODEL,
    assert_healthy,
    endpoints,
    make_config,
    prepare,
    root_of,
    run_engine,
)

from tracegen.dataset.reader import read_indices
from tracegen.dataset.stored import load_index
from tracegen.generate.engine import ChunkEngine, ChunkInterrupted, ChunkJob, ChunkOptions
from tracegen.sample_data import CHAT_SAMPLE_DATASET, CHAT_SAMPLE_TURNS
from tracegen.sglang.client import ClientConfig
from tracegen.store.current import current_rows
from tracegen.store.records import OK, unpack_token_ids

SIM = dict(sim_time_scale=2000, sim_length_model="short", sim_runaway_rate=0.0, log_level="warning",
           reasoning_parser="qwen3")


@pytest.fixture
def chat(tmp_path):
    dataset = tmp_path / "chat.jsonl"
    shutil.copy(CHAT_SAMPLE_DATASET, dataset)
    return dataset


def _rows(config):
    frame = current_rows(root_of(config).snapshots.frame())
    return {r.index: r for r in _read(root_of(config), frame)}


def _read(root, frame):
    out = []
    for part in sorted(set(frame["part"])):
        wanted = set(frame.loc[frame["part"] == part, "index"].tolist())
        out += [r for r in root.commits.read_part(part) if r.index in wanted]
    return out


def _prompt_text(sim, row) -> str:
    ids = unpack_token_ids(row.prompt_token_ids)
    return httpx.post(sim.url + "/detokenize", json={"tokens": ids}).json()["text"]


def test_each_turn_is_sent_with_the_model_s_own_earlier_answers(tmp_path, sim_server, chat):
    sim = sim_server(**SIM)
    config = make_config(chat, tmp_path / "out", turns="chain", max_tokens=4096)
    prepare(config, "run-chain")
    summary = run_engine(config, "run-chain", endpoints(sim), tmp_path / "spool", range(CHAT_SAMPLE_TURNS))
    assert summary.generated == CHAT_SAMPLE_TURNS and summary.held == 0
    rows = _rows(config)
    assert len(rows) == CHAT_SAMPLE_TURNS and all(r.status == OK and r.finish_reason == "stop" for r in rows.values())
    index = load_index(root_of(config))
    dataset = {p.index: p for p in read_indices(index, range(CHAT_SAMPLE_TURNS))}
    chained = 0
    for i in range(CHAT_SAMPLE_TURNS):
        first = index.first_prompt_row(int(index.conversations(np.asarray([i]))[0]))
        text = _prompt_text(sim, rows[i])
        for j in range(first, i):  # every earlier turn: the model's answer, not the dataset's
            original = dataset[j + 1].messages[-2]["content"]
            assert rows[j].content.strip() and rows[j].content in text, (i, j)
            assert original not in text, (i, j)
            chained += 1
    assert chained == sum(k * (k - 1) // 2 for k in
                          (index.prompt_rows_of(c) for c in range(index.n_rows)))
    # Turns commit as they finish so the next ones can go: more parts than rows alone would make, far fewer
    # than one a row.
    assert summary.parts <= CHAT_SAMPLE_TURNS
    assert_healthy(root_of(config), CHAT_SAMPLE_TURNS, config)


def test_a_truncated_turn_holds_the_later_ones_pending_until_a_raised_cap_completes_it(tmp_path, sim_server, chat):
    sim = sim_server(**SIM)
    # At 60 tokens about half the answers are cut: a conversation goes on until one of its turns is.
    low = make_config(chat, tmp_path / "out", turns="chain", max_tokens=60, truncated_policy="keep")
    prepare(low, "run-60")
    summary = run_engine(low, "run-60", endpoints(sim), tmp_path / "spool", range(CHAT_SAMPLE_TURNS))
    index = load_index(root_of(low))
    rows = _rows(low)
    truncated = {i for i, r in rows.items() if r.finish_reason == "length"}
    for c in range(index.n_rows):
        turns = list(_turns(index, c))
        present = [i for i in turns if i in rows]
        assert present == turns[: len(present)] and present, c  # the first turns, in order, never a gap
        assert all(rows[i].finish_reason == "stop" for i in present[:-1]), c
        if len(present) < len(turns):  # ended early: by a cut turn, the later ones pending (no ledger row)
            assert present[-1] in truncated, c
    assert summary.held == CHAT_SAMPLE_TURNS - len(rows) > 0
    later = {i for i in truncated if i not in _firsts(index)}
    assert later  # cut turns after a first: their prompts hold the model's earlier answers
    # The cap raised: the cut turns are continued from their tokens, and the later turns go on from them.
    high = make_config(chat, tmp_path / "out", turns="chain", max_tokens=4096, truncated_policy="extend")
    prepare(high, "run-4096")
    summary = run_engine(high, "run-4096", endpoints(sim), tmp_path / "spool", range(CHAT_SAMPLE_TURNS))
    assert summary.extended == len(truncated) and summary.held == 0
    done = _rows(high)
    assert len(done) == CHAT_SAMPLE_TURNS and all(r.finish_reason == "stop" for r in done.values())
    for i in truncated:
        assert done[i].pivot == "extended"
        assert unpack_token_ids(done[i].prompt_token_ids) == unpack_token_ids(rows[i].prompt_token_ids)
        if i in later:
            assert done[i - 1].content in _prompt_text(sim, done[i])
        if i + 1 in done and i + 1 not in _firsts(index):
            assert done[i].content in _prompt_text(sim, done[i + 1])  # the next turn follows the whole answer
    assert_healthy(root_of(high), CHAT_SAMPLE_TURNS, high)


def _firsts(index) -> set[int]:
    return {index.first_prompt_row(c) for c in range(index.n_rows)}


def _turns(index, c: int) -> range:
    first = index.first_prompt_row(c)
    return range(first, first + index.prompt_rows_of(c))


def test_a_resumed_chunk_generates_nothing_twice_and_builds_turns_from_the_ledger(tmp_path, sim_server, chat):
    sim = sim_server(**{**SIM, "sim_time_scale": 200})
    config = make_config(chat, tmp_path / "out", turns="chain", max_tokens=4096)
    prepare(config, "run-resume")
    root = root_of(config)
    cc = ClientConfig(request_deadline_s=30.0, max_attempts=8, **FAST_CLIENT)
    seen: list[int] = []

    def stop_once_some_committed(truncated: int, judged: int) -> str | None:
        seen.append(judged)
        return "test stop" if judged >= 8 else None

    job = ChunkJob(config=config, run_id="run-resume", model=MODEL, chunk=0, label="chunk 0")
    options = ChunkOptions(spool_dir=str(tmp_path / "spool"), client_config=cc, progress_interval_s=3600,
                           stop_check=stop_once_some_committed, stop_check_interval_s=0.05)
    first = ChunkEngine(job, root=root, dataset=load_index(root), servers=endpoints(sim), options=options)
    with pytest.raises(ChunkInterrupted, match="test stop"):
        first.run(np.arange(CHAT_SAMPLE_TURNS))
    done_before = set(_rows(config))
    assert 0 < len(done_before) < CHAT_SAMPLE_TURNS
    again = run_engine(config, "run-resume", endpoints(sim), tmp_path / "spool", range(CHAT_SAMPLE_TURNS))
    assert again.already_done == len(done_before)
    assert again.generated == CHAT_SAMPLE_TURNS - len(done_before)
    rows = _rows(config)
    assert len(rows) == CHAT_SAMPLE_TURNS
    assert_healthy(root, CHAT_SAMPLE_TURNS, config)  # no index committed twice
    index = load_index(root)
    resumed = 0
    for i in range(CHAT_SAMPLE_TURNS):
        first_turn = index.first_prompt_row(int(index.conversations(np.asarray([i]))[0]))
        if i > first_turn and i not in done_before:
            assert rows[i - 1].content in _prompt_text(sim, rows[i])
            resumed += i - 1 in done_before  # built on a turn the first attempt committed
    assert resumed > 0
