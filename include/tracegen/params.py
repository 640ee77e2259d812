"""The trigger form of `tracegen_generate`, generated from `RunConfig`'s own rules, and the settings that
shape the DAG (read once, when the DAG file is parsed).

Importing this module imports neither Airflow nor the engine: `trigger_params` imports `airflow.sdk.Param`
only when called.
"""

from __future__ import annotations

import json
import os
from dataclasses import fields
from typing import Any

from tracegen.config import LOCAL_SIM, SAMPLE_DATASET, RunConfig, state_dir

# RunConfig fields shown on the form, in RunConfig's order (max_tokens first): those whose rule has a title.
CONFIG_PARAMS = tuple(f.name for f in fields(RunConfig) if f.metadata.get("rule") and f.metadata["rule"].title)

FLEET_PARAM = {
    "type": "string", "minLength": 1, "title": "Fleet description",
    "description": f"Path to a fleet JSON file on the Airflow workers (hosts, GPUs, model, SGLang flags), or "
    f"'{LOCAL_SIM}' for the bundled simulated fleet: one the operator listed (TRACEGEN_FLEET, TRACEGEN_FLEETS); "
    "any other is refused before it is read.",
}

# The JSON Schema draft the forms' fields are written in, named in each field. Airflow validates every field of
# every task's copy of the params each time it serializes the DAG (the dag-processor at each parse, `airflow
# dags test` several times a run), and jsonschema first checks the field's schema against its draft's
# metaschema: 1.46 ms a field against 2020-12, the default when none is named, 0.35 ms against draft-07, which
# holds every keyword the fields use. Serializing tracegen_generate: 0.90 s of CPU against 2020-12, 0.27 s
# against draft-07.
SCHEMA_DRAFT = {"$schema": "http://json-schema.org/draft-07/schema#"}


def form_field(default: Any, **schema: Any) -> Any:
    """One field of a trigger form: an Airflow `Param` whose schema names `SCHEMA_DRAFT`."""
    from airflow.sdk import Param

    return Param(default, **schema, **SCHEMA_DRAFT)


TEARDOWN_PARAM = {
    "type": "boolean", "title": "Stop servers at the end",
    "description": "Stop the SGLang servers when the run ends (they are reused by later runs otherwise).",
}


def default_params() -> dict[str, Any]:
    """Trigger-form defaults: the embedded default runs anywhere (bundled prompts, simulated fleet); the
    environment may point them elsewhere (TRACEGEN_DATASET_URI, TRACEGEN_OUTPUT_URI, TRACEGEN_FLEET)."""
    defaults = RunConfig(dataset_uri=str(SAMPLE_DATASET), output_uri=str(state_dir() / "output"))
    params = {name: getattr(defaults, name) for name in CONFIG_PARAMS}
    params["dataset_uri"] = os.environ.get("TRACEGEN_DATASET_URI", params["dataset_uri"])
    params["output_uri"] = os.environ.get("TRACEGEN_OUTPUT_URI", params["output_uri"])
    params["fleet"] = default_fleet_source()
    params["teardown"] = False
    return params


def default_fleet_source() -> str:
    """The operator's fleet: TRACEGEN_FLEET (a fleet file's path), else the bundled simulated fleet."""
    return os.environ.get("TRACEGEN_FLEET", LOCAL_SIM)


def trigger_params() -> dict[str, Any]:
    """`Param`s for the trigger form: each RunConfig param's type, range, enum, title and description
    come from its rule, so whatever the form accepts RunConfig accepts, and the reverse."""
    from tracegen.config import rule_of

    defaults = default_params()
    form: dict[str, Any] = {}
    for name in CONFIG_PARAMS:
        rule = rule_of(name)
        form[name] = form_field(defaults[name], title=rule.title, description=rule.description, **rule.schema())
    form["fleet"] = form_field(defaults["fleet"], **FLEET_PARAM)
    form["teardown"] = form_field(defaults["teardown"], **TEARDOWN_PARAM)
    return form


def generate_chunk_concurrency() -> int:
    """Chunk tasks of one run in flight at once; each spreads its requests over every server.

    Read once, when the DAG is parsed: it shapes the DAG (one task per slot beside the pilot) and is
    handed to the run's first task, which records it as the chunk layout's stagger, so the layout and
    the slots can never disagree.

    3, not 2 (bench/occupancy.py): tasks started together end together; with 2, both were often starting
    up at once and the fleet idled between chunks (fan-out occupancy 87% vs 95% with 3 on the benchmark's
    fleet). The per-server in-flight auto-tuner shares each server among them.
    """
    return int(os.environ.get("TRACEGEN_CHUNK_CONCURRENCY", "3"))


def output_roots() -> list[str]:
    """Output roots the scheduled rerun looks after: the `tracegen_output_roots` Variable (a JSON list),
    else the default output root."""
    from airflow.sdk import Variable

    raw = Variable.get("tracegen_output_roots", default=None)
    if raw is None:
        return [default_params()["output_uri"]]
    roots = json.loads(raw) if isinstance(raw, str) else raw
    if not isinstance(roots, list) or not all(isinstance(r, str) and r for r in roots):
        raise ValueError(f"Variable tracegen_output_roots must be a JSON list of output URIs, got {raw!r}")
    return roots


def raise_cap_params() -> dict[str, Any]:
    """`tracegen_raise_cap`'s form: which running run, and its new cap. The field is the run's own
    max_tokens field (`config.Cap`, `tracegen.common.cap_rule`'s bounds); the rest of the one cap rule (above
    the run's cap, below the servers' context length) is applied when the raise is made and read."""
    from tracegen.common.cap_rule import HIGHEST
    from tracegen.config import rule_of

    rule = rule_of("max_tokens")
    return {
        "run_id": form_field("", type="string", minLength=1, title="Run id",
                             description="The running tracegen_generate run to raise the cap of (its run id, as "
                                         "the Airflow UI shows it)."),
        "max_tokens": form_field(8192, title="New cap (max_tokens)",
                                 description="Above the run's current cap and below the servers' context length "
                                             f"(at most {HIGHEST:,}). Chunks starting from now generate at it; "
                                             "rows already truncated are extended to it from their tokens after "
                                             "the first fan-out.", **rule.schema()),
    }
