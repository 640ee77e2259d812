"""`python -m tracegen status --watch`: the newest run of an output root followed from a shell until it ends.

Every few seconds the run's progress is read again from the ledger, by the progress page's own reader
(`status.run_progress`), and drawn as a terminal progress bar (rich) with the rate, the truncation figures and
the ETA under it; `--json` prints each snapshot as one JSON line instead. Where the output is not a terminal
(a log file), each snapshot is one plain line. The run has ended, from the output root alone, once nothing is
left to generate at its cap, its gate stopped it, or its final report is written.
"""

from __future__ import annotations

import json
import sys
import time
from typing import IO, Any

from tracegen.audit.figures import AT_CAP, STILL, figure
from tracegen.audit.formats import duration_fine, pct

WATCH_INTERVAL_S = 5.0  # as often as the progress page refreshes


def ended(root: Any, record: Any, progress: dict[str, Any]) -> str | None:
    """Why the run is over, or None while it goes on (or waits for its reviewer)."""
    from tracegen.run import FINAL_REPORT
    from tracegen.run.run_record import STOPPED, stage_of
    from tracegen.store.storage import StorageKeyError

    if progress["left"] == 0:
        return "done: nothing left at its cap"
    if stage_of(root, record) == STOPPED:
        return f"stopped at its gate with {progress['left']:,} rows left"
    try:
        root.run_files.get(record.run_id, FINAL_REPORT)
    except StorageKeyError:
        return None
    return f"ended: its final report is written, {progress['left']:,} rows left"


def _eta(p: dict[str, Any]) -> str:
    if p["left"] == 0:
        return "done"
    if not p["eta_s"]:
        return "– (nothing committed in the last 10 min)"
    text = duration_fine(p["eta_s"] / 3600)
    if p.get("eta_range_s"):
        fast, slow = p["eta_range_s"]
        text += f" ({duration_fine(fast / 3600)} to {'more' if slow is None else duration_fine(slow / 3600)})"
    return text


def figures_line(p: dict[str, Any]) -> str:
    """The figures under the bar: rate, tokens, the two truncation figures, the run's interval and the ETA."""
    rate = "idle" if p["rows_per_s"] is None else f"{p['rows_per_s']:,.2f} rows/s, {p['tokens_per_s']:,.0f} tokens/s"
    figures = p["truncation_figures"]
    interval = ("" if p["truncation_low"] is None
                else f" (this run {pct(p['truncation_low'])}–{pct(p['truncation_high'])})")
    return (f"{rate} · {AT_CAP}: {figure(*figures[AT_CAP])}{interval}, threshold {pct(p['threshold'])} · "
            f"{STILL}: {figure(*figures[STILL])} · ETA {_eta(p)}")


def watch(output_uri: str, aws_conn_id: str = "aws_default", interval: float = WATCH_INTERVAL_S,
          as_json: bool = False, out: IO[str] | None = None) -> int:
    """Follow the newest run until it ends (exit 0) or the user presses Ctrl-C (exit 130); 1 without a run."""
    from tracegen.run.run_record import latest_run, read_run_record
    from tracegen.status import run_progress
    from tracegen.store.root import open_root

    out = out or sys.stdout
    root = open_root(output_uri, aws_conn_id)
    record = latest_run(root, aws_conn_id)
    if record is None:
        print(f"{output_uri}: no runs yet", file=sys.stderr)
        return 1

    def snapshots() -> Any:
        nonlocal record
        while True:
            record = read_run_record(root, record.run_id)  # a decision or a raise since the last look
            progress = run_progress(root, record)
            why = ended(root, record, progress)
            yield progress | {"ended": why}
            if why:
                return
            time.sleep(interval)

    try:
        if as_json:
            for snapshot in snapshots():
                print(json.dumps(snapshot, default=str), file=out, flush=True)
        else:
            _draw(record.run_id, snapshots(), out)
    except KeyboardInterrupt:
        print("stopped watching; the run goes on", file=sys.stderr)
        return 130
    return 0


def _draw(run_id: str, snapshots: Any, out: IO[str]) -> None:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskProgressColumn, TextColumn
    from rich.text import Text

    console = Console(file=out, highlight=False)

    class WithFigures(Progress):
        """The bar, and the run's figures on the line under it."""

        figures = ""

        def get_renderables(self) -> Any:
            yield self.make_tasks_table(self.tasks)
            yield Text(self.figures)

    if not console.is_terminal:
        for p in snapshots:
            console.print(Text(f"{run_id}: {p['done']:,}/{p['total']:,} rows done · " + figures_line(p)), soft_wrap=True)
            if p["ended"]:
                console.print(Text(f"{run_id}: {p['ended']}"))
        return
    # Run ids and servers' text are data: no rich markup is read in them.
    with WithFigures(TextColumn("{task.description}", markup=False), BarColumn(bar_width=None), MofNCompleteColumn(),
                     TextColumn("rows"), TaskProgressColumn(), console=console, auto_refresh=False) as bar:
        task = bar.add_task(run_id, total=None)
        for p in snapshots:
            bar.figures = figures_line(p)
            bar.update(task, completed=p["done"], total=p["total"])
            bar.refresh()
            if p["ended"]:
                console.print(Text(f"{run_id}: {p['ended']}"))
