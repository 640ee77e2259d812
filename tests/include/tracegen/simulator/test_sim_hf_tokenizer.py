"""The stand-in's tokenizer folder (`simulator/tokenizer/`) loads in Hugging Face `tokenizers` and
`transformers` as the stand-in's own tokenizer: for any text the same ids, for any ids the same text, and
Qwen3's added tokens at Qwen3's ids. A trainer that tokenizes with it (SpecForge, speculators) gets the ids
the stand-in generated and counted.

The texts are drawn at random (a fixed seed) from what the pre-tokenizer's classes and the added tokens
make hard: ASCII prose and code, CJK, kana and hangul, emoji with joiners and modifiers, arrows and
dashes, runs of every kind of whitespace (`\\x1c`, NBSP, U+3000, U+2028), combining marks, digits and
numerals of other scripts, contractions in both cases (and `'ſ`, which Python's `(?i)` folds to `'s`),
added tokens' strings inside words, code points from every plane, and windows of the stand-in's own text.
"""

from __future__ import annotations

import random

import pytest

from tracegen.simulator import bpe, corpus

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

ADDED = {content: i for i, content, _ in bpe.ADDED_TOKENS}
POOLS = {
    "ascii": ["the", " test", " fails", "def f(x):", "    return x + 1", "I'm", " we'll", "DON'T", "x_y",
              "__init__", "3.14159", "2026-07-01", "{\"a\": [1, 2]}", "$ ls -la", "#!/bin/sh", "a+b=c", "_"],
    "cjk": ["请修复失败的测试", "テスト", "ひらがな", "한국어", "漢字", "㐀", "䶵", "中文，标点。", "（括号）", "ｶﾀｶﾅ"],
    "emoji": ["🧪", "👍🏽", "👨‍👩‍👧", "🇯🇵", "❤️", "✅", "❌", "✓", "🙏", "🫠"],
    "symbols": ["→", "⇒", "←", "—", "–", "…", "≤", "≥", "±", "·", "•", "©", "€", "∑", "√", "°C", "“quoted”"],
    "space": [" ", "  ", "\t", "\n", "\n\n", "\r\n", "   \n", "\u00a0", "\u3000", "\x1c", "\x1f", "\u2028",
              "\x85", "\u200b", "\u200d", " \t \n ", "\x0b\x0c"],
    "marks": ["e\u0301", "a\u0308", "n\u0303", "ह\u093f", "हिन्दी", "ก\u0e34", "\u0301", "a\u20dd", "ﬁ", "ß"],
    "digits": ["0", "42", "٣", "１２", "²", "½", "Ⅻ", "①", "𝟙", "௧"],
    "contractions": ["'s", "'S", "'ll", "'LL", "'Re", "'ve", "'d", "'m", "'t", "'ſ", "'K", "''", "'"],
    "added": list(ADDED),
}


def _random_code_point(r: random.Random) -> str:
    while True:
        cp = r.choice([r.randrange(0x20, 0x7F), r.randrange(0x80, 0x800), r.randrange(0x800, 0x10000),
                       r.randrange(0x10000, 0x110000), r.randrange(0, 0x20)])
        if not 0xD800 <= cp <= 0xDFFF:
            return chr(cp)


def texts(n: int, seed: int = 20260701) -> list[str]:
    r = random.Random(seed)
    streams = {name: corpus.text(name, 40_000, seed=seed) for name in ("en", "intl")}
    out = []
    for _ in range(n):
        parts = []
        for _ in range(r.randrange(1, 12)):
            kind = r.random()
            if kind < 0.7:
                parts.append(r.choice(POOLS[r.choice(list(POOLS))]))
            elif kind < 0.85:
                parts.append("".join(_random_code_point(r) for _ in range(r.randrange(1, 6))))
            else:
                s = streams[r.choice(("en", "intl"))]
                at = r.randrange(len(s) - 300)
                parts.append(s[at : at + r.randrange(1, 300)])
        out.append("".join(parts))
    return out


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
