"""Every DAG imports cleanly, cheaply, and with an explicit scheduling policy."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

DAGS = Path(__file__).resolve().parents[2] / "dags"
EXPECTED = {"tracegen_generate", "tracegen_fleet", "tracegen_rerun_failed", "tracegen_raise_cap", "tracegen_export"}


@pytest.fixture(scope="module")
def dagbag():
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(str(DAGS))


def test_dags_import_without_errors(dagbag):
    assert dagbag.import_errors == {}
    assert set(dagbag.dag_ids) == EXPECTED


def test_each_dag_lives_in_a_file_of_its_name(dagbag):
    # The tests run `airflow dags test` on that one file (engine_support.dags_test).
    for dag_id in dagbag.dag_ids:
        assert Path(dagbag.dags[dag_id].fileloc) == DAGS / f"{dag_id}.py", dag_id


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
    # The bounds are checked when a run is triggered, not clamped by the form's number input (config.bounded).
    schema = params.get_param("max_tokens").schema
    assert "minimum" not in schema and "maximum" not in schema and schema["allOf"] == [{"minimum": 1, "maximum": 1_048_576}]


def test_mapped_generation_is_readable_and_bounded(dagbag):
    for task_id in ("generate_alongside_pilot", "generate_chunk", "generate_at_decided_cap"):
        task = dagbag.dags["tracegen_generate"].get_task(task_id)
        # Labelled from the mapped input before the task runs (tests/plugins/test_chunk_labels.py).
        from tracegen.steps import CHUNK_LABEL_TEMPLATE

        assert task.map_index_template == CHUNK_LABEL_TEMPLATE
        assert task.max_active_tis_per_dagrun >= 1


def test_first_chunks_run_beside_the_pilot_and_the_rest_wait_for_the_gate(dagbag):
    dag = dagbag.dags["tracegen_generate"]
    upstream = {t: dag.get_task(t).upstream_task_ids for t in ("generate_alongside_pilot", "generate_chunk")}
    # Beside the pilot: needs only the prepared run, not the pilot, its gate, nor provision_fleet (each
    # generation task provisions idempotently and checks the servers' context itself; occupancy).
    assert upstream["generate_alongside_pilot"] == {"prepare_run"}
    # Everything starts from the run prepared once; nothing else feeds the first tasks.
    assert not dag.get_task("prepare_run").upstream_task_ids
    assert dag.get_task("provision_fleet").upstream_task_ids == {"prepare_run"}
    assert dag.get_task("run_pilot").upstream_task_ids == {"prepare_run"}
    assert "audit_and_gate" in upstream["generate_chunk"]
    # The tail is measured between the pilot and the gate's audit, which reports on the measured rows.
    assert dag.get_task("measure_tail").upstream_task_ids == {"prepare_run", "provision_fleet", "run_pilot"}
    assert "measure_tail" in dag.get_task("audit_and_gate").upstream_task_ids
    # The runaway rows' fresh samples (runaway_policy=resample) come once every fan-out is over.
    assert dag.get_task("resample_runaways").upstream_task_ids == {"prepare_run", "generate_alongside_pilot",
                                                                    "generate_chunk", "generate_while_asking",
                                                                    "generate_at_decided_cap"}
    # The report and teardown wait for the generation themselves: the resample is skipped from the start unless
    # runaway_policy=resample.
    generation = {"generate_alongside_pilot", "generate_chunk", "generate_while_asking", "generate_at_decided_cap"}
    assert dag.get_task("final_report").upstream_task_ids == {"prepare_run", "resample_runaways", *generation}
    # Teardown waits for the generation, the second fan-out after the reviewer's answer and the resampling
    # included (the servers stay up while the question waits), not for the report (which reads only the ledger).
    assert dag.get_task("teardown_fleet").upstream_task_ids == {"prepare_run", "resample_runaways", *generation}
    # The watcher fails the run on a failure the ALL_DONE report and teardown would hide; those two are
    # leaves, so their own failure fails the run, and the watcher need not wait for them.
    assert dag.get_task("watcher").upstream_task_ids == {"generate_alongside_pilot", "generate_chunk",
                                                         "measure_tail", "audit_and_gate", "ask_about_cap",
                                                         "review_cap", "generate_while_asking",
                                                         "resample_runaways", "apply_decision",
                                                         "generate_at_decided_cap"}
    assert {t.task_id for t in dag.tasks if not t.downstream_task_ids} == {"final_report", "teardown_fleet",
                                                                             "watcher"}


def test_the_gate_asks_after_the_first_fan_out_and_the_answer_feeds_a_second(dagbag):
    """gate_mode=ask: the question waits for every chunk of the first fan-out (held ones are skipped, so
    it runs unless one failed), the reviewer's task and the work done while asking follow it, and the chunks
    at the decided cap map over what applying the answer returns."""
    from airflow.sdk import TriggerRule

    from tracegen.review_gate import CapReviewOperator

    dag = dagbag.dags["tracegen_generate"]
    ask = dag.get_task("ask_about_cap")
    assert {"generate_alongside_pilot", "generate_chunk", "run_pilot", "provision_fleet"} <= ask.upstream_task_ids
    assert ask.trigger_rule == TriggerRule.NONE_FAILED
    review = dag.get_task("review_cap")
    assert isinstance(review, CapReviewOperator) and review.upstream_task_ids == {"ask_about_cap"}
    assert list(review.params.keys()) == ["cap"]  # the reviewer's form, not the trigger form
    # While the question waits, the fleet generates the chunks the question task chose; the answer is
    # applied as soon as it is in (not after that fan-out), and only when something was asked.
    while_asking = dag.get_task("generate_while_asking")
    assert while_asking.upstream_task_ids == {"prepare_run", "ask_about_cap"}
    assert while_asking.max_active_tis_per_dagrun == dag.get_task("generate_chunk").max_active_tis_per_dagrun
    decide = dag.get_task("apply_decision")
    assert decide.upstream_task_ids == {"review_cap"}
    assert decide.trigger_rule == TriggerRule.ALL_SUCCESS
    assert dag.get_task("generate_at_decided_cap").upstream_task_ids == {"apply_decision"}


def test_the_slots_beside_the_pilot_are_the_stagger_the_run_records(dagbag):
    """The chunk concurrency is read once, when the DAG is parsed, and handed to prepare_run: the number of
    slots beside the pilot and the layout's stagger cannot disagree."""
    from tracegen.params import generate_chunk_concurrency

    dag = dagbag.dags["tracegen_generate"]
    lead = generate_chunk_concurrency()
    assert dag.get_task("prepare_run").op_kwargs == {"lead": lead}
    assert dag.get_task("generate_alongside_pilot").max_active_tis_per_dagrun == lead


