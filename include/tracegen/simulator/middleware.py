"""What every request passes before its handler: SGLang's auth decision, its JSON-only routes, and any
error answered as SGLang answers it (a JSON body, never a traceback page)."""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import Any

from aiohttp import web

from tracegen.simulator import protocol as p
from tracegen.simulator.responses import error_response, json_response
from tracegen.simulator.state import STATE

log = logging.getLogger("tracegen.simulator")
# Paths reachable without the API key (SGLang: prefix match).
_AUTH_EXEMPT = ("/health", "/ready", "/metrics")
# SGLang's ADMIN_OPTIONAL endpoints among the stand-in's: with --admin-api-key only that key opens them.
_ADMIN_OPTIONAL = frozenset({"/abort_request"})
# Routes SGLang guards with validate_json_request: any other Content-Type is a 400.
_JSON_ONLY = frozenset({"/v1/chat/completions", "/tokenize", "/v1/tokenize", "/detokenize", "/v1/detokenize"})


def _bearer_is(header: str | None, key: str) -> bool:
    """SGLang's check: exactly "<scheme> <token>" split at the first space, scheme `bearer` in any case,
    the token equal to the key as sent (so "Bearer  key", two spaces, is refused)."""
    if not header:
        return False
    parts = header.split(" ", 1)
    return len(parts) == 2 and parts[0].lower() == "bearer" and secrets.compare_digest(parts[1], key)


def auth_allows(
    method: str, path: str, header: str | None, api_key: str | None, admin_key: str | None
) -> bool:
    """SGLang's `decide_request_auth` for the stand-in's endpoints (the normal and admin-optional levels)."""
    if method == "OPTIONS" or path.startswith(_AUTH_EXEMPT):
        return True
    if path in _ADMIN_OPTIONAL and admin_key:
        return _bearer_is(header, admin_key)
    if api_key:
        return _bearer_is(header, api_key)
    return True


@web.middleware
async def auth_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    a = request.app[STATE].args
    header = request.headers.get("Authorization")
    if not auth_allows(request.method, request.path, header, a["api_key"], a["admin_api_key"]):
        return json_response({"error": "Unauthorized"}, 401)
    return await handler(request)


def _refuse_unless_json(request: web.Request) -> None:
    """SGLang's validate_json_request: a FastAPI validation error, so its "Bad Request" 400."""
    media_type = request.headers.get("Content-Type", "").lower().split(";", 1)[0]
    if media_type != "application/json":
        error = {
            "loc": ["header", "content-type"],
            "msg": "Unsupported Media Type: Only 'application/json' is allowed",
            "type": "value_error",
        }
        raise p.BadRequest(f"1 validation error:\n  {error} {[error]}")


@web.middleware
async def error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        if request.method == "POST" and request.path in _JSON_ONLY:
            _refuse_unless_json(request)
        return await handler(request)
    except p.BadRequest as exc:
        return error_response(request, str(exc), 400, exc.error_type)
    except web.HTTPNotFound:
        return json_response({"detail": "Not Found"}, 404)
    except web.HTTPMethodNotAllowed:
        return json_response({"detail": "Method Not Allowed"}, 405)
    except web.HTTPException:
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as exc:  # never a traceback page: log it, answer a JSON 500
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(request, f"Internal server error: {type(exc).__name__}: {exc}", 500)
