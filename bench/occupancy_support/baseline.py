"""The reference job's way, as a baseline: one asyncio script, a fixed semaphore over all servers, round-robin,
results appended to a JSONL file and the done indices to a text file (no ledger, no parts, no pilot).

    python baseline.py DATASET.jsonl OUT_DIR MAX_TOKENS CONCURRENCY URL [URL ...]
"""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
import time
from pathlib import Path

import httpx

MODEL = "qwen3.6-27b-sim"


async def main(dataset: str, out_dir: str, max_tokens: int, concurrency: int, urls: list[str]) -> dict:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = [json.loads(line) for line in open(dataset)]
    sem = asyncio.Semaphore(concurrency)
    servers = itertools.cycle(urls)
    limits = httpx.Limits(
        max_connections=concurrency, max_keepalive_connections=concurrency, keepalive_expiry=4
    )
    tokens = 0
    started = time.time()
    with open(out / "completions.jsonl", "w") as results, open(out / ".done_indices", "w") as done:
        async with httpx.AsyncClient(limits=limits, timeout=1800) as client:

            async def one(i: int, row: dict) -> None:
                nonlocal tokens
                async with sem:
                    url = next(servers)
                    for _ in range(5):
                        try:
                            r = await client.post(url + "/v1/chat/completions", json={
                                "model": MODEL, "messages": row["messages"], "max_tokens": max_tokens,
                                "temperature": 0.6, "top_p": 0.95})  # fmt: skip
                            if r.status_code == 200:
                                break
                        except httpx.TransportError:
                            pass
                        await asyncio.sleep(1)
                    body = r.json()
                    tokens += body["usage"]["completion_tokens"]
                    results.write(json.dumps({"index": i, **body}) + "\n")
                    done.write(f"{i}\n")

            # The reference job created every request task up front and let the semaphore meter them.
            await asyncio.gather(*(one(i, row) for i, row in enumerate(rows)))
    return {"started": started, "ended": time.time(), "rows": len(rows), "completion_tokens": tokens}


if __name__ == "__main__":
    a = sys.argv[1:]
    result = asyncio.run(main(a[0], a[1], int(a[2]), int(a[3]), a[4:]))
    print(json.dumps(result))
