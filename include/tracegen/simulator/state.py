"""The server's state, shared by every handler: its settings, the batching engine, the fault injector, the
metrics, and where the server stands in its life (warming up, serving, draining)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from tracegen.simulator import metrics as prom
from tracegen.simulator.batching import AsyncBatcher
from tracegen.simulator.faults import FaultInjector
from tracegen.simulator.launch_args import SimSettings

log = logging.getLogger("tracegen.simulator")


@dataclass
class State:
    settings: SimSettings
    batcher: AsyncBatcher
    injector: FaultInjector
    metrics: prom.Metrics = field(default_factory=prom.Metrics)
    started_wall: float = field(default_factory=time.time)
    warm: bool = False
    warm_at: float | None = None  # loop time
    unready_until: float = 0.0  # loop time before which /health is 503 (slow start)
    draining: bool = False
    hung: int = 0
    active: int = 0  # generation handlers running (hung ones excluded)
    # Priorities seen since start: SGLang keeps reporting each one's series, at 0 when it has no request.
    known_priorities: set[str] = field(default_factory=set)

    @property
    def args(self) -> dict[str, Any]:
        return self.settings.args

    def healthy(self) -> bool:
        return self.warm and not self.draining and asyncio.get_running_loop().time() >= self.unready_until

    def sync_wedge(self) -> None:
        if self.batcher.engine.wedged != self.injector.config.wedged:
            self.batcher.set_wedged(self.injector.config.wedged)
            log.warning("simulated fault: server %s", "wedged" if self.injector.config.wedged else "unwedged")


STATE = web.AppKey("state", State)
