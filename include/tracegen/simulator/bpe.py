"""A byte-level BPE tokenizer for the stand-in, GPT-2 style, with Qwen3's special tokens.

Text is split into pre-tokens by a regex (Qwen2's pattern, except that each CJK ideograph, kana or hangul
syllable is a pre-token of its own), each pre-token's UTF-8 bytes are mapped to printable characters
(GPT-2's `bytes_to_unicode`: a space is `Ġ`, a newline `Ċ`, so whitespace lives inside tokens as GPT-2 BPE
has it: `Ġthe`, `ĊĊ`) and merged by rank. Decoding joins the tokens' bytes and decodes them as UTF-8 with
U+FFFD for every maximal invalid subsequence, as the Rust `tokenizers` ByteLevel decoder
(`String::from_utf8_lossy`) does: a token sequence that ends inside a character decodes to U+FFFD there.

The vocabulary and merges ship as `tokenizer.json` (the Hugging Face layout: `model.vocab`,
`model.merges`, `added_tokens`), trained by `python -m tracegen.simulator.bpe` on the stand-in's own text
(`corpus`): 256 byte tokens, then merges. Special and added tokens keep Qwen3's ids (151643 and up), so
`<|im_end|>` is 151645 as SGLang reports it; `<think>`, `</think>`, `<tool_call>` and `</tool_call>` are
added tokens that are not special (skip_special_tokens keeps them, as Qwen3's tokenizer does).
"""

from __future__ import annotations

import heapq
import json
import re
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from functools import lru_cache
from pathlib import Path

TOKENIZER_FILE = Path(__file__).with_name("tokenizer.json")
STREAMS_FILE = Path(__file__).with_name("streams.npz")
# The text of each register that is tokenized into the stream completions are cut from (`tokens.Stream`).
STREAM_CHARS = {"en": 400_000, "intl": 200_000}
STREAM_SEED = 1

# Qwen3's added tokens: (id, content, special).
ADDED_TOKENS: tuple[tuple[int, str, bool], ...] = (
    (151643, "<|endoftext|>", True),
    (151644, "<|im_start|>", True),
    (151645, "<|im_end|>", True),
    (151657, "<tool_call>", False),
    (151658, "</tool_call>", False),
    (151667, "<think>", False),
    (151668, "</think>", False),
)
_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af"
# Qwen2's pre-tokenizer with \p{L} as [^\W\d_] and \p{N} as \d (Python's re has no \p), and CJK split per
# character.
PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
    rf"|[{_CJK}]"
    rf"|(?:[^\r\n\w]|_)?[^\W\d_{_CJK}]+"
    r"|\d"
    r"| ?(?:[^\s\w]|_)+[\r\n]*"
    r"|\s*[\r\n]+"
    r"|\s+(?!\S)"
    r"|\s+"
)
_PRE = re.compile(PATTERN)


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def pre_tokenize(text: str) -> list[str]:
    return _PRE.findall(text)