def test_the_trigger_form_accepts_exactly_what_the_run_config_accepts(dagbag):
    """The form's ranges and choices are RunConfig's own rules: probe each param at and beyond every
    bound, through the form's JSON schema and through RunConfig."""
    import jsonschema

    from tracegen.config import ConfigError, RunConfig
    from tracegen.params import CONFIG_PARAMS

    params = dagbag.dags["tracegen_generate"].params
    base = {name: params[name] for name in CONFIG_PARAMS}
    probes = {
        "max_tokens": [0, 1, 4096, 1_048_576, 1_048_577, 4096.5, "4096"],
        "temperature": [-0.1, 0, 2, 2.01],
        "top_p": [0, 0.001, 1, 1.01],
        "top_k": [-1, 0, 1, 20, 1_000_000, 1_000_001, 2.5],
        "min_p": [-0.01, 0, 1, 1.01],
        "repetition_penalty": [0, 0.01, 2, 2.01],
        "chunk_size": [-1, 0, 1, 9, 10, 1_000_000, 1_000_001],
        "pilot_size": [-1, 0, 1_000_000, 1_000_001],
        "truncation_threshold": [-0.01, 0, 1, 1.01],
        "gate_mode": ["stop", "warn", "ask", "", "ASK"],
        "gate_question_timeout_minutes": [0, 0.1, 60, 43_200, 43_201, "60"],
        "truncated_policy": ["regenerate", "keep", "extend-ish"],
        "invalid_rows": ["record", "fail", "skip"],
        "measure_tail": ["auto", "always", "never", "", "AUTO"],
        "measure_budget_tokens": [-1, 0, 1, 999, 1_000, 100_000_000_000, 100_000_000_001, 1.5],
        "runaway_policy": ["drop", "resample", "keep", "ignore"],
        "stop_loops": [True, False, "true", 1, None],
        "while_asking": ["recommended", "current", "idle", "", "wait"],
        "while_asking_budget_pct": [-0.1, 0, 25, 100, 100.5, "25"],
        "dataset_uri": ["", "relative/prompts.jsonl", "/abs/prompts.jsonl", "file:///abs/p.jsonl", "s3://bucket/k",
                        "s3://bucket/", "s3://", "http://host/prompts.jsonl", "file://host/p.jsonl"],
        "output_uri": ["", "relative/out", "/abs/out", "file:///abs/out", "s3://bucket/prefix", "s3://bucket",
                       "s3://"],
        "dataset_format": ["auto", "messages", "sharegpt", "prompt", "alpaca", ""],
        "dataset_fields": ["", "  ", "{}", '{"prompt": "question", "id": "uid"}', '{"prompt": "q",}', '{"bogus": "q"}',
                           '{"prompt": ""}', "not json", '["prompt"]', '{"prompt": "frageä"}', 7, None],
        "turns": ["last", "first", "each", "chain", "LAST"],
        "max_invalid_pct": [-0.1, 0, 50, 100, 100.1, "50"],
        "chat_template_kwargs": ["", "  ", "{}", '{"enable_thinking": false}', '{"enable_thinking": "no"}',
                                 '{"reasoning_effort": "high", "thinking_budget": 1024}', '{"a": {"b": 1}}',
                                 "not json", "[1]", '{"enable_thinking": true,}', None, 7, "{" + " " * 4096 + "}"],
        "thinking_off_pct": [-0.1, 0, 50, 100, 100.1, "50"],
    }
    assert set(probes) == set(CONFIG_PARAMS)
    for name, values in probes.items():
        schema = params.get_param(name).schema
        for value in values:
            try:
                jsonschema.validate(value, schema)
                form_ok = True
            except jsonschema.ValidationError:
                form_ok = False
            try:
                RunConfig.from_params({**base, name: value})
                config_ok = True
            except ConfigError:
                config_ok = False
            assert form_ok == config_ok, (name, value, form_ok, config_ok)


