"""A byte-level BPE tokenizer for the stand-in, GPT-2 style, with Qwen3's special tokens.

Text is split into pre-tokens by a regex (Qwen2's pattern, except that each CJK ideograph, kana or hangul
syllable is a pre-token of its own), each pre-token's UTF-8 bytes are mapped to printable characters
(GPT-2's `bytes_to_unicode`: a space is `Ġ`, a newline `Ċ`, so whitespace lives inside tokens as GPT-2 BPE
has it: `Ġthe`, `ĊĊ`) and merged by rank. Decoding joins the tokens' bytes and decodes them as UTF-8 with
U+FFFD for every maximal invalid subsequence, as the Rust `tokenizers` ByteLevel decoder
(`String::from_utf8_lossy`) does: a token sequence that ends inside a character decodes to U+FFFD there.

The tokenizer ships as a Hugging Face tokenizer folder, `tokenizer/`, written by
`python -m tracegen.simulator.bpe` (which trains it on the stand-in's own text, `corpus`: 256 byte
tokens, then merges): `tokenizer.json` (`model.vocab`, `model.merges`, `added_tokens`, the
pre-tokenizer's regex) and `tokenizer_config.json` (the special tokens), beside `chat_template.jinja`
(Qwen3's chat template, kept by hand). The stand-in reads its regex, vocabulary and merges from that same
`tokenizer.json`, so `tokenizers` and `transformers` (`AutoTokenizer.from_pretrained(TOKENIZER_DIR)`)
encode any text to the stand-in's ids and decode any ids to its text. Two things make that hold:

- Special and added tokens keep Qwen3's ids (151643 and up), so `<|im_end|>` is 151645 as SGLang reports
  it; `<think>`, `</think>`, `<tool_call>`, `<tool_response>` and the like are added tokens that are not special
  (skip_special_tokens keeps them, as Qwen3's tokenizer does). They are also entries of `model.vocab`: the
  `tokenizers` library gives an added token the id its model has for it, and otherwise the next free id
  after the model's (4096, 4097, ...), whatever id `added_tokens` names. Every other id below Qwen3's
  tokenizer length (151669) is a reserved token, `<|reserved_N|>`: no merge makes one, so no text encodes
  to it, and it decodes to its name. Without them the vocabulary would have holes, which `tokenizers`
  prints in full (about a megabyte) each time it serialises the model, as `transformers` does on every load;
  with them `len(tokenizer)` is Qwen3's. The stand-in knows them by their name and id without holding them.
- The file's regex has no `\\w`, `\\s`, `\\d` or `(?i)`: Python's `re` and Oniguruma (the `tokenizers`
  regex engine) read those from different Unicode databases and definitions (combining marks are word
  characters to one and not the other, `\\x1c` is a space to one only, `(?i)` folds `ſ` to `s` in Python),
  so `explicit_pattern` writes each class as the code point ranges Python's `re` gives it when the file is
  generated, and the contractions in ASCII cases. Both engines then split every text alike.
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

TOKENIZER_DIR = Path(__file__).with_name("tokenizer")  # a Hugging Face tokenizer folder
TOKENIZER_FILE = TOKENIZER_DIR / "tokenizer.json"
TOKENIZER_CONFIG_FILE = TOKENIZER_DIR / "tokenizer_config.json"
CHAT_TEMPLATE_FILE = TOKENIZER_DIR / "chat_template.jinja"
MODEL_MAX_LENGTH = 131_072  # Qwen3's tokenizer_config model_max_length
TOKENIZER_LENGTH = 151_669  # Qwen3's len(tokenizer): ids 0 .. 151668, the last 26 its added tokens
STREAMS_FILE = Path(__file__).with_name("streams.npz")
# The text of each register that is tokenized into the stream completions are cut from (`tokens.Stream`).
STREAM_CHARS = {"en": 400_000, "intl": 200_000}
STREAM_SEED = 1

# Qwen3's 26 added tokens: (id, content, special). All of them, not only those the stand-in writes: a prompt
# holding `<tool_response>` (Qwen3's template writes it around every tool result) or `<|fim_prefix|>` is
# one id each to Qwen3's tokenizer, so prompt lengths are counted as SGLang counts them.
ADDED_TOKENS: tuple[tuple[int, str, bool], ...] = (
    (151643, "<|endoftext|>", True),
    (151644, "<|im_start|>", True),
    (151645, "<|im_end|>", True),
    (151646, "<|object_ref_start|>", True),
    (151647, "<|object_ref_end|>", True),
    (151648, "<|box_start|>", True),
    (151649, "<|box_end|>", True),
    (151650, "<|quad_start|>", True),
    (151651, "<|quad_end|>", True),
    (151652, "<|vision_start|>", True),
    (151653, "<|vision_end|>", True),
    (151654, "<|vision_pad|>", True),
    (151655, "<|image_pad|>", True),
    (151656, "<|video_pad|>", True),
    (151657, "<tool_call>", False),
    (151658, "</tool_call>", False),
    (151659, "<|fim_prefix|>", False),
    (151660, "<|fim_middle|>", False),
    (151661, "<|fim_suffix|>", False),
    (151662, "<|fim_pad|>", False),
    (151663, "<|repo_name|>", False),
    (151664, "<|file_sep|>", False),
    (151665, "<tool_response>", False),
    (151666, "</tool_response>", False),
    (151667, "<think>", False),
    (151668, "</think>", False),
)


def reserved(i: int) -> str:
    """The reserved token with id i: an id neither trained nor added (see the module's docstring)."""
    return f"<|reserved_{i}|>"


_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af"
# The pre-tokenizer: Qwen2's pattern with each CJK ideograph, kana or hangul syllable a pre-token of its own.
# Written over named classes, each defined by what Python's `re` matches (`explicit_pattern` expands them to
# code point ranges): W word characters (`\w`), S whitespace (`\s`), D digits (`\d`), L letters (Qwen2's
# \p{L}, as `[^\W\d_]` without CJK), C the CJK characters split one by one.
CLASSES = {"W": r"\w", "S": r"\s", "D": r"\d", "L": rf"[^\W\d_{_CJK}]", "C": f"[{_CJK}]"}
PATTERN = (
    r"'(?:[sS]|[tT]|[rR][eE]|[vV][eE]|[mM]|[lL][lL]|[dD])"  # Qwen2's (?i:'s|'t|'re|'ve|'m|'ll|'d)
    r"|[{C}]"
    r"|(?:[^\r\n{W}]|_)?[{L}]+"
    r"|[{D}]"
    r"| ?(?:[^{S}{W}]|_)+[\r\n]*"
    r"|[{S}]*[\r\n]+"
    r"|[{S}]+(?![^{S}])"
    r"|[{S}]+"
)


def _ranges(cls: re.Pattern[str]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    start = None
    for cp in range(0x110001):
        hit = cp <= 0x10FFFF and not 0xD800 <= cp <= 0xDFFF and cls.match(chr(cp)) is not None
        if hit and start is None:
            start = cp
        elif not hit and start is not None:
            out.append((start, cp - 1))
            start = None
    return out


def _class_body(ranges: Iterable[tuple[int, int]]) -> str:
    # ASCII as \xHH (no character needs escaping then), the rest as itself: both engines read both forms.
    def ch(cp: int) -> str:
        return f"\\x{cp:02x}" if cp < 0x80 else chr(cp)

    return "".join(ch(a) if a == b else f"{ch(a)}{'' if b == a + 1 else '-'}{ch(b)}" for a, b in ranges)


def explicit_pattern(pattern: str = PATTERN) -> str:
    """`pattern` with each `{X}` replaced by the code point ranges of class X as this Python's `re` reads
    it: a regex that means the same to Python's `re` and to Oniguruma."""
    bodies = {name: _class_body(_ranges(re.compile(cls))) for name, cls in CLASSES.items()}
    return re.sub(r"\{([A-Z])\}", lambda m: bodies[m.group(1)], pattern)


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


class Tokenizer:
    """Encode and decode with a trained vocabulary (`load()` for the shipped one)."""

    def __init__(self, vocab: dict[str, int], merges: Sequence[tuple[str, str]], pattern: str) -> None:
        self.vocab = vocab  # the trained tokens, ids 0 .. size - 1 (the added ones are `added`)
        self.pattern = pattern  # the pre-tokenizer's regex, explicit (`explicit_pattern`)
        self._pre = re.compile(pattern)
        self.ranks = {pair: i for i, pair in enumerate(merges)}
        self.size = len(vocab)
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
        for piece in self._pre.findall(text):
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
        """The bytes of the tokens; reserved ids decode to their names, unknown ids (negative or from
        TOKENIZER_LENGTH up) to nothing."""
        pieces = self._skip if skip_special_tokens else self._keep
        try:
            return b"".join(map(pieces.__getitem__, ids))
        except (KeyError, TypeError):  # an id outside the vocabulary: the slow path skips it
            pass
        out = []
        for i in ids:
            piece = pieces.get(i) if isinstance(i, int) else None
            if piece is None and isinstance(i, int) and self.size <= i < TOKENIZER_LENGTH:
                piece = reserved(i).encode()
            out.append(piece or b"")
        return b"".join(out)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.to_bytes(ids, skip_special_tokens).decode("utf-8", "replace")

    def id_bytes(self, i: int) -> bytes:
        """One token's bytes (added tokens: their content; reserved ids: their names; unknown ids: b"")."""
        return self.to_bytes([i], skip_special_tokens=False)

    def to_json(self, merges: Sequence[tuple[str, str]]) -> dict:
        """The `tokenizer.json` of this tokenizer."""
        # The added tokens are model tokens too: that is what gives them their ids in `tokenizers`.
        added = {c: i for i, c, _ in ADDED_TOKENS}
        ids = set(self.vocab.values()) | set(added.values())
        vocab = self.vocab | {reserved(i): i for i in range(TOKENIZER_LENGTH) if i not in ids} | added
        return {
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": [{"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
                              "normalized": False, "special": s} for i, c, s in ADDED_TOKENS],
            "normalizer": None,
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": self.pattern}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]},
            "post_processor": None,
            "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                      "ignore_merges": False, "vocab": vocab, "merges": [list(m) for m in merges]},
        }  # fmt: skip


