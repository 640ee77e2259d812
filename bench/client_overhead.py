"""Client CPU per completion: `SGLangClient.complete()` and its ledger row (`generate.rows.complete_row`) vs a bare
httpx loop, same stand-in, same process.

The stand-in runs in its own process, so this process's CPU time (time.process_time) is the client's cost.
Baselines, same bodies and concurrency, rounds interleaved so drift hits all alike: a bare httpx.AsyncClient
loop (what anyone would write first), and bare httpx transports in pools of 8 (httpx's cheapest layout; the
client itself sends on its own connections, `tracegen.sglang.connections`).
Prints the per-completion CPU of each, the ratio, and the absolute figure against the 1 ms budget.

    .venv/bin/python bench/client_overhead.py [--n 2000] [--concurrency 64] [--rounds 3] [--url URL]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "include"))

from tracegen.generate.rows import complete_row  # noqa: E402
from tracegen.sglang.client import ChatRequest, ClientConfig, Sampling, ServerEndpoint, SGLangClient  # noqa: E402

MODEL = "sim/bench"
BUDGET_MS = 1.0


def messages(i: int) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": "You are a careful coding assistant."},
        {"role": "user", "content": f"Task {i}: explain what this function does.\n" + "def f(x):\n    return x\n" * 20},
    ]


def start_stand_in(max_running: int) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, "-m", "tracegen.simulator", "--model-path", MODEL, "--port", str(port),
            "--max-running-requests", str(max_running), "--sim-time-scale", "100000", "--sim-warmup-s", "0.05",
            "--log-level", "warning"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT / "include")}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"stand-in exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    proc.kill()
    raise SystemExit("stand-in not healthy after 30 s")


async def bare_httpx(url: str, n: int, concurrency: int, max_tokens: int) -> int:
    """Baseline: what any client must do at least — encode, POST, decode JSON."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency, keepalive_expiry=4.0)
    gate = asyncio.Semaphore(concurrency)
    ok = 0
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as http:

        async def one(i: int) -> None:
            nonlocal ok
            body = {"model": MODEL, "messages": messages(i), "max_tokens": max_tokens, "temperature": 0.6,
                    "top_p": 0.95, "stream": False}  # fmt: skip
            async with gate:
                response = await http.post("/v1/chat/completions", content=json.dumps(body).encode(),
                                           headers={"Content-Type": "application/json"})  # fmt: skip
            data = json.loads(response.content)
            ok += data["choices"][0]["finish_reason"] in ("stop", "length")

        await asyncio.gather(*(one(i) for i in range(n)))
    return ok


async def bare_transport(url: str, n: int, concurrency: int, max_tokens: int) -> int:
    """Tighter baseline: httpx's cheapest layout (bare transports, pools of 8) with nothing else — no routing,
    retries or validation. client / this < 1 where the client's own connections save more than its logic costs."""
    size = 8
    pools = [
        httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=size, keepalive_expiry=4.0))
        for _ in range(-(-concurrency // size))
    ]
    free = [i % len(pools) for i in range(concurrency)]
    target = httpx.URL(url + "/v1/chat/completions")
    ok = 0

    async def one(i: int) -> None:
        nonlocal ok
        body = {"model": MODEL, "messages": messages(i), "max_tokens": max_tokens, "temperature": 0.6,
                "top_p": 0.95, "stream": False}  # fmt: skip
        request = httpx.Request("POST", target, headers={"Content-Type": "application/json"},
                                content=json.dumps(body).encode())  # fmt: skip
        async with gate:
            slot = free.pop()
            try:
                response = await pools[slot].handle_async_request(request)
                raw = await response.aread()
                await response.aclose()
            finally:
                free.append(slot)
        ok += json.loads(raw)["choices"][0]["finish_reason"] in ("stop", "length")

    gate = asyncio.Semaphore(concurrency)
    await asyncio.gather(*(one(i) for i in range(n)))
    for pool in pools:
        await pool.aclose()
    return ok


async def tracegen_client(url: str, n: int, concurrency: int, max_tokens: int) -> int:
    gate = asyncio.Semaphore(concurrency)
    sampling = Sampling(max_tokens=max_tokens)
    async with SGLangClient([ServerEndpoint(url, max_in_flight=concurrency)], ClientConfig()) as client:

        async def one(i: int) -> bool:
            async with gate:
                # The row as the engine records it: the client's answer and its conversion to a ledger row.
                request = ChatRequest(i, messages(i), sampling=sampling, model=MODEL)
                row = await complete_row(client, request, run_id="bench", chunk=0)
            return row.status == "ok"

        return sum(await asyncio.gather(*(one(i) for i in range(n))))


def measure(fn, url: str, n: int, concurrency: int, max_tokens: int) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """(CPU ms per completion, wall s) of one loop run."""
    cpu0, wall0 = time.process_time(), time.perf_counter()
    ok = asyncio.run(fn(url, n, concurrency, max_tokens))
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    if ok != n:
        raise SystemExit(f"{fn.__name__}: only {ok} of {n} completions succeeded")
    return cpu / n * 1000.0, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=2000, help="completions per round and loop")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--url", default=None, help="use this running stand-in instead of starting one")
    args = parser.parse_args()

    proc, url = (None, args.url) if args.url else start_stand_in(max_running=max(args.concurrency, 64))
    try:
        # Warm-up: imports, connection pools, the stand-in's own caches.
        measure(bare_httpx, url, 200, args.concurrency, args.max_tokens)
        measure(bare_transport, url, 200, args.concurrency, args.max_tokens)
        measure(tracegen_client, url, 200, args.concurrency, args.max_tokens)
        base, floor, ours = [], [], []
        for _ in range(args.rounds):
            base.append(measure(bare_httpx, url, args.n, args.concurrency, args.max_tokens))
            floor.append(measure(bare_transport, url, args.n, args.concurrency, args.max_tokens))
            ours.append(measure(tracegen_client, url, args.n, args.concurrency, args.max_tokens))
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()

    base_cpu = statistics.median(c for c, _ in base)
    floor_cpu = statistics.median(c for c, _ in floor)
    floor_wall = statistics.median(w for _, w in floor)
    ours_cpu = statistics.median(c for c, _ in ours)
    base_wall = statistics.median(w for _, w in base)
    ours_wall = statistics.median(w for _, w in ours)
    print(f"completions: {args.n} x {args.rounds} rounds per loop, concurrency {args.concurrency}, "
          f"max_tokens {args.max_tokens}")  # fmt: skip
    print(f"bare httpx loop   : {base_cpu:.3f} ms CPU/completion  ({args.n / base_wall:,.0f} completions/s wall)")
    print(f"bare transports   : {floor_cpu:.3f} ms CPU/completion  ({args.n / floor_wall:,.0f} completions/s wall)")
    print(f"tracegen client   : {ours_cpu:.3f} ms CPU/completion  ({args.n / ours_wall:,.0f} completions/s wall)")
    print(f"ratio client/bare httpx loop : {ours_cpu / base_cpu:.2f}x ({ours_cpu - base_cpu:+.3f} ms/completion)")
    print(f"ratio client/bare transports : {ours_cpu / floor_cpu:.2f}x ({ours_cpu - floor_cpu:+.3f} ms/completion: "
          "routing, retries, validation, row building, less what its own connections save)")  # fmt: skip
    verdict = "within" if ours_cpu < BUDGET_MS else "OVER"
    print(f"absolute          : {ours_cpu:.3f} ms CPU/completion, {verdict} the {BUDGET_MS:g} ms budget")


if __name__ == "__main__":
    main()