def test_parsing_imports_nothing_heavy():
    """DAG files must not pull pandas, numpy or the engine in at parse time (the DAG processor parses
    them every few seconds). httpx is not checked: airflow.sdk itself imports it."""
    probe = (
        "import sys, runpy, json\n"
        f"for f in {sorted(str(p) for p in DAGS.glob('*.py'))!r}: runpy.run_path(f)\n"
        "heavy = ['pandas', 'numpy', 'pyarrow', 'scipy', 'tracegen.generate.engine', 'tracegen.sglang.client']\n"
        "print(json.dumps([m for m in heavy if m in sys.modules]))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_the_export_dag_announces_each_export_through_its_alias(dagbag):
    """tracegen_export: one task, triggered by hand, whose outlet is the AssetAlias every export is announced
    through (the event itself resolves to the destination's manifest: tests/e2e/test_export_asset.py)."""
    from airflow.sdk import AssetAlias

    from tracegen.common.dag_ids import EXPORT_ALIAS as ALIAS
    from tracegen.export.layouts import LAYOUTS

    dag = dagbag.dags["tracegen_export"]
    assert dag.schedule is None and [t.task_id for t in dag.tasks] == ["export"]
    assert dag.get_task("export").outlets == [AssetAlias(ALIAS)]
    assert list(dag.params.keys()) == ["output_uri", "dest_uri", "replace_existing_export", "layout",
                                       "include_truncated"]
    # The conf default never replaces an export (tests/dags/test_dag_locations.py triggers it).
    assert dag.params["replace_existing_export"] is False
    assert dag.params.get_param("layout").schema["enum"] == list(LAYOUTS)
