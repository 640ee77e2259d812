"""The stand-in's tokenizer folder (`simulator/tokenizer/`) loads in Hugging Face `tokenizers` and
`transformers` as the stand-in's own tokenizer: for any text the same ids, for any ids the same text, and
Qwen3's added tokens at Qwen3's ids. A trainer that tokenizes with it (SpecForge, speculators) gets the ids
the stand-in generated and counted.

The texts are `fixtures.tokenizer_texts`: what the pre-tokenizer's classes and the added tokens make hard.
"""

from __future__ import annotations

import random

import pytest
from fixtures.tokenizer_texts import ADDED, texts

from tracegen.simulator import bpe

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

TEXTS = texts(1500)


@pytest.fixture(scope="module")
def standin():
    return bpe.tokenizer()


@pytest.fixture(scope="module")
def rust():
    return tokenizers.Tokenizer.from_file(str(bpe.TOKENIZER_FILE))


@pytest.fixture(scope="module")
def auto():
    return transformers.AutoTokenizer.from_pretrained(str(bpe.TOKENIZER_DIR))


@pytest.fixture(scope="module")
def fast():
    return transformers.PreTrainedTokenizerFast(tokenizer_file=str(bpe.TOKENIZER_FILE))


def test_added_tokens_have_the_stand_ins_ids(standin, rust, auto, fast):
    for content, i in ADDED.items():
        assert standin.encode(content) == [i], content
        assert rust.token_to_id(content) == i and rust.id_to_token(i) == content, content
        for hf in (auto, fast):
            assert hf.convert_tokens_to_ids(content) == i and hf.convert_ids_to_tokens(i) == content, content
    assert (auto.eos_token, auto.eos_token_id, auto.pad_token_id) == ("<|im_end|>", 151645, 151643)
    assert auto.bos_token is None and auto.model_max_length == bpe.MODEL_MAX_LENGTH
    assert set(auto.all_special_ids) == {i for i, _, special in bpe.ADDED_TOKENS if special}
    # Qwen3's tokenizer length; no id of the stand-in's reaches it.
    assert len(auto) == len(fast) == rust.get_vocab_size() == bpe.TOKENIZER_LENGTH
    assert "{%" in auto.chat_template  # chat_template.jinja is read from the folder


@pytest.mark.parametrize("chunk", range(3))
def test_any_text_encodes_to_the_stand_ins_ids_and_decodes_back(chunk, standin, rust, auto, fast):
    batch = TEXTS[chunk::3]
    rust_ids = [e.ids for e in rust.encode_batch(batch, add_special_tokens=True)]
    auto_ids = auto(batch, add_special_tokens=True)["input_ids"]  # no BOS or other token is added
    fast_ids = fast(batch, add_special_tokens=False)["input_ids"]
    for text, a, b, c in zip(batch, rust_ids, auto_ids, fast_ids, strict=True):
        ids = standin.encode(text)
        assert a == b == c == ids, repr(text)
        assert auto.decode(ids, skip_special_tokens=False) == standin.decode(ids, skip_special_tokens=False) == text
        assert auto.decode(ids, skip_special_tokens=True) == standin.decode(ids, skip_special_tokens=True)


def test_any_ids_decode_to_the_stand_ins_text(standin, rust, auto):
    # Ids a cap cuts anywhere (inside a character: U+FFFD), shuffled, reserved and unknown ids included.
    r = random.Random(7)
    pool = standin.encode("".join(TEXTS[:200]))
    for _ in range(800):
        ids = pool[(at := r.randrange(len(pool))) : at + r.randrange(1, 40)]
        if r.random() < 0.3:
            ids = r.sample(ids, len(ids))
        if r.random() < 0.2:
            ids.insert(r.randrange(len(ids) + 1), r.choice([4096, 150000, 151650, 151666, 151669, 10**6]))
        for skip in (True, False):
            expect = standin.decode(ids, skip_special_tokens=skip)
            assert rust.decode(ids, skip_special_tokens=skip) == expect, ids
            assert auto.decode(ids, skip_special_tokens=skip) == expect, ids


def test_reserved_ids_are_never_encoded(standin, rust):
    # The ids between the trained tokens and Qwen3's added ones decode to their names; their names encode
    # as plain text, so no text ever becomes one.
    for i in (standin.size, 100_000, 151_642):  # 151643 and up: Qwen3's 26 added tokens
        name = bpe.reserved(i)
        assert rust.id_to_token(i) == name and standin.decode([i]) == name
        assert i not in rust.encode(name).ids and rust.encode(name).ids == standin.encode(name)
