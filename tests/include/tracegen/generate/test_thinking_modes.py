"""Thinking on and off: the run's chat template arguments reach the template on both routes (the chat route
whole, and `/v1/tokenize` before a streamed `/generate`), a share of the rows chosen by id has thinking off,
and each row's provenance says which arguments its prompt was rendered with."""

from __future__ import annotations

import json

import pytest
from engine_support.helpers import endpoints, make_config, prepare, root_of, run_engine, write_dataset

from tracegen.config import ConfigError, RunConfig, parse_template_kwargs
from tracegen.generate.thinking import TEMPLATE_KWARGS, TemplateChoice, row_unit
from tracegen.store.records import OK

SIM = dict(sim_time_scale=1000, log_level="warning", sim_length_model="short", reasoning_parser="qwen3",
           incremental_streaming_output=True, stream_interval=16)
N_ROWS = 40
OFF = {"enable_thinking": False}


def _rows(tmp_path, sim, name: str, **params):
    dataset = tmp_path / "prompts.jsonl"
    if not dataset.exists():
        write_dataset(dataset, N_ROWS)
    config = make_config(dataset, tmp_path / name, max_tokens=400, **params)
    prepare(config, f"run-{name}")
    run_engine(config, f"run-{name}", endpoints(sim), tmp_path / f"spool-{name}", range(N_ROWS))
    root = root_of(config)
    frame = root.snapshots.frame()
    rows = [r for part in set(frame["part"]) for r in root.commits.read_part(part)]
    assert len(rows) == N_ROWS and all(r.status == OK for r in rows)
    return config, rows


def _thinks(row) -> bool:
    return bool(row.reasoning_content) and row.reasoning_tokens > 0


@pytest.mark.parametrize("stop_loops", [True, False], ids=["streamed", "chat-route"])
def test_a_share_of_rows_chosen_by_id_is_generated_without_thinking(tmp_path, sim_server, stop_loops):
    sim = sim_server(**SIM)
    config, rows = _rows(tmp_path, sim, "half", thinking_off_pct=50.0, stop_loops=stop_loops)
    choice = TemplateChoice.of_config(config)
    off = {r.id for r in rows if choice.for_row(r.id) == OFF}
    assert 0 < len(off) < N_ROWS  # 40 ids at 50%: both modes drawn
    assert off == {r.id for r in rows if row_unit(r.id) < 0.5}
    for row in rows:
        if row.id in off:
            assert not _thinks(row) and row.provenance[TEMPLATE_KWARGS] == OFF, row.id
        else:
            assert _thinks(row) and TEMPLATE_KWARGS not in (row.provenance or {}), row.id


def test_the_runs_template_arguments_reach_every_row(tmp_path, sim_server):
    sim = sim_server(**SIM)
    _, rows = _rows(tmp_path, sim, "off", chat_template_kwargs='{"enable_thinking": false}')
    assert not any(_thinks(r) for r in rows)
    assert all(r.provenance[TEMPLATE_KWARGS] == OFF for r in rows)


@pytest.mark.parametrize("text, says", [
    ("{not json", "not a flat JSON object"),
    ("[1, 2]", "not a flat JSON object"),
    ('{"enable_thinking": "no"}', "enable_thinking true or false"),
    ('{"budget": {"tokens": 1}}', "not a flat JSON object"),
    ('{"x": "' + "a" * 5000 + '"}', "more than 4,096"),
])
def test_bad_template_arguments_are_refused_naming_the_param(tmp_path, text, says):
    with pytest.raises(ConfigError, match="chat_template_kwargs") as err:
        RunConfig.from_params({"dataset_uri": str(tmp_path / "d.jsonl"), "output_uri": str(tmp_path / "o"),
                               "chat_template_kwargs": text})
    assert says in str(err.value)


@pytest.mark.parametrize("text", ["", None, "  "])
def test_empty_template_arguments_are_the_templates_defaults(text):
    assert parse_template_kwargs(text) == {}
    assert TemplateChoice(parse_template_kwargs(text), 0.0).for_row("p1") is None


def test_rows_without_ids_are_chosen_by_the_name_they_get(tmp_path, sim_server):
    # A row without an id is named index-<n> everywhere (the export too): its mode is chosen by that name.
    sim = sim_server(**SIM)
    dataset = tmp_path / "no-ids.jsonl"
    dataset.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"task {i}"}]}) + "\n"
                               for i in range(N_ROWS)))
    config = make_config(dataset, tmp_path / "out", max_tokens=400, thinking_off_pct=50.0)
    prepare(config, "run-no-ids")
    run_engine(config, "run-no-ids", endpoints(sim), tmp_path / "spool", range(N_ROWS))
    root = root_of(config)
    frame = root.snapshots.frame()
    rows = [r for part in set(frame["part"]) for r in root.commits.read_part(part)]
    assert len(rows) == N_ROWS and all(r.status == OK for r in rows)
    for row in rows:
        off = row_unit(f"index-{row.index}") < 0.5
        assert (TEMPLATE_KWARGS in (row.provenance or {})) == off and _thinks(row) != off, row.index
