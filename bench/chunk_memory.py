"""Peak RSS of one chunk task vs chunk size and dataset size (it must not grow with either: docs/benchmarks.md).

Each measurement is a fresh subprocess (this file with --child) that runs `ChunkEngine` on one chunk
against a stand-in and reports its own peak RSS (VmHWM; `ru_maxrss` where /proc is missing). A zero-row chunk on the same root is the baseline
(interpreter + imports + ledger read), so the printed ratios isolate what the chunk itself costs.
"Dataset size" is both more rows in the dataset and a ledger that already holds a committed row for
every index outside the measured chunks (a resumed run late in a big job, the worst case for memory).

    .venv/bin/python bench/chunk_memory.py [--small 20000] [--large 200000] [--chunks 500,2000,8000]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "include"))

MODEL = "sim/bench"


def prompt(i: int) -> dict:
    return {"id": f"p{i}", "messages": [
        {"role": "system", "content": "You are a careful coding assistant."},
        {"role": "user", "content": f"Task {i}: explain this.\n" + f"def f{i}(x):\n    return x * {i}\n" * 8}]}


def start_stand_in() -> tuple[subprocess.Popen[bytes], str]:
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, "-m", "tracegen.simulator", "--model-path", MODEL, "--port", str(port),
            "--max-running-requests", "256", "--sim-time-scale", "100000", "--sim-length-model", "short",
            "--sim-warmup-s", "0.05", "--log-level", "warning"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "include")}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.05)
    proc.kill()
    raise SystemExit("stand-in did not become healthy")


def make_root(work: Path, n_rows: int, measured: list[tuple[int, int]]) -> dict:
    """A dataset of n_rows, an output root bound to it, and a ledger row for every index not measured."""
    from tracegen.config import RunConfig
    from tracegen.fleet import FleetSpec
    from tracegen.fleet.spec import HostSpec
    from tracegen.run.prepare import prepare_run
    from tracegen.run.run_spec import FleetRef
    from tracegen.store.records import OK, GeneratedRow
    from tracegen.store.root import open_root

    dataset = work / f"prompts-{n_rows}.jsonl"
    with open(dataset, "w") as f:
        for i in range(n_rows):
            f.write(json.dumps(prompt(i)) + "\n")
    params = dict(dataset_uri=str(dataset), output_uri=str(work / f"out-{n_rows}"), max_tokens=4096,
                  chunk_size=100_000, pilot_size=0, part_rows=500, part_seconds=60.0)
    config = RunConfig.from_params(params)
    fleet = FleetSpec(hosts=(HostSpec("local", (0,)),), model_path=MODEL, launch_module="tracegen.simulator")
    prepare_run(config, "prefill", FleetRef.of(fleet, "bench-fleet"))
    root = open_root(config.output_uri)
    skip = set()
    for start, stop in measured:
        skip.update(range(start, stop))
    todo = [i for i in range(n_rows) if i not in skip]
    # Prefill in 5,000-row parts with short texts: what a mostly finished dataset's ledger looks like.
    for n, s in enumerate(range(0, len(todo), 5000)):
        rows = [GeneratedRow(index=i, status=OK, max_tokens=4096, run_id="prefill", chunk=1, finish_reason="stop",
                             content="done", completion_tokens=60) for i in todo[s:s + 5000]]
        root.commits.commit(rows, "prefill", 1, f"prefill-{n:05d}")
    return params


def measure(params: dict, url: str, run_id: str, start: int, stop: int, spool: Path) -> dict:
    job = {"params": params, "url": url, "run_id": run_id, "start": start, "stop": stop, "spool": str(spool)}
    env = {**os.environ, "PYTHONPATH": str(ROOT / "include")}
    out = subprocess.run([sys.executable, __file__, "--child", json.dumps(job)], capture_output=True, text=True,
                         env=env, timeout=900)
    if out.returncode != 0:
        raise SystemExit(f"child failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def peak_rss_mib() -> float:
    """This process's peak RSS. VmHWM belongs to the process's own address space; ru_maxrss does not:
    Linux carries the parent's RSS at fork/exec into a child's ru_maxrss, which makes every child of a big
    parent look big (a child would report its parent's ledger as its own)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(job: dict) -> None:
    import numpy as np

    from tracegen.config import RunConfig
    from tracegen.dataset.stored import load_index
    from tracegen.generate.engine import ChunkEngine, ChunkJob, ChunkOptions
    from tracegen.sglang.client import ClientConfig
    from tracegen.sglang.routing import ServerEndpoint
    from tracegen.store.root import open_root

    config = RunConfig.from_params(job["params"])
    root = open_root(config.output_uri)
    options = ChunkOptions(spool_dir=job["spool"], client_config=ClientConfig(), progress_interval_s=3600)
    engine = ChunkEngine(ChunkJob(config=config, run_id=job["run_id"], model=MODEL, chunk=0, label="bench"),
                         root=root, dataset=load_index(root), servers=[ServerEndpoint(job["url"], max_in_flight=128)],
                         options=options)
    started = time.monotonic()
    summary = engine.run(np.arange(job["start"], job["stop"], dtype=np.int64))
    print(json.dumps({"rss_mib": peak_rss_mib(),
                      "generated": summary.generated, "parts": summary.parts,
                      "elapsed_s": round(time.monotonic() - started, 2)}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", type=int, default=20_000)
    ap.add_argument("--large", type=int, default=200_000)
    ap.add_argument("--chunks", default="500,2000,8000")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    sizes = [int(x) for x in args.chunks.split(",")]
    proc, url = start_stand_in()
    try:
        with tempfile.TemporaryDirectory(prefix="chunk-memory-") as tmp:
            work = Path(tmp)
            os.environ["TRACEGEN_WRITE_PREFIXES"] = str(work)  # the bench writes its roots here (tracegen.common.locations)
            table: dict[int, dict[int, dict]] = {}
            for n_rows in (args.small, args.large):
                # Measured chunks sit back to back at the start; every other index is already done.
                ranges, start = [], 0
                for size in sizes:
                    ranges.append((start, start + size))
                    start += size
                if start > n_rows:
                    raise SystemExit(f"chunks need {start} rows; dataset has {n_rows}")
                t0 = time.monotonic()
                params = make_root(work, n_rows, ranges)
                print(f"dataset {n_rows:,} rows: root prepared in {time.monotonic() - t0:.1f}s", flush=True)
                row = {0: measure(params, url, "bench", 0, 0, work / "spool")}
                for size, (a, b) in zip(sizes, ranges, strict=True):
                    row[size] = measure(params, url, "bench", a, b, work / "spool")
                    print(f"  chunk {size:>6,}: peak RSS {row[size]['rss_mib']:.0f} MiB "
                          f"({row[size]['generated']:,} rows, {row[size]['parts']} parts, {row[size]['elapsed_s']} s)",
                          flush=True)
                print(f"  baseline (0-row chunk): {row[0]['rss_mib']:.0f} MiB", flush=True)
                table[n_rows] = row
    finally:
        proc.kill()
        proc.wait()

    small, large = table[args.small], table[args.large]
    base = small[0]["rss_mib"]
    print("\npeak RSS ratios (1.00 = no growth)")
    for size in sizes:
        print(f"  chunk {size:>6,} / chunk {sizes[0]:,} (dataset {args.small:,}): "
              f"{small[size]['rss_mib'] / small[sizes[0]]['rss_mib']:.2f}   "
              f"above baseline: {small[size]['rss_mib'] - base:+.0f} MiB")
    for size in [0, *sizes]:
        name = "baseline" if size == 0 else f"chunk {size:,}"
        print(f"  dataset {args.large:,} / {args.small:,}, {name}: {large[size]['rss_mib'] / small[size]['rss_mib']:.2f}"
              f"   ({small[size]['rss_mib']:.0f} -> {large[size]['rss_mib']:.0f} MiB)")


if __name__ == "__main__":
    main()
