"""One DAG task as its own process, the way LocalExecutor runs a task instance: a fresh interpreter that
imports tracegen and calls the same pipeline function the DAG's task callable calls (`tracegen.steps`
minus the Airflow context). Writes its timings to a JSON file the orchestrator reads.

    python task.py SPEC.json OUT.json
"""

from __future__ import annotations

import json
import sys
import time

STARTED = time.time()  # before the heavy imports: start-up cost is part of a task's overhead

from tracegen.config import RunConfig  # noqa: E402
from tracegen.fleet import FleetSpec  # noqa: E402
from tracegen.generate.engine import PILOT_CHUNK  # noqa: E402
from tracegen.pipeline import (  # noqa: E402
    ChunkWork,
    GateClosed,
    audit_and_report,
    dataset_index,
    generate_chunk_work,
    open_ledger,
    pilot_indices,
    prepare_run,
    run_chunk,
    starting_in_flight,
)
from tracegen.sglang.routing import ServerEndpoint  # noqa: E402


def main(spec_path: str, out_path: str) -> int:
    spec = json.loads(open(spec_path).read())
    config = RunConfig.from_params(spec["config"])
    fleet = FleetSpec.from_dict(spec["fleet"])
    run_id = spec["run_id"]
    # What fleet_endpoints yields after provisioning (the bench's servers are already up, so the
    # provisioning check is replaced by the URLs themselves).
    endpoints = [
        ServerEndpoint(u, max_in_flight=starting_in_flight(config), name=f"sim:gpu{i}")
        for i, u in enumerate(spec["urls"])
    ]
    out: dict = {"started": STARTED, "imported": time.time()}
    step = spec["step"]
    if step == "plan":
        out["chunks"] = [w.to_json() for w in prepare_run(config, run_id, fleet, stagger=spec["stagger"])]
    elif step == "pilot":
        indices = pilot_indices(config, dataset_index(config, open_ledger(config)).n_rows)
        out["work_start"] = time.time()
        out["summary"] = run_chunk(
            config, run_id, fleet, chunk=PILOT_CHUNK, label="pilot", indices=indices, endpoints=endpoints
        )
        out["work_end"] = time.time()
    elif step == "gate":
        indices = pilot_indices(config, dataset_index(config, open_ledger(config)).n_rows)
        outcome = audit_and_report(
            config, run_id, name="pilot-report", indices=indices, n_gpus=len(endpoints)
        )
        out["verdict"] = outcome.verdict
        out["reason"] = outcome.reason
        if outcome.verdict == "stop" and config.gate_mode == "stop":
            out["ended"] = time.time()
            json.dump(out, open(out_path, "w"))
            return 3
    elif step == "chunk":
        # What steps.generate_chunk / steps.generate_alongside_pilot call, minus the Airflow context.
        work = ChunkWork(**spec["chunk"])
        out["work_start"] = time.time()
        try:
            out["summary"] = generate_chunk_work(
                config, run_id, fleet, work, alongside_pilot=spec["alongside_pilot"], endpoints=endpoints
            )
        except GateClosed as exc:
            out["gate_closed"] = str(exc)
        out["work_end"] = time.time()
    else:
        raise SystemExit(f"unknown step {step!r}")
    out["ended"] = time.time()
    json.dump(out, open(out_path, "w"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
