"""How SGLang 0.5.23 streams one request's output: when an event is due, and the text each event carries.

- **When** (`event_ends`): the scheduler's output streamer sends the first step's tokens at once, then an
  event at the first step end with at least `stream_interval` tokens unsent (`--stream-interval`, default
  1, or the request's `sampling_params.stream_interval`), and always the finishing step. Without
  speculative decoding (a token a step) a stream of n tokens at interval I is so 1 + ceil((n - 1) / I)
  events, the last one the finish; each is its own SSE event (SGLang coalesces only what a slow client
  left queued).
- **What** (`Detokenizer`): SGLang's DetokenizerManager turns new ids into new text incrementally, after a
  few surrogate ids of context; a step whose text ends inside a character emits only its printable prefix
  (`printable`) and retries with more ids, and the finish emits the rest. The deltas add up to the finished
  text, which `--incremental-streaming-output` sends piece by piece and the default repeats whole.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

from tracegen.simulator.tokens import SURROGATE_TOKENS, decode

# CJK ideograph blocks, as SGLang's `_is_chinese_char` (HF's TextStreamer) lists them.
_CJK_BLOCKS = (
    (0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F),
    (0x2B740, 0x2B81F), (0x2B820, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F),
)  # fmt: skip


def _is_cjk(char: str) -> bool:
    cp = ord(char)
    return any(lo <= cp <= hi for lo, hi in _CJK_BLOCKS)


def printable(text: str) -> str:
    """SGLang's `find_printable_text`: what a step whose text ends in U+FFFD may send, whole words only."""
    if text.endswith("\n"):
        return text
    if text and _is_cjk(text[-1]):
        return text
    if len(text) > 1 and _is_cjk(text[-2]):
        return text[:-1]
    return text[: text.rfind(" ") + 1]


def event_ends(sent: int, produced: int, interval: int, per_step: float = 1.0) -> Iterator[int]:
    """Token counts, after `sent`, at which an intermediate event is due once `produced` tokens exist.

    Events fall at the end of a decode step, which adds `per_step` tokens (the accept length with
    speculative decoding; step k ends at token floor(k * per_step), as the batching engine counts them), so
    an event may carry more than `interval` tokens, as SGLang's do."""
    while True:
        due = 1 if sent == 0 else sent + interval
        at = int(math.ceil(due / per_step - 1e-9) * per_step + 1e-9)  # the first step end at or past `due`
        if at > produced:
            return
        yield at
        sent = at


class Detokenizer:
    """One request's incremental detokenization, as SGLang's DetokenizerManager keeps it (DecodeStatus)."""

    def __init__(self, context: Sequence[int]) -> None:
        self._ids = list(context[-SURROGATE_TOKENS:]) if SURROGATE_TOKENS else []
        self._surr = 0
        self._read = len(self._ids)
        self._decoded = ""  # committed text
        self._sent = 0  # characters sent: the committed text plus any printable prefix sent after it

    def step(self, new_ids: Sequence[int], finished: bool) -> str:
        """The text an event carrying `new_ids` adds (the ids of a finish include the stop token, whose
        text is empty: special tokens are skipped)."""
        self._ids.extend(new_ids)
        surr = decode(self._ids[self._surr : self._read])
        new = decode(self._ids[self._surr :])[len(surr) :]
        if finished:
            whole = self._decoded + new
            out = whole[self._sent :]
            self._sent = len(whole)
            return out
        pending = self._sent - len(self._decoded)
        if new and not new.endswith("\ufffd"):
            self._decoded += new
            self._surr, self._read = self._read, len(self._ids)
            self._sent = len(self._decoded)
            return new[pending:]
        shown = printable(new)
        self._sent = len(self._decoded) + len(shown)
        return shown[pending:]
