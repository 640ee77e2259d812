"""A run's fleet made ready: one server per GPU launched or reused and healthy, the cap checked against the
context the servers report, and what they say about themselves kept beside the run for the export."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


def provision_for_run(spec) -> list[dict[str, Any]]:
    """Launch or reuse the run's servers (its recorded fleet, `fleet.sources.resolve`) and wait for health;
    a cap over a server's context is a `ConfigError`. Returns each server with the context length it
    reports: the gate and its question (which caps a reviewer may choose) read it from here."""
    from tracegen.fleet import FleetConnection, provision
    from tracegen.fleet.sources import resolve
    from tracegen.generate.chunk import check_served_context

    fleet = resolve(spec.fleet)
    with FleetConnection(fleet) as connection:
        handles = provision(fleet, connection)
        context_lengths = check_served_context(spec.config, handles, connection.headers())
        record_servers(spec, [h.url for h in handles], connection.headers())
    for handle in handles:
        log.info("%s: %s server pid %d (%s)", handle.label, "reused" if handle.reused else "launched",
                 handle.pid, handle.model)
    return [{"server": h.label, "pid": h.pid, "reused": h.reused, "context_length": context_lengths[h.label]}
            for h in handles]


def record_servers(spec, urls: list[str], headers: dict[str, str]) -> None:
    """Keep what the servers say about their model, tokenizer, chat template and SGLang version beside the
    run (`runs/<run>/servers.json`), for the export's provenance. Provenance, not a condition to generate:
    a server that does not answer is logged, and the export's manifest then says it was not recorded."""
    from tracegen.export.servers import record
    from tracegen.store.root import open_root

    try:
        doc = record(open_root(spec.config.output_uri, spec.config.aws_conn_id), spec.run_id, urls, headers)
    except Exception as exc:  # noqa: BLE001 - provenance must never stop a run
        log.warning("could not record what the servers report about themselves (%s: %s); the export's "
                    "manifest will say so", type(exc).__name__, exc)
        return
    log.info("servers: %s", {k: doc.get(k) for k in ("model_path", "sglang_version", "agree")})
