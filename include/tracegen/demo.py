"""`make demo`: the 4096 → 8192 pivot (18% of rows truncated at 4096, the cap raised to 8192), end to end through the real `tracegen_generate` DAG.

Runs `airflow dags test` on a local SQLite metadata DB against a simulated fleet (two SGLang stand-ins
launched exactly like SGLang) and the bundled prompts, at a 4096 cap. The pilot gate finds too many
rows truncated and asks (gate_mode=ask): the run waits at its question, as it would in the UI's Required
Actions. `airflow dags test` starts no api-server, so the demo answers for the reviewer through the REST
API's own handler, with the cap the report recommends, and the same run goes on at that cap from the
committed rows. Each task's log goes where `make airflow` (the same AIRFLOW_HOME) shows it in the UI;
the demo's own commands log to `.state/demo/logs/`; this prints the story. Each demo writes to a new
output root (`.state/demo/output` links to the newest) and keeps the last few, so the runs the metadata DB
still lists keep their reports.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

from tracegen.common import dag_ids
from tracegen.config import PROJECT_DIR, state_dir

DEMO_PILOT = 500  # of the bundled 3,000 prompts
DEMO_LOOP_RATE = 0.03  # share of the stand-ins' samples that loop


def airflow_env(state: Path) -> dict[str, str]:
    """The environment every Airflow command of the embedded default runs with (`make airflow` sets the same:
    the stand-ins' loop rate is part of the bundled fleet's digest, and a run refuses a changed fleet, so a demo
    run rerun from the UI needs the rate it began with)."""
    home = state / "airflow"
    return {
        **os.environ,
        # A realistic share of samples loop, as Qwen3 models do in agentic coding (unless the caller chose one).
        "TRACEGEN_SIM_RUNAWAY_RATE": os.environ.get("TRACEGEN_SIM_RUNAWAY_RATE", str(DEMO_LOOP_RATE)),
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(PROJECT_DIR / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(PROJECT_DIR / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home}/airflow.db",
        "TRACEGEN_STATE_DIR": str(state),
        "TRACEGEN_SPOOL_DIR": str(state / "spool"),
    }


def _say(text: str = "") -> None:
    print(text, flush=True)


def _airflow(env: dict[str, str], args: list[str], log: Path) -> int:
    with log.open("w") as out:
        return subprocess.call([sys.executable, "-m", "airflow", *args], env=env, stdout=out,
                               stderr=subprocess.STDOUT)


def _wait_for_question(env: dict[str, str], run: subprocess.Popen) -> dict | None:
    """The question the run parks at (`airflow dags test` then waits for an answer), or None when the
    run ends without asking."""
    os.environ.update(env)  # this process reads the same metadata DB as the run it answers for
    from tracegen.review_gate import awaiting_answers

    while run.poll() is None:
        pending = awaiting_answers(dag_ids.GENERATE)
        if pending:
            return pending[0]
        time.sleep(1)
    return None


def _choose(question: dict) -> tuple[str, int | None, str]:
    """The demo reviewer's answer (option, cap typed or None, why): the smallest cap in the table whose
    whole interval meets the threshold, less the rows that loop (no cap finishes them, so no cap is judged
    on them). That is the recommended cap when its interval does; otherwise a bigger one, typed in the
    form's field."""
    threshold = question["verdict"]["threshold"]

    def high(row: dict) -> float:
        excluding = row.get("truncation_excluding_runaways")
        floor = row["truncation"] - excluding if excluding is not None else 0.0
        return row["truncation_high"] - floor

    safe = [r["cap"] for r in question["cap_rows"]
            if high(r) <= threshold and r["cap"] > question["current_cap"] and r["cap"] <= question["max_cap"]]
    options = {o["kind"]: o["label"] for o in question["options"]}
    rec = question["recommended_cap"]
    if not safe:
        return options["stop"], None, "no cap in the table meets the threshold"
    if safe[0] == rec:
        return options["recommended"], None, "its interval is under the threshold too"
    reason = (f"the recommended {rec:,}'s interval reaches past {100 * threshold:.0f}%, {safe[0]:,}'s does not"
              if rec else f"{safe[0]:,} is the smallest cap whose interval is under {100 * threshold:.0f}%")
    return options["other"], safe[0], reason


def _show_question(question: dict) -> None:
    """The question as the Required Actions page shows it: the subject, the verdict, the cap table."""
    _say(f"  the question, under Browse → Required Actions:\n    {question['subject']}")
    for line in question["body"].splitlines():
        if line.startswith("|") and not line.startswith("|---"):
            _say("      " + line.replace("\\", "").replace("**", ""))
    _say("    options: " + " / ".join(question["options"]) + f" (unanswered: {question['defaults'][0]})")


