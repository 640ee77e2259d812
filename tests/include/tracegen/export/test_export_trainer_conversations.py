"""Both drafter trainers tokenize every row of the `conversations` export of a `make demo`-sized run to the ids the server generated, through their own conversation-form preprocessing.

SpecForge: `preprocess_conversations` (what `build_eagle3_dataset` maps over the rows) with its
`qwen3-thinking` template and `train_only_last_turn`, at the manifest's settings. speculators:
`_render_conversation_rows` (what `prepare-data` runs per conversation), whose renders go to a vLLM
server's `/v1/chat/completions/render`; here that call renders locally as vLLM does, the tokenizer's chat
template then its encoding. The target's tokenizer and chat template are the stand-in's, the Hugging Face
folder `simulator/tokenizer/`.

A module of its own, beside `test_export_trainer_loaders.py`: under `--dist loadfile` it runs on another
xdist worker (the demo run is built once per pytest run and shared, `conftest.demo_run`). About two minutes of
one core on the CI machine, nearly all of it the trainers' own template rendering and tokenization (the
checks' own encodings are about a fifth of it), spread over two forked processes that each check every other
row.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from tracegen.simulator.bpe import TOKENIZER_DIR  # noqa: E402

pytest.importorskip("specforge.data.prompt_builder", reason="requirements-trainers.txt is not installed")

_PROCESSES = min(2, os.cpu_count() or 1)
_SHARED: dict = {}  # what the forked processes of the test read


@pytest.fixture(scope="module")
def conversations_export(demo_run, export_layout, tmp_path_factory):
    dest = tmp_path_factory.mktemp("conversations-export") / "export"
    manifest = export_layout(demo_run, dest, "conversations")
    path = manifest["trainers"]["specforge"]["data.train_data_path"].removeprefix("file://")
    return manifest, [json.loads(line) for line in Path(path).read_text().splitlines()]


def _template_rendering(text: str) -> str:
    """The generated turn's text as Qwen3's chat template writes it back from reasoning_content and content:
    `<think>\\n` + reasoning.strip("\\n") + `\\n</think>\\n\\n` + content.lstrip("\\n"), then `<|im_end|>\\n`."""
    text = re.sub(r"<think>\n+", "<think>\n", text, count=1)
    text = re.sub(r"\n+</think>\n\n\n*", "\n</think>\n\n", text, count=1)
    return text + "\n"


def _encodings_of_expected(tok, texts: list[str], expects: list[str], encoded_texts: list[list[int]],
                           newline: list[int]) -> list[list[int]]:
    """The tokenizer's encoding of each expected turn. Where it is the turn's text + "\\n" and the text ends
    with `<|im_end|>`, it is the text's encoding followed by the newline's: the tokenizer splits a text at its
    special tokens before anything else (`<|im_end|>` strips no whitespace around it), and encodes the part
    after one on its own. Only the other turns (the re-rendered reasoning) are encoded again; a sample of the
    derived ones is too, and must agree."""
    derived = [expect == text + "\n" and text.endswith("<|im_end|>") for text, expect in zip(texts, expects, strict=True)]
    again = [k for k, d in enumerate(derived) if not d]
    encoded_again = dict(zip(again, tok([expects[k] for k in again], add_special_tokens=False)["input_ids"], strict=True))
    out = [encoded_texts[k] + newline if d else encoded_again[k] for k, d in enumerate(derived)]
    sample = [k for k, d in enumerate(derived) if d][::20]
    assert tok([expects[k] for k in sample], add_special_tokens=False)["input_ids"] == [out[k] for k in sample]
    return out


def _check_rows(manifest: dict, rows: list[dict], ledger: dict[str, dict]) -> tuple[int, int, int]:
    """Every check of the test on `rows` (a share of the export's rows): the counts of rows trained on exactly
    the ledger's ids + newline, of rows whose reasoning the template re-rendered, and of rows whose ids are not
    the tokenizer's encoding of their text."""
    from specforge.data.preprocessing import preprocess_conversations
    from specforge.data.template import TEMPLATE_REGISTRY
    from speculators.data_generation import preprocessing as speculators_pre
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    settings = manifest["trainers"]["specforge"]
    tools = [json.loads(r["tools"]) if r["tools"] else [] for r in rows]
    specforge = preprocess_conversations(
        tok, [r["conversations"] for r in rows], TEMPLATE_REGISTRY.get("qwen3-thinking"), settings["data.max_length"],
        train_only_last_turn=settings["data.train_only_last_turn"], tools=tools)

    def render(endpoint, messages, *, add_generation_prompt, tools=None, truncate_prompt_tokens=None,
               truncation_side=None, **_):
        # vLLM's /v1/chat/completions/render: the target tokenizer's chat template, then its encoding.
        ids = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                      tokenize=True, return_dict=False)
        assert truncation_side in (None, "right")
        return ids[:truncate_prompt_tokens] if truncate_prompt_tokens else ids

    seq_length = manifest["trainers"]["speculators"]["--seq-length"]
    original = speculators_pre.render_conversation
    speculators_pre.render_conversation = render
    try:
        # One row per assistant turn: the last is the generated one (earlier ones are prompt history).
        speculators = [speculators_pre._render_conversation_rows(r["conversations"], r["tools"], i, "vllm", seq_length)
                       for i, r in enumerate(rows)]
    finally:
        speculators_pre.render_conversation = original

    # The checks' own tokenization, in batches (the Rust tokenizer spreads a batch over the cores).
    newline = tok.encode("\n")
    assert len(newline) == 1
    cuts = [ledger[r["id"]]["loss_mask"].index(1) for r in rows]
    responses = [ledger[r["id"]]["input_ids"][cut:] for r, cut in zip(rows, cuts, strict=True)]
    texts = tok.batch_decode(responses, skip_special_tokens=False)
    expects = [_template_rendering(t) for t in texts]
    encoded_texts = tok(texts, add_special_tokens=False)["input_ids"]
    encoded_expects = _encodings_of_expected(tok, texts, expects, encoded_texts, newline)
    starts = [mask[0].tolist().index(1) for mask in specforge["loss_mask"]]
    trained = [ids[0].tolist()[start:] for ids, start in zip(specforge["input_ids"], starts, strict=True)]
    trained_texts = tok.batch_decode(trained, skip_special_tokens=False)

    exact = rendered = noncanonical = 0
    for k, (row, ids, mask, spec_rows) in enumerate(zip(rows, specforge["input_ids"], specforge["loss_mask"],
                                                        speculators, strict=True)):
        where = f"row {row['id']}"
        led = ledger[row["id"]]
        prompt, response = led["input_ids"][: cuts[k]], responses[k]
        ids, mask, start = ids[0].tolist(), mask[0].tolist(), starts[k]
        assert mask == [0] * start + [1] * (len(mask) - start), where  # one span: the last turn's
        last = spec_rows[-1]
        assert last["input_ids"][last["loss_mask"].index(1):] == trained[k], where  # both trainers agree
        assert len(spec_rows) == 1 + sum(m["role"] == "assistant" for m in row["conversations"][:-1]), where

        assert trained_texts[k] == expects[k], where
        assert trained[k] == encoded_expects[k], where
        canonical = encoded_texts[k] == response
        same_text = expects[k] == texts[k] + "\n"
        # Exactly the ledger's ids plus the newline, unless one of the two reasons above says otherwise.
        assert (trained[k] == response + newline) == (same_text and canonical), where
        exact += trained[k] == response + newline
        rendered += not same_text
        noncanonical += not canonical

        # The context is the served prompt, token for token.
        assert last["input_ids"][: last["loss_mask"].index(1)] == prompt, where
        if row["conversations"][0]["role"] == "system":
            assert ids[:start] == prompt, where
    return exact, rendered, noncanonical


