"""`bench/prefill.py` runs end to end on a tiny fleet and prints its last line (its figures are not judged here:
performance is measured in bench/, and timed assertions stay out of the tests)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_prefill_benchmark_runs_and_prints_its_figures():
    args = ["--servers", "2", "--conversations", "2", "--max-running", "8", "--time-scale", "200", "--cap", "256",
            "--length-model", "fixed:20"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "include")}
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "prefill.py"), *args], capture_output=True,
                         text=True, timeout=280, env=env)  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert "least_outstanding:" in out.stdout and "prefix:" in out.stdout
    assert re.fullmatch(r"prefill computed / distinct prefix tokens: [\d.]+ \(least-outstanding routing: [\d.]+\); "
                        r"kept rows per fleet-second: [\d.]+ x", lines[-1]), lines[-1]  # fmt: skip
    # What prefill cost, summed from the answers by the report's own account, is what the servers counted.
    total = int(re.search(r"([\d,]+) prompt tokens \(mean", out.stdout).group(1).replace(",", ""))
    said = re.findall(r"prefill as the report says it: ([\d,]+) prompt tokens sent over \d+ rows: ([\d,]+) found "
                      r"cached \([\d.]+%\), ([\d,]+) computed; the servers computed ([\d,]+)", out.stdout)
    assert len(said) == 2 and re.findall(r"(\d+) failed", out.stdout) == ["0", "0"], out.stdout
    for sent, cached, computed, servers in ([int(n.replace(",", "")) for n in row] for row in said):
        assert sent == total and computed == sent - cached == servers
