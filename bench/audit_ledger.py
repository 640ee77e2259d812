"""Benchmark: audit 1,000,000 ledger rows, against the reference job's way of reading completion JSONL.

The reference job's analysis read every completion (thinking trace and answer included) line by line with
``json.loads`` and computed the statistics in Python. Here the audit reads only the ledger frame. Both run in
this process; the baseline runs on ``--baseline-rows`` completions (full text at ~4 characters per token) and
is extrapolated linearly to ``--rows``, since a million full completions would be ~10 GB of JSONL.

    .venv/bin/python bench/audit_ledger.py [--rows 1000000] [--baseline-rows 5000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

from tracegen.audit.capfit import cap_table
from tracegen.audit.length_fit import fit_lengths
from tracegen.audit.stats import audit, censoring_arrays


def synthetic_ledger(n: int, seed: int = 0) -> pd.DataFrame:
    """n ledger rows shaped like a pivoted run: 4096 rows, 5% regenerated at 8192, 1% failed attempts."""
    rng = np.random.default_rng(seed)
    n_first = int(n / 1.06)
    index = np.arange(n_first)
    regen = rng.choice(n_first, n - n_first - n // 100, replace=False)
    failed = rng.choice(n_first, n // 100, replace=False)
    idx = np.concatenate([index, regen, failed])
    cap = np.concatenate([np.full(n_first, 4096), np.full(regen.size, 8192), np.full(failed.size, 8192)])
    natural = np.ceil(np.exp(rng.normal(np.log(2300), 0.63, n_first))).astype(np.int64)[idx]
    status = np.full(idx.size, "ok", dtype=object)
    status[n_first + regen.size:] = "failed"
    ok = status == "ok"
    finish = np.where(natural > cap, "length", "stop").astype(object)
    finish[~ok] = None
    tokens = np.where(ok, np.minimum(natural, cap), 0)
    servers = np.array([f"http://127.0.0.1:{30000 + g}" for g in range(7)], dtype=object)
    cats = np.array(["bugfix", "refactor", "tool-use", "explain", None], dtype=object)
    part = np.arange(idx.size) // 500
    return pd.DataFrame({
        "index": idx, "status": status, "finish_reason": finish, "prompt_tokens": rng.integers(200, 30000, idx.size),
        "completion_tokens": tokens, "reasoning_tokens": (tokens * rng.uniform(0.55, 0.92, idx.size)).astype(np.int64),
        "cut_in_reasoning": (finish == "length") & (rng.random(idx.size) < 0.7), "max_tokens": cap,
        "run_id": np.where(cap == 4096, "run-4096", "run-8192").astype(object), "chunk": idx // 2000,
        "attempt": np.where(ok, 1, 5), "server": servers[rng.integers(0, 7, idx.size)],
        "latency_s": tokens / 40.0 + rng.uniform(0.1, 2.0, idx.size), "category": cats[rng.integers(0, 5, idx.size)],
        "error": np.where(ok, None, "HTTP 503: Service Unavailable").astype(object),
        "part": [f"parts/c{p:07d}" for p in part], "committed_at": [f"2026-05-01T{p // 3600 % 24:02d}:{p // 60 % 60:02d}:"
                                                                    f"{p % 60:02d}" for p in part],
    })


def write_completions(path: Path, n: int, seed: int = 1) -> None:
    """Full completion rows as the reference job's generator wrote them (text included)."""
    rng = np.random.default_rng(seed)
    lengths = np.ceil(np.exp(rng.normal(np.log(2300), 0.63, n))).astype(int)
    words = "the function returns none when the list is empty so we check the index first ".split()
    with path.open("w") as fh:
        for i, natural in enumerate(lengths):
            tokens = min(int(natural), 4096)
            think = int(tokens * 0.75)
            reasoning = " ".join(words[(i + k) % len(words)] for k in range(think))
            content = " ".join(words[(i + k) % len(words)] for k in range(tokens - think))
            fh.write(json.dumps({
                "index": i, "id": f"chatcmpl-{i}", "reasoning_content": reasoning, "content": content,
                "finish_reason": "length" if natural > 4096 else "stop",
                "usage": {"prompt_tokens": 800, "completion_tokens": tokens},
            }) + "\n")


def seed_analysis(path: Path) -> dict:
    """The hand analysis: parse every line, collect lengths and finish reasons, compute the numbers."""
    lengths, reasons = [], {}
    with path.open() as fh:
        for line in fh:
            row = json.loads(line)
            lengths.append(row["usage"]["completion_tokens"])
            reasons[row["finish_reason"]] = reasons.get(row["finish_reason"], 0) + 1
    ordered = sorted(lengths)
    return {
        "mean": statistics.fmean(lengths), "median": statistics.median(lengths),
        "p90": ordered[int(0.9 * (len(ordered) - 1))], "p99": ordered[int(0.99 * (len(ordered) - 1))],
        "max": ordered[-1], "reasons": reasons,
        "buckets": {edge: sum(1 for x in lengths if x < edge) for edge in (100, 500, 2000, 3000)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--baseline-rows", type=int, default=5000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    frame = synthetic_ledger(args.rows)
    audit(frame.head(1000), 8192)  # warm up imports and code paths
    times = []
    for _ in range(args.repeat):
        t = time.perf_counter()
        result = audit(frame, 8192)
        times.append(time.perf_counter() - t)
    t_audit = min(times)

    with tempfile.TemporaryDirectory() as tmp:
        pq = Path(tmp) / "ledger.parquet"
        frame.to_parquet(pq)
        t = time.perf_counter()
        audit(pd.read_parquet(pq), 8192)
        t_read_audit = time.perf_counter() - t

        t = time.perf_counter()
        fit = fit_lengths(*censoring_arrays(frame))
        cap_table(fit, 8192)
        t_fit = time.perf_counter() - t

        jsonl = Path(tmp) / "completions.jsonl"
        write_completions(jsonl, args.baseline_rows)
        size = os.path.getsize(jsonl)
        t = time.perf_counter()
        seed_analysis(jsonl)
        t_base = time.perf_counter() - t
    t_base_full = t_base * args.rows / args.baseline_rows

    print(f"ledger rows: {len(frame):,} ({result.rows['indices']:,} indices, "
          f"{result.rows['superseded_rows']:,} superseded); truncated {result.truncation['rate']:.1%}")
    print(f"audit (in-memory frame), best of {args.repeat}: {t_audit:.2f} s  (target < 3 s)")
    print(f"audit incl. reading the ledger from Parquet: {t_read_audit:.2f} s")
    print(f"censored fit + cap table (200 bootstrap replicates): {t_fit:.2f} s")
    print(f"reference-job-style JSONL analysis: {t_base:.2f} s for {args.baseline_rows:,} completions "
          f"({size / args.baseline_rows / 1024:.1f} KiB each) -> {t_base_full:.1f} s extrapolated to {args.rows:,}")
    print(f"ratio (reference-job-style JSONL / ledger audit): {t_base_full / t_audit:.0f}x")


if __name__ == "__main__":
    main()
