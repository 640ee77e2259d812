"""`python -m tracegen status --watch` follows a live run, as an operator's terminal shows it: the stand-in
generates, the chunk engine commits, and the watch (in a pseudo-terminal, so rich draws its bar) shows the
bar advancing and exits by itself once nothing is left."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time

from engine_support.helpers import ROOT, endpoints, make_config, prepare, run_engine, write_dataset

ROWS = 60
ANSI = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]")


def _read(fd: int, into: bytearray, until: float) -> None:
    while time.monotonic() < until:
        ready, _, _ = select.select([fd], [], [], 0.1)
        if not ready:
            return
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # the terminal's other end closed: the watch exited
            return
        if not chunk:
            return
        into += chunk


def test_the_watch_bar_advances_with_a_live_run_and_ends_with_it(sim_server, tmp_path) -> None:
    # About 3 s of generating: 60 rows of 600 tokens, 4 at a time.
    sim = sim_server(max_running_requests=4, sim_time_scale=20, sim_length_model="fixed:600")
    dataset = write_dataset(tmp_path / "prompts.jsonl", ROWS)
    config = make_config(dataset, tmp_path / "out", part_rows=4, part_seconds=0.1)
    prepare(config, "run-watch")
    main, other = pty.openpty()
    fcntl.ioctl(other, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 200, 0, 0))
    env = {**os.environ, "TERM": "xterm", "PYTHONPATH": os.pathsep.join([str(ROOT / "include"),
                                                                         os.environ.get("PYTHONPATH", "")])}
    watch = subprocess.Popen([sys.executable, "-m", "tracegen", "status", str(tmp_path / "out"), "--watch",
                              "--interval", "0.2"], stdin=other, stdout=other, stderr=other, env=env)
    os.close(other)
    seen = bytearray()
    try:
        deadline = time.monotonic() + 60
        while f"0/{ROWS} rows".encode() not in ANSI.sub(b"", bytes(seen)):  # the bar drawn before any row
            assert watch.poll() is None and time.monotonic() < deadline, bytes(seen)[-2000:]
            _read(main, seen, time.monotonic() + 0.5)
        summary = run_engine(config, "run-watch", endpoints(sim, in_flight=4), tmp_path / "spool", range(ROWS))
        assert summary.committed_rows == ROWS, summary
        deadline = time.monotonic() + 60
        while watch.poll() is None and time.monotonic() < deadline:
            _read(main, seen, time.monotonic() + 0.5)
        _read(main, seen, time.monotonic() + 1)
        assert watch.wait(5) == 0
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.wait()
        os.close(main)
    text = ANSI.sub(b"", bytes(seen)).decode(errors="replace")
    done = [int(n) for n in re.findall(rf"(\d+)/{ROWS} rows", text)]
    steps = sorted(set(done))
    assert done == sorted(done) and steps[0] == 0 and steps[-1] == ROWS, done
    assert len(steps) >= 3, f"the bar should advance while the run generates: {steps}"
    assert "run-watch: done: nothing left at its cap" in text and "rows/s" in text and "ETA" in text, text[-1500:]
