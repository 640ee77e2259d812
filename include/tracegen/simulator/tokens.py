"""Token ids for the stand-in: a pseudo-tokenizer for prompts, and response ids that name their sample.

SGLang turns every prompt into token ids and samples token ids back. The stand-in has no vocabulary, so:

- Prompts are "tokenized" four characters to a token (the same count `prompt_tokens` always used), each
  chunk hashed to an id below the special tokens; chat messages add four template ids each. The ids
  are a pure function of the text, so a chat prompt and the `prompt_token_ids` it returns hash alike:
  `/generate` with those ids sees the same prompt as the chat route did. The tools block keeps its
  token count but opens with `TOOLS_BLOCK_ID` and the tools' names packed two bytes an id, so
  `/generate` on those ids knows which tools the prompt offers, as the model reading it would.
- A response's ids carry the identity of the sample they came from. The first `HEADER_TOKENS` ids spell
  the sample key, whether thinking was on, and a check bound to the prompt; every later id is a
  position of an arithmetic sequence seeded by the key. `/generate` with `input_ids` = prompt ids +
  response ids so far can therefore find where the response starts, recover its sample and finish
  it, as SGLang would finish the sampled sequence it is given. Ids the stand-in did not produce
  after that prompt (edited, truncated inside the header, glued to another prompt, or ending in EOS)
  do not verify, and the request samples afresh.
"""

from __future__ import annotations

import hashlib
import json
import math
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

VOCAB_SIZE = 151_936
TEXT_VOCAB = 151_643  # ids below Qwen3's special tokens: what ordinary text tokenizes to
IM_START_ID = 151_644  # <|im_start|>
EOS_TOKEN_ID = 151_645  # <|im_end|>: the stop token SGLang reports as matched_stop
NEWLINE_ID = 198
TOOLS_BLOCK_ID = 151_700  # an id past Qwen3's special tokens that no text maps to: opens the tools block
CHARS_PER_TOKEN = 4
TEMPLATE_TOKENS_PER_MESSAGE = 4  # <|im_start|>, role, <|im_end|>, newline

KEY_BITS = 44
HEADER_TOKENS = 4
_CHUNK_BITS = 15  # 4 chunks x 15 bits = key (44) + thinking flag (1) + prompt check (15)
_CHECK_BITS = 15
_CHUNK_MASK = (1 << _CHUNK_BITS) - 1

_ROLE_IDS = {"system": 8948, "user": 872, "assistant": 77091, "tool": 14172, "developer": 34566}


# -- prompts -----------------------------------------------------------------------------------------
def text_ids(text: str) -> list[int]:
    """Ids of raw text: one per four characters (ceil), each a hash of its chunk."""
    if not text:
        return []
    points = array("I", text.encode("utf-32-le", "surrogatepass"))
    points.extend([0] * (-len(points) % CHARS_PER_TOKEN))
    it = iter(points)
    return [
        (a * 1_000_003 + b * 10_007 + c * 101 + d) % TEXT_VOCAB
        for a, b, c, d in zip(it, it, it, it, strict=True)
    ]


def _message_text(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list):  # OpenAI content parts: the text ones are what the template renders
        text = "".join(p.get("text") or "" for p in content if isinstance(p, Mapping))
    else:
        text = str(content)
    calls = message.get("tool_calls")
    if calls:  # chat templates render an assistant's earlier tool calls into the prompt
        text += json.dumps(calls, sort_keys=True, separators=(",", ":"))
    return text


def _role_id(role: Any) -> int:
    if role in _ROLE_IDS:
        return _ROLE_IDS[role]
    return int.from_bytes(hashlib.blake2b(str(role).encode(), digest_size=4).digest(), "little") % TEXT_VOCAB


def chat_prompt_ids(messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None = None) -> list[int]:
    """Ids of a templated chat prompt: per message <|im_start|> role text <|im_end|> newline, then tools."""
    ids: list[int] = []
    for m in messages:
        ids.append(IM_START_ID)
        ids.append(_role_id(m.get("role")))
        ids += text_ids(_message_text(m))
        ids.append(EOS_TOKEN_ID)
        ids.append(NEWLINE_ID)
    if tools:
        ids += tools_ids(tools)
    return ids


def _tool_name(tool: Any) -> str:
    fn = tool.get("function") if isinstance(tool, Mapping) else None
    name = fn.get("name") if isinstance(fn, Mapping) else None
    return name if isinstance(name, str) else ""


def tools_ids(tools: Sequence[Any]) -> list[int]:
    """Ids of the tools block: as many as its JSON's text ids, the first ones naming the tools
    (`TOOLS_BLOCK_ID`, the byte length of the names joined by NUL, then two bytes an id). Names too long
    for the block leave it hashed text only."""
    hashed = text_ids(json.dumps(tools, separators=(",", ":")))
    data = "\0".join(_tool_name(t) for t in tools).encode()
    padded = data + b"\0" * (len(data) % 2)
    packed = [TOOLS_BLOCK_ID, len(data)] + [
        int.from_bytes(padded[i : i + 2], "big") for i in range(0, len(data), 2)
    ]
    if len(packed) > len(hashed) or len(data) >= TEXT_VOCAB:
        return hashed
    return packed + hashed[len(packed) :]


