"""The stand-in's tokenizer and token streams: a real byte-level BPE, streams that are the
tokenization of the stand-in's text, cuts inside characters at the documented rates, and SGLang's
detokenization of a continuation."""

from __future__ import annotations

import numpy as np

from tracegen.simulator import bpe, corpus
from tracegen.simulator.tokens import (
    EOS_TOKEN_ID,
    THINK_ID,
    chat_prompt_ids,
    decode,
    detokenize,
    register_of,
    stream,
    text_ids,
    tokenizer,
)


def test_the_shipped_streams_are_the_tokenization_of_the_stand_ins_text():
    tok = tokenizer()
    for name, chars in bpe.STREAM_CHARS.items():
        text = corpus.text(name, chars, seed=bpe.STREAM_SEED)
        ids = stream(name).ids
        assert tok.decode(ids.tolist()) == text
        assert tok.encode(text) == ids.tolist()


def test_byte_level_bpe_whitespace_inside_tokens_and_lossy_utf8():
    tok = tokenizer()
    pieces = [tok.decode([i]) for i in text_ids(" the test fails\n\n")]
    assert pieces == [" the", " test", " fails", "\n\n"]
    assert "Ġthe" in tok.vocab and "ĊĊ" in tok.vocab  # GPT-2's byte-to-unicode spelling
    emoji = text_ids("🧪")
    assert len(emoji) >= 2 and decode(emoji[:1]).endswith("\ufffd") and decode(emoji) == "🧪"
    # Added tokens are single ids; only the special ones are skipped when decoding.
    assert text_ids("<think>x</think><|im_end|>")[0] == THINK_ID
    assert decode(text_ids("<think>x<|im_end|>")) == "<think>x"
    assert decode(text_ids("<think>x<|im_end|>"), skip_special_tokens=False) == "<think>x<|im_end|>"


def test_cuts_fall_inside_characters_at_the_documented_rates():
    # Token boundaries inside a character: ~0.4% of cuts in English agentic text, ~11% in the CJK-rich register.
    rates = {}
    for name in ("en", "intl"):
        s = stream(name)
        rates[name] = 1 - float(np.mean(s.starts))
    assert 0.002 < rates["en"] < 0.006 and 0.08 < rates["intl"] < 0.14, rates


def test_the_register_follows_the_prompts_language():
    assert register_of(chat_prompt_ids([{"role": "user", "content": "fix the failing test → please 🙏"}])) == "en"
    assert register_of(chat_prompt_ids([{"role": "user", "content": "请修复失败的测试"}])) == "intl"


def test_sglangs_detokenizer_drops_the_character_a_continuation_completes():
    prompt = chat_prompt_ids([{"role": "user", "content": "hi"}])
    out = text_ids("ok 🧪 done") + [EOS_TOKEN_ID]
    whole = detokenize(prompt, out, stopped=True)
    assert whole == "ok 🧪 done"
    # Cut between the emoji's tokens: the first text ends in U+FFFD, the continuation's starts after the emoji.
    cut = next(k for k in range(1, len(out)) if decode(out[:k]).endswith("\ufffd"))
    first = detokenize(prompt, out[:cut], stopped=False)
    rest = detokenize(prompt + out[:cut], out[cut:], stopped=True)
    assert first == "ok \ufffd" and rest == " done" and first + rest != whole
    assert decode(out) == whole  # decoding all the ids at once is exact
