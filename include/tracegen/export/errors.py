"""What an export raises: one line naming the file, object or setting that stopped it."""

from __future__ import annotations


class ExportError(RuntimeError):
    pass


class ExportLockError(ExportError):
    """Another export holds the destination, or took it over, or published there meanwhile."""
