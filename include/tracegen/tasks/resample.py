"""The `resample_runaways` task's work: one fresh sample for each runaway row (`generate.resample`)."""

from __future__ import annotations

from typing import Any

from tracegen.tasks.outcomes import Skip


def resample_decided_run(spec) -> dict[str, Any]:
    """The `resample_runaways` task's work, for the run as decided: a `tasks.outcomes.Skip` under a
    runaway_policy other than resample, and for a run its gate or its reviewer stopped (a stop spends no
    more GPU time), else `resample_runaways` on the run's fleet (`fleet.sources.resolve`)."""
    from tracegen.fleet.sources import resolve
    from tracegen.generate.resample import resample_runaways
    from tracegen.run.run_record import stopped_at_gate
    from tracegen.store.root import open_root

    if spec.config.runaway_policy != "resample":
        raise Skip(f"runaway_policy={spec.config.runaway_policy}: nothing to resample")
    root = open_root(spec.config.output_uri, spec.config.aws_conn_id)
    if stopped_at_gate(root, spec):
        raise Skip("the run stopped at its gate: nothing is resampled")
    return resample_runaways(spec, fleet=resolve(spec.fleet), root=root)
