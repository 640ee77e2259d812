"""Where a run's fleet comes from: the operator's configuration, never the output root.

A fleet is named by a source: 'local-sim' (the bundled simulated fleet, SGLang stand-ins on this
machine) or the path of a fleet JSON file on the Airflow workers. Runs record the source and the
fleet's digest (`tracegen.run.run_spec.FleetRef`); a task that needs the fleet loads it from the source
and refuses a fleet that changed since the run began.

A DAG's `fleet` param names only a fleet the operator listed (`listed_fleet`): TRACEGEN_FLEET (the
default) and the entries of TRACEGEN_FLEETS (comma-separated fleet files, or directories whose files may
all be named). Anything else is refused before it is opened, with the same words whether or not such a
file exists, so the param cannot probe the workers' file system or read a file's contents into a log.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from tracegen.config import LOCAL_SIM, state_dir
from tracegen.fleet.ref import FleetRef, fleet_digest
from tracegen.fleet.spec import FleetSpec, FleetSpecError
from tracegen.params import default_fleet_source

__all__ = ["LOCAL_SIM", "FleetChangedError", "FleetNotListed", "listed_fleet", "load_fleet", "local_sim_fleet",
           "reference", "resolve"]

DEFAULT_FLEET_ENV = "TRACEGEN_FLEET"  # read by `params.default_fleet_source`
LISTED_FLEETS_ENV = "TRACEGEN_FLEETS"
# Decoded tokens per streamed event of the bundled fleet, chosen from the client CPU each event costs (a read in
# the event loop, a decode, the watch's feed): against 64, 15-30% less CPU a streamed row, and 256 is the cheapest
# measured. A stop comes up to an interval late (the watch judges every 64 ids, an event's points in turn),
# 96 tokens more a looping row on average; every loop of the test set still ends within two periods and a
# window of its onset (docs/benchmarks.md, "Where the tokens of looping rows go").
STREAM_INTERVAL = 256


class FleetChangedError(FleetSpecError):
    """The fleet a run recorded is not the fleet its source describes now."""


class FleetNotListed(FleetSpecError):
    """A `fleet` param naming a fleet the operator did not list."""


def _listed() -> list[str]:
    entries = [e.strip() for e in os.environ.get(LISTED_FLEETS_ENV, "").split(",")]
    return [default_fleet_source(), *(e for e in entries if e)]


def listed_fleet(source: Any) -> str:
    """`source` when the operator listed it (TRACEGEN_FLEET, or a file or directory in TRACEGEN_FLEETS);
    `FleetNotListed` otherwise. Only the operator's entries are looked at on disk: for any other path the
    refusal is the same whether a file is there or not, and quotes nothing of it."""
    if not isinstance(source, str) or not source.strip():
        raise FleetNotListed(f"fleet: expected '{LOCAL_SIM}' or the path of a fleet file the operator listed")
    source = source.strip()
    listed = _listed()
    if source == LOCAL_SIM:
        if LOCAL_SIM in listed:
            return source
    elif os.path.isabs(source):
        # Compared by real path (links and '..' resolved), the operator's entries' too.
        wanted = os.path.realpath(source)
        for entry in listed:
            if entry == LOCAL_SIM or not os.path.isabs(entry):
                continue
            real = os.path.realpath(entry)
            if wanted == real or (os.path.isdir(real) and wanted.startswith(real.rstrip("/") + "/")):
                return source
    raise FleetNotListed(
        f"fleet: not one the operator listed ({DEFAULT_FLEET_ENV}, {LISTED_FLEETS_ENV}): the trigger may name "
        f"{', '.join(repr(e) for e in listed)} (or a file in a listed directory); nothing was read")


def local_sim_fleet() -> dict[str, Any]:
    """The bundled simulated fleet: SGLang stand-ins on this machine, launched exactly like SGLang."""
    time_scale = float(os.environ.get("TRACEGEN_SIM_TIME_SCALE", "40"))
    # A share of samples that loop as models do (`make demo` sets 3%): none unless asked for.
    runaway_rate = float(os.environ.get("TRACEGEN_SIM_RUNAWAY_RATE") or 0)
    loops = {"--sim-runaway-rate": runaway_rate, "--sim-loop-shape": "varied"} if runaway_rate > 0 else {}
    return {
        "hosts": [{"conn_id": "local", "gpus": [0, 1], "base_port": int(os.environ.get("TRACEGEN_SIM_PORT", "31000"))}],
        "model_path": "Qwen/Qwen3.6-27B",
        "served_model_name": "qwen3.6-27b",
        "python": sys.executable,
        "launch_module": "tracegen.simulator",
        "sglang_flags": {
            "--reasoning-parser": "qwen3",
            "--speculative-algorithm": "NEXTN",
            "--speculative-num-steps": 3,
            "--max-running-requests": 64,
            "--context-length": 40960,
            "--enable-metrics": True,
            # The chat route's usage says how many prompt tokens the prefix cache held only with it
            # (`/generate` always does): the report's prefill account is unknown for those rows otherwise.
            "--enable-cache-report": True,
            # Streamed output, so that a generation that loops is stopped while it loops: each event only
            # its new ids, one every STREAM_INTERVAL tokens (docs/architecture.md, "Stopping a loop").
            "--incremental-streaming-output": True,
            "--stream-interval": STREAM_INTERVAL,
            "--sim-time-scale": time_scale,
            **loops,
        },
        "work_dir": str(state_dir() / "fleet"),
        "health_timeout_s": 60.0,
        "stop_timeout_s": 10.0,
    }


def load_fleet(source: str) -> FleetSpec:
    """'local-sim' or a path to a fleet JSON file; errors say which file and what is wrong."""
    if source == LOCAL_SIM:
        return FleetSpec.from_dict(local_sim_fleet())
    path = Path(source)
    if not path.is_file():
        raise FleetSpecError(f"fleet: {source!r} is neither '{LOCAL_SIM}' nor a readable fleet JSON file")
    try:
        return FleetSpec.from_json(path.read_text())
    except FleetSpecError as exc:
        raise FleetSpecError(f"fleet file {path}: {exc}") from None


def reference(source: str) -> tuple[FleetSpec, FleetRef]:
    """Load the fleet at `source` and the reference a run records for it."""
    fleet = load_fleet(source)
    return fleet, FleetRef.of(fleet, source)


def resolve(ref: FleetRef, source: str | None = None) -> FleetSpec:
    """The fleet a run recorded, loaded from `source` (default: the source the run named) and refused
    when it no longer has the recorded digest.

    Callers that hold a record read back from storage pass the operator's own `source`, so a record
    can never choose which fleet file is loaded."""
    source = ref.source if source is None else source
    fleet = load_fleet(source)
    digest = fleet_digest(fleet)
    if digest != ref.sha256:
        raise FleetChangedError(
            f"fleet {source!r} has changed since the run began (digest {digest[:12]}, the run recorded "
            f"{ref.sha256[:12]} from {ref.source!r}); finish the run with its own fleet, or start a new run"
        )
    return fleet
