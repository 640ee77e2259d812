"""Peak memory and time of `export`, `status` and `audit` on a synthetic full-scale output root (913,786 rows),
against the same commands reading the whole ledger frame, in the same run (docs/benchmarks.md).

The root: a dataset of short prompts, one run at 4096 whose rows all finished (short texts, 40 prompt ids
and 80 response ids each, 500 rows a part: 1,828 parts), folded into a Parquet snapshot as a long run's
planner leaves it, plus a few hundred loose entries on top of it. Each measurement is a fresh subprocess
(this file with --child) that exports the root and reports its own peak RSS (VmHWM) and wall time:

- `old`: an export that chooses its rows from the whole ledger frame (`Snapshots.frame()`: every column of
  every ledger row as one pandas frame), then writes the same shards: the baseline;
- `messages`, `tokens`: the export as it is (the ledger read a snapshot batch at a time with the export's
  columns only, strings as codes; a trainer layout's file streamed to disk);
- `status-old`, `status`: `tracegen status` of the root, reading the whole ledger frame, and as it is (the same
  bounded reader as the export);
- `audit-old`, `audit`: `tracegen audit` of the root (the final report: statistics, cap fit, report files),
  reading the whole ledger frame (`Snapshots.frame(compact_over=...)`), and as it is (the bounded reader
  with the report's columns, after the streamed `compact_loose`). Both fold the loose entries into a snapshot,
  as `tracegen audit` does; the snapshot and report files an audit writes are removed after it, so every path
  reads the root as it was built.

    .venv/bin/python bench/export_memory.py [--rows 913786] [--work DIR] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "include"))

PART_ROWS = 500
LOOSE_PARTS = 210  # entries committed after the snapshot (more than COMPACT_OVER): read on top of it


def prompt(i: int) -> dict:
    return {"id": f"p{i}", "messages": [
        {"role": "system", "content": "You are a careful coding assistant."},
        {"role": "user", "content": f"Task {i}: explain f{i}.\ndef f{i}(x):\n    return x * {i}\n"}]}


def make_root(work: Path, n_rows: int) -> str:
    import numpy as np

    from tracegen.config import RunConfig
    from tracegen.fleet import FleetSpec
    from tracegen.fleet.spec import HostSpec
    from tracegen.run.prepare import prepare_run
    from tracegen.run.run_spec import FleetRef
    from tracegen.store.records import OK, GeneratedRow, pack_token_ids
    from tracegen.store.root import open_root

    dataset = work / "prompts.jsonl"
    with open(dataset, "w") as f:
        for i in range(n_rows):
            f.write(json.dumps(prompt(i)) + "\n")
    output = work / "output"
    config = RunConfig.from_params(dict(dataset_uri=str(dataset), output_uri=str(output), max_tokens=4096,
                                        chunk_size=100_000, pilot_size=0, part_rows=PART_ROWS))
    fleet = FleetSpec(hosts=(HostSpec("local", (0,)),), model_path="sim/bench", launch_module="tracegen.simulator")
    prepare_run(config, "run-4096", FleetRef.of(fleet, "bench-fleet"))
    output_root = open_root(str(output))
    rng = np.random.default_rng(0)
    prompt_ids = pack_token_ids(rng.integers(0, 150_000, 40).tolist())
    response = rng.integers(0, 150_000, 80).tolist()
    response_ids = pack_token_ids([*response[:-1], 151645])
    reasoning = "Let me look at the function first. " * 10
    n_parts = (n_rows + PART_ROWS - 1) // PART_ROWS
    started = time.monotonic()
    for p in range(n_parts):
        rows = [GeneratedRow(index=i, status=OK, max_tokens=4096, run_id="run-4096", chunk=i // 100_000,
                             finish_reason="stop", content=f"f{i} multiplies its argument by {i}.",
                             reasoning_content=reasoning, prompt_tokens=40, completion_tokens=80,
                             reasoning_tokens=60, attempt=1, server="http://127.0.0.1:30000", latency_s=12.5,
                             prompt_token_ids=prompt_ids, response_token_ids=response_ids)
                for i in range(p * PART_ROWS, min(n_rows, (p + 1) * PART_ROWS))]
        output_root.commits.commit(rows, "run-4096", rows[0].chunk, f"s{p:06d}")
        if p == n_parts - LOOSE_PARTS - 1:
            output_root.snapshots.compact()  # what the planner and audit tasks leave behind on a long run
        if p % 200 == 0:
            print(f"  root: {p}/{n_parts} parts ({time.monotonic() - started:.0f} s)", flush=True)
    return str(output)


def peak_rss_mib() -> float:
    """This process's own peak RSS (VmHWM; see bench/chunk_memory.py on why not ru_maxrss)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def status_child(job: dict) -> None:
    """`status` of the root: through the bounded reader, or (`status-old`) the whole ledger frame as it read it."""
    import tracegen.status as status

    if job["path"] == "status-old":
        status.ledger_rows = lambda output_root, columns: output_root.snapshots.frame()
    started = time.monotonic()
    doc = status.dataset_status(job["root"])
    print(json.dumps({"path": job["path"], "rows": doc["ledger_rows"], "seconds": round(time.monotonic() - started, 1),
                      "peak_rss_mib": round(peak_rss_mib(), 1)}))


