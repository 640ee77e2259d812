"""Runs one chunk in its own process, the way a mapped Airflow task does, so tests can SIGKILL/SIGTERM it.

    python chunk_driver.py '{"config": {...RunConfig params}, "run_id": ..., "chunk": 0, "start": 0,
                             "stop": 500, "spool_dir": ..., "model": ..., "servers": [{"url": ...}],
                             "client": {...ClientConfig overrides}, "writer": optional lease owner,
                             "lease_wait_s": optional}'

Prints the chunk summary as one JSON line on stdout and exits 0; on ChunkInterrupted prints the
message on stderr and exits 3 (any other error: a traceback and exit 1).
"""

from __future__ import annotations

import json
import logging
import sys

import numpy as np

from tracegen.config import RunConfig
from tracegen.dataset.stored import load_index
from tracegen.generate.engine import ChunkEngine, ChunkInterrupted, ChunkJob, ChunkOptions
from tracegen.sglang.client import ClientConfig
from tracegen.sglang.routing import ServerEndpoint
from tracegen.store.root import open_root


def main(argv: list[str]) -> int:
    job = json.loads(argv[1])
    if job.get("ready_file"):
        # Imports done (they take seconds on a busy box): tells a test when killing us tests the engine.
        open(job["ready_file"], "w").close()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    config = RunConfig.from_params(job["config"])
    root = open_root(config.output_uri, config.aws_conn_id)
    servers = [ServerEndpoint(s["url"], max_in_flight=s["max_in_flight"]) for s in job["servers"]]
    client = ClientConfig(request_deadline_s=config.request_deadline_s, max_attempts=config.max_attempts,
                          **job.get("client", {}))
    # "writer": the lease owner (another owner's driver yields to it, or takes the root once its lease is stale).
    owner = {"writer": job["writer"], "lease_wait_s": job.get("lease_wait_s")} if job.get("writer") else {}
    work = ChunkJob(config=config, run_id=job["run_id"], model=job["model"], chunk=job["chunk"],
                    label=f"chunk {job['chunk']}")
    options = ChunkOptions(spool_dir=job["spool_dir"], client_config=client, progress_interval_s=3600, **owner)
    engine = ChunkEngine(work, root=root, dataset=load_index(root), servers=servers, options=options)
    try:
        summary = engine.run(np.arange(job["start"], job["stop"], dtype=np.int64)).to_json()
    except ChunkInterrupted as exc:
        print(f"ChunkInterrupted: {exc}", file=sys.stderr, flush=True)
        print(json.dumps({**engine.summary.to_json()}), flush=True)
        return 3
    print(json.dumps({**summary}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
