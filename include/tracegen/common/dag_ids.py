"""The names of tracegen's DAGs and of the tasks other code reads across runs (their states and XComs).

The DAG files use these ids, and everything that looks a run up in Airflow's metadata names it by them,
so a renamed DAG or task is renamed in one place.
"""

GENERATE = "tracegen_generate"
RAISE_CAP = "tracegen_raise_cap"
RERUN_FAILED = "tracegen_rerun_failed"
EXPORT = "tracegen_export"
FLEET = "tracegen_fleet"
# The AssetAlias every export is announced through: a trainer's DAG schedules on it.
EXPORT_ALIAS = "tracegen_export"

# Tasks of tracegen_generate whose results other runs read.
PREPARE_RUN = "prepare_run"  # its `run` XCom: the run as first described
PROVISION_FLEET = "provision_fleet"  # its result: the servers, with their context length
DECIDING_TASK = "ask_about_cap"  # decides the run's cap; reads a raise once, when it starts
QUESTION_KEY = "question"  # its XCom: the question asked, or {"decided": ...} for a raise taken instead
APPLY_DECISION = "apply_decision"  # its `run` XCom (DECIDED_RUN_KEY): the run as decided
DECIDED_RUN_KEY = "run"  # its return value is the chunks; a mapped task maps only over a return value
REVIEW_TASK = "review_cap"  # the reviewer's question (human in the loop)
WHILE_ASKING = "generate_while_asking"  # the chunks generated while the question waits; apply_decision reads their states
DECIDED_FAN_OUT = "generate_at_decided_cap"  # the chunks at the answered cap
# The question task and everything that exists only for a question: skipped together when there is none.
QUESTION_CHAIN = (DECIDING_TASK, REVIEW_TASK, WHILE_ASKING, APPLY_DECISION, DECIDED_FAN_OUT)
RESAMPLE_RUNAWAYS = "resample_runaways"  # skipped by prepare_run unless runaway_policy=resample
REFUSED_ANSWER_KEY = "refused_answer"  # review_cap's XCom: the last answer it refused, and why

# The task of tracegen_raise_cap that makes a raise; its result is what a reader checks the raise against.
RAISE_TASK = "raise_cap"


def state_name(state: object) -> str | None:
    """A task state as `get_task_states` returns it (a TaskInstanceState or its string), as the lower-case
    name the task-state checks compare against ("running", "success", ...); None stays None."""
    return None if state is None else str(state).removeprefix("TaskInstanceState.").lower()


def task_state(ti: object, dag_id: str, run_id: str, task_id: str) -> str | None:
    """The lower-case state of one task of one DAG run, read through a running task's `ti`
    (`get_task_states`); None when Airflow has no such task instance yet."""
    states = ti.get_task_states(dag_id=dag_id, run_ids=[run_id], task_ids=[task_id])  # type: ignore[attr-defined]
    return state_name(((states or {}).get(run_id) or {}).get(task_id))
