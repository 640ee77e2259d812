"""`make airflow` opens the UI on `make demo`'s state with the same bundled fleet: the stand-ins' settings the
demo runs them with are part of the fleet's digest, and a run refuses a fleet that changed since it began, so
with another digest a demo run could not be rerun from the UI.

Checked with `make -n` (what make would run, nothing run): the `airflow standalone` line's environment, with
the command swapped for one that prints the bundled fleet's digest.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRINT_DIGEST = ("from tracegen.fleet.ref import fleet_digest; from tracegen.fleet.sources import load_fleet; "
                "print(fleet_digest(load_fleet('local-sim')))")


def _clean_env() -> dict[str, str]:
    """This checkout's tracegen, and none of the stand-in settings a caller's shell may hold."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACEGEN_SIM_")}
    env["PYTHONPATH"] = str(ROOT / "include")
    return env


def _make_airflow_digest() -> str:
    printed = subprocess.run(["make", "-n", "-C", str(ROOT), "airflow", f"PY={sys.executable}"],
                             capture_output=True, text=True, check=True, timeout=60).stdout
    lines = [line for line in printed.splitlines() if re.search(r"/bin/airflow standalone$", line)]
    assert len(lines) == 1, printed
    command = re.sub(r"\S+/bin/airflow standalone$", f'{sys.executable} -c "{PRINT_DIGEST}"', lines[0])
    done = subprocess.run(["bash", "-c", command], cwd=ROOT, env=_clean_env(), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _demo_digest(state: Path) -> str:
    script = ("import os, sys; from pathlib import Path; from tracegen.demo import airflow_env; "
              "env = airflow_env(Path(sys.argv[1])); os.environ.clear(); os.environ.update(env); " + PRINT_DIGEST)
    done = subprocess.run([sys.executable, "-c", script, str(state)], env=_clean_env(), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_make_airflow_sees_the_fleet_make_demo_ran_on() -> None:
    demo = _demo_digest(ROOT / ".state")  # the state both use (the fleet's work dir is under it); nothing made
    assert re.fullmatch(r"[0-9a-f]{64}", demo)
    assert _make_airflow_digest() == demo


def test_the_demo_runs_its_stand_ins_with_loops() -> None:
    """The loop rate is what the two would otherwise differ in: without it the digest check above would hold
    trivially."""
    from tracegen.demo import DEMO_LOOP_RATE, airflow_env

    assert DEMO_LOOP_RATE > 0
    assert airflow_env(Path("/nonexistent"))["TRACEGEN_SIM_RUNAWAY_RATE"] in (
        os.environ.get("TRACEGEN_SIM_RUNAWAY_RATE"), str(DEMO_LOOP_RATE))
