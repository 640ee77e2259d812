"""The pilot's two tasks after it generated: the tail measured past the cap (`measure_tail`), then the gate
on the pilot's truncation (`audit_and_gate`), which decides whether the fan-out starts, waits for the
reviewer, or stops the run."""

from __future__ import annotations

import logging
from typing import Any

from tracegen.run.stage import STOPPED
from tracegen.tasks.outcomes import Skip

log = logging.getLogger(__name__)


def tokens_per_s_per_gpu(summary: dict[str, Any], n_gpus: int) -> float | None:
    """The pilot's throughput per GPU, from its summary: what the question's GPU-hour estimates scale by."""
    elapsed, tokens = summary.get("elapsed_s") or 0, summary.get("completion_tokens") or 0
    return tokens / elapsed / max(1, n_gpus) if elapsed > 0 and tokens > 0 else None


def measure_tail(run: dict[str, Any], pilot: dict[str, Any], servers: list[dict[str, Any]]) -> dict[str, Any]:
    """Measure the tail before the gate reports (`tracegen.generate.measure`): when the pilot's truncation
    is over the threshold (measure_tail=auto) or always, continue its truncated rows from their tokens to
    the highest candidate cap the context and the token budget allow, so the pilot report's cap table is
    measured up to that cap. The pilot report is written first, for its verdict: the chunks beside the
    pilot stop on it and leave the fleet to the measurement; the gate's audit then rewrites it."""
    from tracegen.fleet.sources import resolve
    from tracegen.generate.measure import measure_tail as measure
    from tracegen.run.cap_raise import served_context
    from tracegen.run.plan import pilot_indices
    from tracegen.run.run_report import audit_and_report
    from tracegen.run.run_spec import handed_over
    from tracegen.store.root import open_root

    spec = handed_over(run)
    if not pilot.get("indices"):
        return {"cap": None, "reason": "no pilot"}
    context_length = served_context(servers)
    root = open_root(spec.config.output_uri, spec.config.aws_conn_id)

    def verdict_first() -> None:
        audit_and_report(spec, name="pilot-report", indices=pilot_indices(spec.config, spec.dataset.n_rows, spec.layout),
                         tokens_per_s_per_gpu=tokens_per_s_per_gpu(pilot, spec.fleet.gpus),
                         context_length=context_length, root=root)

    m = measure(spec, context_length=context_length, fleet=resolve(spec.fleet), before_measuring=verdict_first,
                root=root)
    return {"cap": m.cap, "reason": m.reason, "trigger": m.trigger, "rows": len(m.indices),
            "worst_case_tokens": m.worst_case_tokens, "budget_tokens": m.budget_tokens, **(m.outcome or {})}


def audit_and_gate(run: dict[str, Any], pilot: dict[str, Any], chunks: list[dict[str, Any]],
                   servers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Audit the pilot rows and gate the fan-out on their truncation. Over the threshold, gate_mode=stop
    stops the run (a `Skip` of this task, and of the chunks past it, "stopped by the gate"), 'ask' holds
    every chunk for the reviewer's question (`ask_about_cap`, once the first chunks have stopped), 'warn'
    logs and goes on.

    Returns the chunks to fan out past the gate: the plan's chunks but the first `stagger` ones, which
    run beside the pilot (`generate_alongside_pilot`); none while a question is to be asked."""
    from tracegen.run.cap_raise import served_context
    from tracegen.run.plan import pilot_indices
    from tracegen.run.run_report import audit_and_report
    from tracegen.run.run_spec import handed_over

    spec = handed_over(run)
    lead = spec.layout.stagger
    if not pilot.get("indices"):
        log.info("no pilot (pilot_size=0): nothing to gate on; the continuous gate watches the fan-out")
        return chunks[lead:]
    outcome = audit_and_report(
        spec, name="pilot-report", indices=pilot_indices(spec.config, spec.dataset.n_rows, spec.layout),
        tokens_per_s_per_gpu=tokens_per_s_per_gpu(pilot, spec.fleet.gpus), context_length=served_context(servers),
    )
    if outcome.verdict == "stop":
        message = f"{outcome.reason}; see report {outcome.html_uri}"
        if spec.config.gate_mode == "stop":
            # The gate doing its job is not a crash: this task is skipped, saying so, and the chunks past
            # it with it; the run ends without a failed task (docs/deployment.md, "A run stopped by the gate").
            raise Skip(f"{STOPPED}: {message}")
        if spec.config.gate_mode == "ask":
            log.warning("gate_mode=ask: no chunk starts before the reviewer answers: %s", message)
            return []
        log.warning("gate_mode=warn, going on: %s", message)
    return chunks[lead:]
