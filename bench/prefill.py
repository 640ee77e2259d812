"""Prefill paid once: agentic conversations on one stand-in fleet, routed least-outstanding and by prefix affinity
(and, with --router, by sglang-router's cache_aware policy in front of the fleet).

A fleet of SGLang stand-ins runs in this process (each with its prefill rate, chunked prefill and radix cache:
`tracegen.simulator.batching`, `radix_cache`), started afresh for each routing so each begins with empty caches.
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

With `--router`, a third arm: the same fleet started afresh behind sglang-router (`python -m
sglang_router.launch_router --policy cache_aware`, a process of its own), tracegen's client sending every
request to the router's one URL with the whole fleet's in-flight limit, so the router alone picks the server.
The requests are the same `/generate` bodies with the rows' `input_ids`: cache_aware matches a `/generate`
request on its `text`, or, without one, on its `input_ids` written as decimal numbers joined by spaces, in a
character tree of what it sent to each server (sglang-router's `GenerateRequest::extract_text_for_routing`),
so a prompt that extends an earlier one matches it as far as the ids agree, as the servers' radix caches do.
The servers' own counters measure the arm as they measure the others. sglang-router is the `bench` extra
(requirements-bench.txt), kept out of the suite's venv: install it into a venv of its own and name that
interpreter with --router-python.

    PYTHONPATH=include .venv/bin/python bench/prefill.py [--servers 4] [--conversations 40] [--seed 0]
        [--router [--router-python /path/to/venv/bin/python] [--router-args "--cache-threshold 0.5"]]

The last line: `prefill computed / distinct prefix tokens: X (least-outstanding routing: Y); kept rows per
fleet-second: Z x` (Z: prefix routing's kept rows per fleet-second over least-outstanding's); with --router,
`X (least-outstanding routing: Y; sglang-router cache_aware: W); kept rows per fleet-second: Z x (router: V x)`
(V: the router's kept rows per fleet-second over least-outstanding's).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "include"))
sys.path.insert(0, str(ROOT / "tests"))

import pandas as pd  # noqa: E402
from aiohttp import ClientError, ClientSession, web  # noqa: E402
from aiohttp.http_exceptions import BadHttpMessage  # noqa: E402
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
ROUTER = "cache_aware"  # the router arm's name in the results
# The stand-in's tokenizer, which the router loads for its own routes (without it, it would fetch the served
# model's from the Hugging Face hub); cache_aware's matching does not use it.
TOKENIZER = ROOT / "include" / "tracegen" / "simulator" / "tokenizer"
INSTALL = ("sglang-router is not importable by {python}: install it into a venv of its own, e.g. "
           "`python3.11 -m venv /tmp/router && /tmp/router/bin/pip install -r requirements-bench.txt`, then pass "
           "--router-python /tmp/router/bin/python")


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
    router_cpu_share: float | None = None  # the router process's CPU over the arm's wall time
    per_server: tuple[int, ...] = ()  # the requests each server finished: how evenly the routing spread them

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


class _NoHttp2Probe(logging.Filter):
    """sglang-router opens each worker with an HTTP/2 preface (how it tells a gRPC worker from an HTTP one) before
    it speaks HTTP/1.1 to it; the stand-in's aiohttp logs every such preface as a bad request."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (isinstance(exc, BadHttpMessage) and "PRI" in str(exc))


