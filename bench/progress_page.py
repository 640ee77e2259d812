"""Benchmark: the live progress page (bar, figures and the run's charts) rendered from a 913,786-row ledger.

The root: one run at 4096 that has been generating for 30 hours on 8 servers (one stalled for 3 hours, one
quarantined for the last 10), its truncation drifting from 2% to 4%, a few rows stopped in a loop, in ledger
entries of 500 rows (1,828 entries) folded into a Parquet snapshot as a long run's planner leaves it, plus
150 loose entries on top. The entries are written directly with their commit times: the page never reads
parts.

Each path's time is the best of five in this process, the two alternated; its peak RSS (VmHWM) is that of a
fresh process rendering the page once, the interpreter and its imports included:

- `text`: the page before it drew charts: `status.run_progress` and the page's figures (the baseline);
- `charts`: the page as served: one ledger read, the progress, the timeline (`audit.timeline`) and the bar
  and charts (`audit.charts`), rendered.

    .venv/bin/python bench/progress_page.py [--rows 913786] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "include"))

PART_ROWS = 500
LOOSE = 150  # entries committed after the snapshot (fewer than COMPACT_OVER, as the planner leaves them)
HOURS = 30.0
RUN = "run-4096"
SERVERS = [f"http://gpu-node-{h}.cluster.internal:3000{g}" for h in range(2) for g in range(4)]


def make_root(out: Path, n: int, now: float) -> None:
    from tracegen.config import RunConfig
    from tracegen.run.plan import ChunkLayout
    from tracegen.run.run_record import write_run_record
    from tracegen.run.run_spec import DatasetIdentity, FleetRef, RunSpec
    from tracegen.store.entries import SCHEMA, entry_key, part_key
    from tracegen.store.records import LEDGER_COLUMNS
    from tracegen.store.root import OutputRoot
    from tracegen.store.storage import open_storage

    root = OutputRoot(open_storage(str(out)))
    n_rows = int(n * 1.1)  # the dataset: the run has rows left, so the page is live
    root.run_files.bind_dataset("bench-fingerprint", {"uri": "bench", "rows": n_rows})
    config = RunConfig(max_tokens=4096, dataset_uri="/data/prompts.jsonl", output_uri=str(out), pilot_size=0)
    spec = RunSpec(RUN, now - HOURS * 3600 - 60, config, FleetRef("bench-fleet", "0" * 64, "m", 8, None),
                   DatasetIdentity("/data/prompts.jsonl", "bench-fingerprint", n_rows), ChunkLayout(100_000))
    write_run_record(root, spec)
    rng = np.random.default_rng(0)
    n_entries = (n + PART_ROWS - 1) // PART_ROWS
    # Commit times over 30 hours, the rate rising over the first hours as the fleet fills.
    frac = np.sqrt(np.linspace(0, 1, n_entries)) * 0.5 + np.linspace(0, 1, n_entries) * 0.5
    stamps = now - 20 - HOURS * 3600 * (1 - frac)
    for e in range(n_entries):
        lo, hi = e * PART_ROWS, min(n, (e + 1) * PART_ROWS)
        k, hour = hi - lo, (stamps[e] - stamps[0]) / 3600
        alive = [s for i, s in enumerate(SERVERS) if not (i == 3 and 12 <= hour < 15) and not (i == 6 and hour >= 20)]
        cut = rng.random(k) < 0.02 + 0.02 * hour / HOURS
        loop = ~cut & (rng.random(k) < 0.003)
        failed = rng.random(k) < 0.005
        finish = np.where(failed, None, np.where(cut, "length", np.where(loop, "loop", "stop")))
        tokens = np.where(cut | loop, 4096, rng.integers(200, 4000, k))
        cols = {
            "index": list(range(lo, hi)), "status": np.where(failed, "failed", "ok").tolist(),
            "finish_reason": finish.tolist(), "prompt_tokens": [800] * k, "completion_tokens": tokens.tolist(),
            "reasoning_tokens": (tokens * 7 // 10).tolist(), "cut_in_reasoning": cut.tolist(), "max_tokens": [4096] * k,
            "run_id": [RUN] * k, "chunk": [lo // 100_000] * k, "attempt": [1] * k,
            "server": rng.choice(alive, k).tolist(), "latency_s": [60.0] * k, "category": [None] * k,
            "error": [None] * k, "pivot": [None] * k, "prefix_tokens": [0] * k, "text_joined": [False] * k,
            "while_asking": [False] * k, "runaway_score": np.where(cut | loop, 0.9, np.nan).tolist(),
            "loop_judge": [1] * k,
        }
        cols["runaway_score"] = [None if v != v else v for v in cols["runaway_score"]]
        segment = f"s{e:06d}"
        chunk = cols["chunk"][0]
        entry = {"schema": SCHEMA, "run_id": RUN, "chunk": chunk, "segment": segment,
                 "part": part_key(RUN, chunk, segment), "n_rows": k,
                 "committed_at": datetime.fromtimestamp(stamps[e], UTC).isoformat(),
                 "columns": {c: cols[c] for c in LEDGER_COLUMNS}}
        root.storage.put(entry_key(RUN, chunk, segment), json.dumps(entry).encode())
        if e == n_entries - LOOSE - 1:
            root.snapshots.compact()


def peak_rss_mib() -> float:
    """This process's peak RSS (VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def pages(out: Path) -> dict[str, Any]:
    """The two paths over the root at `out`, each a function rendering the page."""
    from tracegen.review.progress_page import read_progress, render_progress
    from tracegen.review.read_model import read_run
    from tracegen.run.run_record import read_run_record
    from tracegen.status import run_progress
    from tracegen.store.root import OutputRoot
    from tracegen.store.storage import open_storage

    root = OutputRoot(open_storage(str(out)))
    record = read_run_record(root, RUN)
    view = read_run(root, RUN)

    def text() -> str:
        p = run_progress(root, record) | {"state": "running", "live": True, "raise_allowed": False,
                                          "timeline": {"bins": 0}}
        return render_progress([], view, p)

    def charts() -> str:
        return render_progress([], view, read_progress(root, record, view, "running"))

    return {"text": text, "charts": charts}


