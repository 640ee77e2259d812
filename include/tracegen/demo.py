"""`make demo`: the seed's 4096 → 8192 pivot, end to end through the real `tracegen_generate` DAG.

Runs `airflow dags test` on a local SQLite metadata DB against a simulated fleet (two SGLang stand-ins
launched exactly like SGLang) and the bundled prompts, at the seed's cap. The pilot gate finds too many
rows truncated and asks (gate_mode=ask): the run waits at its question, as it would in the UI's Required
Actions. `airflow dags test` starts no api-server, so the demo answers for the reviewer through the REST
API's own handler, with the cap the report recommends, and the same run goes on at that cap from the
committed rows. Full task logs go to `.state/demo/logs/`; this prints the story.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

from tracegen.config import PROJECT_DIR, state_dir

DEMO_PILOT = 500  # of the bundled 3,000 prompts


def airflow_env(state: Path) -> dict[str, str]:
    """The environment every Airflow command of the embedded default runs with (also `make airflow`)."""
    home = state / "airflow"
    return {
        **os.environ,
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
        pending = awaiting_answers("tracegen_generate")
        if pending:
            return pending[0]
        time.sleep(1)
    return None


def _choose(question: dict) -> tuple[str, int | None, str]:
    """The demo reviewer's answer (option, cap typed or None, why): the smallest cap in the table whose
    whole interval meets the threshold. That is the recommended cap when its interval does; otherwise a
    bigger one, typed in the form's field."""
    threshold = question["verdict"]["threshold"]
    safe = [r["cap"] for r in question["cap_rows"]
            if r["truncation_high"] <= threshold and r["cap"] > question["current_cap"] and r["cap"] <= question["max_cap"]]
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
    output = demo / "output"
    logs = demo / "logs"
    if demo.exists():
        shutil.rmtree(demo)  # the demo tells the story from an empty output root every time
    logs.mkdir(parents=True)
    env = airflow_env(state)
    env["TRACEGEN_OUTPUT_URI"] = str(output)
    (state / "airflow").mkdir(parents=True, exist_ok=True)

    started = time.monotonic()
    _say("tracegen demo: 3,000 agentic-coding prompts, a simulated 2-GPU SGLang fleet, the real DAG.\n")
    _say("[1/4] migrating the Airflow metadata DB (SQLite) ...")
    if _airflow(env, ["db", "migrate"], logs / "db-migrate.log") != 0:
        _say(f"  airflow db migrate failed; see {logs / 'db-migrate.log'}")
        return 1

    _say("[2/4] tracegen_generate with max_tokens=4096 (the seed's cap; gate_mode=ask, the default) ...")
    conf = {"max_tokens": 4096, "pilot_size": DEMO_PILOT, "teardown": True}
    log1 = logs / "run-4096.log"
    with log1.open("w") as out:
        dags_test = subprocess.Popen(
            [sys.executable, "-m", "airflow", "dags", "test", "tracegen_generate", "--conf", json.dumps(conf)],
            env=env, stdout=out, stderr=subprocess.STDOUT)
    question = _wait_for_question(env, dags_test)
    run1 = _newest_run_dir(output)
    gate = _verdict(run1 and run1 / "pilot-report.json")
    if question is None or gate.get("verdict") != "stop":
        _explain_failure(log1)
        return 1
    _say(f"  the pilot gate holds the run at a question:\n    {gate['reason']}")
    committed = _rows_of_run(output, run1.name)
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
    option, typed, why = _choose(json.loads((run1 / "question.json").read_text()))
    page = (f"http://localhost:8080/dags/tracegen_generate/runs/{urllib.parse.quote(question['run_id'], safe='')}"
            f"/tasks/{question['task_id']}/required_actions")
    what = f"type {typed} in the cap field and click \"{option}\"" if typed else f"click \"{option}\""
    _say(f"  a reviewer would {what} ({why}) on\n    {page}\n    (`make airflow` opens that UI on this state; "
         "there the run shows the question and its answer)")
    _say("  answering for them, through the REST API's handler (PATCH .../hitlDetails), as user 'demo' ...")
    from tracegen.review_gate import answer_in_process

    answer_in_process("tracegen_generate", question["run_id"], question["task_id"], option, {"cap": typed},
                      user="demo", map_index=question["map_index"])
    rc = dags_test.wait()
    run2 = run1  # answered in place: the same run goes on
    decision = (json.loads((run2 / "run.json").read_text()).get("decisions") or [{}])[-1]
    cap = decision.get("cap") or 0

    _say(f"\n[3/4] the same run goes on at max_tokens={cap:,}, as answered (no new trigger) ...")
    if rc != 0 or not cap:
        _explain_failure(log1)
        return 1
    final = _verdict(run2 / "report.json")
    _say(f"  decision, in run.json and the report: {decision['responded_by']} chose \"{decision['option']}\" "
         f"at {decision['responded_at']}")
    _say(f"  final audit: {final.get('reason')}")
    _say("  rows finished under 4096 were kept; rows truncated at 4096 were continued from their tokens.")
    pivot = json.loads((run2 / "report.json").read_text())["audit"].get("pivot") or {}
    _say(f"  the pivot (truncated_policy=extend): {pivot.get('extended', 0):,} rows extended "
         f"({pivot.get('extended_finished', 0):,} now finish), {pivot.get('extended_new_tokens', 0):,} new tokens "
         f"spent; {pivot.get('tokens_saved', 0):,} tokens saved against regenerating them (their 4096-token "
         "prefixes, not paid again)")

    _say("\n[4/4] status, from the ledger alone (python -m tracegen status):\n")
    from tracegen.status import dataset_status, format_status

    _say("  " + format_status(dataset_status(str(output))).replace("\n", "\n  "))
    _say(f"\nreport:  {run2 / 'report.html'}")
    _say(f"output:  {output}")
    _say(f"logs:    {logs}")
    _say(f"export:  .venv/bin/python -m tracegen export {output} {demo / 'export'}")
    _say("UI:      make airflow   (then open http://localhost:8080; same state: the run, its question and the answer)")
    _say(f"\ndone in {time.monotonic() - started:.0f} s")
    return 0


def _rows_of_run(output: Path, run_id: str) -> int:
    from tracegen.store.ledger import Ledger
    from tracegen.store.storage import open_storage

    frame = Ledger(open_storage(str(output))).frame()
    return int((frame["run_id"] == run_id).sum())


if __name__ == "__main__":
    sys.exit(main())
