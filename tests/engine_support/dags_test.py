"""`airflow dags test`, each run in a process forked from one that has already paid Airflow's start-up.

A fresh `python -m airflow dags test` spends about 9 s of CPU on the CI machine before the DAG file is even
read: importing Airflow and its CLI (3 s), then building the in-process execution API that `dags test` runs
its tasks against (a Cadwyn app whose versioned routers take 6 s to generate). A test module that runs the
DAGs eight times pays that eight times. `DagsTest` starts one server per module environment that does both
once, then forks a child per run; the child sets the run's environment, sends its output to a file and runs
the same CLI entry point (`airflow.__main__.main`) with the arguments a fresh process would get. The DAG
file, tracegen and the run's own work are still read and done in the child, from disk.

Each run names the one file that defines its DAG (`--dagfile-path dags/DAG_ID.py`, which
tests/dags/test_dagbag.py holds every DAG to): without it each run parses and serializes every DAG of the
folder, about 2 s of CPU a run on the CI machine.

Only stdlib here: the server must not import tracegen before it forks (the children import it from disk).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Settings Airflow reads once at import: a run may not change them, the server was started with them.
_FIXED_AT_IMPORT = ("AIRFLOW_HOME", "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "AIRFLOW__CORE__DAGS_FOLDER",
                    "AIRFLOW__CORE__PLUGINS_FOLDER", "PYTHONPATH")


def migrated_env(home: Path, project: Path, fleets: Path) -> dict[str, str]:
    """The environment `airflow dags test` of `project`'s DAGs runs with, on a SQLite metadata DB under `home`,
    migrated here; fleet files are allowed under `fleets`."""
    env = {
        **os.environ,
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home}/airflow.db",
        "AIRFLOW__CORE__DAGS_FOLDER": str(project / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(project / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "TRACEGEN_SPOOL_DIR": str(home / "spool"),
        "TRACEGEN_STATE_DIR": str(home / "state"),
        "TRACEGEN_FLEETS": str(fleets),
    }
    subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], env=env, check=True, capture_output=True)
    return env


class DagsTest:
    """Runs `airflow dags test DAG_ID --dagfile-path dags/DAG_ID.py [--conf JSON]` with `env`, forked from a
    warm server; `run` answers as `subprocess.run(..., capture_output=True, text=True)` would (the output,
    stdout and stderr interleaved as a terminal shows them, is in `stdout`)."""

    def __init__(self, env: dict[str, str], dags_dir: Path) -> None:
        self.env = dict(env)
        self.dags_dir = dags_dir
        self.workdir = Path(tempfile.mkdtemp(prefix="dags-test-"))
        self._log = (self.workdir / "server.log").open("w")
        # Unbuffered: answers are read whole lines at a time off the pipe, never left in a buffer select() misses.
        self._server = subprocess.Popen([sys.executable, __file__], env=self.env, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=self._log, bufsize=0)
        self._pending = b""
        self._runs = 0
        self._read(timeout=300)  # {"ready": true}

    def run(self, dag_id: str, conf: dict | None = None, extra_env: dict[str, str] | None = None,
            timeout: float = 600) -> subprocess.CompletedProcess:
        env = {**self.env, **(extra_env or {})}
        changed = [k for k in _FIXED_AT_IMPORT if env.get(k) != self.env.get(k)]
        if changed:
            raise ValueError(f"{changed}: Airflow read these when the server started; start another DagsTest")
        args = ["dags", "test", dag_id, "--dagfile-path", str(self.dags_dir / f"{dag_id}.py")]
        if conf is not None:
            args += ["--conf", json.dumps(conf)]
        self._runs += 1
        out = self.workdir / f"run-{self._runs}.log"
        request = memoryview(json.dumps({"args": args, "env": env, "out": str(out)}).encode() + b"\n")
        while request:
            request = request[os.write(self._server.stdin.fileno(), request):]
        pid = self._read(timeout=60)["pid"]
        try:
            rc = self._read(timeout=timeout)["rc"]
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)
            self._read(timeout=30)  # the killed child's exit status: the next run's answers come after it
            raise subprocess.TimeoutExpired(["airflow", *args], timeout, out.read_text(errors="replace")) from None
        return subprocess.CompletedProcess(["airflow", *args], rc, out.read_text(errors="replace"), "")

    def _read(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            line, newline, rest = self._pending.partition(b"\n")
            if newline:
                self._pending = rest
                return json.loads(line)
            ready, _, _ = select.select([self._server.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if ready:
                chunk = os.read(self._server.stdout.fileno(), 65536)
                if chunk:
                    self._pending += chunk
                    continue
                self._server.wait()
                self._log.flush()
                tail = (self.workdir / "server.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"the dags-test server exited ({self._server.returncode}):\n{tail}")
            if time.monotonic() >= deadline:
                raise TimeoutError

    def close(self) -> None:
        if self._server.poll() is None:
            self._server.stdin.close()
            try:
                self._server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._server.kill()
                self._server.wait()
        self._log.close()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> DagsTest:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _serve() -> None:
    """The server: warm up, then fork one child per request line on stdin, answering on the original stdout."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # Airflow logs to stdout while it imports: keep that off the answers

    from airflow.__main__ import main as airflow_main
    from airflow.cli.commands import dag_command  # noqa: F401  (what the command imports, imported once)
    from airflow.sdk.execution_time.supervisor import in_process_api_server

    # The execution API `dags test` runs tasks against: built here, with its versioned routers, so every
    # child inherits it. Its transport (an event loop on a thread) is not: each child starts its own.
    app = in_process_api_server().app
    if not getattr(app, "_cadwyn_initialized", True):
        app._cadwyn_initialize()

    def answer(doc: dict) -> None:
        answers.write(json.dumps(doc) + "\n")
        answers.flush()

    answer({"ready": True})
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                answers.close()
                devnull = os.open(os.devnull, os.O_RDONLY)
                os.dup2(devnull, 0)
                out = os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                os.dup2(out, 1)
                os.dup2(out, 2)
                os.environ.clear()
                os.environ.update(request["env"])
                sys.argv = ["airflow", *request["args"]]
                try:
                    airflow_main()
                    code = 0
                except SystemExit as exc:
                    code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
                    if not isinstance(exc.code, int) and exc.code is not None:
                        print(exc.code, file=sys.stderr)  # as the interpreter prints SystemExit("message")
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        answer({"pid": pid})
        _, status = os.waitpid(pid, 0)
        answer({"rc": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    _serve()
