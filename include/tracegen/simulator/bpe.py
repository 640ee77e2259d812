"""The stand-in's tokenizer: the Hugging Face tokenizer folder `tokenizer/`, read with `tokenizers`, the
library (and the file) SGLang tokenizes with, so the stand-in's ids are SGLang's for any text.

The folder holds a byte-level BPE, GPT-2 style, with Qwen3's special tokens: text is split into pre-tokens
by the file's regex, each pre-token's UTF-8 bytes become printable characters (a space is `Ġ`, a newline
`Ċ`, so whitespace lives inside tokens: `Ġthe`, `ĊĊ`) and are merged by rank. Decoding joins the tokens'
bytes and decodes them with U+FFFD for every maximal invalid subsequence (the ByteLevel decoder's
`String::from_utf8_lossy`): a token sequence that ends inside a character decodes to U+FFFD there.
`make_tokenizer` writes the folder and the token streams cut from it (`python -m
tracegen.simulator.make_tokenizer`); `tokenizer_config.json` and `chat_template.jinja` (Qwen3's, kept by hand)
make it a folder `transformers.AutoTokenizer` loads too.

- Special and added tokens keep Qwen3's ids (151643 and up), so `<|im_end|>` is 151645 as SGLang reports
  it; `<think>`, `</think>`, `<tool_call>`, `<tool_response>` and the like are added tokens that are not
  special (skip_special_tokens keeps them, as Qwen3's tokenizer does).
- Every other id below Qwen3's tokenizer length (151669) that no trained token has is a reserved token,
  `<|reserved_N|>`: no merge makes one, so no text encodes to it, and it decodes to its name.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path

import tokenizers

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



@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to the printable characters byte-level tokens are spelled in."""
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
    """Encode and decode with a tokenizer folder's `tokenizer.json` (`tokenizer()` for the shipped one)."""

    def __init__(self, library: tokenizers.Tokenizer) -> None:
        self.library = library
        # The trained tokens: ids 0 .. size - 1, up to the first reserved or added one.
        added = {i for i, _, _ in ADDED_TOKENS}
        trained: list[str] = []
        while (i := len(trained)) not in added and (token := library.id_to_token(i)) not in (None, reserved(i)):
            trained.append(token)
        self.vocab = {token: i for i, token in enumerate(trained)}
        self.size = len(trained)
        u2b = {c: b for b, c in bytes_to_unicode().items()}
        self.token_bytes: list[bytes] = [b""] * self.size
        for token, i in self.vocab.items():
            self.token_bytes[i] = bytes(u2b[c] for c in token)

    def encode(self, text: str) -> list[int]:
        """Ids of text; the added tokens' strings (`<|im_end|>`, `<think>`, ...) become their ids."""
        return self.library.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ids; reserved ids decode to their names, unknown ids (negative or from TOKENIZER_LENGTH
        up) to nothing."""
        ids = list(ids)
        try:
            return self.library.decode(ids, skip_special_tokens=skip_special_tokens)
        except OverflowError:  # an id no u32 holds: the library refuses what it would otherwise skip
            known = [i for i in ids if 0 <= i < TOKENIZER_LENGTH]
            return self.library.decode(known, skip_special_tokens=skip_special_tokens)


def load(path: Path = TOKENIZER_FILE) -> Tokenizer:
    """The tokenizer of `path`, checked to hold Qwen3's added tokens at their ids and Qwen3's length (the ids
    `tokens` names as constants)."""
    library = tokenizers.Tokenizer.from_file(str(path))
    added = [(i, t.content, t.special) for i, t in sorted(library.get_added_tokens_decoder().items())]
    if added != list(ADDED_TOKENS):
        raise ValueError(f"{path}: its added tokens are not ADDED_TOKENS: regenerate it "
                         "(python -m tracegen.simulator.make_tokenizer --train)")
    tok = Tokenizer(library)
    if tok.size < 256 or library.get_vocab_size() != TOKENIZER_LENGTH:
        raise ValueError(f"{path}: not 256 byte tokens and merges, then reserved and added ones up to {TOKENIZER_LENGTH}")
    return tok


@lru_cache(maxsize=1)
def tokenizer() -> Tokenizer:
    """The shipped tokenizer, loaded once per process."""
    return load()
