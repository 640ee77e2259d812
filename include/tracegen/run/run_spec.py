"""`RunSpec`: everything a run's tasks need to know about it, built once by the first task.

It travels between tasks (XCom) and is stored as `runs/<run_id>/run.json` through one codec
(`to_json` / `from_json`). It holds the operator's fleet by reference and digest (`FleetRef`), never the
fleet description itself: whatever is read back from the output root must not be able to choose what
runs on a GPU host, so a task that needs the fleet loads it from the operator's own configuration and
refuses when its digest no longer matches (`tracegen.fleet.sources.resolve`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from tracegen.audit.cap_question import CURRENT, RAISE, CapDecision
from tracegen.config import ConfigError, RunConfig
from tracegen.fleet.ref import FleetRef
from tracegen.run.plan import ChunkLayout

if TYPE_CHECKING:
    pass

SCHEMA = 1


class RunSpecError(ValueError):
    """A stored or handed-off run description is malformed; the message says where and what."""


@dataclass(frozen=True)
class DatasetIdentity:
    """Which dataset the run reads: its URI, the fingerprint bound to the output root, its row count, and
    the file's size and version when indexed ("mtime_ns:<n>" local, "etag:<etag>" S3). Reads compare the
    size and version first and re-hash only when they differ (`tracegen.dataset.blocks.check_unchanged`)."""

    uri: str
    fingerprint: str
    n_rows: int
    size: int | None = None  # None in records written before sizes and versions were recorded
    version: str | None = None


@dataclass(frozen=True)
class RunSpec:
    run_id: str
    created_at: float
    config: RunConfig
    fleet: FleetRef
    dataset: DatasetIdentity
    layout: ChunkLayout
    teardown: bool = False  # stop the servers when the run ends
    # The reviewer's answers to the gate's questions (gate_mode=ask), oldest first; `config` is as decided.
    decisions: tuple[CapDecision, ...] = ()
    # The DagRun's id as Airflow spells it (`run_id` is its file-safe form). Read back from a record it is
    # only a key to look the run up in Airflow's metadata, which then says whether the run exists and what
    # it is (`run.rerun`); None for runs not started by Airflow.
    airflow_run_id: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "run_id": self.run_id,
            "created_at": self.created_at,
            "config": self.config.to_json(),
            "fleet": vars(self.fleet).copy(),
            "dataset": vars(self.dataset).copy(),
            "layout": self.layout.to_json(),
            "teardown": self.teardown,
            "decisions": [d.to_json() for d in self.decisions],
            "airflow_run_id": self.airflow_run_id,
        }

    @classmethod
    def from_json(cls, doc: Any, where: str = "run description") -> RunSpec:
        """Decode what `to_json` wrote; anything else is refused, naming `where` and the field."""
        if not isinstance(doc, dict):
            raise RunSpecError(f"{where}: expected a JSON object, got {type(doc).__name__}")
        if doc.get("schema") != SCHEMA:
            raise RunSpecError(f"{where}: schema {doc.get('schema')!r} is not {SCHEMA} (written by another "
                               "tracegen version, or not a run description)")
        try:
            fleet, dataset = doc["fleet"], doc["dataset"]
            mrr = fleet["max_running_requests"]
            return cls(
                run_id=_str(doc["run_id"], "run_id"),
                created_at=float(doc["created_at"]),
                config=RunConfig.from_params(doc["config"]),
                fleet=FleetRef(_str(fleet["source"], "fleet.source"), _str(fleet["sha256"], "fleet.sha256"),
                               _str(fleet["model"], "fleet.model"), int(fleet["gpus"]),
                               None if mrr is None else int(mrr)),
                dataset=DatasetIdentity(_str(dataset["uri"], "dataset.uri"),
                                        _str(dataset["fingerprint"], "dataset.fingerprint"), int(dataset["n_rows"]),
                                        None if dataset.get("size") is None else int(dataset["size"]),
                                        None if dataset.get("version") is None
                                        else _str(dataset["version"], "dataset.version")),
                layout=ChunkLayout.from_json(doc["layout"]),
                teardown=bool(doc.get("teardown", False)),
                decisions=tuple(CapDecision.from_json(d) for d in doc.get("decisions") or ()),
                airflow_run_id=None if doc.get("airflow_run_id") is None
                else _str(doc["airflow_run_id"], "airflow_run_id"),
            )
        except KeyError as exc:
            raise RunSpecError(f"{where}: missing field {exc}") from None
        except (ConfigError, TypeError, ValueError) as exc:
            raise RunSpecError(f"{where}: {exc}") from None

    def decided(self, decision: CapDecision) -> RunSpec:
        """The same run as a reviewer's answer leaves it: at the chosen cap, with the decision recorded.

        Nobody is asked twice in one run, so the gate is settled by the answer: accepting the truncation
        turns it into a warning; a new cap keeps it, but as 'stop' (a drift past the chosen cap fails the
        chunks it would hold back instead of leaving them for a question that will not come)."""
        decisions = (*self.decisions, decision)
        if not decision.continues:
            return replace(self, decisions=decisions)
        mode = "warn" if decision.kind == CURRENT else "stop"
        if decision.trigger == RAISE and self.config.gate_mode != "ask":
            mode = self.config.gate_mode  # an operator's raise, not an answer: the gate stays as configured
        return replace(self, config=replace(self.config, max_tokens=decision.cap, gate_mode=mode),
                       decisions=decisions)

    def rebased(self, output_uri: str, aws_conn_id: str) -> RunSpec:
        """The same run read from the root it is found in, through the caller's connection.

        A record read back from storage names the root and connection it was written with; a copied or
        moved root must be worked on where it is now, never where it was, so readers replace both."""
        return replace(self, config=replace(self.config, output_uri=output_uri, aws_conn_id=aws_conn_id))


def handed_over(doc: Any) -> RunSpec:
    """The run as a task receives it from `prepare_run` (or `apply_decision`), as an XCom."""
    return RunSpec.from_json(doc, "the run handed over by prepare_run")


def _str(value: Any, name: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name}: expected a non-empty string, got {value!r}")
    return value
