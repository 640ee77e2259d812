"""The gates a generation task checks while it runs: the continuous gate (the running truncation rate
over a fixed sample of the dataset) and the pilot gate's verdict, for the chunks that run beside the
pilot. Both count with `audit.stats.gate_counts` and decide with `audit.gate.decide`."""

from __future__ import annotations

from tracegen.audit import gate
from tracegen.audit.stats import gate_counts
from tracegen.run import plan
from tracegen.run.run_record import gate_verdict, pilot_report
from tracegen.run.run_spec import RunSpec
from tracegen.store.root import OutputRoot

# Rows the continuous gate judges: enough for a tight interval, few enough to read in any chunk task.
CONTINUOUS_GATE_SAMPLE = 20_000
# The modes in which a closed gate holds chunks back: 'stop' skips them (the run ends stopped by the gate),
# 'ask' leaves their rows for the reviewer's question after the fan-out.
HOLDING_MODES = ("stop", "ask")


def continuous_sample(spec: RunSpec) -> list[int]:
    """The fixed random sample of the dataset the continuous gate judges.

    Judged over the current rows of a sample of the dataset, not just this run's rows: after a pivot this
    run's own rows are mostly the long tail regenerated from a lower cap, which says little about the cap
    on its own. A sample keeps a chunk task's memory independent of dataset size."""
    n_rows = spec.dataset.n_rows
    return plan.pilot_sample(n_rows, min(n_rows, CONTINUOUS_GATE_SAMPLE), spec.config.pilot_seed + 1)


def continuous_gate(spec: RunSpec, root: OutputRoot) -> str | None:
    """Why a chunk must not start (the running truncation rate is over the threshold with confidence),
    or None. Catches a bad cap even when the pilot was skipped."""
    config = spec.config
    if config.gate_mode not in HOLDING_MODES:
        return None
    truncated, judged = gate_counts(root.snapshots.plan_frame(continuous_sample(spec)), config.max_tokens)
    decision = gate.decide(gate.GateInputs(truncated, judged, gate.GateRule(config.truncation_threshold),
                                           max_tokens=config.max_tokens, suggestion=gate.NOT_WEIGHED))
    return decision.reason if decision.verdict == gate.STOP else None


class PilotGateWatch:
    """Stop check for a chunk that runs beside the pilot, called with the rows the chunk has finished.

    Those chunks keep the fleet busy while the pilot's stragglers finish and the gate audits (otherwise
    that barrier idles every GPU), but they must not spend GPU time the gate would refuse:
    - the pilot report's verdict, once there, rules: stop closes the watch, anything else opens it for good;
    - until then the chunk's own rows are judged by the gate's test, stricter (99% confidence, at least
      the gate's minimum sample, since it is repeated every poll), so a chunk that runs before the pilot
      (a single-process `airflow dags test` runs tasks one at a time, in no fixed order) stops after a
      gate's worth of rows, not a chunk's.
    """

    def __init__(self, spec: RunSpec, root: OutputRoot) -> None:
        self.spec, self.root = spec, root
        self._settled = spec.config.gate_mode not in HOLDING_MODES
        self.closed: str | None = None  # why the gate stopped the run, once it has

    def __call__(self, truncated: int = 0, judged: int = 0) -> str | None:
        if self._settled:
            return self.closed
        report = pilot_report(self.root, self.spec.run_id)
        if report is not None:
            self._settled = True
            verdict, reason = gate_verdict(report)
            if verdict == gate.STOP:
                self.closed = f"the pilot gate stopped the run: {reason}"
            return self.closed
        if judged < gate.DEFAULT_MIN_SAMPLE:
            return None
        config = self.spec.config
        rule = gate.GateRule(config.truncation_threshold, confidence=0.99)
        own = gate.decide(gate.GateInputs(truncated, judged, rule, max_tokens=config.max_tokens,
                                          suggestion=gate.NOT_WEIGHED))
        if own.verdict == gate.STOP:
            self._settled = True
            self.closed = f"this chunk's own rows close the gate before the pilot's verdict: {own.reason}"
        return self.closed
