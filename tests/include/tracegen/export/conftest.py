"""A `make demo`-sized output root, made once per pytest run (shared by every xdist worker: the first to
need it builds it under a file lock, the others read it; the tests only read it): the bundled 3,000 prompts on two SGLang
stand-ins launched as the demo's fleet is (Qwen3 model path and served name, the qwen3 reasoning parser,
40,960 context), generated at the reference job's 4096 cap and then pivoted to 8192 (truncated rows extended from
their token ids), through the chunk engine the DAG's tasks run. Each run records what its servers report
(`tracegen.export.servers.record`, as the provisioning task should).
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
from engine_support.helpers import endpoints, make_config, prepare, root_of, run_engine
from filelock import FileLock
from fixtures.simulator import start_sim_server

from tracegen.config import SAMPLE_DATASET
from tracegen.export import export_dataset
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
def demo_run(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> DemoRun:
    if worker_id == "master":  # not under xdist
        return _build(tmp_path_factory.mktemp("demo-run"))
    # Under xdist every worker's base temp sits in one folder that this pytest run alone uses: built there,
    # the demo run is made once for all workers and never read by another pytest run.
    shared = tmp_path_factory.getbasetemp().parent / "demo-run"
    built = shared / "demo-run.json"
    with FileLock(f"{shared}.lock"):
        if not built.exists():  # none built yet, or a worker's build failed part way
            shutil.rmtree(shared, ignore_errors=True)
            shared.mkdir()
            run = _build(shared)
            built.write_text(json.dumps({"root": str(run.root), "dataset": str(run.dataset),
                                         "n_rows": run.n_rows, "urls": list(run.urls)}))
    doc = json.loads(built.read_text())
    return DemoRun(Path(doc["root"]), Path(doc["dataset"]), int(doc["n_rows"]), tuple(doc["urls"]))


def _build(tmp: Path) -> DemoRun:
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


def _export_layout(demo_run: DemoRun, dest: Path, layout: str) -> dict:
    """Export the demo run in `layout` to `dest`; its manifest, once the folder's shape is checked."""
    result = export_dataset(str(demo_run.root), str(dest), layout=layout)
    manifest = json.loads((dest / "manifest.json").read_text())
    assert manifest["rows"] == result.rows > 0 and manifest["layout"] == layout
    data_dir = dest / manifest["data_dir"]
    # The data file alone in its folder: `speculators prepare-data --data DIR` reads every .json/.jsonl there.
    assert [p.name for p in data_dir.iterdir()] == [f"{layout}.jsonl"]
    assert sorted(p.name for p in dest.iterdir()) == sorted(["manifest.json", manifest["data_dir"].rstrip("/")])
    return manifest


@pytest.fixture(scope="session")
def export_layout():
    return _export_layout


@pytest.fixture(scope="module")
def tokens_export(demo_run, tmp_path_factory):
    """The demo run's `tokens` export: (destination, manifest, rows)."""
    dest = tmp_path_factory.mktemp("tokens-export") / "export"
    manifest = _export_layout(demo_run, dest, "tokens")
    rows = [json.loads(line) for line in (dest / manifest["data_file"]).read_text().splitlines()]
    return dest, manifest, rows


@pytest.fixture(scope="module")
def hf_cache(tmp_path_factory):
    """Hugging Face's caches in a throwaway place for the trainers' loaders (nothing is looked up on a hub)."""
    cache = tmp_path_factory.mktemp("hf-cache")
    saved = {k: os.environ.get(k) for k in ("HF_HOME", "HF_DATASETS_CACHE")}
    os.environ.update(HF_HOME=str(cache), HF_DATASETS_CACHE=str(cache / "datasets"))
    yield cache
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
