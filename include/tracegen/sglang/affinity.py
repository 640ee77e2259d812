"""Which server a prompt's prefix prefers: the one likely to hold it in its radix cache.

A server computes a shared prefix once and keeps it while it is used (SGLang's RadixAttention), so the turns
of one conversation should go where its earlier turns went. The prefix a conversation's prompts share is named
by `prefix_key`: the tools and the messages up to the first user message (a conversation's opening, the same
in every one of its prompt rows under `turns=each`, different between conversations that share only a system
prompt, which every server computes once anyway).

The key is placed with consistent hashing with bounded loads (Mirrokni, Thorup and Zadimoghaddam, "Consistent
Hashing with Bounded Loads", 2018): each server holds `VIRTUAL_NODES` points on a ring, a key goes to the first
server clockwise from its own point that has room and carries at most `load_factor` times the fleet's average
of requests in flight, so no server idles while another overflows; a server joining or leaving the ring moves
only the keys next to its points. At low load that bound alone would scatter a conversation whose turns are in
flight together, so a server may also carry up to `slack` requests more than the least loaded one (sglang-router's
cache-aware policy keeps affinity the same way until loads differ by an absolute threshold).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

VIRTUAL_NODES = 64
S = TypeVar("S")


def _point(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def prefix_key(messages: Sequence[Any], tools: Sequence[Any] | None = None) -> str:
    """The conversation's opening: tools and messages up to the first user message, as one hashable text."""
    opening: list[Any] = []
    for message in messages:
        opening.append(message)
        if isinstance(message, dict) and message.get("role") == "user":
            break
    return json.dumps([tools or [], opening], sort_keys=True, ensure_ascii=False, default=str)


class PrefixRing:
    """The servers on a hash ring, by name; `choose` places a key under the load bound."""

    def __init__(self, names: Sequence[str], load_factor: float = 1.25) -> None:
        if load_factor < 1:
            raise ValueError(f"load_factor must be >= 1, got {load_factor}")
        self.load_factor = load_factor
        ring = sorted((_point(f"{name}#{v}"), k) for k, name in enumerate(names) for v in range(VIRTUAL_NODES))
        self._points = [p for p, _ in ring]
        self._owners = [k for _, k in ring]

    def choose(
        self, key: str, servers: Sequence[S], load: Callable[[S], int], usable: Callable[[S], bool], slack: int = 0
    ) -> S | None:
        """The first usable server clockwise from `key` whose load stays within the bound (the fleet's load with
        this request, averaged over the usable servers, times the load factor, rounded up; or the least load
        plus the slack, whichever is more); None if no usable server is under it."""
        candidates = [s for s in servers if usable(s)]
        if not candidates:
            return None
        loads = [load(s) for s in candidates]
        bound = max(math.ceil(self.load_factor * (sum(loads) + 1) / len(candidates)), min(loads) + slack)
        start = bisect.bisect(self._points, _point(key))
        seen: set[int] = set()
        for i in range(len(self._points)):
            k = self._owners[(start + i) % len(self._points)]
            if k in seen:
                continue
            seen.add(k)
            server = servers[k]
            if usable(server) and load(server) < bound:
                return server
            if len(seen) == len(servers):
                break
        return None
