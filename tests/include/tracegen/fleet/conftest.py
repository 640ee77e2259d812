"""Fixtures for the fleet tests."""

from __future__ import annotations

import os

import pytest
from fleet_helpers import live_group_members


@pytest.fixture
def stray_groups():
    """Collects process groups a test started; any still alive at the end are killed (and fail the test)."""
    groups: list[int] = []
    yield groups
    leftovers = [g for g in groups if live_group_members(g)]
    for pgid in leftovers:
        try:
            os.killpg(pgid, 9)
        except ProcessLookupError:
            pass
    assert not leftovers, f"process groups left running: {leftovers}"