def _newest_run_dir(output: Path) -> Path | None:
    runs = [p for p in (output / "runs").glob("*") if (p / "run.json").exists()]
    return max(runs, key=lambda p: json.loads((p / "run.json").read_text())["created_at"], default=None)


def _verdict(report: Path | None) -> dict:
    if report is None or not report.exists():
        return {}
    return json.loads(report.read_text()).get("verdict") or {}


def _explain_failure(log: Path) -> None:
    """The task errors of a failed `airflow dags test`, so the user need not dig through the log."""
    errors = [line.strip() for line in log.read_text(errors="replace").splitlines()
              if line.startswith(("tracegen.", "airflow.sdk.exceptions.")) or "Error: " in line]
    _say(f"  the run failed for another reason than the gate; full log: {log}")
    for line in dict.fromkeys(errors[:5]):
        _say(f"    {line[:300]}")


def main() -> int:
    state = state_dir()
    demo = state / "demo"
    logs = demo / "logs"
    if logs.exists():
        shutil.rmtree(logs)  # this demo's own command logs; the task logs are Airflow's (AIRFLOW_HOME/logs)
    logs.mkdir(parents=True)
    # The demo tells the story from an empty output root every time: a new one, which `.state/demo/output`
    # (the root `make airflow` defaults to) points at. Earlier demos' roots are kept, so their runs, still
    # in the metadata DB, keep their reports; only the oldest beyond KEEP_DEMOS go, with their runs.
    output, dropped = new_output_root(demo)
    env = airflow_env(state)
    env["TRACEGEN_OUTPUT_URI"] = str(output)
    (state / "airflow").mkdir(parents=True, exist_ok=True)

    started = time.monotonic()
    _say("tracegen demo: 3,000 agentic-coding prompts, a simulated 2-GPU SGLang fleet, the real DAG.\n")
    if not _migrate(env, logs, demo, dropped):
        return 1

    _say("[2/4] tracegen_generate with max_tokens=4096 (gate_mode=ask, the default) ...")
    log1 = logs / "run-4096.log"
    dags_test, question = _run_until_question(env, output, log1)
    run1 = _newest_run_dir(output)
    gate = _verdict(run1 and run1 / "pilot-report.json")
    if question is None or gate.get("verdict") != "stop":
        dags_test.wait()
        _write_task_logs(log1)
        _explain_failure(log1)
        return 1
    _tell_pilot(gate, run1, output, question)
    _tell_work_while_asking(run1, output, dags_test)
    rc, decision = _answer(question, run1, dags_test, log1)
    run2 = run1  # answered in place: the same run goes on
    cap = decision.get("cap") or 0

    _say(f"\n[3/4] the same run goes on at max_tokens={cap:,}, as answered (no new trigger) ...")
    if rc != 0 or not cap:
        _explain_failure(log1)
        return 1
    _tell_outcome(run2, decision, cap)
    asked = json.loads((run2 / "report.json").read_text())["run"].get("while_asking")
    if asked:
        _say(f"  {asked['text']}")

    _say("\n[4/4] status, from the ledger alone (python -m tracegen status):\n")
    _tell_where(output, run2, logs, demo)
    _say(f"\ndone in {time.monotonic() - started:.0f} s")
    return 0


def _migrate(env: dict[str, str], logs: Path, demo: Path, dropped: list[Path]) -> bool:
    """Step 1: the metadata DB migrated, and the runs of the output roots this demo removed forgotten."""
    _say("[1/4] migrating the Airflow metadata DB (SQLite) ...")
    if _airflow(env, ["db", "migrate"], logs / "db-migrate.log") != 0:
        _say(f"  airflow db migrate failed; see {logs / 'db-migrate.log'}")
        return False
    if dropped:
        forgotten = _forget_runs(env, dropped)
        _say(f"  removed the {len(dropped)} oldest demo output root(s) ({', '.join(p.name for p in dropped)}) and "
             f"their {forgotten} run(s) in the metadata DB; the last {KEEP_DEMOS} demos are kept under {demo}")
    return True


