"""The operator's fleet by reference, as a run records it: where it is configured and its digest, never
the fleet itself. Import-light (no SSH, no client), so the read-only tools can decode run records."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tracegen.fleet.spec import FleetSpec


def fleet_digest(fleet: FleetSpec) -> str:
    """sha256 of the fleet description's canonical JSON: equal digests, equal fleets."""
    blob = json.dumps(fleet.to_dict(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


@dataclass(frozen=True)
class FleetRef:
    """The operator's fleet by reference: where it is configured, its digest, and the few facts the
    plan, the engine and the report read from it (so they need not load it)."""

    source: str  # 'local-sim' or the path of a fleet JSON file on the Airflow workers
    sha256: str
    model: str  # the served model name rows are stamped with
    gpus: int
    max_running_requests: int | None  # per server, when the flags say; None: SGLang sizes it at start-up

    @classmethod
    def of(cls, fleet: FleetSpec, source: str) -> FleetRef:
        return cls(source, fleet_digest(fleet), fleet.model_name, len(fleet.servers()), fleet.max_running_requests)

    @property
    def slots(self) -> int | None:
        """Requests the whole fleet decodes at once, when known."""
        return None if self.max_running_requests is None else self.max_running_requests * self.gpus
