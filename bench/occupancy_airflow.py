"""GPU occupancy of a whole `tracegen_generate` run on a real Airflow, vs the reference job's script on the same fleet.

bench/occupancy.py models Airflow (bare task processes, a fixed 1 s scheduler delay). This runs the real
thing: a distributed Airflow 3 as local processes (tests/e2e/airflow_cluster.py, as `make airflow-up`:
PostgreSQL metadata DB, CeleryExecutor on Redis, api-server, scheduler, dag-processor, triggerer, Celery
workers) running the DAG unchanged on its bundled `local-sim` fleet (two SGLang stand-ins, 64 slots each),
the run triggered through the REST API.

1. A warm-up run of 40 prompts lets the DAG's own provision_fleet task launch the local-sim fleet (on a free
   port pair, at the chosen time scale), as the long-lived servers of a deployment are; the measured run
   reuses it (checked: same pids), so the sampler watches from the trigger on the very servers the run
   uses and their counters never reset mid-run.
2. Trigger → run end (the DAG run's end_date, as the scheduler records it): the stand-ins' own counters
   (busy / available slot-seconds, generated tokens) are sampled 5×/s. Whole-run occupancy = busy /
   available over [trigger, run end]. "From the first request" starts at the last sample before busy
   first grows; start-up is the wall time from the trigger to that sample. Ideal wall = tokens ÷ fleet
   capacity (every slot decoding, with the step model the servers report). Idle slot-time is attributed to
   the run's phase, and the task instances' timestamps give the latency of every hand-off.
3. The cluster is stopped (which stops the fleet), the fleet relaunched identically, and the reference job's script
   (bench/occupancy_support/baseline.py: one asyncio process, semaphore = every slot of the fleet) runs
   over the same prompts, sampled the same way, with no Airflow on the machine, as the reference job ran.

    make bench-occupancy-airflow        # = .venv/bin/python bench/occupancy_airflow.py
    .venv/bin/python bench/occupancy_airflow.py --rows 1500 --time-scale 40    # smoke run, about 2 minutes

Defaults: 16,000 prompts at time scale 8, cap 8192 — a tracegen run of about 6 minutes, long against the
2–3 s from the trigger to the first request; about 13 minutes in all on 2 cores (cluster start-up, warm-up
run, tracegen run, baseline). Starts private PostgreSQL and Redis servers on free loopback ports, like
`make airflow-up` (Debian's postgresql and redis-server packages: `make system-deps`; docs/deployment.md).
`--keep` keeps the work directory: Airflow's task logs, the output, results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections import defaultdict
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "include"))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests" / "e2e"))

from airflow_cluster import AirflowApi, AirflowCluster, ClusterError, free_port  # noqa: E402
from occupancy import pct, window, write_dataset  # noqa: E402
from occupancy_support.fleet import Fleet, Sample, Sampler, running_fleet  # noqa: E402

from tracegen import params  # noqa: E402
from tracegen.config import LOCAL_SIM  # noqa: E402
from tracegen.fleet import FleetConnection, FleetSpec, provision, teardown  # noqa: E402
from tracegen.fleet.sources import local_sim_fleet  # noqa: E402
from tracegen.status import dataset_status  # noqa: E402

DAG = "tracegen_generate"
BASELINE = ROOT / "bench" / "occupancy_support" / "baseline.py"
# Every mapped chunk task of the DAG: the first fan-out, the one while a question waits, the one at the cap
# the answer decided. Each takes its slot under max_active_tis_per_dagrun.
CHUNK_TASKS = ("generate_alongside_pilot", "generate_chunk", "generate_while_asking", "generate_at_decided_cap")
# Every task that sends requests: the phases are cut at their starts and ends (an ask-path run generates most
# of its rows in generate_while_asking).
GENERATION_TASKS = ("run_pilot", "measure_tail", *CHUNK_TASKS, "resample_runaways")


def epoch(iso: str | None) -> float | None:
    return datetime.fromisoformat(iso).timestamp() if iso else None


def measure(samples: list[Sample], fleet: Fleet) -> dict:
    """Whole window, and from the first request: the window from the last sample before busy first grows
    (so the first busy interval counts whole), with the wall time before it as start-up."""
    if any(b.available < a.available for a, b in zip(samples, samples[1:], strict=False)):
        raise SystemExit("a stand-in's counters went backwards (restarted mid-run?): the measurement is void")
    first = next((i for i in range(1, len(samples)) if samples[i].busy > samples[i - 1].busy), None)
    if first is None:
        raise SystemExit("the fleet never became busy")
    start = samples[first - 1]
    return {**window(samples, fleet), "from_first_request": window(samples[first - 1 :], fleet),
            "first_request_t": start.t, "startup_wall_s": start.t - samples[0].t}  # fmt: skip


# ---- tracegen on Airflow ----------------------------------------------------------------------------


def provision_through_dag(api: AirflowApi, spec: FleetSpec, work: Path, args) -> tuple[Fleet, list[int]]:
    """A warm-up run of a few prompts, whose provision_fleet task launches the fleet: the servers of a
    long-lived deployment, which the measured run then reuses. Launching them from this process instead
    would not do: the DAG's spec reaches provision_fleet through XCom (PostgreSQL JSONB, which reorders
    the SGLang flags), so its config hash differs and it would relaunch them mid-sampling."""
    dataset = work / "warmup.jsonl"
    write_dataset(dataset, 40)
    # No pilot, gate only warns: a few rows say nothing about truncation and must not stop the warm-up.
    conf = {"max_tokens": args.max_tokens, "dataset_uri": str(dataset), "output_uri": str(work / "warmup"),
            "pilot_size": 0, "gate_mode": "warn", "fleet": LOCAL_SIM}  # fmt: skip
    run_id = api.trigger(DAG, conf)
    if api.wait_run(DAG, run_id, 600) != "success":
        raise SystemExit(f"the warm-up run failed: {api.describe(DAG, run_id)}")
    pids = sorted(s["pid"] for s in api.xcom(DAG, run_id, "provision_fleet"))
    with FleetConnection(spec) as connection:
        return running_fleet(connection.urls()), pids


def run_tracegen(cluster: AirflowCluster, fleet: Fleet, pids: list[int], dataset: Path, output: Path,
                 args) -> dict:  # fmt: skip
    api = cluster.api()
    conf = {"max_tokens": args.max_tokens, "dataset_uri": str(dataset), "output_uri": str(output),
            "pilot_size": args.pilot, "fleet": LOCAL_SIM}  # fmt: skip
    if args.chunk_size:
        conf["chunk_size"] = args.chunk_size
    if args.whole_rows:
        conf["stop_loops"] = False
    if args.ask_late is not None:
        # The ask path: the pilot gate stops 4096 and asks; the fleet works at the recommended cap while the
        # question waits (the whole dataset may be done meanwhile), and the answer comes ask_late seconds late.
        conf.update(max_tokens=ASK_CAP, while_asking_budget_pct=100.0)
    sampler = Sampler(fleet.urls)
    sampler.start()  # its first sample is read before the trigger: the window starts at the trigger
    triggered = time.time()
    run_id = api.trigger(DAG, conf)
    answer = None
    try:
        if args.ask_late is not None:
            answer = answer_late(api, run_id, args.ask_late)
        state = api.wait_run(DAG, run_id, args.timeout)
    finally:
        samples = sampler.stop()
    run = api.run(DAG, run_id)
    tis = api.task_instances(DAG, run_id)
    if state != "success":
        raise SystemExit(
            f"{DAG} {run_id} ended {state}: {api.describe(DAG, run_id)}\n{cluster.logs_summary()}"
        )
    # A relaunched server would have reset its counters and not be the one sampled.
    servers = api.xcom(DAG, run_id, "provision_fleet")
    if sorted(s["pid"] for s in servers) != pids or not all(s["reused"] for s in servers):
        raise SystemExit(f"the run did not reuse the warm-up run's fleet (pids {pids}): {servers}")
    ended = epoch(run["end_date"])
    # The sampler ran until the poll saw the run end (up to 2 s later): cut at the scheduler's end_date.
    samples = [s for s in samples if s.t <= ended]
    result = measure(samples, fleet)
    chunks = api.xcom(DAG, run_id, "prepare_run", key="chunks")
    status = dataset_status(str(output))
    result.update({
        "run_id": run_id, "triggered": triggered, "ended": ended, "tis": tis, "samples": samples,
        "rows": status["done"], "total": status["total"], "truncated": status["truncated"],
        "chunks": len(chunks), "chunk_rows": max((c["stop"] - c["start"] for c in chunks), default=0),
        "upstream": upstream_of(api), "queued_at": epoch(run["queued_at"]), "started": epoch(run["start_date"]),
        "answer": answer, "fleet": fleet,
    })  # fmt: skip
    result["phases"] = attribute(samples, tis, result["first_request_t"])
    return result


ASK_CAP = 4096  # the ask path's cap: the reference job's, which the bundled prompts' pilot stops at


def answer_late(api: AirflowApi, run_id: str, late_s: float) -> dict:
    """Wait for the run's question, answer it `late_s` seconds after it was posed with the recommended cap
    (through the REST API, as the UI does), and say when and what."""
    path = f"/dags/{DAG}/dagRuns/{urllib.parse.quote(run_id, safe='')}/taskInstances/review_cap/-1/hitlDetails"
    deadline = time.monotonic() + 1800
    while time.monotonic() < deadline:
        states = {t["task_id"]: t["state"] for t in api.task_instances(DAG, run_id) if t["map_index"] == -1}
        if states.get("review_cap") == "awaiting_input":
            break
        if api.run(DAG, run_id)["state"] not in ("queued", "running"):
            raise SystemExit(f"the run ended without asking: {api.describe(DAG, run_id)}")
        time.sleep(0.5)
    asked = time.time()
    detail = api._call("GET", path)
    time.sleep(max(0.0, late_s - (time.time() - asked)))
    option = detail["options"][0]
    api._call("PATCH", path, json={"chosen_options": [option], "params_input": {"cap": None}})
    print(f"the question was posed, and answered {time.time() - asked:.0f} s later: {option}", flush=True)
    return {"asked": asked, "answered": time.time(), "option": option}


def upstream_of(api: AirflowApi) -> dict[str, set[str]]:
    response = api.client.get(f"/dags/{DAG}/tasks")
    response.raise_for_status()
    upstream: dict[str, set[str]] = defaultdict(set)
    for task in response.json()["tasks"]:
        for down in task["downstream_task_ids"] or []:
            upstream[down].add(task["task_id"])
    return upstream


def ran(tis: list[dict], task_id: str) -> list[dict]:
    """The task's instances that actually ran (skipped ones have no meaningful start), by start time."""
    out = [
        t for t in tis if t["task_id"] == task_id and t["state"] in ("success", "failed") and t["start_date"]
    ]
    return sorted(out, key=lambda t: epoch(t["start_date"]))


