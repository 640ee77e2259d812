"""One DAG task as its own process, the way LocalExecutor runs a task instance: a fresh interpreter that
imports tracegen and calls the same package function the DAG's task callable calls (`tracegen.steps`
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
from tracegen.generate.chunk import GateClosed, generate_chunk_work, run_pilot, starting_in_flight  # noqa: E402
from tracegen.run.plan import ChunkWork, pilot_indices  # noqa: E402
from tracegen.run.prepare import prepare_run  # noqa: E402
from tracegen.run.run_record import read_run_record  # noqa: E402
from tracegen.run.run_report import audit_and_report  # noqa: E402
from tracegen.run.run_spec import FleetRef  # noqa: E402
from tracegen.sglang.routing import ServerEndpoint  # noqa: E402
from tracegen.store.root import open_root  # noqa: E402


def main(spec_path: str, out_path: str) -> int:
    job = json.loads(open(spec_path).read())
    config = RunConfig.from_params(job["config"])
    run_id = job["run_id"]
    # What fleet_endpoints yields after provisioning (the bench's servers are already up, so the
    # provisioning check is replaced by the URLs themselves).
    endpoints = [
        ServerEndpoint(u, max_in_flight=starting_in_flight(config), name=f"sim:gpu{i}")
        for i, u in enumerate(job["urls"])
    ]
    out: dict = {"started": STARTED, "imported": time.time()}
    step = job["step"]
    if step == "plan":
        ref = FleetRef.of(FleetSpec.from_dict(job["fleet"]), "bench-fleet")
        _, work = prepare_run(config, run_id, ref, stagger=job["stagger"])
        out["chunks"] = [w.to_json() for w in work]
        json.dump(out | {"ended": time.time()}, open(out_path, "w"))
        return 0
    # The run as the DAG's tasks receive it from prepare_run (here: from its record).
    spec = read_run_record(open_root(config.output_uri, config.aws_conn_id), run_id)
    if step == "pilot":
        out["work_start"] = time.time()
        out["summary"] = run_pilot(spec, endpoints=endpoints).to_json()
        out["work_end"] = time.time()
    elif step == "gate":
        indices = pilot_indices(config, spec.dataset.n_rows)
        outcome = audit_and_report(spec, name="pilot-report", indices=indices)
        out["verdict"] = outcome.verdict
        out["reason"] = outcome.reason
        if outcome.verdict == "stop" and config.gate_mode == "stop":
            out["ended"] = time.time()
            json.dump(out, open(out_path, "w"))
            return 3
    elif step == "chunk":
        # What steps.generate_chunk / steps.generate_alongside_pilot call, minus the Airflow context.
        work = ChunkWork.from_json(job["chunk"])
        out["work_start"] = time.time()
        try:
            out["summary"] = generate_chunk_work(
                spec, work, alongside_pilot=job["alongside_pilot"], endpoints=endpoints
            ).to_json()
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