def _run_until_question(env: dict[str, str], output: Path, log: Path) -> tuple[subprocess.Popen, dict | None]:
    """`airflow dags test` started at a 4096 cap, and the question it parks at (None: it ended without one)."""
    # The output root in the conf too: the review pages find each run's root from the run itself.
    # Half the rows may be generated while the question waits: at 3,000 rows the first chunks past the pilot
    # (twice its size, 1,000 rows) are more than the default quarter, which would show nothing being done.
    conf = {"max_tokens": 4096, "pilot_size": DEMO_PILOT, "teardown": True, "output_uri": str(output),
            "while_asking_budget_pct": 50}
    with log.open("w") as out:
        dags_test = subprocess.Popen(
            [sys.executable, "-m", "airflow", "dags", "test", dag_ids.GENERATE, "--conf", json.dumps(conf)],
            env=env, stdout=out, stderr=subprocess.STDOUT)
    return dags_test, _wait_for_question(env, dags_test)


def _tell_pilot(gate: dict, run1: Path, output: Path, question: dict) -> None:
    """What the pilot found: the gate's reason, the measured tail, the rows committed, the question."""
    _say(f"  the pilot gate holds the run at a question:\n    {gate['reason']}")
    tail = json.loads((run1 / "measure.json").read_text()) if (run1 / "measure.json").exists() else {}
    spent = tail.get("outcome") or {}
    if tail.get("cap") and spent:
        _say(f"  measured, not extrapolated: the pilot's {spent['rows']:,} truncated rows were continued from their "
             f"tokens to {tail['cap']:,} ({spent['finished']:,} finished, {spent['still_truncated']:,} still cut), "
             f"{spent['new_tokens']:,} new tokens, {100 * (spent.get('pilot_share') or 0):.0f}% of what the pilot "
             "spent; they stay in the dataset at the cap chosen")
    elif tail:
        _say(f"  the tail was not measured: {tail.get('reason')}")
    # The measured rows are the pilot's, continued above 4096: not counted again here.
    committed = _rows_of_run(output, run1.name) - int(spent.get("measured") or 0)
    beside = committed - DEMO_PILOT
    if beside > 0:
        _say(f"  {committed:,} rows committed at 4096: the pilot's {DEMO_PILOT:,}, and {beside:,} of the first "
             "chunks, which run beside the pilot and stop with its gate (finished rows are kept)")
    else:
        # `airflow dags test` runs one task at a time: when it picks the pilot first, the first chunks
        # start after the verdict instead of beside the pilot, as they do on a scheduler.
        _say(f"  {committed:,} rows committed at 4096: the pilot's. The first chunks, which run beside the "
             "pilot on a scheduler, started after it here (`airflow dags test` runs one task at a time) and "
             "found the gate closed")
    _say(f"  pilot report: {run1 / 'pilot-report.html'}")
    _show_question(question)


def _tell_work_while_asking(run1: Path, output: Path, dags_test: subprocess.Popen, wait_s: float = 60.0) -> None:
    """The fleet does not wait for the answer: what the question says it generates meanwhile, and the rows it
    has committed so far, waited for (a few seconds, as a reviewer takes longer) before the demo answers."""
    plan = json.loads((run1 / "question.json").read_text()).get("while_asking")
    if not plan:
        _say("  while the question waits, nothing is generated (while_asking=idle, or no budget)")
        return
    _say(f"  while the question waits, the fleet goes on at max_tokens={plan['cap']:,} (the recommended cap): "
         f"{plan['rows_planned']:,} rows in {len(plan['chunks'])} chunk{'' if len(plan['chunks']) == 1 else 's'}, "
         "within the budget of "
         f"{plan['budget_rows']:,} rows")
    deadline, rows = time.monotonic() + wait_s, 0
    while time.monotonic() < deadline and dags_test.poll() is None:
        rows = _rows_of_run(output, run1.name, while_asking=True)
        if rows >= min(plan["rows_planned"], 200):
            break
        time.sleep(1)
    _say(f"  {rows:,} of them committed before anyone answered (marked in the ledger: while_asking)")


def _answer(question: dict, run1: Path, dags_test: subprocess.Popen, log: Path) -> tuple[int, dict]:
    """The demo reviewer's answer given through the REST API's handler; (the run's exit code once it has
    gone on, the decision its record holds)."""
    option, typed, why = _choose(json.loads((run1 / "question.json").read_text()))
    page = (f"http://localhost:8080/dags/tracegen_generate/runs/{urllib.parse.quote(question['run_id'], safe='')}"
            f"/tasks/{question['task_id']}/required_actions")
    what = f"type {typed} in the cap field and click \"{option}\"" if typed else f"click \"{option}\""
    _say(f"  a reviewer would {what} ({why}) on\n    {page}\n    (`make airflow` opens that UI on this state; "
         "there the run shows the question and its answer)")
    _say("  answering for them, through the REST API's handler (PATCH .../hitlDetails), as user 'demo' ...")
    from tracegen.review_gate import answer_in_process

    answer_in_process(dag_ids.GENERATE, question["run_id"], question["task_id"], option, {"cap": typed},
                      user="demo", map_index=question["map_index"])
    rc = dags_test.wait()
    _write_task_logs(log, question["run_id"])
    decision = (json.loads((run1 / "run.json").read_text()).get("decisions") or [{}])[-1]
    return rc, decision


