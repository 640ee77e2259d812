"""An export as Airflow hears of it: the Asset event the `tracegen_export` DAG emits through its
AssetAlias, resolving to the destination's manifest, so a training DAG can be scheduled on "a new dataset
version is ready" and read the manifest the event names.

Pure: the DAG file adds the event; a test can check the URI and extra without a scheduler.
"""

from __future__ import annotations

from typing import Any

ASSET_GROUP = "tracegen"


def asset_uri(manifest_uri: str) -> str:
    """The Asset's URI: the manifest's (`file:///...` or `s3://bucket/...`). One Asset per destination: every
    export into it is a new event of the same asset."""
    return manifest_uri


def event_extra(result: Any) -> dict[str, Any]:
    """What a consumer needs without reading anything else: which export, how many rows, the manifest's
    sha256 (check it before trusting what the manifest says), the layout and its data file."""
    return {"export_id": result.export_id, "rows": result.rows, "sha256": result.sha256, "layout": result.layout,
            "manifest": result.manifest_uri, "data": result.data_uri, "destination": result.dest}
