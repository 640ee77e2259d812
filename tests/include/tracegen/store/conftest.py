"""The storages the output root's tests run against: a local directory and the S3 stand-in."""

from __future__ import annotations

from pathlib import Path

import pytest

from tracegen.store.storage import Storage, open_storage


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    if request.param == "local":
        return open_storage(str(tmp_path / "out"))
    return open_storage(request.getfixturevalue("s3_uri"), retry_deadline_s=5)
