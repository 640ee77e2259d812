"""Every DAG imports cleanly, cheaply, and with an explicit scheduling policy."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

DAGS = Path(__file__).resolve().parents[2] / "dags"
EXPECTED = {"tracegen_generate", "tracegen_fleet", "tracegen_rerun_failed"}


@pytest.fixture(scope="module")
def dagbag():
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(str(DAGS))


def test_dags_import_without_errors(dagbag):
    assert dagbag.import_errors == {}
    assert set(dagbag.dag_ids) == EXPECTED


def test_scheduling_policy_is_explicit(dagbag):
    for dag_id in dagbag.dag_ids:
        dag = dagbag.dags[dag_id]
        assert dag.catchup is False, dag_id
        assert "tracegen" in dag.tags, dag_id
        assert dag.doc_md and dag.doc_md.strip().startswith("###"), dag_id
        assert "retries" in dag.default_args, dag_id
    assert dagbag.dags["tracegen_generate"].schedule is None
    assert dagbag.dags["tracegen_fleet"].schedule is None
    assert dagbag.dags["tracegen_rerun_failed"].schedule == "@hourly"


def test_trigger_form_params_have_titles_and_max_tokens_first(dagbag):
    params = dagbag.dags["tracegen_generate"].params
    assert next(iter(params.keys())) == "max_tokens"
    for name in params.keys():
        param = params.get_param(name)
        assert param.schema.get("title") and param.description, name
    assert params.get_param("max_tokens").schema["minimum"] == 1


def test_mapped_generation_is_readable_and_bounded(dagbag):
    for task_id in ("generate_alongside_pilot", "generate_chunk"):
        task = dagbag.dags["tracegen_generate"].get_task(task_id)
        assert task.map_index_template == "{{ chunk_label }}"
        assert task.max_active_tis_per_dagrun >= 1


def test_first_chunks_run_beside_the_pilot_and_the_rest_wait_for_the_gate(dagbag):
    dag = dagbag.dags["tracegen_generate"]
    upstream = {t: dag.get_task(t).upstream_task_ids for t in ("generate_alongside_pilot", "generate_chunk")}
    # Beside the pilot: needs the plan and the servers, not the pilot or its gate (DESIGN §8, occupancy).
    assert upstream["generate_alongside_pilot"] == {"validate_run", "provision_fleet", "plan_run"}
    # The three start together (provisioning and planning validate the params themselves): the first
    # request waits for one layer of tasks, not two.
    assert all(not dag.get_task(t).upstream_task_ids for t in ("validate_run", "provision_fleet", "plan_run"))
    assert "audit_and_gate" in upstream["generate_chunk"]
    report = dag.get_task("final_report").upstream_task_ids
    assert {"generate_alongside_pilot", "generate_chunk"} <= report
    # Teardown waits for the generation, not for the report (which reads only the ledger).
    assert dag.get_task("teardown_fleet").upstream_task_ids == {"validate_run", "generate_alongside_pilot",
                                                                 "generate_chunk"}
    # The watcher fails the run on a failure the ALL_DONE report and teardown would hide; those two are
    # leaves, so their own failure fails the run, and the watcher need not wait for them.
    assert dag.get_task("watcher").upstream_task_ids == {"generate_alongside_pilot", "generate_chunk",
                                                         "audit_and_gate"}
    assert {t.task_id for t in dag.tasks if not t.downstream_task_ids} == {"final_report", "teardown_fleet",
                                                                             "watcher"}


def test_parsing_imports_nothing_heavy():
    """DAG files must not pull pandas, numpy or the engine in at parse time (the DAG processor parses
    them every few seconds). httpx is not checked: airflow.sdk itself imports it."""
    probe = (
        "import sys, runpy, json\n"
        f"for f in {sorted(str(p) for p in DAGS.glob('*.py'))!r}: runpy.run_path(f)\n"
        "heavy = ['pandas', 'numpy', 'pyarrow', 'scipy', 'tracegen.generate.engine', 'tracegen.pipeline', 'tracegen.sglang.client']\n"
        "print(json.dumps([m for m in heavy if m in sys.modules]))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
