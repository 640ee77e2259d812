"""An output root: everything tracegen keeps for one dataset, behind one object with a part per job.

    root = open_root(output_uri, aws_conn_id)   # once per task; passed down to whatever needs it
    root.commits     commit parts and entries; list and read them (`commits`)
    root.snapshots   the ledger as a frame, and the Parquet snapshots that make that cheap (`snapshots`)
    root.run_files   the dataset fingerprint and `runs/<run_id>/` files (`run_files`)
    root.repair      verify parts against their entries, retire damaged ones, check invariants (`repair`)
    root.storage     the objects themselves (`storage`)

The layout of the objects is in `entries`.
"""

from __future__ import annotations

from tracegen.store.commits import Commits
from tracegen.store.repair import Repair
from tracegen.store.run_files import RunFiles
from tracegen.store.snapshots import Snapshots
from tracegen.store.storage import Storage, open_storage


class OutputRoot:
    """The parts of one output root, sharing its storage."""

    __slots__ = ("storage", "commits", "snapshots", "run_files", "repair")

    def __init__(self, storage: Storage, *, read_workers: int | None = None) -> None:
        self.storage = storage
        self.commits = Commits(storage, read_workers=read_workers)
        self.snapshots = Snapshots(self.commits)
        self.run_files = RunFiles(storage)
        self.repair = Repair(self.commits, self.snapshots, self.run_files)

    def __repr__(self) -> str:
        return f"OutputRoot({self.storage.uri!r})"


def open_root(output_uri: str, aws_conn_id: str = "aws_default", *, must_exist: bool = False) -> OutputRoot:
    """The output root at `output_uri` (a local directory, file:// or s3://). Opening creates nothing; with
    `must_exist` (read-only tools) a missing local root is a StorageRootError naming it."""
    return OutputRoot(open_storage(output_uri, aws_conn_id=aws_conn_id, must_exist=must_exist))
