"""Prefix affinity: a conversation's prompts go to one server, within the load bound; without a key, or over
the bound, the least-outstanding server."""

from __future__ import annotations

import asyncio

from tracegen.sglang.affinity import PrefixRing, prefix_key
from tracegen.sglang.routing import ServerEndpoint, ServerPool
from tracegen.sglang.settings import ClientConfig

SYSTEM = {"role": "system", "content": "You are a coding agent."}


def test_the_key_is_the_conversations_opening():
    first = [SYSTEM, {"role": "user", "content": "fix the parser"}]
    later = [*first, {"role": "assistant", "content": "done"}, {"role": "user", "content": "and the tests"}]
    other = [SYSTEM, {"role": "user", "content": "fix the lexer"}]
    assert prefix_key(first) == prefix_key(later) != prefix_key(other)
    assert prefix_key(first, [{"type": "function"}]) != prefix_key(first)


def test_keys_spread_over_the_ring_and_stay_within_the_bound():
    ring = PrefixRing([f"http://s{k}" for k in range(4)])
    servers = list(range(4))
    loads = [0, 0, 0, 0]
    homes = {ring.choose(f"conversation {i}", servers, lambda s: 0, lambda s: True) for i in range(200)}
    assert homes == set(servers)  # 200 keys reach every one of 4 servers
    for _ in range(400):  # one hot key: it fills its home up to the bound, then the next servers clockwise
        chosen = ring.choose("hot", servers, lambda s: loads[s], lambda s: True)
        loads[chosen] += 1
    assert max(loads) <= 1.25 * sum(loads) / 4 + 1


async def _route(routing: str) -> list[str]:
    config = ClientConfig(routing=routing)
    pool = ServerPool([ServerEndpoint(f"http://127.0.0.1:{9000 + k}", max_in_flight=8) for k in range(3)], config)
    try:
        chosen = []
        for _ in range(4):
            server = await pool.acquire(key="conversation 7")
            chosen.append(server.url)
        return chosen
    finally:
        await pool.aclose()


def test_a_key_keeps_its_server_and_least_outstanding_spreads():
    assert len(set(asyncio.run(_route("prefix")))) == 1  # 4 in flight: within the slack, 1.5 x the limit of 8
    assert len(set(asyncio.run(_route("least_outstanding")))) == 3
