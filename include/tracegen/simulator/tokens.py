"""Token ids for the stand-in: a real byte-level BPE tokenizer, Qwen3's chat template, and completions that
are windows of a tokenized text stream.

- **Prompts** are rendered with Qwen3's chat template as SGLang applies it (`chat_template`) and tokenized
  by `bpe.tokenizer()`. A chat prompt and the `prompt_token_ids` it returns are the same ids, so `/generate` on them sees the prompt the chat route saw: which tools it offers
  (read from the decoded tools block) and which register the answer is written in (`register_of`: a prompt
  whose text is at least 10% non-ASCII is answered in the `intl` register, as a model answers in the
  language it is asked in).
- **Completions** are the ids of a `Response`: `<think>`, `\\n`, thinking, `\\n`, `</think>`, `\\n\\n`, the
  answer, an optional tool call, `<|im_end|>`. Thinking and answer are one contiguous window of the
  register's `Stream` (the tokenization of `corpus.text`), starting at the sample's `origin`; the window's
  ends fall on whole characters, so a finished completion decodes without U+FFFD, while a cap can cut
  anywhere, inside a character too. A runaway sample repeats a stretch of the stream (one token to a
  thousand) from its loop onset on, exactly or with a token swapped now and then, so its ids loop as a real
  model's do.
- **Continuing** a response (`find_origins`): the response starts after the last assistant header of the
  input ids; its first stream ids are looked up in the stream's 4-gram index, which gives the origin, and
  the sample is a pure function of the prompt and the origin (`lengths.continued_sample` verifies every id
  of the prefix against it). Ids the stand-in did not produce after that prompt sample afresh.
"""

from __future__ import annotations

import hashlib
import json
import re
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from tracegen.simulator import bpe
from tracegen.simulator.chat_template import render_chat

VOCAB_SIZE = 151_936  # what the served model reports (Qwen3's embedding rows)
ENDOFTEXT_ID = 151_643
IM_START_ID = 151_644  # <|im_start|>
EOS_TOKEN_ID = 151_645  # <|im_end|>: the stop token SGLang reports as matched_stop
TOOL_CALL_ID = 151_657  # <tool_call>
TOOL_CALL_END_ID = 151_658  # </tool_call>
THINK_ID = 151_667  # <think>
THINK_END_ID = 151_668  # </think>
# SGLang's INIT_INCREMENTAL_DETOKENIZATION_OFFSET: the input ids its detokenizer decodes the output after.
SURROGATE_TOKENS = 5
NON_ASCII_REGISTER_SHARE = 0.10
TOKENIZER_MAX_LENGTH = bpe.MODEL_MAX_LENGTH  # what /tokenize reports
_KEY_BITS = 44
_NGRAM = 4


def tokenizer() -> bpe.Tokenizer:
    return bpe.tokenizer()


@lru_cache(maxsize=1)
def _fixed() -> dict[str, Any]:
    tok = tokenizer()
    ids = {name: tuple(tok.encode(text)) for name, text in (
        ("nl", "\n"), ("nlnl", "\n\n"), ("pad", "."), ("header", "<|im_start|>assistant\n"),
        ("no_think", "<think>\n\n</think>\n\n"))}  # fmt: skip
    assert len(ids["nl"]) == len(ids["nlnl"]) == len(ids["pad"]) == 1, ids
    return ids


def nl_id() -> int:
    return _fixed()["nl"][0]


def nlnl_id() -> int:
    return _fixed()["nlnl"][0]


def pad_id() -> int:
    return _fixed()["pad"][0]


# -- prompts -----------------------------------------------------------------------------------------
def text_ids(text: str) -> list[int]:
    """Ids of raw text (added tokens' strings, `<think>` and the like, become their ids)."""
    return tokenizer().encode(text)