def tokenizer_config() -> dict:
    """The folder's `tokenizer_config.json`: Qwen3's special tokens and settings. `PreTrainedTokenizerFast`
    (not Qwen3's `Qwen2Tokenizer`) so that `transformers` takes `tokenizer.json`'s pipeline as it is instead
    of building Qwen2's own regex; no `clean_up_tokenization_spaces`, so decoding gives the bytes back.
    The chat template is `chat_template.jinja` beside it, which `transformers` reads from the folder."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": MODEL_MAX_LENGTH,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "errors": "replace",
        # As Qwen3's: the special tokens beside eos and pad, so `all_special_ids` holds every special one.
        "additional_special_tokens": [c for _, c, special in ADDED_TOKENS if special and c != "<|endoftext|>"],
        "added_tokens_decoder": {str(i): {"content": c, "lstrip": False, "normalized": False, "rstrip": False,
                                          "single_word": False, "special": s} for i, c, s in ADDED_TOKENS},
    }


def load(path: Path = TOKENIZER_FILE) -> Tokenizer:
    data = json.loads(path.read_text())
    added = [(t["id"], t["content"], t["special"]) for t in data["added_tokens"]]
    if added != list(ADDED_TOKENS):
        raise ValueError(f"{path}: its added tokens are not ADDED_TOKENS: regenerate it (python -m {__name__})")
    model = data["model"]
    added_ids = {i for i, _, _ in ADDED_TOKENS}
    vocab = {t: i for t, i in model["vocab"].items() if i not in added_ids and t != reserved(i)}
    if sorted(vocab.values()) != list(range(len(vocab))) or len(model["vocab"]) != TOKENIZER_LENGTH:
        raise ValueError(f"{path}: not trained ids 0 .. n - 1, then reserved and added ones up to {TOKENIZER_LENGTH}")
    (split, _) = data["pre_tokenizer"]["pretokenizers"]
    return Tokenizer(vocab, [tuple(m) for m in model["merges"]], split["pattern"]["Regex"])


@lru_cache(maxsize=1)
def tokenizer() -> Tokenizer:
    """The shipped tokenizer, loaded once per process."""
    return load()


# -- training (offline: `python -m tracegen.simulator.bpe` rewrites the tokenizer folder) ----------------------
def train(texts: Iterable[str], vocab_size: int, pattern: str) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-level BPE merges learned from `texts` pre-tokenized by `pattern` (most frequent pair first; ties
    by the pair's strings, so the result is deterministic)."""
    b2u = bytes_to_unicode()
    pre = re.compile(pattern)
    counts: Counter[str] = Counter()
    for t in texts:
        counts.update("".join(b2u[b] for b in p.encode()) for p in pre.findall(t))
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

    pattern = explicit_pattern()
    vocab, merges = train(training_texts(), VOCAB_SIZE, pattern)
    tok = Tokenizer(vocab, merges, pattern)
    TOKENIZER_FILE.write_text(json.dumps(tok.to_json(merges), ensure_ascii=False, separators=(",", ":")) + "\n")
    TOKENIZER_CONFIG_FILE.write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    print(f"wrote {TOKENIZER_DIR} ({len(vocab):,} tokens, {len(merges):,} merges)", file=sys.stderr)
    # The served streams: the tokenization of each register's text, shipped so a server starts in
    # milliseconds instead of tokenizing ~600,000 characters (tests check they are that tokenization).
    arrays = {name: np.asarray(tok.encode(corpus.text(name, chars, seed=STREAM_SEED)), dtype=np.uint16)
              for name, chars in STREAM_CHARS.items()}
    np.savez_compressed(STREAMS_FILE, **arrays)
    print(f"wrote {STREAMS_FILE} ({', '.join(f'{k}: {v.size:,} tokens' for k, v in arrays.items())})",
          file=sys.stderr)


if __name__ == "__main__":
    main()