def audit_child(job: dict) -> None:
    """`tracegen audit` of the root: through the bounded reader, or (`audit-old`) the whole ledger frame as the
    report read it before (folding loose entries by writing that frame, `frame(compact_over=...)`)."""
    import tracegen.run.run_report as report
    from tracegen.run.run_record import latest_run
    from tracegen.store.root import open_root
    from tracegen.store.snapshots import COMPACT_OVER, Snapshots

    if job["path"] == "audit-old":
        report.ledger_rows = lambda output_root, columns: output_root.snapshots.frame(compact_over=COMPACT_OVER)
        Snapshots.compact_loose = lambda self, over=COMPACT_OVER, keep=2: None  # folded by the read above
    started = time.monotonic()
    root = open_root(job["root"])
    outcome = report.audit_and_report(latest_run(root), name="audit", root=root)
    rows = json.loads(root.run_files.get(latest_run(root).run_id, "audit.json"))["audit"]["rows"]["ledger_rows"]
    print(json.dumps({"path": job["path"], "rows": rows, "seconds": round(time.monotonic() - started, 1),
                      "peak_rss_mib": round(peak_rss_mib(), 1), "verdict": outcome.verdict}))


def child(job: dict) -> None:
    if job["path"].startswith("status"):
        return status_child(job)
    if job["path"].startswith("audit"):
        return audit_child(job)
    import tracegen.export as export

    if job["path"] == "old":
        # The baseline: the whole ledger frame, every column of every row (Snapshots.frame()), chosen from.
        export.ledger_rows = lambda output_root, columns: output_root.snapshots.frame()
    layout = "messages" if job["path"] in ("old", "messages") else job["path"]
    started = time.monotonic()
    result = export.export_dataset(job["root"], job["dest"], layout=layout, overwrite=True)
    print(json.dumps({"path": job["path"], "rows": result.rows, "seconds": round(time.monotonic() - started, 1),
                      "peak_rss_mib": round(peak_rss_mib(), 1)}))


def measure(root: str, dest: Path, path: str) -> dict:
    job = {"root": root, "dest": str(dest), "path": path}
    env = {**os.environ, "PYTHONPATH": str(ROOT / "include")}
    snapshots, runs = Path(root) / "ledger-snapshots", Path(root) / "runs"
    before = set(snapshots.iterdir()) | set(runs.rglob("*"))
    try:
        out = subprocess.run([sys.executable, __file__, "--child", json.dumps(job)], capture_output=True,
                             text=True, env=env, timeout=3600)
    finally:
        # What an audit wrote (its snapshot, its report files): the next path reads the root as it was built.
        after = set(snapshots.iterdir()) | set(runs.rglob("*"))
        for new in sorted(after - before, reverse=True):
            new.unlink() if new.is_file() else new.rmdir()
        if before - after:
            raise SystemExit(f"{path} removed {sorted(map(str, before - after))}: the root is no longer the same")
    if out.returncode != 0:
        raise SystemExit(f"child failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=913_786)
    ap.add_argument("--work", help="reuse (or keep) the root here")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--paths", default="old,messages,tokens,status-old,status,audit-old,audit",
                    help="what to measure, in order: exports (old, messages, tokens), status (status-old, status) "
                         "and audit (audit-old, audit)")
    ap.add_argument("--child")
    args = ap.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="tracegen-export-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ["TRACEGEN_WRITE_PREFIXES"] = str(work)  # the bench writes its roots here (tracegen.common.locations)
    try:
        root = str(work / "output")
        if not (work / "output" / "dataset.json").exists():
            t = time.monotonic()
            make_root(work, args.rows)
            print(f"root: {args.rows:,} rows in {time.monotonic() - t:.0f} s", flush=True)
        results = []
        for path in args.paths.split(","):
            r = measure(root, work / f"export-{path}", path)
            results.append(r)
            print(f"{path:9s} {r['rows']:>9,} rows  {r['seconds']:7.1f} s  peak {r['peak_rss_mib']:7.1f} MiB", flush=True)
            shutil.rmtree(work / f"export-{path}", ignore_errors=True)
        by_path = {r["path"]: r for r in results}
        for new, old in (("messages", "old"), ("tokens", "old"), ("status", "status-old"), ("audit", "audit-old")):
            if new in by_path and old in by_path:
                n, o = by_path[new], by_path[old]
                print(f"{new}: {n['peak_rss_mib'] / o['peak_rss_mib']:.2f}x the {old} path's peak, "
                      f"{n['seconds'] / max(o['seconds'], 0.1):.2f}x its time")
        print(json.dumps(results))
    finally:
        if not args.keep and not args.work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
