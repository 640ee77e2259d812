"""`make demo`: the seed's 4096 → 8192 pivot, end to end through the real `tracegen_generate` DAG.

Runs `airflow dags test` twice on a local SQLite metadata DB against a simulated fleet (two SGLang
stand-ins launched exactly like SGLang) and the bundled prompts: first at the default cap, which the
pilot gate stops, then at the cap the report recommends, which resumes from the committed rows.
Full task logs go to `.state/demo/logs/`; this prints the story.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
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

    _say("[2/4] tracegen_generate with max_tokens=4096 (the seed's cap) ...")
    conf = {"max_tokens": 4096, "pilot_size": DEMO_PILOT}
    rc = _airflow(env, ["dags", "test", "tracegen_generate", "--conf", json.dumps(conf)], logs / "run-4096.log")
    run1 = _newest_run_dir(output)
    gate = _verdict(run1 and run1 / "pilot-report.json")
    if rc == 0 or gate.get("verdict") != "stop":
        _explain_failure(logs / "run-4096.log")
        return 1
    _say(f"  the pilot gate stopped the run:\n    {gate['reason']}\n    next: {gate['action']}")
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
    cap = gate.get("suggested_cap") or 8192

    _say(f"\n[3/4] tracegen_generate with max_tokens={cap}, truncated_policy=regenerate (the pivot) ...")
    conf = {"max_tokens": cap, "pilot_size": DEMO_PILOT, "truncated_policy": "regenerate", "teardown": True}
    rc = _airflow(env, ["dags", "test", "tracegen_generate", "--conf", json.dumps(conf)], logs / f"run-{cap}.log")
    run2 = _newest_run_dir(output)
    if rc != 0 or run2 is None or run2 == run1:
        _explain_failure(logs / f"run-{cap}.log")
        return 1
    final = _verdict(run2 / "report.json")
    _say(f"  pilot gate: {_verdict(run2 / 'pilot-report.json').get('reason')}")
    _say(f"  final audit: {final.get('reason')}")
    _say("  rows finished under 4096 were kept; only rows truncated at 4096 were generated again.")

    _say("\n[4/4] status, from the ledger alone (python -m tracegen status):\n")
    from tracegen.status import dataset_status, format_status

    _say("  " + format_status(dataset_status(str(output))).replace("\n", "\n  "))
    _say(f"\nreport:  {run2 / 'report.html'}")
    _say(f"output:  {output}")
    _say(f"logs:    {logs}")
    _say(f"export:  .venv/bin/python -m tracegen export {output} {demo / 'export'}")
    _say("UI:      make airflow   (then open http://localhost:8080; same state, both runs visible)")
    _say(f"\ndone in {time.monotonic() - started:.0f} s")
    return 0


def _rows_of_run(output: Path, run_id: str) -> int:
    from tracegen.store.ledger import Ledger
    from tracegen.store.storage import open_storage

    frame = Ledger(open_storage(str(output))).frame()
    return int((frame["run_id"] == run_id).sum())


if __name__ == "__main__":
    sys.exit(main())
