"""GPU occupancy of a whole tracegen run vs the reference job's single asyncio script, on one simulated fleet.

A fleet of SGLang stand-ins (time-scaled, reference-job-calibrated lengths) is driven, for each cap, by:
(a) tracegen's real path, as the `tracegen_generate` DAG runs it on LocalExecutor: plan, pilot and gate
    tasks, then one process per mapped chunk task (`pipeline.run_chunk`), at most
    `max_active_tis_per_dagrun` of them at once, with a scheduler delay between a task's end and the
    next task's start;
(b) the reference job's way: one asyncio process with a fixed semaphore over all servers.
Occupancy is busy slot-time / available slot-time from the stand-ins' own accounting over each run's
whole window; idle slot-time is attributed to what the orchestrator was doing at the time. Then a
sweep of fixed per-server in-flight limits against the auto-tuner started from a bad default.

    .venv/bin/python bench/occupancy.py [--rows 24000] [--time-scale 8] [--caps 4096,8192] [--quick]

The defaults take about 30 minutes on 2 cores: the run must be long against the few wall seconds of task
start-up before the first request, which no time scale shrinks. `--quick` (6,000 prompts at time scale
20, no sweep, about 4 minutes) shows the same phases with start-up weighing about 10% of the run.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "include"))
sys.path.insert(0, str(ROOT / "bench"))

from occupancy_support.fleet import MODEL, Fleet, Sampler, start_fleet  # noqa: E402

from tracegen import params  # noqa: E402
from tracegen.fleet.sources import local_sim_fleet  # noqa: E402
from tracegen.run import plan  # noqa: E402
from tracegen.run.plan import TARGET_CHUNK_ROWS  # noqa: E402

REFERENCE_PROMPTS = 913_786
REFERENCE_SERVERS = 7
TASK = ROOT / "bench" / "occupancy_support" / "task.py"
BASELINE = ROOT / "bench" / "occupancy_support" / "baseline.py"


def write_dataset(path: Path, n: int) -> None:
    """`n` distinct agentic-coding-like prompts (the stand-in draws each one's length from its hash)."""
    with gzip.open(ROOT / "include/tracegen/sample_data/agentic_coding_prompts.jsonl.gz", "rt") as f:
        sample = [json.loads(line) for line in f]
    with path.open("w") as out:
        for i in range(n):
            row = sample[i % len(sample)]
            messages = [dict(m) for m in row["messages"]]
            messages[-1]["content"] = f"[{i}] " + str(messages[-1]["content"])
            out.write(json.dumps({"id": f"bench-{i:07d}", "messages": messages}) + "\n")


def fleet_spec() -> dict:
    spec = local_sim_fleet()
    spec["served_model_name"] = MODEL
    return spec


# ---- (a) tracegen as the DAG runs it ------------------------------------------------------------


class Executor:
    """LocalExecutor stand-in: each task a fresh process; mapped tasks at most `concurrency` at once."""

    def __init__(self, work: Path, urls: list[str], config: dict, run_id: str, sched_delay_s: float) -> None:
        self.work, self.urls, self.config, self.run_id = work, urls, config, run_id
        self.sched_delay_s = sched_delay_s
        self.tasks: list[dict] = []
        self._n = 0

    def spawn(self, step: str, **extra) -> tuple[subprocess.Popen, dict]:
        self._n += 1
        spec = {"step": step, "config": self.config, "run_id": self.run_id, "fleet": fleet_spec(),
                "urls": self.urls, **extra}  # fmt: skip
        spec_path = self.work / f"task-{self._n}.json"
        spec_path.write_text(json.dumps(spec))
        record = {"step": step, "spawned": time.time(), "out": str(self.work / f"task-{self._n}.out.json"),
                  "log": str(self.work / f"task-{self._n}.log"), **extra}  # fmt: skip
        log = open(record["log"], "w")
        proc = subprocess.Popen([sys.executable, str(TASK), str(spec_path), record["out"]], stdout=log,
                                stderr=subprocess.STDOUT)  # fmt: skip
        return proc, record

    def finish(self, proc: subprocess.Popen, record: dict) -> dict:
        record["rc"] = proc.returncode
        record["exited"] = time.time()
        try:
            record.update(json.loads(Path(record["out"]).read_text()))
        except FileNotFoundError:
            pass
        if record["rc"] not in (0, 3):
            tail = Path(record["log"]).read_text()[-2000:]
            raise SystemExit(f"task {record['step']} failed (rc {record['rc']}):\n{tail}")
        self.tasks.append(record)
        return record

    def run(self, step: str, **extra) -> dict:
        proc, record = self.spawn(step, **extra)
        proc.wait()
        out = self.finish(proc, record)
        time.sleep(self.sched_delay_s)  # the scheduler notices the success and queues the next task
        return out

    def fan_out(self, alongside: list[dict], after_gate: list[dict], concurrency: int) -> dict:
        """The DAG past `plan_run`: the pilot and `generate_alongside_pilot` start together, the gate after
        the pilot, `generate_chunk` after the gate; each mapped task at most `concurrency` at once, and a
        scheduler delay between a task's end and what it unblocks. Returns the gate task's record."""
        now = time.time()
        pending: dict[str, list[dict]] = {
            "pilot": [{}], "gate": [], "alongside": [{"chunk": c, "alongside_pilot": True} for c in alongside],
            "after_gate": [],
        }  # fmt: skip
        # Per task (group), when each of its slots can start its next task.
        slots = {"pilot": [now], "gate": [], "alongside": [now] * concurrency, "after_gate": []}
        step = {"pilot": "pilot", "gate": "gate", "alongside": "chunk", "after_gate": "chunk"}
        running: list[tuple[str, subprocess.Popen, dict]] = []
        gate: dict = {}
        while any(pending.values()) or running:
            for item in list(running):
                group, proc, record = item
                if proc.poll() is None:
                    continue
                running.remove(item)
                self.finish(proc, record)
                ready = time.time() + self.sched_delay_s
                slots[group].append(ready)
                if group == "pilot":
                    pending["gate"].append({})
                    slots["gate"] = [ready]
                elif group == "gate":
                    gate = record
                    if record["rc"] == 0:
                        pending["after_gate"] = [{"chunk": c, "alongside_pilot": False} for c in after_gate]
                        slots["after_gate"] = [ready] * concurrency
            for group, queue in pending.items():
                slots[group].sort()
                while queue and slots[group] and slots[group][0] <= time.time():
                    slots[group].pop(0)
                    running.append((group, *self.spawn(step[group], **queue.pop(0))))
            time.sleep(0.02)
        return gate


def run_tracegen(fleet: Fleet, work: Path, dataset: Path, cap: int, args) -> dict:
    work.mkdir(parents=True)
    config = {
        "max_tokens": cap, "dataset_uri": str(dataset), "output_uri": str(work / "output"),
        "chunk_size": args.chunk_size, "pilot_size": args.pilot,
        # At 4096 the gate (rightly) stops the run; an operator who accepts the truncation goes on.
        "gate_mode": "warn" if cap < 8192 else "stop",
        "max_in_flight_per_server": args.in_flight, "autotune_in_flight": args.autotune,
    }  # fmt: skip
    ex = Executor(work, fleet.urls, config, f"bench-{cap}", args.sched_delay_s)
    sampler = Sampler(fleet.urls)
    sampler.start()
    lead = args.chunk_concurrency
    ex.run("plan", stagger=lead)  # as steps.prepare_run: chunks staggered over the tasks in flight at once
    chunks = ex.tasks[-1]["chunks"]
    gate = ex.fan_out(chunks[:lead], chunks[lead:], args.chunk_concurrency)
    samples = sampler.stop()
    pilot = next(t for t in ex.tasks if t["step"] == "pilot")
    chunk_tasks = [t for t in ex.tasks if t["step"] == "chunk"]
    generating = [pilot, *chunk_tasks]
    phases = attribute(samples, generating, gate)
    rows = sum(t.get("summary", {}).get("generated", 0) for t in generating)
    overhead = [(t["work_start"] - t["spawned"]) + (t["exited"] - t["work_end"]) for t in chunk_tasks]
    first_request = min(t["work_start"] for t in generating)
    run = window([x for x in samples if x.t >= first_request], fleet)
    return {**window(samples, fleet), "phases": phases, "rows": rows, "chunks": len(chunk_tasks),
            "from_first_request": run, "startup_wall_s": first_request - samples[0].t,
            "task_overhead_s": sum(overhead) / max(len(overhead), 1)}  # fmt: skip


def attribute(samples, generating: list[dict], gate: dict) -> dict[str, float]:
    """Idle slot-seconds (simulated) by what the orchestrator was doing while they were idle."""
    first = min(t["work_start"] for t in generating)
    gate_passed = gate.get("exited", float("inf"))
    idle: dict[str, float] = defaultdict(float)
    for a, b in zip(samples, samples[1:], strict=False):
        gap = (b.available - a.available) - (b.busy - a.busy)
        mid = (a.t + b.t) / 2
        if mid < first:
            phase = "start-up (plan task, first tasks)"
        elif mid < gate_passed:
            phase = "pilot + gate (first chunks alongside)"
        elif any(t["work_start"] > mid for t in generating):
            phase = "fan-out, chunks still to start"
        else:
            phase = "run end tail (last chunks)"
        idle[phase] += gap
    return dict(idle)


def window(samples, fleet: Fleet) -> dict:
    first, last = samples[0], samples[-1]
    busy, available = last.busy - first.busy, last.available - first.available
    tokens = last.tokens - first.tokens
    wall = last.t - first.t
    ideal = tokens / fleet.capacity_tokens_per_wall_s()
    return {"occupancy": busy / available, "busy": busy, "available": available, "idle": available - busy,
            "tokens": tokens, "wall_s": wall, "ideal_s": ideal}  # fmt: skip


# ---- (b) the reference job's script ------------------------------------------------------------------------


def run_baseline(fleet: Fleet, work: Path, dataset: Path, cap: int, concurrency: int) -> dict:
    sampler = Sampler(fleet.urls)
    sampler.start()
    out = subprocess.run([sys.executable, str(BASELINE), str(dataset), str(work), str(cap), str(concurrency),
                          *fleet.urls], check=True, capture_output=True, text=True)  # fmt: skip
    samples = sampler.stop()
    result = json.loads(out.stdout.strip().splitlines()[-1])
    first_request = result["started"]  # right after it read the dataset, before its first request
    run = window([x for x in samples if x.t >= first_request], fleet)
    return {**window(samples, fleet), "rows": result["rows"], "from_first_request": run,
            "startup_wall_s": first_request - samples[0].t}  # fmt: skip


# ---- auto-tuning vs a sweep of fixed limits -------------------------------------------------------


def tune_run(fleet: Fleet, work: Path, dataset: Path, cap: int, in_flight: int, autotune: bool,
             interval_s: float) -> dict:  # fmt: skip
    """One chunk of the whole dataset through the chunk engine, fixed or auto-tuned; wall time and tokens."""
    from tracegen.config import RunConfig
    from tracegen.dataset.stored import load_index
    from tracegen.fleet import FleetSpec
    from tracegen.generate.engine import ChunkEngine, ChunkJob, ChunkOptions
    from tracegen.run.prepare import prepare_run
    from tracegen.run.run_spec import FleetRef
    from tracegen.sglang.client import ClientConfig
    from tracegen.sglang.routing import ServerEndpoint
    from tracegen.store.root import open_root

    work.mkdir(parents=True)
    config = RunConfig(
        max_tokens=cap,
        dataset_uri=str(dataset),
        output_uri=str(work / "output"),
        pilot_size=0,
        max_in_flight_per_server=in_flight,
        autotune_in_flight=autotune,
    )
    prepare_run(config, "tune", FleetRef.of(FleetSpec.from_dict(fleet_spec()), "bench-fleet"))
    root = open_root(config.output_uri)
    index = load_index(root)
    endpoints = [
        ServerEndpoint(u, max_in_flight=in_flight, name=f"sim:gpu{i}") for i, u in enumerate(fleet.urls)
    ]
    client_config = ClientConfig(autotune=autotune, autotune_interval_s=interval_s)
    engine = ChunkEngine(
        ChunkJob(config=config, run_id="tune", model=MODEL, chunk=0, label="tune"),
        root=root,
        dataset=index,
        servers=endpoints,
        options=ChunkOptions(spool_dir=str(work / "spool"), client_config=client_config),
    )
    started = time.time()
    summary = engine.run(range(index.n_rows))
    wall = time.time() - started
    return {"in_flight": in_flight, "autotune": autotune, "wall_s": wall, "tokens": summary.completion_tokens}


# ---- main ---------------------------------------------------------------------------------------


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", type=int, default=4)
    p.add_argument("--max-running", type=int, default=32, help="--max-running-requests of each stand-in")
    p.add_argument("--time-scale", type=float, default=8.0, help="simulated seconds per wall second")
    p.add_argument("--rows", type=int, default=24000)
    p.add_argument("--caps", default="4096,8192")
    p.add_argument(
        "--chunk-size",
        type=int,
        default=plan.choose_chunk_size(REFERENCE_PROMPTS, TARGET_CHUNK_ROWS),
        help="rows per chunk task (default: the chunk size tracegen picks at the reference job's scale)",
    )
    p.add_argument("--pilot", type=int, default=500)
    p.add_argument(
        "--chunk-concurrency",
        type=int,
        default=params.generate_chunk_concurrency(),
        help="max_active_tis_per_dagrun of the mapped generation (TRACEGEN_CHUNK_CONCURRENCY)",
    )
    p.add_argument(
        "--sched-delay-s",
        type=float,
        default=1.0,
        help="wall seconds between a task's end and the next task's start (scheduler latency)",
    )
    p.add_argument(
        "--in-flight", type=int, default=None,
        help="max_in_flight_per_server: the fixed limit with --no-autotune (default: RunConfig's)",
    )
    p.add_argument("--autotune", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--baseline-concurrency", type=int, default=0, help="0: every slot of the fleet")
    p.add_argument("--sweep", default="4,8,16,32,64,128", help="fixed per-server in-flight limits to sweep")
    p.add_argument("--sweep-rows", type=int, default=800)
    p.add_argument("--skip-sweep", action="store_true")
    p.add_argument("--skip-baseline", action="store_true")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument("--quick", action="store_true", help="6,000 prompts at time scale 20, no sweep")
    args = p.parse_args()
    if args.quick:
        args.rows, args.time_scale, args.skip_sweep = 6000, 20.0, True
    from tracegen.config import RunConfig

    defaults = RunConfig(dataset_uri="/d.jsonl", output_uri="/out")
    args.in_flight = args.in_flight or defaults.max_in_flight_per_server
    args.autotune = defaults.autotune_in_flight if args.autotune is None else args.autotune
    caps = [int(c) for c in args.caps.split(",")]

    work = Path(tempfile.mkdtemp(prefix="tracegen-occupancy-"))
    os.environ["TRACEGEN_WRITE_PREFIXES"] = str(work)  # the bench writes its roots here (tracegen.common.locations)
    fleet = start_fleet(args.servers, args.max_running, args.time_scale)
    baseline_conc = args.baseline_concurrency or fleet.slots
    print(
        f"fleet: {args.servers} stand-ins x {args.max_running} slots, time scale {args.time_scale:g}, "
        f"capacity {fleet.capacity_tokens_per_wall_s():,.0f} tok/wall-s; {args.rows:,} prompts, chunk "
        f"{args.chunk_size}, pilot {args.pilot}, {args.chunk_concurrency} chunk tasks at once, scheduler "
        f"delay {args.sched_delay_s:g} s; tracegen in-flight/server "
        f"{f'auto-tuned from {defaults.autotune_start_in_flight}' if args.autotune else f'{args.in_flight}, fixed'}; "
        f"baseline semaphore {baseline_conc}",
        flush=True,
    )
    results: dict = {"args": vars(args), "caps": {}}
    try:
        dataset = work / "prompts.jsonl"
        write_dataset(dataset, args.rows)
        for cap in caps:
            tg = run_tracegen(fleet, work / f"tracegen-{cap}", dataset, cap, args)
            if args.skip_baseline:
                print(
                    f"cap {cap}: tracegen occupancy {pct(tg['occupancy'])}, from the first request "
                    f"{pct(tg['from_first_request']['occupancy'])}, wall {tg['wall_s']:.1f} s, "
                    f"phases { ({k: round(v) for k, v in tg['phases'].items()}) }"
                )
                continue
            bl = run_baseline(fleet, work / f"baseline-{cap}", dataset, cap, baseline_conc)
            results["caps"][cap] = {"tracegen": tg, "baseline": bl}
            report_cap(cap, tg, bl, fleet, args)
        if not args.skip_sweep:
            results["tune"] = sweep(fleet, work, args)
        if results["caps"]:
            results["seed_scale"] = extrapolate(results, fleet, args)
        (work / "results.json").write_text(json.dumps(results, indent=2, default=str))
        print(f"\nresults: {work / 'results.json'}")
    finally:
        fleet.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def report_cap(cap: int, tg: dict, bl: dict, fleet: Fleet, args) -> None:
    print(f"\n== cap {cap} ==")
    for name, r in (("tracegen", tg), ("baseline", bl)):
        print(
            f"  {name:9s} occupancy {pct(r['occupancy'])}  wall {r['wall_s']:6.1f} s  ideal {r['ideal_s']:6.1f} s"
            f"  wall/ideal {r['wall_s'] / r['ideal_s']:.3f}  rows {r['rows']:,}  tokens {r['tokens']:,.0f}"
        )
    print(
        f"  tracegen/baseline: wall {tg['wall_s'] / bl['wall_s']:.3f}, occupancy "
        f"{tg['occupancy'] / bl['occupancy']:.3f}"
    )
    for name, r in (("tracegen", tg), ("baseline", bl)):
        run = r["from_first_request"]
        print(
            f"  {name:9s} from its first request: occupancy {pct(run['occupancy'])}, wall {run['wall_s']:.1f} s; "
            f"{r['startup_wall_s']:.1f} wall s of start-up before it"
        )
    print(
        f"  tracegen idle slot-time (simulated slot-s, % of available) by phase, {tg['chunks']} chunk tasks:"
    )
    for phase, idle in sorted(tg["phases"].items(), key=lambda kv: -kv[1]):
        idle = max(idle, 0.0)  # sampling jitter makes an all-busy phase a hair negative
        print(f"    {phase:40s} {idle:10,.0f}  {pct(idle / tg['available'])}")
    print(
        f"  chunk task orchestration overhead (spawn->generating + generating->exit): "
        f"{tg['task_overhead_s']:.2f} wall s per chunk",
        flush=True,
    )


def sweep(fleet: Fleet, work: Path, args) -> dict:
    cap = 4096
    dataset = work / "sweep.jsonl"
    write_dataset(dataset, args.sweep_rows)
    # The tuner polls once per simulated ~4 s (1 s at time scale 1 is 1/4 of a short request); the
    # default interval is 1 wall s for real servers.
    interval = 4.0 / args.time_scale
    print(f"\n== in-flight sweep: {args.sweep_rows} rows at cap {cap}, fixed limits vs auto-tune from 4 ==")
    fixed = []
    for n in [int(x) for x in args.sweep.split(",")]:
        r = tune_run(fleet, work / f"sweep-{n}", dataset, cap, n, False, interval)
        fixed.append(r)
        print(
            f"  fixed {n:4d}/server  wall {r['wall_s']:6.2f} s  {r['tokens'] / r['wall_s']:,.0f} tok/s",
            flush=True,
        )
    best = min(fixed, key=lambda r: r["wall_s"])
    auto = tune_run(fleet, work / "sweep-auto", dataset, cap, 4, True, interval)
    print(f"  auto (start 4)    wall {auto['wall_s']:6.2f} s  {auto['tokens'] / auto['wall_s']:,.0f} tok/s")
    ratio = auto["wall_s"] / best["wall_s"]
    print(
        f"  auto / best fixed ({best['in_flight']}/server): wall {ratio:.3f} "
        f"({'within' if ratio <= 1.05 else 'NOT within'} 5%)",
        flush=True,
    )
    return {"fixed": fixed, "auto": auto, "best": best, "auto_over_best": ratio}


def extrapolate(results: dict, fleet: Fleet, args) -> dict:
    """Whole-run occupancy at the reference job's scale (913,786 prompts, 7 servers) from the measured idle parts.

    Idle slot-time is measured per slot and split by kind: start-up before the first request is
    wall-clock time, charged in real seconds; idle while the pilot and the gate run, and the end tail,
    are simulated time, the same at any scale; idle during the fan-out is charged per chunk as measured
    (an upper bound: part of it is task start-up, wall-clock time the time scale multiplies).
    """
    cap = max(results["caps"])
    tg = results["caps"][cap]["tracegen"]
    bl = results["caps"][cap].get("baseline")
    chunk_size = plan.choose_chunk_size(REFERENCE_PROMPTS, TARGET_CHUNK_ROWS)
    n_chunks = len(plan.chunks(REFERENCE_PROMPTS, chunk_size))
    tokens_per_row = tg["tokens"] / max(tg["rows"], 1)
    per_server = fleet.capacity_tokens_per_wall_s() / fleet.time_scale / len(fleet.urls)
    run_s = REFERENCE_PROMPTS * tokens_per_row / (per_server * REFERENCE_SERVERS)  # ideal, every slot busy
    ph, slots = tg["phases"], fleet.slots
    startup = ph.get("start-up (plan task, first tasks)", 0.0) / slots / fleet.time_scale
    tails = (ph.get("pilot + gate (first chunks alongside)", 0.0) + ph.get("run end tail (last chunks)", 0.0))
    tails /= slots
    boundary = max(ph.get("fan-out, chunks still to start", 0.0), 0.0) / slots / max(tg["chunks"], 1)
    idle = startup + tails + n_chunks * boundary
    occupancy = run_s / (run_s + idle)
    out = {"chunk_size": chunk_size, "chunks": n_chunks, "ideal_run_h": run_s / 3600, "idle_s_per_slot": {
        "start-up (wall)": startup, "pilot, gate and end tail": tails,
        "fan-out, per chunk (upper bound)": n_chunks * boundary}, "tracegen_occupancy": occupancy}  # fmt: skip
    print(f"\n== full scale: {REFERENCE_PROMPTS:,} prompts, {REFERENCE_SERVERS} servers, cap {cap} ==")
    print(
        f"  {n_chunks} chunks of {chunk_size:,}; ideal run {run_s / 3600:.1f} h at {tokens_per_row:,.0f} tokens/row"
    )
    for kind, v in out["idle_s_per_slot"].items():
        print(f"  idle per slot, {kind:34s} {v:8,.0f} s  ({pct(v / run_s)} of the run)")
    print(f"  tracegen whole-run occupancy at the reference job's scale: {pct(occupancy)}")
    if bl is not None:
        # The baseline's idle is partly its end tail (once) and partly round-robin imbalance that recurs
        # all run long; the two bound its occupancy at the reference job's scale.
        once = bl["idle"] / slots
        recurring = 1 - bl["from_first_request"]["occupancy"]
        low, high = 1 - recurring, run_s / (run_s + once)
        out["baseline_occupancy"] = [low, high]
        print(
            f"  baseline: {pct(low)} (its idle all recurring imbalance) to {pct(high)} (all a one-off tail); "
            f"wall tracegen/baseline {low * (run_s + idle) / run_s:.4f} to {(run_s + idle) / (run_s + once):.4f}"
        )
    return out


if __name__ == "__main__":
    sys.exit(main())