def decode(ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    return tokenizer().decode(ids, skip_special_tokens)


@lru_cache(maxsize=4096)
def _encoded(text: str) -> tuple[int, ...]:
    return tuple(tokenizer().encode(text))


def chat_prompt_ids(messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None = None,
                    thinking: bool = True, tool_choice: str | Mapping[str, Any] = "auto",
                    continue_final_message: bool = False, add_generation_prompt: bool | None = None) -> list[int]:
    """Ids of a templated chat prompt, the generation prompt included, as SGLang encodes it: the rendered
    text, then on its own what it appends (a final assistant message continued)."""
    text, after = render_chat(messages, tools, thinking=thinking, tool_choice=tool_choice,
                              continue_final_message=continue_final_message,
                              add_generation_prompt=add_generation_prompt)
    return list(_encoded(text)) + (list(_encoded(after)) if after else [])


def opens_without_thinking(ids: Sequence[int]) -> bool:
    """The prompt ends with the empty think block Qwen3's template adds when thinking is off."""
    no_think = _fixed()["no_think"]
    return tuple(ids[-len(no_think) :]) == no_think


def chat_prompt_tokens(messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None = None,
                       thinking: bool = True) -> int:
    return len(chat_prompt_ids(messages, tools, thinking))


_TOOLS_BLOCK = re.compile(r"<tools>\n(.*?)\n</tools>", re.DOTALL)


def prompt_tool_names(ids: Sequence[int]) -> list[str] | None:
    """The names of the tools a prompt's ids offer, in order (None when it has no tools block): read from
    the decoded template, as the model reads them."""
    text = decode(ids)
    found = _TOOLS_BLOCK.findall(text)
    if not found:
        return None
    names = []
    for line in found[-1].split("\n"):
        try:
            tool = json.loads(line)
        except ValueError:
            continue
        fn = tool.get("function") if isinstance(tool, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        names.append(name if isinstance(name, str) else "")
    return names


def register_of(ids: Sequence[int]) -> str:
    """The register a prompt is answered in: `intl` when its text (tools block aside) is at least 10%
    non-ASCII, else `en`."""
    text = _TOOLS_BLOCK.sub("", decode(ids))
    if not text:
        return "en"
    non_ascii = len(text) - len(text.encode("ascii", "ignore"))
    return "intl" if non_ascii >= NON_ASCII_REGISTER_SHARE * len(text) else "en"


def _ids_bytes(ids: Sequence[int]) -> bytes:
    try:
        return array("q", ids).tobytes()
    except (OverflowError, TypeError):  # ids outside int64: SGLang would fail later; hashing them must not
        return ",".join(map(str, ids)).encode()


def prompt_digest(ids: Sequence[int], seed: int = 0) -> bytes:
    """16-byte hash of a prompt's ids under the stand-in's --sim-seed: the prompt's identity."""
    salt = int(seed & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "little")
    return hashlib.blake2b(_ids_bytes(ids), digest_size=16, salt=salt).digest()


def origin_key(digest: bytes, register: str, origin: int) -> int:
    """The sample key of the response that starts at `origin` of the register's stream after the prompt
    with `digest`: everything random about the sample (length, thinking share, loop) derives from it."""
    payload = digest + register.encode() + origin.to_bytes(8, "little")
    return int.from_bytes(hashlib.blake2b(payload, digest_size=8, person=b"origin").digest(), "little") >> (
        64 - _KEY_BITS
    )


# -- streams -----------------------------------------------------------------------------------------
class Stream:
    """One register's token stream (cyclic), with where characters start and a 4-gram index."""

    def __init__(self, name: str, ids: np.ndarray) -> None:
        tok = tokenizer()
        self.name = name
        self.ids = ids.astype(np.int64)
        self.size = int(ids.size)
        first = np.array([(b[0] if b else 0) for b in tok.token_bytes], dtype=np.uint8)
        # A token starts a character unless its first byte is a UTF-8 continuation byte.
        self.starts = (first[self.ids] & 0xC0) != 0x80
        pos = np.arange(self.size)
        last = np.maximum.accumulate(np.where(self.starts, pos, -1))
        # Cyclic: positions before the first character start take the last one of the stream.
        tail = int(np.flatnonzero(self.starts)[-1])
        self._prev = np.where(last < 0, tail - self.size, last)
        # Tokens that are whole characters (this one and the next start one): a loop's variants swap these.
        self.whole = self.starts & np.roll(self.starts, -1)
        self.whole_positions = np.flatnonzero(self.whole)
        self._index: tuple[np.ndarray, np.ndarray] | None = None

    def window(self, start: int, count: int) -> np.ndarray:
        """Ids at stream positions start .. start + count - 1 (cyclic)."""
        start %= self.size
        if start + count <= self.size:
            return self.ids[start : start + count]
        return self.ids[(start + np.arange(count)) % self.size]

    def is_start(self, pos: int) -> bool:
        return bool(self.starts[pos % self.size])

    def snap_down(self, start: int, k: int) -> int:
        """The largest k' <= k such that position start + k' starts a character (start must)."""
        if k <= 0:
            return 0
        p = (start + k) % self.size
        return max(0, k - (p - int(self._prev[p])))

    def snap_up(self, start: int, k: int) -> int:
        """The smallest k' >= k such that position start + k' starts a character."""
        while not self.starts[(start + k) % self.size]:
            k += 1
        return k

    def next_start(self, pos: int) -> int:
        pos %= self.size
        return (pos + self.snap_up(pos, 0)) % self.size

    def _keys(self, ids: np.ndarray) -> np.ndarray:
        k = np.zeros(ids.size - _NGRAM + 1, dtype=np.int64)
        for j in range(_NGRAM):
            k = k * 8192 + ids[j : j + k.size]
        return k

    def origins(self, first: Sequence[int]) -> list[int]:
        """Stream positions starting a character where the stream reads `first` (its first 4 ids)."""
        if len(first) < _NGRAM or any(not 0 <= t < 8192 for t in first[:_NGRAM]):
            return []
        if self._index is None:
            wrapped = np.concatenate([self.ids, self.ids[: _NGRAM - 1]])
            keys = self._keys(wrapped)
            pos = np.flatnonzero(self.starts)
            order = np.argsort(keys[pos], kind="stable")
            self._index = (keys[pos][order], pos[order])
        keys, pos = self._index
        key = int(self._keys(np.asarray(first[:_NGRAM], dtype=np.int64))[0])
        lo, hi = np.searchsorted(keys, [key, key + 1])
        return pos[lo:hi].tolist()


@lru_cache(maxsize=1)
def streams() -> dict[str, Stream]:
    data = np.load(bpe.STREAMS_FILE)
    return {name: Stream(name, data[name]) for name in bpe.STREAM_CHARS}


def stream(name: str) -> Stream:
    return streams()[name]


# -- responses ---------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Response:
    """The id sequence of one sample's completion (see the module docstring).

    `segments` are, in order, fixed ids (a tuple) or a stretch of the body (`(body_start, length)`, length
    None for endless); the body is the stream from `origin`, looping from body index `loop[0]` with period
    `loop[1]` when set, each copy after the first swapping one whole-character token of the loop for another
    with probability `variants` (which copy swaps which token for which is a function of `loop_key`).
    `total` is the number of tokens until it stops (None: it never does)."""

    register: str
    origin: int
    thinking: bool
    reasoning: int  # tokens through </think> (0 without a think block)
    segments: tuple[Any, ...]
    total: int | None
    stops: bool
    loop: tuple[int, int] | None = None
    tool: bool = False
    variants: float = 0.0
    loop_key: int = 0

    def _body(self, j0: int, count: int) -> np.ndarray:
        s = stream(self.register)
        if self.loop is None or j0 + count <= self.loop[0]:
            return s.window(self.origin + j0, count)
        onset, period = self.loop
        j = np.arange(j0, j0 + count)
        looped = j >= onset
        k = np.where(looped, j - onset, 0)  # index inside the loop's run
        out = s.ids[(self.origin + np.where(looped, onset + k % period, j)) % s.size]
        if self.variants <= 0:
            return out
        copy = k // period
        swapped = looped & (copy >= 1)
        if not swapped.any():
            return out
        # Each copy's draw: whether it swaps, which of the loop's tokens, and for which token of the stream.
        h = _mix(copy[swapped].astype(np.uint64) ^ np.uint64(self.loop_key & _MASK64))
        slot = (h >> np.uint64(16)) % np.uint64(period)
        at = np.flatnonzero(swapped)
        hit = ((h & np.uint64(0xFFFF)) < np.uint64(int(self.variants * 0x10000))) & (
            slot == (k[at] % period).astype(np.uint64)
        )
        # Only a whole-character token is swapped, for another: the text stays whole characters.
        hit &= s.whole[(self.origin + onset + k[at] % period) % s.size]
        if hit.any():
            pick = (h[hit] >> np.uint64(32)) % np.uint64(s.whole_positions.size)
            out[at[hit]] = s.ids[s.whole_positions[pick.astype(np.int64)]]
        return out

    def ids(self, start: int, count: int) -> list[int]:
        """Ids at response positions [start, start + count)."""
        out: list[int] = []
        pos = 0
        end = start + count
        for seg in self.segments:
            if pos >= end:
                break
            n = len(seg) if isinstance(seg, tuple) and not _is_body(seg) else seg[1]
            seg_end = end if n is None else pos + n
            lo, hi = max(start, pos), min(end, seg_end)
            if hi > lo:
                if _is_body(seg):
                    out.extend(self._body(seg[0] + lo - pos, hi - lo).tolist())
                else:
                    out.extend(seg[lo - pos : hi - pos])
            if n is None:
                break
            pos = seg_end
        return out


_MASK64 = 0xFFFFFFFFFFFFFFFF


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on uint64s (wrapping arithmetic): a fixed, well-spread hash per value."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class _BodySeg(tuple):
    """A (body_start, length) segment, told apart from fixed ids."""


def _is_body(seg: Any) -> bool:
    return isinstance(seg, _BodySeg)


def _body_seg(start: int, length: int | None) -> _BodySeg:
    return _BodySeg((start, length))


def tool_call_text(name: str, key: int) -> str:
    """A call as the model writes it (Qwen's format), after the answer."""
    words = ("check", "run", "failing", "tests", "module", "config", "parser", "cache", "path", "logs")
    query = " ".join(words[(key >> (4 * i)) % len(words)] for i in range(3))
    call = json.dumps({"name": name, "arguments": {"query": query}})
    return f"\n\n<tool_call>\n{call}\n</tool_call>"


MIN_THINKING_TOTAL = 6  # <think> \n ... \n </think> and one answer token: a shorter thinking sample is this long


def layout(sample: Any, register: str, origin: int, thinking: bool, tool_name: str | None = None,
           ignore_eos: bool = False) -> Response:
    """The completion of `sample` (`lengths.Sample`) whose body starts at `origin` of the register's stream.

    Its length is the sample's: a body stretch that would end inside a character ends before it, and the
    tokens it gave up are `.` (so the text ends on whole characters); an answer too short for its tool call
    grows to hold it. A runaway never stops; with `ignore_eos` the answer
    runs on past where it would stop."""
    s = stream(register)
    nl, nlnl, pad = nl_id(), nlnl_id(), pad_id()
    head = (THINK_ID, nl)
    if sample.runaway:
        base = 2 if thinking else 0
        # The loop starts after the body's first 4 ids at least: a continuation finds its sample by them.
        onset = s.snap_up(origin, max(_NGRAM, sample.loop_onset - base))
        period = s.snap_up(origin + onset, max(1, sample.loop_period))
        segs = ((head,) if thinking else ()) + (_body_seg(0, None),)
        return Response(register, origin, thinking, sample.reasoning if thinking else 0, segs, None, False,
                        (onset, period), variants=sample.loop_variants, loop_key=sample.key)
    total = sample.total if thinking else max(1, sample.answer)
    if thinking:
        total = max(total, MIN_THINKING_TOTAL)
        r_target = max(0, min(sample.reasoning, total - 2) - 4)
        body_r = s.snap_down(origin, r_target)
        answer = total - (r_target + 4)
        segs: list[Any] = [head, _body_seg(0, body_r), (pad,) * (r_target - body_r), (nl, THINK_END_ID)]
        reasoning = r_target + 4
    else:
        body_r, answer, segs, reasoning = 0, total, [], 0
    opener = 1 if thinking else 0  # the \n\n after </think>
    if ignore_eos:
        segs += ([(nlnl,)] if thinking else []) + [_body_seg(body_r, None)]
        return Response(register, origin, thinking, reasoning, tuple(segs), None, False)
    call = tuple(text_ids(tool_call_text(tool_name, sample.key))) if tool_name else ()
    # A call is written whole: an answer too short for it grows to hold it (the call's tokens are paid for).
    body_a_target = answer - opener - len(call) - 1
    if body_a_target < 0 and not call and opener:
        opener = 0  # an answer of one token: the stop token right after </think>
    body_a_target = max(0, body_a_target)
    body_a = s.snap_down(origin + body_r, body_a_target)
    if opener:
        segs.append((nlnl,))
    segs += [_body_seg(body_r, body_a), (pad,) * (body_a_target - body_a), call, (EOS_TOKEN_ID,)]
    n = reasoning + opener + body_a_target + len(call) + 1
    return Response(register, origin, thinking, reasoning, tuple(segs), n, True, None, bool(call))


# -- continuing ----------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Origins:
    """Where a response the stand-in may have produced starts inside input ids, and its candidate origins."""

    prompt_len: int  # input_ids[:prompt_len] is the prompt
    thinking: bool
    register: str
    origins: tuple[int, ...]


def find_origins(input_ids: Sequence[int]) -> Origins | None:
    """The response that `input_ids` ends with, if it can be one of the stand-in's: it follows the last
    assistant header (and the empty think block of a prompt with thinking off), opens as the stand-in's
    responses open, holds no stop token and at least 4 body ids to look up (None otherwise)."""
    fixed = _fixed()
    header, no_think = fixed["header"], fixed["no_think"]
    ids = list(input_ids)
    at = len(ids) - 1 - ids[::-1].index(IM_START_ID) if IM_START_ID in ids else -1
    if at >= 0 and tuple(ids[at : at + len(header)]) == header:
        prompt_len = at + len(header)
    elif THINK_ID in ids:  # a raw prompt (no template): the response opened its thinking
        prompt_len = len(ids) - 1 - ids[::-1].index(THINK_ID)
    else:
        return None
    thinking = True
    if tuple(ids[prompt_len : prompt_len + len(no_think)]) == no_think:
        prompt_len += len(no_think)
        thinking = False
    response = ids[prompt_len:]
    if not response or EOS_TOKEN_ID in response or prompt_len == 0:
        return None
    if thinking:
        if response[:2] != [THINK_ID, nl_id()]:
            return None
        response = response[2:]
    first = response[:_NGRAM]
    if len(first) < _NGRAM:
        return None
    register = register_of(ids[:prompt_len])
    found = stream(register).origins(first)
    if not found:
        return None
    return Origins(prompt_len, thinking, register, tuple(found))


# -- detokenizing as SGLang does -----------------------------------------------------------------------
def detokenize(input_ids: Sequence[int], output_ids: Sequence[int], stopped: bool) -> str:
    """The text SGLang 0.5.23 returns for `output_ids` generated after `input_ids`, at finish.

    Its DetokenizerManager decodes the output after the last `SURROGATE_TOKENS` input ids and keeps what
    follows their own decoding (`decode(surr + out)[len(decode(surr)):]`), the matched stop token trimmed
    from the ids (`trim_matched_stop`) and special tokens skipped. A completion cut inside a character ends
    in U+FFFD; a continuation of ids that end inside a character loses that character (its first bytes
    decode to U+FFFD in the surrogate text, the whole character in the output's, and the length of the
    former is cut off)."""
    tok = tokenizer()
    out = list(output_ids)
    if stopped and out and out[-1] == EOS_TOKEN_ID:
        out = out[:-1]
    surr = list(input_ids[-SURROGATE_TOKENS:]) if SURROGATE_TOKENS else []
    if not surr:
        return tok.decode(out)
    head = tok.decode(surr)
    return tok.decode(surr + out)[len(head) :]