def attribute(samples: list[Sample], tis: list[dict], first_request: float) -> dict[str, float]:
    """Idle slot-seconds (simulated) by what the run was doing while they were idle."""
    gate = ran(tis, "audit_and_gate")
    gate_end = epoch(gate[0]["end_date"]) if gate else first_request
    generating = [t for task in GENERATION_TASKS for t in ran(tis, task)]
    starts = [epoch(t["start_date"]) for t in generating]
    last_end = max(epoch(t["end_date"]) for t in generating)
    idle: dict[str, float] = defaultdict(float)
    for a, b in zip(samples, samples[1:], strict=False):
        mid = (a.t + b.t) / 2
        if mid < first_request:
            phase = "start-up: trigger to first request"
        elif mid < gate_end:
            phase = "pilot + gate (first chunks alongside)"
        elif any(s > mid for s in starts):
            phase = "fan-out, chunk tasks still to start"
        elif mid < last_end:
            phase = "end tail: last chunk tasks finishing"
        else:
            phase = "after generation: report, teardown, run end"
        idle[phase] += (b.available - a.available) - (b.busy - a.busy)
    return dict(idle)


def handoffs(tg: dict) -> list[dict]:
    """Per task: when it became ready (its upstream tasks ended; for a mapped chunk task also a free slot
    under max_active_tis_per_dagrun), when the scheduler queued it, when a worker started it."""
    limit = params.generate_chunk_concurrency()
    tis, t0 = tg["tis"], tg["triggered"]
    ends = defaultdict(list)
    for t in tis:
        if t["end_date"]:  # skipped ones too: a mapped task over nothing is skipped when it is decided
            ends[t["task_id"]].append(epoch(t["end_date"]))
    order = sorted({t["task_id"] for t in tis if ran(tis, t["task_id"])},
                   key=lambda task: epoch(ran(tis, task)[0]["start_date"]))  # fmt: skip
    rows = []
    for task in order:
        instances = ran(tis, task)
        ups = [e for up in tg["upstream"].get(task, ()) for e in ends[up]]
        up_ready = max(ups) if ups else tg["started"]  # the first task waits for the run to start
        own_ends: list[float] = []
        scheduled, started = [], []
        for i, t in enumerate(instances):
            ready = up_ready
            if task in CHUNK_TASKS and i >= limit:
                ready = max(ready, sorted(own_ends)[i - limit])  # a slot freed when one of the earlier ended
            queued, start = epoch(t["queued_when"]) or epoch(t["start_date"]), epoch(t["start_date"])
            scheduled.append(queued - ready)
            started.append(start - queued)
            own_ends.append(epoch(t["end_date"]))
        rows.append({"task": task, "n": len(instances), "start": epoch(instances[0]["start_date"]) - t0,
                     "end": max(own_ends) - t0, "scheduled": scheduled, "started": started,
                     "duration": [e - epoch(t["start_date"]) for t, e in zip(instances, own_ends, strict=True)]})  # fmt: skip
    return rows


