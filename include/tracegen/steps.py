"""The task callables the DAG files wire together: Airflow context in, `tracegen.pipeline` calls out.

This is the one module that touches Airflow's task context; everything it calls is plain Python.
Imports of Airflow and of the heavy modules happen inside the functions, so a DAG file importing
this module parses in milliseconds.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from tracegen.config import SAMPLE_DATASET, RunConfig, safe_run_id

log = logging.getLogger(__name__)

PROJECT_DIR = Path(__file__).resolve().parents[2]
LOCAL_SIM = "local-sim"
CONFIG_PARAMS = (
    "max_tokens", "dataset_uri", "output_uri", "temperature", "top_p", "chunk_size", "pilot_size",
    "truncation_threshold", "gate_mode", "truncated_policy", "invalid_rows",
)


def state_dir() -> Path:
    """Local state of the embedded default (demo output, simulated fleet's pid/log files, spool)."""
    return Path(os.environ.get("TRACEGEN_STATE_DIR") or PROJECT_DIR / ".state")


def default_params() -> dict[str, Any]:
    """Trigger-form defaults: the embedded default runs anywhere (bundled prompts, simulated fleet)."""
    defaults = RunConfig(dataset_uri=str(SAMPLE_DATASET), output_uri=str(state_dir() / "output"))
    params = {name: getattr(defaults, name) for name in CONFIG_PARAMS}
    params["dataset_uri"] = os.environ.get("TRACEGEN_DATASET_URI", params["dataset_uri"])
    params["output_uri"] = os.environ.get("TRACEGEN_OUTPUT_URI", params["output_uri"])
    params["fleet"] = os.environ.get("TRACEGEN_FLEET", LOCAL_SIM)
    return params


def generate_chunk_concurrency() -> int:
    """Chunk tasks of one run in flight at once; each spreads its requests over every server.

    Occupancy hook (bench/occupancy.py): 3, not 2. Tasks started together end together; with 2, both
    were often starting up at once and the fleet idled between chunks (fan-out occupancy 87% vs 95%
    with 3 on the benchmark's fleet). The per-server in-flight auto-tuner shares each server among them.
    """
    return int(os.environ.get("TRACEGEN_CHUNK_CONCURRENCY", "3"))


def local_sim_fleet() -> dict[str, Any]:
    """The bundled simulated fleet: SGLang stand-ins on this machine, launched exactly like SGLang."""
    time_scale = float(os.environ.get("TRACEGEN_SIM_TIME_SCALE", "40"))
    return {
        "hosts": [{"conn_id": "local", "gpus": [0, 1], "base_port": int(os.environ.get("TRACEGEN_SIM_PORT", "31000"))}],
        "model_path": "Qwen/Qwen3.6-27B",
        "served_model_name": "qwen3.6-27b",
        "python": sys.executable,
        "launch_module": "tracegen.simulator",
        "sglang_flags": {
            "--reasoning-parser": "qwen3",
            "--speculative-algorithm": "NEXTN",
            "--speculative-num-steps": 3,
            "--max-running-requests": 64,
            "--context-length": 40960,
            "--enable-metrics": True,
            "--sim-time-scale": time_scale,
        },
        "work_dir": str(state_dir() / "fleet"),
        "health_timeout_s": 60.0,
        "stop_timeout_s": 10.0,
    }


def load_fleet(name: str):
    """'local-sim' or a path to a fleet JSON file; errors say which file and what is wrong."""
    from tracegen.fleet import FleetSpec, FleetSpecError

    if name == LOCAL_SIM:
        return FleetSpec.from_dict(local_sim_fleet())
    path = Path(name)
    if not path.is_file():
        raise FleetSpecError(f"fleet: {name!r} is neither '{LOCAL_SIM}' nor a readable fleet JSON file")
    try:
        return FleetSpec.from_json(path.read_text())
    except FleetSpecError as exc:
        raise FleetSpecError(f"fleet file {path}: {exc}") from None


# ---- tracegen_generate ------------------------------------------------------------------------------


def _context() -> dict[str, Any]:
    from airflow.sdk import get_current_context

    return get_current_context()


def _run(run: dict[str, Any]):
    from tracegen.fleet import FleetSpec

    return RunConfig.from_params(run["config"]), run["run_id"], FleetSpec.from_dict(run["fleet"])


def validate_run() -> dict[str, Any]:
    """Params → validated RunConfig + fleet; a bad param fails here, naming it, before any GPU work.

    The run's snapshot for the tasks after the first ones. `provision_fleet` and `plan_run` call it
    themselves instead of waiting for this task: they start with it, and the first request to the GPUs
    comes one scheduler hand-off sooner (~1 s)."""
    from airflow.sdk.exceptions import AirflowFailException

    from tracegen.config import ConfigError
    from tracegen.fleet import FleetSpecError

    ctx = _context()
    params = dict(ctx["params"])
    try:
        config = RunConfig.from_params({k: params[k] for k in CONFIG_PARAMS})
        fleet = load_fleet(params.get("fleet") or LOCAL_SIM)
    except (ConfigError, FleetSpecError) as exc:
        raise AirflowFailException(f"invalid params: {exc}") from None
    run_id = safe_run_id(ctx["run_id"])
    log.info("run %s: max_tokens=%d, dataset %s, output %s, %d GPUs", run_id, config.max_tokens,
             config.dataset_uri, config.output_uri, len(fleet.servers()))
    return {"run_id": run_id, "config": config.to_json(), "fleet": fleet.to_dict(),
            "teardown": bool(params.get("teardown", False))}


def provision_fleet() -> list[dict[str, Any]]:
    """Launch or reuse one server per GPU and wait for health; check the cap fits the model's context."""
    import httpx
    from airflow.sdk.exceptions import AirflowFailException

    from tracegen.config import ConfigError
    from tracegen.fleet import FleetConnection, provision

    config, _, fleet = _run(validate_run())
    with FleetConnection(fleet) as connection:
        handles = provision(fleet, connection)
        for handle in handles:
            info = httpx.get(f"{handle.url}/server_info", headers=connection.headers(), timeout=30).json()
            try:
                config.check_context_length(int(info.get("context_length") or 0))
            except ConfigError as exc:
                raise AirflowFailException(f"{handle.label}: {exc}") from None
    for handle in handles:
        log.info("%s: %s server pid %d (%s)", handle.label, "reused" if handle.reused else "launched",
                 handle.pid, handle.model)
    return [{"server": h.label, "pid": h.pid, "reused": h.reused} for h in handles]


def plan_run() -> list[dict[str, Any]]:
    """Chunks that still have work for this cap (the mapped fan-outs' input)."""
    from tracegen.pipeline import prepare_run

    config, run_id, fleet = _run(validate_run())
    return [w.to_json() for w in prepare_run(config, run_id, fleet, stagger=generate_chunk_concurrency())]


def run_pilot(run: dict[str, Any], servers: list[dict[str, Any]]) -> dict[str, Any]:
    """Generate the pilot sample; its rows are committed like any other and never generated twice."""
    from tracegen.generate.engine import PILOT_CHUNK
    from tracegen.pipeline import dataset_index, open_ledger, pilot_indices, run_chunk

    config, run_id, fleet = _run(run)
    if config.pilot_size == 0:
        log.info("pilot_size=0: no pilot; the continuous gate watches the fan-out instead")
        return {"indices": 0}
    n_rows = dataset_index(config, open_ledger(config)).n_rows
    indices = pilot_indices(config, n_rows)
    summary = run_chunk(config, run_id, fleet, chunk=PILOT_CHUNK, label=f"pilot ({indices.size:,} rows)",
                        indices=indices)
    return {"indices": int(indices.size), **summary}


def audit_and_gate(
    run: dict[str, Any], pilot: dict[str, Any], chunks: list[dict[str, Any]], lead: int
) -> list[dict[str, Any]]:
    """Audit the pilot rows and stop the run (gate_mode=stop) when truncation is over the threshold.

    Returns the chunks to fan out past the gate: the plan's chunks but the first `lead`, which run beside
    the pilot (`generate_alongside_pilot`)."""
    from airflow.sdk.exceptions import AirflowFailException

    from tracegen.pipeline import audit_and_report, dataset_index, open_ledger, pilot_indices

    config, run_id, fleet = _run(run)
    if not pilot.get("indices"):
        log.info("no pilot (pilot_size=0): nothing to gate on; the continuous gate watches the fan-out")
        return chunks[lead:]
    indices = pilot_indices(config, dataset_index(config, open_ledger(config)).n_rows)
    outcome = audit_and_report(
        config, run_id, name="pilot-report", indices=indices, n_gpus=len(fleet.servers()),
        tokens_per_s_per_gpu=_tokens_per_s_per_gpu(pilot, len(fleet.servers())),
    )
    if outcome.verdict == "stop":
        message = f"{outcome.reason}; see report {outcome.html_uri}"
        if config.gate_mode == "stop":
            raise AirflowFailException(message)
        log.warning("gate_mode=warn, going on: %s", message)
    return chunks[lead:]


def _tokens_per_s_per_gpu(summary: dict[str, Any], n_gpus: int) -> float | None:
    elapsed, tokens = summary.get("elapsed_s") or 0, summary.get("completion_tokens") or 0
    return tokens / elapsed / max(1, n_gpus) if elapsed > 0 and tokens > 0 else None


def generate_chunk(run: dict[str, Any], servers: list[dict[str, Any]], chunk: dict[str, Any]) -> dict[str, Any]:
    """One mapped task past the pilot gate: generate what is left of one chunk. Starts only while the
    running gate holds."""
    return _generate(run, chunk, alongside_pilot=False)


def generate_alongside_pilot(
    run: dict[str, Any], servers: list[dict[str, Any]], chunks: list[dict[str, Any]], slot: int
) -> dict[str, Any]:
    """The plan's chunk number `slot` (one of the first few), generated while the pilot runs and the gate
    audits it: leaves the pilot's rows to the pilot, and stops (committing what finished) as soon as the
    gate says stop."""
    from airflow.sdk.exceptions import AirflowSkipException

    if slot >= len(chunks):
        _context()["chunk_label"] = f"slot {slot}: no chunk"
        raise AirflowSkipException(f"the plan has {len(chunks)} chunks with work; none for slot {slot}")
    return _generate(run, chunks[slot], alongside_pilot=True)


def _generate(run: dict[str, Any], chunk: dict[str, Any], *, alongside_pilot: bool) -> dict[str, Any]:
    from airflow.sdk.exceptions import AirflowFailException

    from tracegen.pipeline import ChunkWork, GateClosed, generate_chunk_work

    work = ChunkWork(**chunk)
    _context()["chunk_label"] = work.label
    config, run_id, fleet = _run(run)
    try:
        return generate_chunk_work(config, run_id, fleet, work, alongside_pilot=alongside_pilot)
    except GateClosed as exc:
        # Failed, not skipped: a run whose chunks did not run must not end looking successful. No retry:
        # it would only find the gate closed again.
        raise AirflowFailException(str(exc)) from None


def final_report(run: dict[str, Any]) -> dict[str, Any]:
    """Audit the whole output root at this run's cap and write report.json / report.html beside the data."""
    from tracegen.pipeline import audit_and_report

    config, run_id, fleet = _run(run)
    return audit_and_report(config, run_id, name="report", n_gpus=len(fleet.servers())).to_json()


def teardown_fleet(run: dict[str, Any]) -> str:
    """Stop the servers when the run asked for it; otherwise leave them for the next run."""
    from tracegen.fleet import teardown

    _, _, fleet = _run(run)
    if not run.get("teardown"):
        return "servers left running (teardown=false)"
    results = teardown(fleet)
    return f"stopped {len(results)} servers"


def watcher() -> None:
    """Fails the run when any task failed: teardown and report run with relaxed trigger rules, and
    without this the run would look successful whenever they did."""
    from airflow.sdk.exceptions import AirflowFailException

    raise AirflowFailException("a task of this run failed; see the failed task's log and the run's report")


# ---- tracegen_rerun_failed -------------------------------------------------------------------------


def output_roots() -> list[str]:
    """Output roots the scheduled rerun looks after: the `tracegen_output_roots` Variable (a JSON list),
    else the default output root."""
    from airflow.sdk import Variable

    raw = Variable.get("tracegen_output_roots", default=None)
    if raw is None:
        return [default_params()["output_uri"]]
    roots = json.loads(raw) if isinstance(raw, str) else raw
    if not isinstance(roots, list) or not all(isinstance(r, str) and r for r in roots):
        raise ValueError(f"Variable tracegen_output_roots must be a JSON list of output URIs, got {raw!r}")
    return roots


def find_unfinished_work() -> list[dict[str, Any]]:
    """Chunks with failed or missing rows in the newest run of each output root; [] when all is done."""
    from tracegen.pipeline import unfinished_work

    work: list[dict[str, Any]] = []
    for root in output_roots():
        if not root.startswith("s3://") and not Path(root.removeprefix("file://")).exists():
            log.info("%s: no output yet", root)
            continue
        work.extend(unfinished_work(root))
    # One mapped task per chunk, bounded well under max_map_length; the next hourly run takes the rest.
    return work[:500]


def rerun_unfinished(work: dict[str, Any]) -> dict[str, Any]:
    """Regenerate what is left of one chunk with the config its run was meant to have."""
    from tracegen.fleet import FleetSpec
    from tracegen.pipeline import ChunkWork, read_run_record, run_chunk
    from tracegen.store.ledger import Ledger
    from tracegen.store.storage import open_storage

    chunk = ChunkWork(work["chunk"], work["start"], work["stop"], work["remaining"])
    _context()["chunk_label"] = f"{work['run_id']} {chunk.label}"
    ledger = Ledger(open_storage(work["output_uri"]))
    record = read_run_record(ledger, work["run_id"])
    return run_chunk(record.config, record.run_id, FleetSpec.from_dict(record.fleet), chunk=chunk.chunk,
                     label=f"rerun {chunk.label}", indices=range(chunk.start, chunk.stop))


# ---- tracegen_fleet ---------------------------------------------------------------------------------


def fleet_action() -> list[dict[str, Any]]:
    from dataclasses import asdict

    from tracegen.fleet import provision, status, teardown

    params = _context()["params"]
    fleet = load_fleet(params["fleet"])
    action = params["action"]
    if action == "start":
        result = [asdict(h) for h in provision(fleet)]
    elif action == "stop":
        result = [asdict(r) for r in teardown(fleet)]
    else:
        result = [asdict(s) for s in status(fleet)]
    for item in result:
        log.info("%s", json.dumps(item, default=str))
    return result
