"""The stand-in's token ids and texts are those of the byte-level BPE encoder and decoder it was built with
(its own Python code), now that `tokenizers` runs them: the streams (streams.npz), the SGLang comparisons and
every test that names an id rely on it.

Each group of texts (the bundled datasets, texts drawn from what the pre-tokenizer makes hard, long runs
and blocks, both registers of the stand-in's text) is pinned by the count and a digest of the ids that
encoder gave it, and every text decodes back to itself; id sequences a cap or a client may send (cut inside
characters, shuffled, added, reserved, unknown and negative ids) are pinned by a digest of their decoding.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np
import pytest
from fixtures.tokenizer_texts import RUNS, id_sequences, sample_texts, texts

from tracegen.simulator import bpe, corpus

# group -> (ids, digest of the ids), as the stand-in's own encoder gave them.
ENCODED = {
    "sample prompts": (1299379, "1a1d3e4f3a301388fe56a8008a7ea8d7"),
    "sft conversations": (13815, "204ea483c57df63152abed6d01a2371b"),
    "drawn": (120986, "0c14c048a06382d5e5d40c604ed24940"),
    "runs": (1294, "07444db930259394ef00e51bb9db6e5c"),
    "en register": (21338, "5126916edaea06a904739c768c89140b"),
    "intl register": (64374, "8d132b61c5c5561b27873fb5b0dd5fff"),
}
# skip_special_tokens -> (characters, digest of the texts) of `id_sequences` decoded.
DECODED = {
    True: (198363, "e5a7a9671730797034dd468ef3e2e478"),
    False: (201586, "9e6c63c28c8ccb9ec50fcf0a2a4f68d7"),
}


def digest(chunks: Iterable[str | list[int]]) -> tuple[int, str]:
    """(total length, digest) of a sequence of id lists or texts, each one framed by its length."""
    h, n = hashlib.sha256(), 0
    for chunk in chunks:
        data = chunk.encode() if isinstance(chunk, str) else np.asarray(chunk, dtype="<u4").tobytes()
        n += len(chunk)
        h.update(len(data).to_bytes(8, "little") + data)
    return n, h.hexdigest()[:32]


def groups() -> dict[str, list[str]]:
    return {**sample_texts(), "drawn": texts(1500), "runs": RUNS,
            **{f"{name} register": [corpus.text(name, 100_000, seed=5)] for name in ("en", "intl")}}


@pytest.fixture(scope="module")
def tok():
    return bpe.tokenizer()


@pytest.mark.parametrize("group", list(ENCODED))
def test_texts_encode_to_the_pinned_ids_and_decode_back(group, tok):
    batch = groups()[group]
    ids = [tok.encode(text) for text in batch]
    assert digest(ids) == ENCODED[group]
    for text, one in zip(batch, ids, strict=True):
        assert tok.decode(one, skip_special_tokens=False) == text, repr(text[:80])


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_id_sequences_decode_to_the_pinned_texts(skip_special_tokens, tok):
    streams = np.load(bpe.STREAMS_FILE)
    pool = streams["intl"][:20_000].tolist() + streams["en"][:20_000].tolist()
    decoded = [tok.decode(ids, skip_special_tokens) for ids in id_sequences(pool)]
    assert digest(decoded) == DECODED[skip_special_tokens]