# ---- the reference job's script ------------------------------------------------------------------------------


def run_baseline(fleet: Fleet, work: Path, dataset: Path, cap: int) -> dict:
    sampler = Sampler(fleet.urls)
    sampler.start()
    try:
        out = subprocess.run([sys.executable, str(BASELINE), str(dataset), str(work), str(cap), str(fleet.slots),
                              *fleet.urls], check=True, capture_output=True, text=True)  # fmt: skip
    finally:
        samples = sampler.stop()
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return {**measure(samples, fleet), "rows": result["rows"]}


# ---- main ---------------------------------------------------------------------------------------------


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=16000, help="prompts in the dataset")
    p.add_argument("--time-scale", type=float, default=8.0, help="simulated seconds per wall second")
    p.add_argument("--max-tokens", type=int, default=8192)
    p.add_argument("--pilot", type=int, default=500, help="pilot_size")
    p.add_argument("--chunk-size", type=int, default=0, help="chunk_size (default 0: the DAG chooses)")
    p.add_argument("--workers", type=int, default=2, help="Celery workers")
    # Deployment sizing: slots >= chunk concurrency + 2. The DAG can run the chunks alongside the pilot and
    # the first chunks past the gate at once (2 x 3), so 2 x 3 slots never hold a chunk task back.
    p.add_argument("--worker-concurrency", type=int, default=3, help="Celery slots per worker")
    p.add_argument("--timeout", type=float, default=3600, help="wall seconds the run may take")
    p.add_argument("--ask-late", type=float, default=None, metavar="S",
                   help="the ask path: trigger at 4096 so the pilot gate asks, answer S seconds late with the "
                        "recommended cap (the baseline runs at --max-tokens, the cap the answer chooses)")
    p.add_argument("--skip-baseline", action="store_true")
    p.add_argument("--whole-rows", action="store_true",
                   help="stop_loops=false: every row asked of the chat route whole, none streamed")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs, output)")
    args = p.parse_args()

    began = time.time()
    root = Path(tempfile.mkdtemp(prefix="tracegen-occupancy-airflow-"))
    # The DAG's fleet is local_sim_fleet() in the workers' environment: these variables give it a
    # free port pair and the time scale, and give this process the same spec (URLs, pid files, teardown).
    env = {"TRACEGEN_STATE_DIR": str(root / "state"), "TRACEGEN_SIM_PORT": str(free_port(2)),
           "TRACEGEN_SIM_TIME_SCALE": repr(args.time_scale)}  # fmt: skip
    os.environ.update(env)
    spec = FleetSpec.from_dict(local_sim_fleet())
    cluster = AirflowCluster(
        root, workers=args.workers, worker_concurrency=args.worker_concurrency, extra_env=env
    )
    bl = None
    try:
        dataset = root / "prompts.jsonl"
        write_dataset(dataset, args.rows)
        load = os.getloadavg()[0]
        t = time.time()
        cluster.start()
        cluster_s = time.time() - t
        api = cluster.api()
        api.wait_for_dag(DAG)
        api.unpause(DAG)
        t = time.time()
        fleet, pids = provision_through_dag(api, spec, root, args)
        warmup_s = time.time() - t
        print(
            f"fleet: local-sim, {len(fleet.urls)} stand-ins x {fleet.max_running} slots, time scale "
            f"{fleet.time_scale:g}, capacity {fleet.capacity_tokens_per_wall_s():,.0f} tok/wall-s; {args.rows:,} "
            f"prompts, cap {args.max_tokens}, pilot {args.pilot}; Airflow: CeleryExecutor, {args.workers} workers "
            f"x {args.worker_concurrency} slots, {params.generate_chunk_concurrency()} chunk tasks per mapped task "
            f"at once; baseline semaphore {fleet.slots}; load average before start {load:.2f}",
            flush=True,
        )
        print(
            f"cluster up in {cluster_s:.0f} s (PostgreSQL DB {cluster.database}), warm-up run (launches the "
            f"fleet) {warmup_s:.0f} s; triggering the measured {DAG} run ...",
            flush=True,
        )
        tg = run_tracegen(cluster, fleet, pids, dataset, root / "output", args)
        print(f"tracegen run done: {tg['wall_s']:.0f} s wall", flush=True)
        # The baseline runs with no Airflow on the machine, as the reference job ran. Stopping the cluster also
        # stops the fleet (by its pid files); it is relaunched with the same spec, fresh counters.
        cluster.stop()
        if not args.skip_baseline:
            handles = provision(spec)
            fleet = running_fleet([h.url for h in handles])
            bl = run_baseline(fleet, root / "baseline", dataset, args.max_tokens)
            print(f"baseline done: {bl['wall_s']:.0f} s wall", flush=True)
        report(tg, bl)
        print(
            f"  cluster start-up {cluster_s:.0f} s and warm-up run {warmup_s:.0f} s: outside the run's window"
        )
        if args.keep:
            results = {"tracegen": {k: v for k, v in tg.items() if k not in ("samples", "fleet")}, "baseline": bl}
            (root / "results.json").write_text(json.dumps(results, indent=2, default=str))
            # The fleet's counters over the run, for looking at where idle slot-time falls.
            (root / "samples.json").write_text(json.dumps([vars(s) for s in tg["samples"]]))
    except ClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        cluster.stop()
        teardown(spec)  # by pid file and process group, never by name
        if args.keep:
            print(f"work directory kept: {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
        print(f"benchmark took {time.time() - began:.0f} s", flush=True)
    return 0


def mm(xs: list[float]) -> str:
    """median/max"""
    return f"{statistics.median(xs):6.1f}/{max(xs):6.1f}"


def report(tg: dict, bl: dict | None) -> None:
    print(f"\n== {DAG} on Airflow (CeleryExecutor) vs the reference job's script ==")
    print(
        f"  tracegen run: {tg['rows']:,}/{tg['total']:,} rows done ({tg['truncated']:,} truncated), "
        f"{tg['chunks']} chunks of up to {tg['chunk_rows']:,} rows"
    )
    runs = (("tracegen", tg), ("baseline", bl)) if bl else (("tracegen", tg),)
    for name, r in runs:
        print(
            f"  {name:9s} occupancy {pct(r['occupancy'])}  wall {r['wall_s']:6.1f} s  ideal {r['ideal_s']:6.1f} s"
            f"  wall/ideal {r['wall_s'] / r['ideal_s']:.3f}  rows {r['rows']:,}  tokens {r['tokens']:,.0f}"
        )
    if bl:
        print(
            f"  tracegen/baseline: wall {tg['wall_s'] / bl['wall_s']:.3f}, occupancy "
            f"{tg['occupancy'] / bl['occupancy']:.3f}"
        )
    for name, r in runs:
        run = r["from_first_request"]
        print(
            f"  {name:9s} from its first request: occupancy {pct(run['occupancy'])}, wall {run['wall_s']:.1f} s, "
            f"wall/ideal {run['wall_s'] / run['ideal_s']:.3f}; {r['startup_wall_s']:.1f} wall s of start-up before it"
        )
    if bl:
        a, b = tg["from_first_request"], bl["from_first_request"]
        print(
            f"  tracegen/baseline from the first request: wall {a['wall_s'] / b['wall_s']:.3f}, occupancy "
            f"{a['occupancy'] / b['occupancy']:.3f}"
        )
    if tg.get("answer"):
        a = tg["answer"]
        during = [s for s in tg["samples"] if a["asked"] <= s.t <= a["answered"]]
        after = [s for s in tg["samples"] if s.t >= a["answered"]]
        print(f"  the question waited {a['answered'] - a['asked']:.0f} s ('{a['option']}'): occupancy while it waited "
              f"{pct(window(during, tg['fleet'])['occupancy'])}, after the answer "
              f"{pct(window(after, tg['fleet'])['occupancy']) if len(after) > 1 else 'n/a (nothing left)'}")
    print("  tracegen idle slot-time (simulated slot-s, % of available) by phase:")
    for phase, idle in sorted(tg["phases"].items(), key=lambda kv: -kv[1]):
        idle = max(idle, 0.0)  # sampling jitter makes an all-busy phase a hair negative
        print(f"    {phase:45s} {idle:10,.0f}  {pct(idle / tg['available'])}")

    t0 = tg["triggered"]
    print(
        f"  run timeline (wall s after the trigger): run queued {tg['queued_at'] - t0:.1f}, started "
        f"{tg['started'] - t0:.1f}, first request {tg['first_request_t'] - t0:.1f}, ended {tg['ended'] - t0:.1f}"
    )
    print("  task hand-offs (wall s): ready->queued = scheduler, queued->started = Celery + task supervisor;")
    print("  median/max over the task's instances (a chunk task is ready when a max_active_tis slot frees)")
    print(f"    {'task':26s} {'n':>3s} {'start':>7s} {'end':>7s} {'ready->queued':>15s} {'queued->started':>16s} "
          f"{'duration':>15s}")  # fmt: skip
    for row in handoffs(tg):
        print(f"    {row['task']:26s} {row['n']:3d} {row['start']:7.1f} {row['end']:7.1f} {mm(row['scheduled']):>15s} "
              f"{mm(row['started']):>16s} {mm(row['duration']):>15s}")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
