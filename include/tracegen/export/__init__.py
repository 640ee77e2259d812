"""The final dataset: one row per index (the row that supersedes the others), in a layout a drafter
trainer reads as it is (`layouts`): tracegen's own `messages` shards (the default), or one plain JSONL file
of `tokens` (`input_ids` + `loss_mask`) or `conversations` for SpecForge and speculators, with a manifest
that names the file to pass to each trainer and the settings that keep every row whole (`manifest`).

Rows still truncated (`finish_reason == "length"`) are left out unless asked for: they would teach
the drafter the wrong ending. A row extended past a lower cap (truncated_policy=extend) is one seamless
completion here, split into thinking, answer and tool calls as an uninterrupted generation is, and its
token ids are the whole completion's. The manifest says how many rows were written, left out and why, with
a sha256 per file, whose tokens these are (model, fleet, servers, sampling, cap decisions) and how long
the rows are.

Memory is bounded: the ledger is read with the export's columns only (`store.ledger_rows`), the rows are
written a shard of indices at a time (each part read once per shard, hashed as read, each row encoded into its
shard as it is shaped), and a trainer layout's single file is streamed to disk and moved or uploaded into place
(`sink`).

An export never clobbers: the output root must lie under the operator's read (or write) prefixes and the
destination under their write prefixes (`tracegen.common.locations`; the command line, the operator's own tool,
skips that check); a destination that holds anything needs `overwrite`, and then only an export of the
same output root is replaced (its manifest's `source`), unless `force`; a destination inside the output
root (or holding it) is refused. All of that is checked before anything is written. Files are written
under names of their own export, so the manifest, published last in one atomic PUT, switches readers from
the previous export to the new one. Only then are the previous export's files removed; a failed export
leaves the previous one as it was.

Every part is checked against its ledger entry as it is read (size and sha256 of the bytes read): a part
that is not what was committed stops the export, naming it, before a byte of it is published.

One export at a time per destination (`lock`): an export holds `export.lock` in the destination while it
writes, and publishes its manifest only over the one it read at the start; it then removes only the files
that manifest listed (and files no manifest lists whose export began longer than LOCK_STALE_S before, the
leftovers of a killed export).
"""

from tracegen.export.errors import ExportError, ExportLockError
from tracegen.export.job import FORMATS, LAYOUTS, ExportJob, ExportResult, export_dataset
from tracegen.export.lock import LOCK, LOCK_STALE_S, MANIFEST, DestinationLock
from tracegen.export.selection import EXPORT_COLUMNS

__all__ = ["EXPORT_COLUMNS", "FORMATS", "LAYOUTS", "LOCK", "LOCK_STALE_S", "MANIFEST", "DestinationLock", "ExportError",
           "ExportJob", "ExportLockError", "ExportResult", "export_dataset"]
