"""Where `make venv` takes CPU torch from: the wheel folder `TORCH_WHEELS` names when it holds the pinned wheel,
PyTorch's CPU wheel index otherwise, so a machine without that folder still builds the venv.

Checked with `make -n -B` (what make would run, nothing run): the install itself needs the index, which this
machine cannot reach.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _torch_install(wheels: Path) -> str:
    printed = subprocess.run(["make", "-n", "-B", "-C", str(ROOT), "venv", f"TORCH_WHEELS={wheels}"],
                             capture_output=True, text=True, check=True, timeout=60).stdout
    lines = [line for line in printed.splitlines() if re.search(r'"torch==[^"]+\+cpu"', line)]
    assert len(lines) == 1, printed
    return lines[0]


def test_an_empty_wheel_folder_takes_torch_from_pytorchs_cpu_index(tmp_path: Path) -> None:
    line = _torch_install(tmp_path)
    assert "--index-url https://download.pytorch.org/whl/cpu" in line
    assert "--find-links" not in line
    assert "--no-deps" in line  # torch alone comes from there, nothing it would pull in


def test_a_folder_holding_the_pinned_wheel_is_used_without_any_index(tmp_path: Path) -> None:
    pinned = re.search(r'"torch==([^"]+)"', _torch_install(tmp_path)).group(1)
    (tmp_path / f"torch-{pinned}-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    line = _torch_install(tmp_path)
    assert f"--find-links {tmp_path}" in line
    assert "--index-url" not in line
