"""Shared pytest set-up: make `include/` importable as `tracegen`, and load the real-component fixtures."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "include"))
sys.path.insert(0, str(ROOT / "tests"))

# Real components on loopback: an S3-compatible server, SGLang stand-ins, an OpenSSH sshd.
pytest_plugins = ["fixtures.s3", "fixtures.simulator", "fixtures.sshd"]