class Tokenizer:
    """Encode and decode with a trained vocabulary (`load()` for the shipped one)."""

    def __init__(self, vocab: dict[str, int], merges: Sequence[tuple[str, str]]) -> None:
        self.vocab = vocab
        self.ranks = {pair: i for i, pair in enumerate(merges)}
        self.size = len(vocab)  # regular tokens: ids 0 .. size - 1
        b2u = bytes_to_unicode()
        u2b = {c: b for b, c in b2u.items()}
        self.byte_map = b2u
        self.token_bytes: list[bytes] = [b""] * self.size
        for token, i in vocab.items():
            self.token_bytes[i] = bytes(u2b[c] for c in token)
        self.added = {i: (content, special) for i, content, special in ADDED_TOKENS}
        self.added_ids = {content: i for i, content, _ in ADDED_TOKENS}
        self._added_re = re.compile("(" + "|".join(re.escape(c) for _, c, _ in ADDED_TOKENS) + ")")
        self._cache: dict[str, tuple[int, ...]] = {}
        self._keep = dict(enumerate(self.token_bytes)) | {i: c.encode() for i, (c, _) in self.added.items()}
        self._skip = self._keep | {i: b"" for i, (_, special) in self.added.items() if special}

    # -- encoding ------------------------------------------------------------------------------------
    def _bpe(self, word: str) -> tuple[int, ...]:
        cached = self._cache.get(word)
        if cached is not None:
            return cached
        parts = list(word)
        ranks = self.ranks
        while len(parts) > 1:
            best, at = None, -1
            for i in range(len(parts) - 1):
                r = ranks.get((parts[i], parts[i + 1]))
                if r is not None and (best is None or r < best):
                    best, at = r, i
            if best is None:
                break
            a, b = parts[at], parts[at + 1]
            merged, i = [], 0
            while i < len(parts):  # merge every occurrence of the pair, left to right
                if i < len(parts) - 1 and parts[i] == a and parts[i + 1] == b:
                    merged.append(a + b)
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        ids = tuple(self.vocab[p] for p in parts)
        if len(self._cache) < 500_000:
            self._cache[word] = ids
        return ids

    def encode_ordinary(self, text: str) -> list[int]:
        """Ids of text with no added tokens recognised."""
        b2u = self.byte_map
        out: list[int] = []
        for piece in _PRE.findall(text):
            out.extend(self._bpe("".join(b2u[b] for b in piece.encode())))
        return out

    def encode(self, text: str) -> list[int]:
        """Ids of text; the added tokens' strings (`<|im_end|>`, `<think>`, ...) become their ids."""
        out: list[int] = []
        for i, part in enumerate(self._added_re.split(text)):
            if i % 2:
                out.append(self.added_ids[part])
            elif part:
                out.extend(self.encode_ordinary(part))
        return out

    # -- decoding ------------------------------------------------------------------------------------
    def to_bytes(self, ids: Iterable[int], skip_special_tokens: bool = True) -> bytes:
        """The bytes of the tokens; unknown ids (outside the vocabulary) decode to nothing."""
        pieces = self._skip if skip_special_tokens else self._keep
        try:
            return b"".join(map(pieces.__getitem__, ids))
        except (KeyError, TypeError):  # an id outside the vocabulary: the slow path skips it
            pass
        table, size, added = self.token_bytes, self.size, self.added
        out = []
        for i in ids:
            if 0 <= i < size:
                out.append(table[i])
            elif i in added:
                content, special = added[i]
                if not (special and skip_special_tokens):
                    out.append(content.encode())
        return b"".join(out)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.to_bytes(ids, skip_special_tokens).decode("utf-8", "replace")

    def id_bytes(self, i: int) -> bytes:
        """One token's bytes (added tokens: their content; unknown ids: b"")."""
        if 0 <= i < self.size:
            return self.token_bytes[i]
        return self.added[i][0].encode() if i in self.added else b""

    def to_json(self, merges: Sequence[tuple[str, str]]) -> dict:
        return {
            "version": "1.0",
            "added_tokens": [{"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
                              "normalized": False, "special": s} for i, c, s in ADDED_TOKENS],
            "normalizer": None,
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": PATTERN}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]},
            "post_processor": None,
            "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                      "ignore_merges": False, "vocab": self.vocab, "merges": [list(m) for m in merges]},
        }  # fmt: skip


def load(path: Path = TOKENIZER_FILE) -> Tokenizer:
    data = json.loads(path.read_text())
    model = data["model"]
    return Tokenizer(model["vocab"], [tuple(m) for m in model["merges"]])


@lru_cache(maxsize=1)
def tokenizer() -> Tokenizer:
    """The shipped tokenizer, loaded once per process."""
    return load()


