"""A fleet's lifecycle, one call per action over every GPU of its spec: provision (reuse or launch, then wait
for health), status, teardown."""

from __future__ import annotations

from tracegen.fleet.server import (
    FleetConnection,
    ServerHandle,
    ServerStatus,
    StopResult,
    expected_config,
    inspect,
    parallel,
    prepare,
    probe,
    stop,
    wait_healthy,
)
from tracegen.fleet.spec import FleetSpec, HostSpec
from tracegen.fleet.transport import FleetError


def provision(spec: FleetSpec, fleet: FleetConnection | None = None) -> list[ServerHandle]:
    """Make every GPU of the spec serve the model with the spec's flags, and wait until healthy.

    A healthy server already launched with the same model and flags is reused (same pid); one
    launched with other flags is stopped and relaunched. Pass an open `FleetConnection` to keep
    the handles' URLs (SSH tunnels) usable after this returns.
    """
    own = fleet is None
    fleet = fleet or FleetConnection(spec)
    try:
        pending = parallel(lambda slot: prepare(fleet, *slot), spec.servers())
        return wait_healthy(fleet, pending)
    finally:
        if own:
            fleet.close()


def status(spec: FleetSpec, fleet: FleetConnection | None = None) -> list[ServerStatus]:
    """One `ServerStatus` per GPU: pid-file state, whether its flags match the spec, health."""
    own = fleet is None
    fleet = fleet or FleetConnection(spec)

    def one(slot: tuple[HostSpec, int]) -> ServerStatus:
        host, gpu = slot
        state = inspect(fleet, host, gpu)
        matches = state.config == expected_config(fleet, host, gpu)
        url, healthy, detail = None, False, state.state
        if state.state == "running":
            url = fleet.url(host, gpu)
            result = probe(url, spec, fleet.headers())
            healthy, detail = result.healthy, result.detail
        return ServerStatus(
            host.conn_id, gpu, host.port(gpu), state.state, state.pid, matches, healthy, detail, url
        )

    try:
        return parallel(one, spec.servers())
    finally:
        if own:
            fleet.close()


def teardown(spec: FleetSpec, fleet: FleetConnection | None = None) -> list[StopResult]:
    """Stop every server of the spec (process group: SIGTERM, grace, SIGKILL) and verify it is gone."""
    own = fleet is None
    fleet = fleet or FleetConnection(spec)
    try:
        results = parallel(lambda slot: stop(fleet, *slot), spec.servers())
        left = [
            f"{host.conn_id}:gpu{gpu} ({st.state}, pid {st.pid})"
            for host, gpu in spec.servers()
            if (st := inspect(fleet, host, gpu)).alive
        ]
        if left:
            raise FleetError(f"teardown left servers behind: {', '.join(left)}")
        return results
    finally:
        if own:
            fleet.close()
