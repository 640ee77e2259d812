"""A server's prefix cache, as SGLang's RadixAttention keeps one: a radix tree of token ids whose nodes hold
the KV of their tokens, the KV budget as its capacity, least-recently-used eviction of the nodes no running
request holds.

What carries over from SGLang 0.5.23 (`mem_cache/radix_cache.py`, `managers/schedule_batch.py`):
- A request matches its prompt against the tree before its prefill; at most `len(prompt) - 1` tokens match
  (`Req._compute_max_prefix_len`: the last prompt token is always computed, its logits give the first output
  token), and only whole pages (`--page-size`, 1 by default: the tree keys pages).
- The matched path is locked (`inc_lock_ref`) while the request lives, so eviction never takes a prefix in
  use; it is unlocked when the request ends (`dec_lock_ref`).
- A prefilled prompt is inserted (`cache_unfinished_req`), and a finished request's prompt and output
  (`cache_finished_req`), so the next request sharing them finds them.
- Eviction takes unreferenced leaves, least recently used first (`evict`, `lru` policy), until the tree fits;
  a parent left without children becomes a leaf it may take next.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(eq=False, slots=True)
class Node:
    key: tuple[int, ...] = ()
    parent: Node | None = None
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0


class RadixCache:
    """Token-prefix tree with `capacity` tokens of KV and LRU eviction of unlocked leaves."""

    def __init__(self, capacity: int, page_size: int = 1) -> None:
        if capacity < 0 or page_size < 1:
            raise ValueError(f"capacity must be >= 0 and page_size >= 1, got {capacity}, {page_size}")
        self.capacity = capacity
        self.page_size = page_size
        self.root = Node()
        self.root.lock_ref = 1  # the root is never evicted
        self.size = 0  # tokens held by the tree
        self.evicted = 0  # tokens evicted since start
        self._clock = itertools.count(1)

    # -- queries --------------------------------------------------------------------------------
    def _child_key(self, ids: Sequence[int], at: int) -> tuple[int, ...]:
        return tuple(ids[at : at + self.page_size])

    def match(self, ids: Sequence[int], limit: int | None = None) -> tuple[int, Node]:
        """The longest cached prefix of `ids[:limit]` in whole pages: (its length, the node it ends in).
        A node matched part-way is split, as SGLang's `_split_node` does, so the returned node ends exactly
        there and can be locked."""
        limit = len(ids) if limit is None else min(limit, len(ids))
        limit -= limit % self.page_size
        node, matched = self.root, 0
        now = next(self._clock)
        node.last_access = now
        while matched < limit:
            child = node.children.get(self._child_key(ids, matched))
            if child is None:
                break
            n = _common(child.key, ids, matched, limit)
            n -= n % self.page_size
            if n == 0:
                break
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            node, matched = child, matched + n
        return matched, node

    # -- locks ----------------------------------------------------------------------------------
    def lock(self, node: Node) -> None:
        while node is not None:
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not None:
            node.lock_ref -= 1
            node = node.parent

    # -- updates --------------------------------------------------------------------------------
    def insert(self, ids: Sequence[int], reserved: int = 0) -> Node:
        """Add `ids` (whole pages of them) to the tree; returns the node they end in. Then evicts until the
        tree fits in the capacity less `reserved` tokens of KV held outside it (running requests' outputs)."""
        end = len(ids) - len(ids) % self.page_size
        node, at = self.root, 0
        now = next(self._clock)
        while at < end:
            child = node.children.get(self._child_key(ids, at))
            if child is None:
                leaf = Node(key=tuple(ids[at:end]), parent=node, last_access=now)
                node.children[leaf.key[: self.page_size]] = leaf
                self.size += len(leaf.key)
                node = leaf
                break
            n = _common(child.key, ids, at, end)
            n -= n % self.page_size
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            node, at = child, at + n
        # The new path stays while this call's caller holds it: lock it through the eviction.
        self.lock(node)
        self.evict(self.size - max(0, self.capacity - reserved))
        self.unlock(node)
        return node

    def evict(self, tokens: int) -> int:
        """Evict at least `tokens` tokens of unlocked leaves, least recently used first (fewer if not that many
        are unlocked). Returns the tokens evicted."""
        if tokens <= 0:
            return 0
        heap = [(leaf.last_access, id(leaf), leaf) for leaf in self._leaves() if leaf.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < tokens:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[: self.page_size]]
            freed += len(leaf.key)
            if not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        self.size -= freed
        self.evicted += freed
        return freed

    # -- internals ------------------------------------------------------------------------------
    def _split(self, child: Node, n: int) -> Node:
        """Cut `child` after its first n tokens; returns the new upper node (holding child's locks)."""
        parent = child.parent
        assert parent is not None
        upper = Node(key=child.key[:n], parent=parent, lock_ref=child.lock_ref, last_access=child.last_access)
        parent.children[upper.key[: self.page_size]] = upper
        child.key = child.key[n:]
        child.parent = upper
        upper.children[child.key[: self.page_size]] = child
        return upper

    def _leaves(self) -> list[Node]:
        leaves, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root:
                leaves.append(node)
        return leaves


def _common(key: tuple[int, ...], ids: Sequence[int], at: int, end: int) -> int:
    """How many leading tokens `key` shares with `ids[at:end]`."""
    n = min(len(key), end - at)
    if tuple(ids[at : at + n]) == key[:n]:
        return n
    i = 0
    while i < n and key[i] == ids[at + i]:
        i += 1
    return i
