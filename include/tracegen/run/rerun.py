"""What the scheduled rerun finds left of an output root's newest run: chunks holding failed or
never-committed rows, each to be generated again with the config its run was meant to have."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from tracegen import plan
from tracegen.run.records import latest_run, stopped_at_gate
from tracegen.store.ledger import COMPACT_OVER, open_ledger

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RerunWork:
    """One chunk of one run, in one output root: the scheduled rerun's mapped work item."""

    output_uri: str
    run_id: str
    work: plan.ChunkWork

    @property
    def label(self) -> str:
        return f"{self.run_id} {self.work.label}"

    def to_json(self) -> dict[str, Any]:
        return {"output_uri": self.output_uri, "run_id": self.run_id, "work": self.work.to_json()}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> RerunWork:
        return cls(str(doc["output_uri"]), str(doc["run_id"]), plan.ChunkWork.from_json(doc["work"]))


def unfinished_work(output_uri: str, aws_conn_id: str = "aws_default") -> list[RerunWork]:
    """Chunks of the newest run of `output_uri` that still hold failed or never-committed rows.

    A run held at its gate (stopped, or waiting for the reviewer's answer) is not finished by the
    scheduler: finishing it would spend the GPU-days the gate exists to save. A run the reviewer let go
    on is finished at the cap they chose (its record holds it).
    """
    ledger = open_ledger(output_uri, aws_conn_id)
    spec = latest_run(ledger, aws_conn_id)
    if spec is None:
        return []
    if stopped_at_gate(ledger, spec):
        log.info("%s: newest run %s stopped at the gate; nothing to rerun", output_uri, spec.run_id)
        return []
    # Parts lost or cut short since they were committed: retire them, so their rows are work again and this
    # rerun regenerates them (the entries and parts stay, as the record of what was lost).
    damaged = ledger.verify_parts(deep=False)
    for damage in damaged:
        log.warning("%s: retiring damaged part %s (%s)", output_uri, damage.part, damage.problem)
    ledger.retire(damaged)
    frame = ledger.frame(compact_over=COMPACT_OVER)
    work = plan.chunks_with_work(frame, spec.dataset.n_rows, spec.layout, spec.config)
    log.info("%s: run %s has %d chunks with %d rows left", output_uri, spec.run_id, len(work),
             sum(w.remaining for w in work))
    return [RerunWork(output_uri, spec.run_id, w) for w in work]
