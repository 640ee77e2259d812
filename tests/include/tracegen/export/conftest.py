"""A `make demo`-sized output root, made once per test session: the bundled 3,000 prompts on two SGLang
stand-ins launched as the demo's fleet is (Qwen3 model path and served name, the qwen3 reasoning parser,
40,960 context), generated at the reference job's 4096 cap and then pivoted to 8192 (truncated rows extended from
their token ids), through the chunk engine the DAG's tasks run. Each run records what its servers report
(`tracegen.export.servers.record`, as the provisioning task should).
"""

from __future__ import annotations

import gzip
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
from engine_support.helpers import endpoints, make_config, prepare, root_of, run_engine
from fixtures.simulator import start_sim_server

from tracegen.config import SAMPLE_DATASET
from tracegen.export.servers import record

DEMO_FLAGS = dict(model_path="Qwen/Qwen3.6-27B", served_model_name="qwen3.6-27b", reasoning_parser="qwen3",
                  context_length=40960, max_running_requests=256, sim_time_scale=20000)


@dataclass(frozen=True)
class DemoRun:
    root: Path
    dataset: Path
    n_rows: int
    urls: tuple[str, ...]


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> DemoRun:
    tmp = tmp_path_factory.mktemp("demo-run")
    dataset = tmp / "prompts.jsonl"
    with gzip.open(SAMPLE_DATASET, "rb") as src, dataset.open("wb") as dst:
        shutil.copyfileobj(src, dst)
    n_rows = sum(1 for _ in dataset.open("rb"))
    root = tmp / "output"
    sims = [start_sim_server(tmp, **DEMO_FLAGS) for _ in range(2)]
    try:
        servers = endpoints(*sims, in_flight=256)
        urls = tuple(s.url for s in sims)
        for run_id, cap in (("run-4096", 4096), ("run-8192", 8192)):
            config = make_config(dataset, root, max_tokens=cap, part_rows=250, part_seconds=30.0)
            prepare(config, run_id)
            record(root_of(config), run_id, urls)
            run_engine(config, run_id, servers, tmp / "spool", range(n_rows))
    finally:
        for s in sims:
            s.stop()
    return DemoRun(root, dataset, n_rows, urls)