def _tell_outcome(run: Path, decision: dict, cap: int) -> None:
    """The run's end at the cap answered: who decided, the final audit, how the truncated rows were finished."""
    final = _verdict(run / "report.json")
    _say(f"  decision, in run.json and the report: {decision['responded_by']} chose \"{decision['option']}\" "
         f"at {decision['responded_at']}")
    _say(f"  final audit: {final.get('reason')}")
    audit = json.loads((run / "report.json").read_text())["audit"]
    past = audit["truncation"].get("past_cap") or 0
    if past:
        _say(f"    ({past:,} of those rows finished past {cap:,} tokens when the tail was measured: complete, they "
             f"are kept; the gate counts them because max_tokens={cap:,} alone would have cut them)")
    _say("  rows finished under 4096 were kept; rows truncated at 4096 were continued from their tokens, "
         "not generated again.")
    from tracegen.audit.pivot import pivot_text

    _say(f"  rows continued from their tokens: {pivot_text(audit.get('pivot') or {}) or 'none'}")
    _tell_loops(json.loads((run / "report.json").read_text()), cap)


def _tell_loops(report: dict, cap: int) -> None:
    """The rows that loop: how many, what stopping them saved, where every generated token went, and what
    prefill cost."""
    from tracegen.audit.token_account import account_lines, prefill_line

    runaway = ((report.get("measurement") or {}).get("runaway") or {})
    account = (report.get("run") or {}).get("token_account") or {}
    stopped, stopped_tokens = account.get("stopped_rows") or 0, account.get("stopped_tokens") or 0
    cut = max((runaway.get("rows") or 0) - stopped, 0)
    if cut or stopped:
        _say(f"  loops: {stopped:,} generations fell into a loop and were stopped while they looped, "
             f"{stopped_tokens:,} tokens in all ({stopped_tokens // max(stopped, 1):,} a row), "
             f"{account.get('stopped_saved') or 0:,} tokens short of their caps; {cut:,} more ran to a cap "
             f"and were judged after the fact. A runaway is never continued: neither the tail measurement nor "
             f"the pivot spent a token on one")
    if account:
        _say("  where the tokens went: " + "; ".join(f"{n:,} {what} ({share})"
                                                  for what, n, share in account_lines(account)))
        if (prefill := prefill_line(account)) is not None:
            _say(f"  prefill: {prefill}")


def _tell_where(output: Path, run: Path, logs: Path, demo: Path) -> None:
    """The output root's status, and where the report, data, logs, an export and the UI are."""
    from tracegen.status import dataset_status, format_status

    _say("  " + format_status(dataset_status(str(output))).replace("\n", "\n  "))
    _say(f"\nreport:  {run / 'report.html'}")
    _say(f"output:  {output}")
    _say(f"logs:    {logs} (the demo's commands); each task's log is in the Airflow UI (make airflow)")
    _tell_export(output, demo / "export")
    _say("UI:      make airflow   (then open http://localhost:8080; same state: the run, its question and the answer)")


def _tell_export(output: Path, dest: Path) -> None:
    """Export the dataset as a drafter trainer reads it (the tokens layout), and say whose tokens they are, as
    the servers reported when the fleet came up."""
    from tracegen.export import export_dataset

    # Each demo has a root of its own and replaces the previous demo's export: the operator's choice (force).
    result = export_dataset(str(output), str(dest), layout="tokens", overwrite=True, force=True)
    servers = json.loads((dest / "manifest.json").read_text())["provenance"].get("servers") or {}
    _say(f"export:  {result.rows:,} rows for SpecForge and speculators in {result.data_uri}, "
         f"manifest {dest / 'manifest.json'} (.venv/bin/python -m tracegen export {output} {dest} --layout tokens --overwrite redoes it)")
    _say(f"         their tokens: {servers.get('model_path') or 'unrecorded model'}, SGLang "
         f"{servers.get('sglang_version') or '?'}, as the {len(servers.get('servers') or [])} servers reported")


KEEP_DEMOS = 3  # demo output roots kept (each a few MB): their runs' reports stay readable in the UI


