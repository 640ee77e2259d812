"""Prefill paid once: agentic conversations on one stand-in fleet, routed least-outstanding and by prefix affinity.

A fleet of SGLang stand-ins runs in this process (each with its prefill rate, chunked prefill and radix cache:
`tracegen.simulator.batching`, `radix_cache`), started afresh for each routing so both begin with empty caches.
The workload is `tracegen.simulator.workloads.agentic_conversations`: conversations sharing one system prompt and tool set,
each read one prompt row per assistant turn (`turns=each`), sent in row order as a chunk sends them, through
tracegen's own client (`SGLangClient.generate`, its routing `ClientConfig.routing`), as many in flight as the
fleet has slots. Measured:

- prefill computed: prompt tokens the servers computed (their `prefill_tokens_computed`), against the distinct
  prefix tokens, the physical limit: every distinct prefix of the prompts computed once, and the prefix every
  conversation shares once more on each other server that served a request;
- kept rows per fleet-second: rows that finished by themselves (not cut at the cap) per simulated second of the
  whole fleet, from the first request to the last answer;
- what prefill cost as the report and `status` say it: the answers' prompt tokens sent, found cached (each
  answer's `cached_tokens`) and computed, summed by the report's own account (`audit.token_account.prefill_account`),
  beside the servers' own count of the tokens they computed: the two agree when no request failed.

    PYTHONPATH=include .venv/bin/python bench/prefill.py [--servers 4] [--conversations 40] [--seed 0]

The last line: `prefill computed / distinct prefix tokens: X (least-outstanding routing: Y); kept rows per
fleet-second: Z x` (Z: prefix routing's kept rows per fleet-second over least-outstanding's).
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "include"))
sys.path.insert(0, str(ROOT / "tests"))

import pandas as pd  # noqa: E402
from aiohttp import web  # noqa: E402
from fixtures.ports import free_port  # noqa: E402

from tracegen.audit.token_account import prefill_account, prefill_line  # noqa: E402
from tracegen.sglang.affinity import prefix_key  # noqa: E402
from tracegen.sglang.client import SGLangClient  # noqa: E402
from tracegen.sglang.routing import ServerEndpoint  # noqa: E402
from tracegen.sglang.settings import ClientConfig, Sampling  # noqa: E402
from tracegen.simulator.http_server import build_app, build_state  # noqa: E402
from tracegen.simulator.launch_args import parse_args  # noqa: E402
from tracegen.simulator.radix_cache import RadixCache  # noqa: E402
from tracegen.simulator.state import State  # noqa: E402
from tracegen.simulator.workloads import PromptRow, Workload, agentic_conversations, prompt_rows  # noqa: E402
from tracegen.store.records import OK  # noqa: E402

MODEL = "qwen3.6-27b-sim"


@dataclass
class Result:
    routing: str
    rows: int
    kept: int
    failed: int
    sim_seconds: float
    computed: int
    cached: int
    servers_used: int
    cpu_share: float
    prefill: dict  # the answers' prompt tokens as the report accounts for them (`prefill_account`)

    def kept_per_fleet_second(self, servers: int) -> float:
        return self.kept / (self.sim_seconds * servers)


async def start_fleet(n: int, args: argparse.Namespace) -> tuple[list[State], list[web.AppRunner], list[str]]:
    states, runners, urls = [], [], []
    for _ in range(n):
        port = free_port()
        argv = ["--model-path", "Qwen/Qwen3.6-27B", "--served-model-name", MODEL, "--port", str(port),
                "--max-running-requests", str(args.max_running), "--context-length", "131072",
                "--max-total-tokens", str(args.kv_tokens), "--sim-length-model", args.length_model,
                "--sim-time-scale", str(args.time_scale), "--sim-seed", str(args.seed),
                "--log-level", "warning"]  # fmt: skip
        state = build_state(parse_args(argv))
        runner = web.AppRunner(build_app(state), access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        state.warm = True
        state.batcher.start_accounting()
        states.append(state)
        runners.append(runner)
        urls.append(f"http://127.0.0.1:{port}")
    return states, runners, urls


async def run(routing: str, rows: list[PromptRow], keys: dict[str, str], args: argparse.Namespace) -> Result:
    states, runners, urls = await start_fleet(args.servers, args)
    config = ClientConfig(routing=routing, routing_load_factor=args.load_factor, routing_load_slack=args.slack,
                          max_attempts=2, request_deadline_s=600.0)
    endpoints = [ServerEndpoint(url, max_in_flight=args.in_flight) for url in urls]
    sampling = Sampling(max_tokens=args.cap)
    kept = failed = 0
    answers: list[tuple[int, int | None]] = []  # each answer's prompt tokens and those it found cached
    cpu0, loop = time.process_time(), asyncio.get_running_loop()
    t0 = loop.time()
    async with SGLangClient(endpoints, config) as client:
        slots = asyncio.Semaphore(client.capacity)

        async def one(row: PromptRow) -> None:
            nonlocal kept, failed
            try:
                out = await client.generate(row.ids, max_new_tokens=args.cap, sampling=sampling,
                                            affinity=keys[row.conversation])
            finally:
                slots.release()
            if out.value is None:
                failed += 1
                return
            answers.append((out.value.prompt_tokens, out.value.cached_tokens))
            if out.value.finish_reason == "stop":
                kept += 1

        tasks = []
        for row in rows:  # in row order, as a chunk sends them; as many in flight as the fleet has slots
            await slots.acquire()
            tasks.append(asyncio.create_task(one(row)))
        await asyncio.gather(*tasks)
    wall = loop.time() - t0
    cpu = time.process_time() - cpu0
    engines = [s.batcher.engine for s in states]
    result = Result(routing, len(rows), kept, failed, wall * args.time_scale,
                    sum(e.prompt_tokens_computed for e in engines), sum(e.prompt_tokens_cached for e in engines),
                    sum(1 for e in engines if e.finished_count), cpu / wall, prefill_of(answers))  # fmt: skip
    for runner in runners:
        await runner.cleanup()
    return result


def prefill_of(answers: list[tuple[int, int | None]]) -> dict:
    """The answers as the ledger would hold them (each its own row, no prefix of an earlier row), accounted
    for as the report accounts for the ledger."""
    sent, cached = zip(*answers, strict=True) if answers else ((), ())
    return prefill_account(pd.DataFrame({"status": OK, "prompt_tokens": list(sent), "prefix_tokens": 0,
                                         "cached_tokens": pd.Series(cached, dtype="float64")}))


def distinct_prefix_tokens(rows: list[PromptRow], shared: int, servers_used: int) -> int:
    """Every distinct prefix of the prompts once, and the prefix all conversations share once per other server."""
    trie = RadixCache(capacity=1 << 62)
    for row in rows:
        trie.insert(row.ids)
    return trie.size + (servers_used - 1) * shared


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--servers", type=int, default=4)
    ap.add_argument("--conversations", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-running", type=int, default=32)
    ap.add_argument("--in-flight", type=int, default=None,
                    help="requests in flight per server (default: twice --max-running, the full batch and the "
                    "queue behind it that tracegen's autotune keeps)")
    ap.add_argument("--load-factor", type=float, default=ClientConfig().routing_load_factor)
    ap.add_argument("--slack", type=float, default=ClientConfig().routing_load_slack,
                    help="routing_load_slack: a share of the servers' in-flight limit")
    ap.add_argument("--kv-tokens", type=int, default=1_000_000, help="each server's KV budget (--max-total-tokens)")
    ap.add_argument("--cap", type=int, default=4096)
    ap.add_argument("--length-model", default="lognormal:800:0.9", help="--sim-length-model of the servers")
    ap.add_argument("--time-scale", type=float, default=20.0)
    args = ap.parse_args()
    args.in_flight = args.in_flight or 2 * args.max_running

    workload: Workload = agentic_conversations(args.conversations, args.seed)
    rows = list(prompt_rows(workload))
    keys = {row["id"]: prefix_key(row["messages"], row["tools"]) for row in workload.rows}
    prompt_tokens = sum(len(r.ids) for r in rows)
    print(f"workload: {args.conversations} conversations (seed {args.seed}), {len(rows)} prompt rows, "
          f"{prompt_tokens:,} prompt tokens (mean {prompt_tokens / len(rows):,.0f}), shared prefix "
          f"{workload.shared_tokens:,} tokens; fleet: {args.servers} stand-ins x {args.max_running} slots "
          f"({args.in_flight} in flight), "
          f"KV {args.kv_tokens:,} tokens each, cap {args.cap}, lengths {args.length_model}, "
          f"time scale {args.time_scale:g}")  # fmt: skip
    results = {}
    for routing in ("least_outstanding", "prefix"):
        r = asyncio.run(run(routing, rows, keys, args))
        results[routing] = r
        distinct = distinct_prefix_tokens(rows, workload.shared_tokens, r.servers_used)
        print(f"{routing:>17}: {r.kept}/{r.rows} rows kept, {r.failed} failed, {r.sim_seconds:,.0f} simulated s; "
              f"prompt tokens computed {r.computed:,}, found cached {r.cached:,}; computed / distinct "
              f"{r.computed / distinct:.2f} (distinct {distinct:,}); kept rows per fleet-second "
              f"{r.kept_per_fleet_second(args.servers):.4f}; this process's CPU {r.cpu_share:.0%} of wall "
              f"(peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB)")  # fmt: skip
        print(f"{'':>17}  prefill as the report says it: {prefill_line({'prefill': r.prefill})}; the servers "
              f"computed {r.computed:,}")  # fmt: skip
    old, new = results["least_outstanding"], results["prefix"]
    x = new.computed / distinct_prefix_tokens(rows, workload.shared_tokens, new.servers_used)
    y = old.computed / distinct_prefix_tokens(rows, workload.shared_tokens, old.servers_used)
    z = new.kept_per_fleet_second(args.servers) / old.kept_per_fleet_second(args.servers)
    print(f"prefill computed / distinct prefix tokens: {x:.2f} (least-outstanding routing: {y:.2f}); "
          f"kept rows per fleet-second: {z:.2f} x")


if __name__ == "__main__":
    main()
