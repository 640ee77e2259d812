"""The SGLang fleet: one server per GPU on hosts reached over SSH (or this machine), launched,
health-checked, reused and stopped without ever killing anything by name pattern.

    spec = FleetSpec.from_json(text)
    with FleetConnection(spec) as fleet:
        handles = provision(spec, fleet)     # reuse healthy servers, (re)launch the rest, wait
        urls = [h.url for h in handles]      # valid while `fleet` is open (SSH tunnels)
    status(spec)                             # one ServerStatus per GPU
    teardown(spec)                           # stop every server's process group
"""

from __future__ import annotations

import importlib
from typing import Any

# Each name and the module that defines it, imported when first asked for: `tracegen.fleet.ref`, which the
# read-only tools read run records with, then loads nothing of SSH, the launch scripts or the client.
_NAMES = {
    "config_hash": "command", "launch_argv": "command", "launch_script": "command", "server_env": "command",
    "stop_script": "command",
    "FleetConnection": "server", "ServerHandle": "server", "ServerStatus": "server", "StopResult": "server",
    "LOCAL": "spec", "FleetSpec": "spec", "FleetSpecError": "spec", "HostSpec": "spec",
    "FleetError": "transport", "LocalTransport": "transport", "SSHTransport": "transport",
    "provision": "lifecycle", "status": "lifecycle", "teardown": "lifecycle",
}

__all__ = sorted(_NAMES)


def __getattr__(name: str) -> Any:
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
