"""The tokenizer folder's builder (`make_tokenizer`): it writes the shipped `tokenizer.json` byte for byte
from the shipped merges and the shipped streams from the shipped tokenizer, and a tokenizer it trains is one
the stand-in loads, with Qwen3's added tokens at their ids."""

from __future__ import annotations

import json

import numpy as np
from fixtures.tokenizer_texts import ADDED, RUNS, texts

from tracegen.simulator import bpe, make_tokenizer


def test_the_shipped_folder_is_what_the_builder_writes_for_its_merges():
    shipped = bpe.TOKENIZER_FILE.read_text()
    merges = json.loads(shipped)["model"]["merges"]
    data = make_tokenizer.tokenizer_json(bpe.tokenizer().vocab, merges, make_tokenizer.explicit_pattern())
    assert make_tokenizer.file_text(data) == shipped
    assert json.loads(bpe.TOKENIZER_CONFIG_FILE.read_text()) == make_tokenizer.tokenizer_config()


def test_a_trained_tokenizer_loads_as_the_stand_ins(tmp_path):
    corpus = texts(300)
    pattern = make_tokenizer.explicit_pattern()
    vocab, merges = make_tokenizer.train(corpus, 600, pattern)
    assert 256 < len(vocab) <= 600 and len(merges) == len(vocab) - 256
    path = tmp_path / "tokenizer.json"
    path.write_text(make_tokenizer.file_text(make_tokenizer.tokenizer_json(vocab, merges, pattern)))
    tok = bpe.load(path)
    assert tok.size == len(vocab) and tok.library.get_vocab_size() == bpe.TOKENIZER_LENGTH
    for content, i in ADDED.items():
        assert tok.encode(content) == [i]
    for text in corpus + RUNS:
        ids = tok.encode(text)
        assert tok.decode(ids, skip_special_tokens=False) == text
        assert all(i < len(vocab) or i in ADDED.values() for i in ids)
    assert len(tok.encode(corpus[0])) < len(corpus[0].encode())  # the merges merge


def test_the_shipped_streams_are_what_the_builder_writes(tmp_path):
    path = tmp_path / "streams.npz"
    make_tokenizer.write_streams(bpe.tokenizer(), path)
    written, shipped = np.load(path), np.load(bpe.STREAMS_FILE)
    assert sorted(written.files) == sorted(shipped.files) == sorted(bpe.STREAM_CHARS)
    for name in bpe.STREAM_CHARS:
        assert written[name].dtype == shipped[name].dtype and np.array_equal(written[name], shipped[name]), name
