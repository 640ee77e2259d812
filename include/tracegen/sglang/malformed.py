"""What the client raises on an answer it cannot trust: a server fault, retried like a 5xx (maybe on another
server), never committed. Each kind names what was wrong (`kind` goes into the attempt's failure reason)."""

from __future__ import annotations


class MalformedResponse(ValueError):
    """A 200 response whose body is not a valid answer to its request."""

    kind = "malformed response"
