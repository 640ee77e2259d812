"""`bench/prefill.py` runs end to end on a tiny fleet and prints its last line (its figures are not judged here:
performance is measured in bench/, and timed assertions stay out of the tests)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_the_router_arm_says_how_to_install_the_router_when_it_is_missing():
    """`--router` needs sglang-router, which the suite's venv does not hold: the bench says how to get it."""
    if subprocess.run([sys.executable, "-c", "import sglang_router"], capture_output=True).returncode == 0:
        pytest.skip("sglang-router is installed in this venv")
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "prefill.py"), "--router"], capture_output=True,
                         text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT / "include")})  # fmt: skip
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert "requirements-bench.txt" in out.stderr and "--router-python" in out.stderr, out.stderr