def child(path: str, out: Path) -> None:
    """One path, once, in a fresh process: its peak RSS, the interpreter and its imports included."""
    page = pages(out)[path]
    html = page()
    print(json.dumps({"path": path, "peak_rss_mib": round(peak_rss_mib(), 1), "kib": round(len(html) / 1024),
                      "svgs": html.count("<svg")}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=913_786)
    ap.add_argument("--work", help="build (or reuse) the root here")
    ap.add_argument("--child")
    args = ap.parse_args()
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="tracegen-progress-bench-"))
    out = work / "output"
    if args.child:
        child(args.child, out)
        return
    if not (out / "dataset.json").exists():
        t = time.monotonic()
        make_root(out, args.rows, time.time())
        print(f"root: {args.rows:,} rows in {time.monotonic() - t:.0f} s", flush=True)
    memory = {}
    for path in ("text", "charts"):
        done = subprocess.run([sys.executable, __file__, "--work", str(work), "--child", path], capture_output=True,
                              text=True, check=True, env={**os.environ, "PYTHONPATH": str(ROOT / "include")})
        memory[path] = json.loads(done.stdout.strip().splitlines()[-1])
    paths = pages(out)
    times: dict[str, list[float]] = {"text": [], "charts": []}
    for _ in range(5):  # alternated: neither path gets the warmer caches
        for path, page in paths.items():
            t = time.perf_counter()
            page()
            times[path].append(time.perf_counter() - t)
    for path in paths:
        print(f"{path:7s} best {min(times[path]):6.3f} s of {', '.join(f'{x:.3f}' for x in times[path])}; "
              f"peak RSS {memory[path]['peak_rss_mib']:6.1f} MiB (fresh process)", flush=True)
    t, m = min(times["charts"]), memory["charts"]["peak_rss_mib"]
    print(f"ledger rows: {args.rows:,}; page {memory['charts']['kib']} KiB, {memory['charts']['svgs']} SVGs")
    print(f"charts / text: time {t / min(times['text']):.2f}x, peak RSS {m / memory['text']['peak_rss_mib']:.2f}x; "
          f"target < 2 s: {'met' if t < 2 else 'NOT met'}, < 500 MiB: {'met' if m < 500 else 'NOT met'}")


if __name__ == "__main__":
    main()
