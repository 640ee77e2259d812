"""Client CPU as a user pays it: the share of one core the client uses at the reference job's row rate (8.5 rows/s)
and at ten times it (85 rows/s), for a streamed row and a whole row, against bare loops in the same process.

One stand-in in its own process (so this process's CPU time, time.process_time, is the client's): reasoning parser
qwen3, streaming incrementally every --stream-interval tokens (the fleet's), rows of the reference length law (18%
past 4096) at max_tokens 16384, paced (--time-scale 10: events arrive one by one, as a GPU's do). Per row:

  tracegen streamed   `generate.watched.watched_row`, the streamed row as the chunk engine runs it (tokenize,
                      /generate streamed and watched for loops, /separate_reasoning)
  tracegen whole      `generate.rows.complete_row`: the chat route, unstreamed, its ids in the answer, as a row
  bare <lib> stream   /generate streamed from the same prompt ids, each event's line split, nothing else
  bare <lib> whole    /v1/chat/completions, its JSON decoded, nothing else

for <lib> aiohttp (what the client is built on) and httpx. Rounds interleaved so drift hits all alike; the ratio is
against the bare aiohttp loop of the same kind. Target: ≤ 25% of one core at 85 rows/s streamed.

    .venv/bin/python bench/client_overhead.py [--rows 128] [--rounds 2] [--concurrency 128]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "include"))
sys.path.insert(0, str(ROOT / "bench"))

from occupancy_support.fleet import free_port, wait_healthy  # noqa: E402

from tracegen.generate.rows import complete_row  # noqa: E402
from tracegen.generate.watched import watched_row, watching  # noqa: E402
from tracegen.sglang.client import ChatRequest, ClientConfig, Sampling, ServerEndpoint, SGLangClient  # noqa: E402

MODEL = "sim/bench"
CAP = 16_384
STREAM_INTERVAL = 256  # the fleet's (tracegen.fleet.sources)
NATURAL_PAST_4096 = 0.18  # the reference job's length law
RATES = (8.5, 85.0)  # rows a second: the reference job's, and ten times it
TARGET_SHARE = 0.25  # of one core at 85 rows/s, streamed


def messages(i: int) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": "You are a careful coding assistant."},
        {"role": "user", "content": f"Task {i}: explain what this function does.\n" + "def f(x):\n    return x\n" * 20},
    ]


def request(i: int) -> ChatRequest:
    return ChatRequest(i, messages(i), sampling=Sampling(max_tokens=CAP), model=MODEL)


def start_stand_in(max_running: int, time_scale: float) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    argv = [sys.executable, "-m", "tracegen.simulator", "--model-path", "Qwen/Qwen3.6-27B", "--served-model-name",
            MODEL, "--port", str(port), "--max-running-requests", str(max_running), "--reasoning-parser", "qwen3",
            "--context-length", "40960", "--sim-time-scale", str(time_scale), "--sim-runaway-rate", "0",
            "--sim-truncated-share", str(NATURAL_PAST_4096), "--incremental-streaming-output",
            "--stream-interval", str(STREAM_INTERVAL), "--sim-warmup-s", "0.05", "--log-level", "warning"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT / "include")}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy([proc], [url])
    except SystemExit:
        proc.kill()
        raise
    return proc, url


def _generate_body(prompt_ids: list[int], i: int) -> bytes:
    return json.dumps({"input_ids": prompt_ids, "stream": True, "rid": f"bare-{i}-{time.monotonic_ns()}",
                       "sampling_params": {"max_new_tokens": CAP, "temperature": 0.6, "sampling_seed": i}}).encode()


def _chat_body(i: int) -> bytes:
    return json.dumps({"model": MODEL, "messages": messages(i), "max_tokens": CAP, "temperature": 0.6,
                       "return_token_ids": True, "stream": False}).encode()


async def bare_aiohttp(url: str, rows: int, concurrency: int, streamed: bool, prompt_ids: list[int]) -> None:
    gate = asyncio.Semaphore(concurrency)
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession(trust_env=False, connector=aiohttp.TCPConnector(limit=0)) as session:

        async def one(i: int) -> None:
            async with gate:
                if streamed:
                    async with session.post(url + "/generate", data=_generate_body(prompt_ids, i),
                                            headers=headers) as r:
                        held = b""
                        async for piece in r.content.iter_any():
                            *lines, held = (held + piece).split(b"\n")
                else:
                    async with session.post(url + "/v1/chat/completions", data=_chat_body(i), headers=headers) as r:
                        json.loads(await r.read())

        await asyncio.gather(*(one(i) for i in range(rows)))


async def bare_httpx(url: str, rows: int, concurrency: int, streamed: bool, prompt_ids: list[int]) -> None:
    gate = asyncio.Semaphore(concurrency)
    headers = {"Content-Type": "application/json"}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency, keepalive_expiry=4.0)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600, trust_env=False) as http:

        async def one(i: int) -> None:
            async with gate:
                if streamed:
                    async with http.stream("POST", "/generate", content=_generate_body(prompt_ids, i),
                                           headers=headers) as r:
                        held = b""
                        async for piece in r.aiter_raw():
                            *lines, held = (held + piece).split(b"\n")
                else:
                    json.loads((await http.post("/v1/chat/completions", content=_chat_body(i), headers=headers)).content)

        await asyncio.gather(*(one(i) for i in range(rows)))


async def tracegen(url: str, rows: int, concurrency: int, streamed: bool, prompt_ids: list[int]) -> None:
    gate = asyncio.Semaphore(concurrency)
    async with SGLangClient([ServerEndpoint(url, max_in_flight=concurrency)], ClientConfig()) as client:
        parsers = await watching(client, True)
        if parsers is None:
            raise SystemExit("the stand-in does not stream incrementally")

        async def one(i: int) -> None:
            async with gate:
                if streamed:
                    row = await watched_row(client, request(i), parsers, run_id="bench", chunk=0, category=None)
                else:
                    row = await complete_row(client, request(i), run_id="bench", chunk=0)
            if row.status != "ok":
                raise SystemExit(f"row {i}: {row.status} {row.error}")

        await asyncio.gather(*(one(i) for i in range(rows)))


def measure(fn, url: str, rows: int, concurrency: int, streamed: bool, prompt_ids: list[int]) -> float:  # type: ignore[no-untyped-def]
    """CPU seconds per row of one run."""
    cpu0 = time.process_time()
    asyncio.run(fn(url, rows, concurrency, streamed, prompt_ids))
    return (time.process_time() - cpu0) / rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=128, help="rows per run")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--time-scale", type=float, default=10.0)
    args = parser.parse_args()
    loops = {"tracegen": tracegen, "bare aiohttp": bare_aiohttp, "bare httpx": bare_httpx}
    proc, url = start_stand_in(max(args.concurrency, 64), args.time_scale)
    try:
        prompt_ids = httpx.post(url + "/v1/tokenize", json={"model": MODEL, "messages": messages(0)},
                                timeout=30, trust_env=False).json()["tokens"]
        for fn in loops.values():  # warm-up: imports, connections, the stand-in's caches
            for streamed in (True, False):
                measure(fn, url, 8, 8, streamed, prompt_ids)
        cpu: dict[tuple[str, bool], list[float]] = {(name, s): [] for name in loops for s in (True, False)}
        for _ in range(args.rounds):
            for streamed in (True, False):
                for name, fn in loops.items():
                    cpu[name, streamed].append(measure(fn, url, args.rows, args.concurrency, streamed, prompt_ids))
    finally:
        proc.kill()
        proc.wait()

    print(f"{args.rows} rows x {args.rounds} rounds per loop, concurrency {args.concurrency}, max_tokens {CAP}, "
          f"stream interval {STREAM_INTERVAL}, time scale {args.time_scale:g}")
    print(f"{'loop':<26}{'CPU ms/row':>11}{'core at 8.5/s':>15}{'core at 85/s':>14}{'÷ bare aiohttp':>16}")
    for streamed in (True, False):
        kind = "stream" if streamed else "whole"
        base = statistics.median(cpu["bare aiohttp", streamed])
        for name in loops:
            per_row = statistics.median(cpu[name, streamed])
            shares = "".join(f"{per_row * rate:>14.1%}" for rate in RATES)
            print(f"{name + ' ' + kind:<26}{per_row * 1000:>11.2f}{shares}{per_row / base:>15.2f}x")
    streamed_share = statistics.median(cpu["tracegen", True]) * RATES[1]
    verdict = "met" if streamed_share <= TARGET_SHARE else "NOT met"
    print(f"target: streamed rows at {RATES[1]:g}/s use ≤ {TARGET_SHARE:.0%} of one core: {verdict} "
          f"({streamed_share:.1%})")


if __name__ == "__main__":
    main()
