"""The run's first task: its params checked, then the run prepared (`run.prepare`)."""

from __future__ import annotations

import logging
from typing import Any

from tracegen.tasks.outcomes import Refuse

log = logging.getLogger(__name__)


def prepare_task(api, lead: int) -> dict[str, Any]:
    """The run's first task: params → validated `RunConfig` and fleet, then `prepare_run`, with the chunks
    staggered over `lead` chunk tasks (the DAG's own number). A bad param is a `Refuse` here, naming it,
    before anything is launched: a cap the fleet's declared context length (its `--context-length` flag)
    cannot hold is refused here too, so a value the trigger form clamped to its maximum never reaches a
    server (a fleet that declares none is checked by provision_fleet, from the servers). Returns the run and
    its chunks with work left, as the XComs the DAG hands on."""
    from tracegen.common import dag_ids
    from tracegen.config import ConfigError, RunConfig, safe_run_id
    from tracegen.dataset.stored import ReadingMismatchError
    from tracegen.dataset.usable import DatasetUnusableError
    from tracegen.fleet import FleetSpecError
    from tracegen.fleet.sources import listed_fleet, reference
    from tracegen.params import CONFIG_PARAMS, default_fleet_source
    from tracegen.run.prepare import prepare_run
    from tracegen.run.run_record import RunRecordTaken

    params = api.params
    try:
        config = RunConfig.from_params({k: params[k] for k in CONFIG_PARAMS})
        fleet, ref = reference(listed_fleet(params.get("fleet") or default_fleet_source()))
        declared = fleet.sglang_flags.get("--context-length")
        if isinstance(declared, int) and not isinstance(declared, bool) and declared > 0:
            config.check_context_length(declared)
    except (ConfigError, FleetSpecError) as exc:
        raise Refuse(f"invalid params: {exc}") from None
    try:
        safe_run_id(api.run_id)
        spec, work = prepare_run(config, None, ref, stagger=lead, teardown=bool(params.get("teardown", False)),
                                 airflow_run_id=api.run_id)
    except (ConfigError, RunRecordTaken, DatasetUnusableError, ReadingMismatchError) as exc:
        raise Refuse(f"run {api.run_id!r}: {exc}") from None
    log.info("run %s (stored as %s): max_tokens=%d, dataset %s, output %s, %d GPUs", api.run_id, spec.run_id,
             config.max_tokens, config.dataset_uri, config.output_uri, len(fleet.servers()))
    if config.runaway_policy != "resample":
        # Skipped now, not by a process started after the last chunk only to skip itself: the report and
        # teardown then follow the last chunk in the scheduler's next loop (docs/benchmarks.md).
        api.skip(dag_ids.RESAMPLE_RUNAWAYS)
    return {"run": spec.to_json(), "chunks": [w.to_json() for w in work]}
