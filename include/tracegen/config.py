"""The typed, validated configuration of one generation run, built from the DAG's params.

Every param a person can type in the trigger form passes through `RunConfig.from_params`, which
names the param and the accepted range in its error. The config is stored beside the data
(`runs/<run_id>/config.json`) so scheduled reruns regenerate rows with the config they were
meant to have.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

TRUNCATED_POLICIES = ("regenerate", "keep")
GATE_MODES = ("stop", "warn")
INVALID_ROW_POLICIES = ("record", "fail")

# Airflow run ids contain ':' and '+'; storage keys and spool dirs want a tamer alphabet.
_RUN_ID_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")

PACKAGE_DIR = Path(__file__).resolve().parent
SAMPLE_DATASET = PACKAGE_DIR / "sample_data" / "agentic_coding_prompts.jsonl.gz"


class ConfigError(ValueError):
    """A param is missing, has the wrong type or is out of range; the message names it."""


def safe_run_id(run_id: str) -> str:
    """A run id usable in object keys and file names, still recognisable to a person."""
    cleaned = _RUN_ID_UNSAFE.sub("_", run_id).strip("._")
    if not cleaned:
        raise ConfigError(f"run id {run_id!r} has no usable characters")
    return cleaned[:120]


@dataclass(frozen=True)
class RunConfig:
    """What one run generates, under which cap, into which output root, and how it gates itself."""

    max_tokens: int = 4096
    dataset_uri: str = ""
    output_uri: str = ""
    temperature: float = 0.6
    top_p: float = 0.95
    chunk_size: int = 0  # 0: chosen from the dataset size so the mapped task count stays well under 1024
    pilot_size: int = 1500
    pilot_seed: int = 0
    truncation_threshold: float = 0.05
    gate_mode: str = "stop"
    truncated_policy: str = "regenerate"
    invalid_rows: str = "record"
    part_rows: int = 500
    part_seconds: float = 60.0
    max_in_flight_per_server: int = 128
    # True: each server's in-flight limit starts at autotune_start_in_flight and follows what the server
    # reports (tracegen.sglang.autotune); False: max_in_flight_per_server is a fixed limit.
    autotune_in_flight: bool = True
    # A trickle, not a batch: a chunk task that starts while others keep the servers full then takes over
    # as they drain instead of taking an equal share at once (tasks with equal shares end together, and
    # the fleet drains through all their tails at once); on servers with room it grows within a poll.
    autotune_start_in_flight: int = 8
    request_deadline_s: float = 1800.0
    max_attempts: int = 6
    context_length: int = 0  # 0: unknown until the fleet reports it; validated again after provisioning
    aws_conn_id: str = "aws_default"

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, 1, 1_048_576)
        if not self.dataset_uri:
            raise ConfigError("dataset_uri: required (a JSONL, JSONL.gz or Parquet file, local or s3://)")
        if not self.output_uri:
            raise ConfigError("output_uri: required (a local directory, file:// or s3://bucket/prefix)")
        _check_float("temperature", self.temperature, 0.0, 2.0)
        _check_float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        if self.chunk_size != 0:
            _check_int("chunk_size", self.chunk_size, 10, 1_000_000)
        _check_int("pilot_size", self.pilot_size, 0, 1_000_000)
        _check_int("pilot_seed", self.pilot_seed, 0, 2**32 - 1)
        _check_float("truncation_threshold", self.truncation_threshold, 0.0, 1.0)
        _check_choice("gate_mode", self.gate_mode, GATE_MODES)
        _check_choice("truncated_policy", self.truncated_policy, TRUNCATED_POLICIES)
        _check_choice("invalid_rows", self.invalid_rows, INVALID_ROW_POLICIES)
        _check_int("part_rows", self.part_rows, 1, 100_000)
        _check_float("part_seconds", self.part_seconds, 0.1, 3600.0)
        _check_int("max_in_flight_per_server", self.max_in_flight_per_server, 1, 4096)
        _check_int("autotune_start_in_flight", self.autotune_start_in_flight, 1, 4096)
        if not isinstance(self.autotune_in_flight, bool):
            raise ConfigError(f"autotune_in_flight: expected true or false, got {self.autotune_in_flight!r}")
        _check_float("request_deadline_s", self.request_deadline_s, 1.0, 24 * 3600.0)
        _check_int("max_attempts", self.max_attempts, 1, 100)
        _check_int("context_length", self.context_length, 0, 10_000_000)
        self.check_context_length(self.context_length)

    def check_context_length(self, context_length: int) -> None:
        """max_tokens must leave room for a prompt inside the model's context window."""
        if context_length and self.max_tokens >= context_length:
            raise ConfigError(
                f"max_tokens: {self.max_tokens} does not fit the model's context length of "
                f"{context_length} tokens (prompt + completion must fit); use at most {context_length - 1}"
            )

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> RunConfig:
        """Build from DAG params (or a JSON dict); unknown keys are an error, not silently dropped."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(params) - known)
        if unknown:
            raise ConfigError(f"unknown param(s) {unknown}; known: {sorted(known)}")
        return cls(**params)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def dumps(self) -> bytes:
        return json.dumps(self.to_json(), indent=2, sort_keys=True).encode()


def _check_int(name: str, value: Any, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name}: expected an integer, got {value!r} ({type(value).__name__})")
    if not low <= value <= high:
        raise ConfigError(f"{name}: {value} is outside [{low}, {high}]")


def _check_float(name: str, value: Any, low: float, high: float, *, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{name}: expected a number, got {value!r} ({type(value).__name__})")
    if value != value or not (low < value if low_open else low <= value) or value > high:
        bound = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise ConfigError(f"{name}: {value} is outside {bound}")


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name}: {value!r} is not one of {list(choices)}")