def _check_share(k: int) -> tuple[int, int, int, int]:
    """`_check_rows` on the k-th of `_PROCESSES` interleaved shares of the rows in `_SHARED`; the share's size first."""
    share = _SHARED["rows"][k::_PROCESSES]
    return len(share), *_check_rows(_SHARED["manifest"], share, _SHARED["ledger"])


@pytest.mark.timeout(900)
def test_both_trainers_tokenize_every_conversation_to_the_ledgers_ids(conversations_export, tokens_export, hf_cache):
    """Both trainers' masks (their 1s: the generated turn they train on) hold, on every row, exactly the
    ledger's response ids followed by the `\\n` Qwen3's template writes after `<|im_end|>` (both masks run to
    the end-of-turn string `<|im_end|>\\n`), except on two kinds of rows, where they legitimately differ and
    hold the tokenizer's encoding of the turn's text instead:

    - **The template's rendering of reasoning** (5 to 9% of rows: the demo run differs between runs): it
      writes `reasoning.strip("\\n")` between `<think>\\n` and `\\n</think>` and the content with its leading
      newlines stripped, so a completion whose thinking ends (or starts) with newlines is trained on without
      them (`_template_rendering`).
    - **Ids that are not the tokenizer's encoding of their text** (11 to 16%): the stand-in's completions are
      windows of a tokenized text stream, so where a window starts or ends inside a pre-token (a run of
      spaces cut by the end of the answer, the `\\n</think>\\n\\n` it inserts), its ids spell the text with
      other tokens than encoding it gives, as a real model's sampled ids can. Re-tokenizing text cannot give
      them back; the `tokens` layout keeps them.

    The context before the mask (the prompt) is the ledger's prompt ids in speculators' rows on every row:
    the export writes the prompt turns and tools as the server handed them to its template
    (`dataset/template_input.py`), so the trainer's rendering is the served prompt. SpecForge's is too on
    rows with a system prompt; on rows without one its template injects its own (the manifest's note).
    """
    manifest, rows = conversations_export
    ledger = {r["id"]: r for r in tokens_export[2]}
    assert len(rows) == manifest["rows"] == len(ledger)
    # Every row is checked, in shares on forked processes, one per core: the trainers' rendering and
    # tokenization is about two minutes of one core's CPU, and a share's checks need no other share's rows.
    # The processes inherit the rows rather than receive them pickled.
    _SHARED.update(manifest=manifest, rows=rows, ledger=ledger)
    try:
        with multiprocessing.get_context("fork").Pool(_PROCESSES) as pool:
            counts = pool.map(_check_share, range(_PROCESSES))
    finally:
        _SHARED.clear()
    checked, exact, rendered, noncanonical = (sum(c) for c in zip(*counts, strict=True))
    assert checked == len(rows)
    n = len(rows)
    assert exact >= 0.75 * n and rendered <= 0.12 * n and noncanonical <= 0.2 * n, (n, exact, rendered, noncanonical)
    print(f"\n{n} rows: {exact} trained on the ledger's ids + \\n, {rendered} reasoning re-rendered, "
          f"{noncanonical} ids not the encoding of their text")
