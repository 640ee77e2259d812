"""Bodies as SGLang's HTTP server writes them: JSON, its two error shapes, server-sent events."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from tracegen.simulator import protocol as p


def json_response(body: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, text=json.dumps(body), content_type="application/json")


def error_response(
    request: web.Request, message: str, status: int, error_type: str | None = None
) -> web.Response:
    """SGLang's error shape: nested on the native /generate route, flat on OpenAI routes."""
    if request.path.startswith("/generate"):
        return json_response(p.native_error(message), status)
    kind = error_type or p.ERROR_TYPES.get(status, "InternalServerError")
    return json_response(p.openai_error(message, status, kind), status)


async def open_event_stream(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    return resp


def sse(payload: Any) -> bytes:
    """One server-sent event as SGLang writes it: `data: {json}` (or `data: [DONE]`) and a blank line."""
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {data}\n\n".encode()


async def send_event(resp: web.StreamResponse, payload: Any) -> None:
    await resp.write(sse(payload))
