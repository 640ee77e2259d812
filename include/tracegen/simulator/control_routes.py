"""Routes that steer the server rather than ask it: the stand-in's fault settings (`/sim/faults`) and
SGLang's `/abort_request`."""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from tracegen.simulator import protocol as p
from tracegen.simulator.responses import json_response
from tracegen.simulator.state import STATE

log = logging.getLogger("tracegen.simulator")


async def get_faults(request: web.Request) -> web.Response:
    return json_response(request.app[STATE].injector.config.to_json())


async def set_faults(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = p.parse_json_object(await request.read())
    try:
        config = state.injector.update(body)
    except (TypeError, ValueError) as exc:
        raise p.BadRequest(str(exc)) from None
    if "slow_start_s" in body:
        state.unready_until = asyncio.get_running_loop().time() + config.slow_start_s
    state.sync_wedge()
    log.info("fault settings updated: %s", body)
    return json_response(config.to_json())


async def abort_request(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = p.parse_json_object(await request.read())
    rid = body.get("rid")
    if body.get("abort_all") is True:
        n = state.batcher.abort_all()
        log.info("aborted all %d requests", n)
    elif isinstance(rid, str) and rid:
        state.batcher.abort_matching(rid)
    else:
        raise p.BadRequest("abort_request needs a non-empty string rid or abort_all: true")
    return web.Response(status=200)

