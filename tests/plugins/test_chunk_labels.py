"""The chunk tasks' map_index_template renders from the mapped input alone, as Airflow renders it before
the task runs (so the grid names a running chunk), and from `chunk_label` afterwards: the same text as
`ChunkWork.label` either way. Rendered by Airflow's own sandboxed template environment."""

from __future__ import annotations

from types import SimpleNamespace

from airflow.sdk import DAG

from tracegen.run.plan import ChunkWork
from tracegen.steps import CHUNK_LABEL_TEMPLATE


def _render(**context) -> str:
    env = DAG("labels").get_template_env()
    return env.from_string(CHUNK_LABEL_TEMPLATE).render(context)


def test_a_chunk_task_is_labelled_from_its_chunk_before_it_runs() -> None:
    work = ChunkWork(chunk=4, start=2000, stop=2500, remaining=500)
    task = SimpleNamespace(op_kwargs={"run": {}, "chunk": work.to_json()})
    assert _render(task=task) == work.label == "chunk 0004 (rows 2,000–2,499)"
    assert _render(task=task, chunk_label="set by the task") == "set by the task"


def test_a_slot_beside_the_pilot_is_labelled_from_the_plans_chunk() -> None:
    plan = [ChunkWork(0, 0, 250, 250).to_json(), ChunkWork(1, 250, 500, 250).to_json()]
    assert _render(task=SimpleNamespace(op_kwargs={"chunks": plan, "slot": 1})) == "chunk 0001 (rows 250–499)"
    assert _render(task=SimpleNamespace(op_kwargs={"chunks": plan, "slot": 0})) == "chunk 0000 (rows 0–249)"
    assert _render(task=SimpleNamespace(op_kwargs={"chunks": plan, "slot": 3})) == "slot 3"
