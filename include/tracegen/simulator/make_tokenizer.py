"""Writes the stand-in's tokenizer folder (`bpe.TOKENIZER_DIR`) and the token streams cut from it
(`bpe.STREAMS_FILE`).

    python -m tracegen.simulator.make_tokenizer           # the streams, with the shipped tokenizer
    python -m tracegen.simulator.make_tokenizer --train   # a new tokenizer, then the streams

The streams are the tokenization of each register's text (`corpus`), shipped so a server starts in
milliseconds instead of tokenizing ~600,000 characters; rewrite them whenever `corpus` changes (tests check
they are that tokenization). The shipped tokenizer encodes any text, so a change of `corpus` needs no new one.

`--train` trains byte-level BPE merges with `tokenizers`' BpeTrainer on the stand-in's own text (256 byte
tokens, then merges) and writes `tokenizer.json` with Qwen3's added tokens at their ids and the reserved ones
between (`bpe`'s docstring says why), and `tokenizer_config.json`. Its ids differ from the shipped file's,
whose merges broke ties between equally frequent pairs by the pairs' strings where BpeTrainer breaks them by
token id: a new tokenizer means new ids everywhere, which is why training is a flag of its own.

The pre-tokenizer's regex has no `\\w`, `\\s`, `\\d` or `(?i)`: engines read those from different Unicode
databases and definitions (combining marks are word characters to one and not the other, `\\x1c` is a space
to one only, `(?i)` folds `ſ` to `s` in Python), so `explicit_pattern` writes each class out as the code
point ranges Python's `re` gives it, and the contractions in ASCII cases: any regex engine (Oniguruma, which
`tokenizers` uses, or another) splits every text as the file was made to.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterable
from pathlib import Path

from tracegen.simulator.bpe import (
    ADDED_TOKENS,
    MODEL_MAX_LENGTH,
    STREAM_CHARS,
    STREAM_SEED,
    STREAMS_FILE,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_DIR,
    TOKENIZER_FILE,
    TOKENIZER_LENGTH,
    Tokenizer,
    load,
    reserved,
)

VOCAB_SIZE = 4096  # trained tokens of the shipped tokenizer (256 bytes + merges)

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


def train(texts: Iterable[str], vocab_size: int, pattern: str) -> tuple[dict[str, int], list[list[str]]]:
    """Byte-level BPE vocabulary and merges learned from `texts` pre-tokenized by `pattern` (the most frequent
    pair first; a pair must occur twice)."""
    import tokenizers
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(pattern), "isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    model = json.loads(tok.to_str())["model"]
    return model["vocab"], model["merges"]


def tokenizer_json(vocab: dict[str, int], merges: list[list[str]], pattern: str) -> dict:
    """The folder's `tokenizer.json` for trained tokens `vocab` (ids 0 .. n - 1)."""
    # The added tokens are model tokens too: `tokenizers` gives an added token the id its model has for it,
    # and otherwise the next free id after the model's (4096, ...), whatever id `added_tokens` names. The
    # reserved ones fill the rest: without them `tokenizers` prints the holes in full (about a megabyte)
    # each time it serialises the model, as `transformers` does on every load.
    added = {c: i for i, c, _ in ADDED_TOKENS}
    ids = set(vocab.values()) | set(added.values())
    full = vocab | {reserved(i): i for i in range(TOKENIZER_LENGTH) if i not in ids} | added
    full = dict(sorted(full.items(), key=lambda item: item[1]))  # by id, so one vocabulary is one file
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": s} for i, c, s in ADDED_TOKENS],
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": full, "merges": [list(m) for m in merges]},
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


def training_texts() -> list[str]:
    """What the shipped tokenizer is trained on: both registers of the stand-in's text (other seeds than
    the served streams') and the chat template's own text."""
    from tracegen.simulator import corpus

    template = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
                "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n# Tools\n\nYou may call one or "
                "more functions to assist with the user query.\n\n<tools>\n</tools>\n") * 200
    return [corpus.text("en", 1_500_000, seed=101), corpus.text("intl", 700_000, seed=102), template]


def file_text(data: dict) -> str:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")) + "\n"


def write_streams(tok: Tokenizer, path: Path = STREAMS_FILE) -> None:
    import numpy as np

    from tracegen.simulator import corpus

    arrays = {name: np.asarray(tok.encode(corpus.text(name, chars, seed=STREAM_SEED)), dtype=np.uint16)
              for name, chars in STREAM_CHARS.items()}
    np.savez_compressed(path, **arrays)
    print(f"wrote {path} ({', '.join(f'{k}: {v.size:,} tokens' for k, v in arrays.items())})", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tracegen.simulator.make_tokenizer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train", action="store_true", help="train a new tokenizer first (new ids everywhere)")
    args = parser.parse_args(argv)
    if args.train:
        pattern = explicit_pattern()
        vocab, merges = train(training_texts(), VOCAB_SIZE, pattern)
        data = tokenizer_json(vocab, merges, pattern)
        TOKENIZER_FILE.write_text(file_text(data))
        TOKENIZER_CONFIG_FILE.write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
        print(f"wrote {TOKENIZER_DIR} ({len(vocab):,} tokens, {len(merges):,} merges)", file=sys.stderr)
    write_streams(load())


if __name__ == "__main__":
    main()
