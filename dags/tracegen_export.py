"""
### tracegen_export — a dataset version for the drafter trainers, announced to Airflow

Exports an output root's final dataset to a destination in the layout a trainer reads
(`python -m tracegen export ROOT DEST --layout ...` does the same from a shell):

- `tokens`: one JSONL file of `{id, input_ids, loss_mask}` (SpecForge `data.prompts_path`, speculators
  `prepare-data --data`); `conversations`: `{id, conversations, tools}`; `messages`: tracegen's own shards.
- The manifest (`DEST/manifest.json`) names the file to pass to each trainer and the settings that cut
  nothing, whose tokens these are (model, fleet digest, SGLang version, tokenizer and chat template as the
  servers reported them, sampling params, cap decisions), and the rows' lengths.

The output root and the destination must lie under the operator's prefixes (TRACEGEN_READ_PREFIXES,
TRACEGEN_WRITE_PREFIXES); a destination that holds anything is replaced only with
`replace_existing_export` and only when it holds an export of the same output root.

When it is published, the task emits an Asset event through the AssetAlias `tracegen_export`, resolving to
the manifest's URI, with the export id, rows and the manifest's sha256 in its extra: a training DAG
scheduled on that asset (or alias) runs on each new version.
"""

from __future__ import annotations

import os

import pendulum
from airflow.sdk import Asset, AssetAlias, Param, dag, task

from tracegen.common import dag_ids

# Parsed every few seconds: nothing of tracegen.export (pandas, pyarrow) is imported until the task runs.
ALIAS = dag_ids.EXPORT_ALIAS
LAYOUTS = ["messages", "tokens", "conversations"]  # tracegen.export.layouts.LAYOUTS

PARAMS = {
    "output_uri": Param(os.environ.get("TRACEGEN_OUTPUT_URI", ""), type="string", minLength=1, title="Output root",
                        description="The output root to export (local directory or s3://bucket/prefix), under a "
                                    "prefix the operator allows for reading (TRACEGEN_READ_PREFIXES or "
                                    "TRACEGEN_WRITE_PREFIXES)."),
    "dest_uri": Param("", type="string", minLength=1, title="Destination",
                      description="Where the export goes: beside the root, never inside it, under a prefix the "
                                  "operator allows for writing (TRACEGEN_WRITE_PREFIXES). Anywhere else the "
                                  "export is refused before anything is written."),
    "replace_existing_export": Param(False, type="boolean", title="Replace the export there",
                                     description="A destination that holds anything is refused unless this is "
                                                 "set, and even then it replaces only an export of the same "
                                                 "output root (its manifest's source): another root's export, "
                                                 "or other files, are never replaced from here. The previous "
                                                 "export stays whole until the new manifest is published."),
    "layout": Param("tokens", type="string", enum=LAYOUTS, title="Layout",
                    description="tokens: {id, input_ids, loss_mask} for SpecForge (data.prompts_path) and "
                                "speculators (prepare-data --data); conversations: {id, conversations, tools}; "
                                "messages: tracegen's own shards. The manifest names the file and each "
                                "trainer's settings."),
    "include_truncated": Param(False, type="boolean", title="Include truncated rows",
                               description="Also export rows still cut at the cap (left out by default)."),
}


@dag(
    dag_id=dag_ids.EXPORT,
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    tags=["tracegen"],
    doc_md=__doc__,
    default_args={"retries": 0},
    params=PARAMS,
)
def tracegen_export():
    @task(outlets=[AssetAlias(ALIAS)])
    def export(*, params, outlet_events) -> dict:
        from tracegen import steps
        from tracegen.export import export_dataset
        from tracegen.export.announce import ASSET_GROUP, asset_uri, event_extra

        steps.refuse_unknown_conf()

        result = export_dataset(params["output_uri"], params["dest_uri"], layout=params["layout"],
                                include_truncated=params["include_truncated"],
                               overwrite=params["replace_existing_export"])
        extra = event_extra(result)
        outlet_events[AssetAlias(ALIAS)].add(Asset(asset_uri(result.manifest_uri), group=ASSET_GROUP), extra=extra)
        return extra

    export()


tracegen_export()