def prompt_tool_names(ids: Sequence[int]) -> list[str] | None:
    """The names of the tools a prompt's ids offer, in order (None when it has no tools block)."""
    try:
        at = len(ids) - 1 - list(reversed(ids)).index(TOOLS_BLOCK_ID)
    except ValueError:
        return None
    if at + 1 >= len(ids):
        return None
    size = ids[at + 1]
    words = ids[at + 2 : at + 2 + (size + 1) // 2]
    if not isinstance(size, int) or len(words) != (size + 1) // 2 or any(not 0 <= w < 1 << 16 for w in words):
        return None
    data = b"".join(w.to_bytes(2, "big") for w in words)[:size]
    try:
        return data.decode().split("\0")
    except UnicodeDecodeError:
        return None


def chat_prompt_tokens(messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None = None) -> int:
    """len(chat_prompt_ids(messages, tools)) without building the list."""
    n = sum(
        math.ceil(len(_message_text(m)) / CHARS_PER_TOKEN) + TEMPLATE_TOKENS_PER_MESSAGE for m in messages
    )
    if tools:
        n += math.ceil(len(json.dumps(tools, separators=(",", ":"))) / CHARS_PER_TOKEN)
    return n


def _ids_bytes(ids: Sequence[int]) -> bytes:
    try:
        return array("q", ids).tobytes()
    except OverflowError:  # ids outside int64: SGLang would fail later; hashing them must not
        return ",".join(map(str, ids)).encode()


def prompt_digest(ids: Sequence[int], seed: int = 0) -> bytes:
    """16-byte hash of a prompt's ids under the stand-in's --sim-seed: the prompt's identity."""
    salt = int(seed & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "little")
    return hashlib.blake2b(_ids_bytes(ids), digest_size=16, salt=salt).digest()


# -- responses ---------------------------------------------------------------------------------------
def _check(key: int, thinking: bool, digest: bytes) -> int:
    payload = key.to_bytes(8, "little") + bytes([thinking]) + digest
    return int.from_bytes(hashlib.blake2b(payload, digest_size=4).digest(), "little") & (
        (1 << _CHECK_BITS) - 1
    )


def _progression(key: int, thinking: bool) -> tuple[int, int]:
    """(offset, step) of the body ids: id at position i >= HEADER_TOKENS is (offset + i * step) % TEXT_VOCAB."""
    h = hashlib.blake2b(
        key.to_bytes(8, "little") + bytes([thinking]), digest_size=16, person=b"body"
    ).digest()
    offset = int.from_bytes(h[:8], "little") % TEXT_VOCAB
    step = 1 + int.from_bytes(h[8:], "little") % (TEXT_VOCAB - 1)
    return offset, step


@dataclass(frozen=True, slots=True)
class ResponseIds:
    """The id stream of one sample's response after one prompt."""

    key: int
    thinking: bool
    digest: bytes  # the prompt's digest: the header's check binds the response to it

    def __post_init__(self) -> None:
        if not 0 <= self.key < 1 << KEY_BITS:
            raise ValueError(f"sample key {self.key} does not fit {KEY_BITS} bits")

    def header(self) -> list[int]:
        word = (self.key << 16) | (int(self.thinking) << 15) | _check(self.key, self.thinking, self.digest)
        return [
            (i << _CHUNK_BITS) | ((word >> (_CHUNK_BITS * i)) & _CHUNK_MASK) for i in range(HEADER_TOKENS)
        ]

    def ids(self, start: int, count: int) -> list[int]:
        """Ids at response positions [start, start + count)."""
        if count <= 0:
            return []
        out: list[int] = []
        if start < HEADER_TOKENS:
            out = self.header()[start : start + count]
            count -= len(out)
            start += len(out)
        offset, step = _progression(self.key, self.thinking)
        out += [(offset + i * step) % TEXT_VOCAB for i in range(start, start + count)]
        return out


def _decode_header(tokens: Sequence[int]) -> tuple[int, bool, int] | None:
    """(key, thinking, check) from four header ids, or None when they are not a header."""
    word = 0
    for i, t in enumerate(tokens):
        if not isinstance(t, int) or t >> _CHUNK_BITS != i:
            return None
        word |= (t & _CHUNK_MASK) << (_CHUNK_BITS * i)
    return word >> 16, bool((word >> 15) & 1), word & ((1 << _CHECK_BITS) - 1)


@dataclass(frozen=True, slots=True)
class Continuation:
    """Where the stand-in's own response starts inside `input_ids`, and which sample it is."""

    prompt_len: int  # input_ids[:prompt_len] is the prompt
    generated: int  # response tokens already in input_ids
    response: ResponseIds


def find_continuation(input_ids: Sequence[int], seed: int = 0) -> Continuation | None:
    """The response of the stand-in's that `input_ids` ends with, if it ends with one (None otherwise).

    The response must run to the end: its header, then body ids that continue the key's sequence up to
    the last id. Candidates for where the body starts are the start of the longest arithmetic run that
    ends the ids (a header id can extend the run by chance, hence a few positions after it), and the
    one- and zero-body-token cases; each is verified in full, header check included.
    """
    n = len(input_ids)
    if n < HEADER_TOKENS + 1:  # at least one prompt token before a header
        return None
    candidates = {n, n - 1}
    if n >= 2:
        step = (input_ids[-1] - input_ids[-2]) % TEXT_VOCAB
        j = n - 2
        while j > 0 and (input_ids[j] - input_ids[j - 1]) % TEXT_VOCAB == step:
            j -= 1
        candidates.update(range(j, min(j + HEADER_TOKENS + 1, n + 1)))
    for body_start in sorted(candidates, reverse=True):
        h = body_start - HEADER_TOKENS
        if h < 1:
            continue
        decoded = _decode_header(input_ids[h:body_start])
        if decoded is None:
            continue
        key, thinking, check = decoded
        offset, step = _progression(key, thinking)
        body = input_ids[body_start:]
        if any(t != (offset + i * step) % TEXT_VOCAB for i, t in enumerate(body, start=HEADER_TOKENS)):
            continue
        digest = prompt_digest(input_ids[:h], seed)
        if _check(key, thinking, digest) != check:
            continue
        return Continuation(prompt_len=h, generated=n - h, response=ResponseIds(key, thinking, digest))
    return None