def new_output_root(demo: Path, keep: int = KEEP_DEMOS) -> tuple[Path, list[Path]]:
    """(a new, empty output root for this demo, the oldest earlier roots it removed).

    `demo/output` becomes a link to the new root, so `make airflow` (TRACEGEN_OUTPUT_URI) opens on the
    newest demo; each run names its own root in its conf. A `demo/output` directory from before roots
    were kept per demo is kept too, renamed like the others."""
    demo.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    link = demo / "output"
    if link.is_symlink():
        link.unlink()
    elif link.is_dir():
        link.rename(demo / f"output-{stamp}-earlier")
    root = demo / f"output-{stamp}"
    n = 1
    while root.exists():  # two demos within a second
        root, n = demo / f"output-{stamp}-{n}", n + 1
    root.mkdir()
    link.symlink_to(root.name)
    earlier = sorted((p for p in demo.glob("output-*") if p.is_dir() and p != root), key=lambda p: p.stat().st_mtime)
    dropped = earlier[: max(0, len(earlier) - (keep - 1))]
    for path in dropped:
        shutil.rmtree(path)
    return root, dropped


def _forget_runs(env: dict[str, str], roots: list[Path]) -> int:
    """Delete from the metadata DB the tracegen_generate runs whose output root (their conf's) was
    removed: a run listed in the UI has its output."""
    os.environ.update(env)
    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session
    from sqlalchemy import select

    names = {str(r) for r in roots}
    with create_session() as session:
        gone = [r for r in session.scalars(select(DagRun).where(DagRun.dag_id == dag_ids.GENERATE))
                if isinstance(r.conf, dict) and r.conf.get("output_uri") in names]
        for run in gone:
            session.delete(run)
    return len(gone)


_TASK_START = re.compile(r"\[DAG TEST\] starting task_id=(\S+) map_index=(-?\d+)")
_TASK_END = re.compile(r"\[DAG TEST\] end task task_id=(\S+) map_index=(-?\d+)")


def split_task_logs(text: str) -> dict[tuple[str, int], list[str]]:
    """Each task's lines of an `airflow dags test` output, by (task_id, map_index). It runs one task at a
    time in its own process and prints everything to stdout between these two markers."""
    out: dict[tuple[str, int], list[str]] = {}
    current: tuple[str, int] | None = None
    for line in text.splitlines():
        if start := _TASK_START.search(line):
            current = (start.group(1), int(start.group(2)))
        if current is not None:
            out.setdefault(current, []).append(line)
        if _TASK_END.search(line):
            current = None
    return out


def task_log_path(base: Path, template: str, dag_id: str, run_id: str, task_id: str, map_index: int,
                  try_number: int) -> Path:
    """Where Airflow's file task handler reads a task's log (`[logging] log_filename_template`)."""
    from types import SimpleNamespace

    import jinja2

    ti = SimpleNamespace(dag_id=dag_id, run_id=run_id, task_id=task_id, map_index=map_index, try_number=try_number)
    return base / jinja2.Template(template).render(ti=ti, try_number=try_number)


def _write_task_logs(run_log: Path, run_id: str | None = None, dag_id: str = dag_ids.GENERATE) -> int:
    """`airflow dags test` writes no task log files (it runs tasks in-process, to stdout): split its output
    into one file per task where the UI of `make airflow` (same AIRFLOW_HOME) reads them."""
    from airflow.configuration import conf
    from airflow.models.dagrun import DagRun
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session
    from sqlalchemy import select

    by_task = split_task_logs(run_log.read_text(errors="replace"))
    base = Path(conf.get("logging", "base_log_folder"))
    template = conf.get("logging", "log_filename_template")
    with create_session() as session:
        if run_id is None:
            run_id = session.scalar(select(DagRun.run_id).where(DagRun.dag_id == dag_id).order_by(DagRun.id.desc()))
        tries = {(ti.task_id, ti.map_index): ti.try_number for ti in session.scalars(
            select(TaskInstance).where(TaskInstance.dag_id == dag_id, TaskInstance.run_id == run_id))}
    written = 0
    for (task_id, map_index), lines in by_task.items():
        if (task_id, map_index) not in tries:
            continue
        path = task_log_path(base, template, dag_id, run_id, task_id, map_index, tries[task_id, map_index])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines) + "\n")
        written += 1
    return written


def _rows_of_run(output: Path, run_id: str, *, while_asking: bool = False) -> int:
    """Ledger rows of `run_id` (only those generated while its question waited, with `while_asking`)."""
    from tracegen.store.root import open_root

    frame = open_root(str(output)).snapshots.frame()
    mine = frame["run_id"] == run_id
    return int((mine & frame["while_asking"]).sum() if while_asking else mine.sum())


if __name__ == "__main__":
    sys.exit(main())