def cpu_seconds(pid: int) -> float:
    """A live process's user + system CPU so far (Linux's /proc), its start-up included."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def router_missing(python: str) -> str | None:
    """Why `python` cannot run sglang-router, or None."""
    out = subprocess.run([python, "-c", "import sglang_router.launch_router"], capture_output=True, text=True)
    return None if out.returncode == 0 else INSTALL.format(python=python)


async def start_router(urls: list[str], args: argparse.Namespace, log) -> tuple[asyncio.subprocess.Process, str]:
    """sglang-router with the cache_aware policy in front of `urls`, on loopback; returns once it is ready."""
    port, metrics = free_port(), free_port()
    argv = [args.router_python, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", *urls, "--policy", "cache_aware", "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(metrics), "--tokenizer-path", str(TOKENIZER), "--log-level", "warn",
            *shlex.split(args.router_args)]  # fmt: skip
    proc = await asyncio.create_subprocess_exec(*argv, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    async with ClientSession() as http:
        while time.monotonic() < deadline:
            if proc.returncode is not None:
                break
            try:
                async with http.get(f"{url}/readiness") as resp:
                    if resp.status == 200:
                        return proc, url
            except ClientError:
                pass
            await asyncio.sleep(0.2)
    if proc.returncode is None:
        proc.terminate()
        await proc.wait()
    log.seek(0)
    raise SystemExit(f"sglang-router did not become ready (exit {proc.returncode}): {' '.join(argv)}\n"
                     + log.read().decode(errors="replace")[-3000:])


async def run(routing: str, rows: list[PromptRow], keys: dict[str, str], args: argparse.Namespace) -> Result:
    states, runners, urls = await start_fleet(args.servers, args)
    router, log = None, None
    if routing == ROUTER:
        # One endpoint, the router, with the whole fleet's slots: tracegen's client routes nothing itself.
        log = tempfile.TemporaryFile()
        router, url = await start_router(urls, args, log)
        router_cpu0 = cpu_seconds(router.pid)
        config = ClientConfig(max_attempts=2, request_deadline_s=600.0)
        endpoints = [ServerEndpoint(url, max_in_flight=args.servers * args.in_flight)]
    else:
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
                                            affinity=None if router else keys[row.conversation])
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
    router_cpu = None if router is None else (cpu_seconds(router.pid) - router_cpu0) / wall
    engines = [s.batcher.engine for s in states]
    result = Result(routing, len(rows), kept, failed, wall * args.time_scale,
                    sum(e.prompt_tokens_computed for e in engines), sum(e.prompt_tokens_cached for e in engines),
                    sum(1 for e in engines if e.finished_count), cpu / wall, prefill_of(answers), router_cpu,
                    tuple(e.finished_count for e in engines))  # fmt: skip
    if router is not None:
        router.terminate()
        await router.wait()
        log.close()
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
    ap.add_argument("--router", action="store_true",
                    help="a third arm: sglang-router's cache_aware policy in front of the fleet (requirements-bench.txt)")
    ap.add_argument("--router-python", default=sys.executable,
                    help="the interpreter that runs `-m sglang_router.launch_router` (default: this one)")
    ap.add_argument("--router-args", default="",
                    help="more of the router's flags, e.g. \"--cache-threshold 0.5 --balance-abs-threshold 32\" "
                    "(default: its own defaults)")
    args = ap.parse_args()
    args.in_flight = args.in_flight or 2 * args.max_running
    if args.router and (why := router_missing(args.router_python)):
        ap.exit(2, why + "\n")
    logging.getLogger("aiohttp.server").addFilter(_NoHttp2Probe())

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
    for routing in ("least_outstanding", "prefix", *([ROUTER] if args.router else [])):
        r = asyncio.run(run(routing, rows, keys, args))
        results[routing] = r
        distinct = distinct_prefix_tokens(rows, workload.shared_tokens, r.servers_used)
        label = "cache_aware (sglang-router)" if routing == ROUTER else routing
        router_cpu = "" if r.router_cpu_share is None else f", the router's {r.router_cpu_share:.0%}"
        print(f"{label:>17}: {r.kept}/{r.rows} rows kept, {r.failed} failed, {r.sim_seconds:,.0f} simulated s, "
              f"rows a server {'/'.join(map(str, r.per_server))}; "
              f"prompt tokens computed {r.computed:,}, found cached {r.cached:,}; computed / distinct "
              f"{r.computed / distinct:.2f} (distinct {distinct:,}); kept rows per fleet-second "
              f"{r.kept_per_fleet_second(args.servers):.4f}; this process's CPU {r.cpu_share:.0%} of wall"
              f"{router_cpu} (peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB)")  # fmt: skip
        print(f"{'':>17}  prefill as the report says it: {prefill_line({'prefill': r.prefill})}; the servers "
              f"computed {r.computed:,}")  # fmt: skip
    def over_distinct(r: Result) -> float:
        return r.computed / distinct_prefix_tokens(rows, workload.shared_tokens, r.servers_used)

    def over_least_outstanding(r: Result) -> float:
        return r.kept_per_fleet_second(args.servers) / old.kept_per_fleet_second(args.servers)

    old, new = results["least_outstanding"], results["prefix"]
    x, y, z = over_distinct(new), over_distinct(old), over_least_outstanding(new)
    if not args.router:
        print(f"prefill computed / distinct prefix tokens: {x:.2f} (least-outstanding routing: {y:.2f}); "
              f"kept rows per fleet-second: {z:.2f} x")
        return
    w, v = over_distinct(results[ROUTER]), over_least_outstanding(results[ROUTER])
    print(f"prefill computed / distinct prefix tokens: {x:.2f} (least-outstanding routing: {y:.2f}; sglang-router "
          f"cache_aware: {w:.2f}); kept rows per fleet-second: {z:.2f} x (router: {v:.2f} x)")


if __name__ == "__main__":
    main()