# -- training (offline: `python -m tracegen.simulator.bpe` rewrites tokenizer.json) --------------------------
def train(texts: Iterable[str], vocab_size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-level BPE merges learned from `texts` (most frequent pair first; ties by the pair's strings, so
    the result is deterministic)."""
    b2u = bytes_to_unicode()
    counts: Counter[str] = Counter()
    for t in texts:
        counts.update("".join(b2u[b] for b in p.encode()) for p in _PRE.findall(t))
    words = [list(w) for w in counts]
    freq = list(counts.values())
    vocab = {b2u[b]: i for i, b in enumerate(sorted(b2u, key=lambda b: b2u[b]))}
    pairs: Counter[tuple[str, str]] = Counter()
    where: dict[tuple[str, str], set[int]] = defaultdict(set)
    for wi, w in enumerate(words):
        for a, b in zip(w, w[1:], strict=False):
            pairs[(a, b)] += freq[wi]
            where[(a, b)].add(wi)
    heap = [(-c, p) for p, c in pairs.items()]
    heapq.heapify(heap)
    merges: list[tuple[str, str]] = []
    while len(vocab) < vocab_size and heap:
        c, pair = heapq.heappop(heap)
        if pairs.get(pair, 0) != -c:
            if pairs.get(pair, 0) > 0:
                heapq.heappush(heap, (-pairs[pair], pair))
            continue
        if -c < 2:
            break
        a, b = pair
        new = a + b
        merges.append(pair)
        vocab[new] = len(vocab)
        changed: set[tuple[str, str]] = set()
        for wi in list(where[pair]):
            w, f = words[wi], freq[wi]
            for x, y in zip(w, w[1:], strict=False):
                pairs[(x, y)] -= f
                changed.add((x, y))
            merged, i = [], 0
            while i < len(w):
                if i < len(w) - 1 and w[i] == a and w[i + 1] == b:
                    merged.append(new)
                    i += 2
                else:
                    merged.append(w[i])
                    i += 1
            words[wi] = merged
            for x, y in zip(merged, merged[1:], strict=False):
                pairs[(x, y)] += f
                where[(x, y)].add(wi)
                changed.add((x, y))
        del pairs[pair]
        where.pop(pair, None)
        for p in changed:
            if pairs.get(p, 0) > 0:
                heapq.heappush(heap, (-pairs[p], p))
    return vocab, merges


VOCAB_SIZE = 4096  # regular tokens of the shipped tokenizer (256 bytes + merges)


def training_texts() -> list[str]:
    """What the shipped tokenizer is trained on: both registers of the stand-in's text (other seeds than
    the served streams') and the chat template's own text."""
    from tracegen.simulator import corpus

    template = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
                "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n# Tools\n\nYou may call one or "
                "more functions to assist with the user query.\n\n<tools>\n</tools>\n") * 200
    return [corpus.text("en", 1_500_000, seed=101), corpus.text("intl", 700_000, seed=102), template]


def main() -> None:
    import numpy as np

    from tracegen.simulator import corpus

    vocab, merges = train(training_texts(), VOCAB_SIZE)
    tok = Tokenizer(vocab, merges)
    TOKENIZER_FILE.write_text(json.dumps(tok.to_json(merges), ensure_ascii=False, separators=(",", ":")) + "\n")
    print(f"wrote {TOKENIZER_FILE} ({len(vocab):,} tokens, {len(merges):,} merges)", file=sys.stderr)
    # The served streams: the tokenization of each register's text, shipped so a server starts in
    # milliseconds instead of tokenizing ~600,000 characters (tests check they are that tokenization).
    arrays = {name: np.asarray(tok.encode(corpus.text(name, chars, seed=STREAM_SEED)), dtype=np.uint16)
              for name, chars in STREAM_CHARS.items()}
    np.savez_compressed(STREAMS_FILE, **arrays)
    print(f"wrote {STREAMS_FILE} ({', '.join(f'{k}: {v.size:,} tokens' for k, v in arrays.items())})",
          file=sys.stderr)


if __name__ == "__main__":
    main()
