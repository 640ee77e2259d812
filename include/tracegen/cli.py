"""`python -m tracegen ...`: status, audit, export, verify, fleet checks and the stand-in, from any shell,
without a scheduler.

Every command reads the output root (ledger, run records, reports) and nothing else, so what it prints
can never disagree with the data. Exit codes: 0 fine, 1 the command found a problem (`verify`, `status`,
`audit`: damaged parts), 2 it could not do its job (the message, one line on stderr, names the file, field or
object; `export`: also a damaged part, or a destination another export holds).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys


def _uri(value: str) -> str:
    """A relative path typed in a shell means the working directory; storage URIs must be absolute."""
    if "://" in value or value.startswith("/"):
        return value
    return os.path.abspath(value)


def _root(args: argparse.Namespace) -> str:
    """The output root a command reads, which must exist: reading creates nothing, so a mistyped path (or a
    link to a missing directory) is an error naming it (exit 2), never an empty root with "no runs yet"."""
    from tracegen.store.storage import open_storage

    uri = _uri(args.output_uri)
    open_storage(uri, aws_conn_id=args.aws_conn_id, must_exist=True)
    return uri


def _status(args: argparse.Namespace) -> int:
    from tracegen.status import dataset_status, format_status

    if args.watch:
        from tracegen.watch import watch

        return watch(_root(args), args.aws_conn_id, interval=args.interval, as_json=args.json)
    status = dataset_status(_root(args), aws_conn_id=args.aws_conn_id)
    print(json.dumps(status, indent=2, default=str) if args.json else format_status(status))
    return 1 if status.get("damaged") else 0  # parts that no longer match their entries: a problem found


def _audit(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from tracegen.run.run_record import latest_run
    from tracegen.run.run_report import audit_and_report
    from tracegen.store.root import open_root

    root = open_root(_root(args), args.aws_conn_id)
    record = latest_run(root, args.aws_conn_id)
    if record is None:
        print(f"{args.output_uri}: no runs yet", file=sys.stderr)
        return 1
    if args.max_tokens:
        record = replace(record, config=replace(record.config, max_tokens=args.max_tokens))
    outcome = audit_and_report(record, name=args.name, root=root)
    print(outcome.summary)
    print(f"report: {outcome.html_uri}")
    return 1 if outcome.verdict == "damaged" else 0  # rows counted as done that cannot be exported


def _export(args: argparse.Namespace) -> int:
    from tracegen.export import export_dataset

    result = export_dataset(
        _root(args), _uri(args.dest), fmt=args.format, layout=args.layout, shard_rows=args.shard_rows,
        include_truncated=args.include_truncated, overwrite=args.overwrite, force=args.force,
        # The operator's own shell: it may write wherever its user can, so the trigger's prefixes do not bind it.
        check_prefixes=False, with_token_ids=args.with_token_ids, aws_conn_id=args.aws_conn_id,
    )
    if result.data_uri:
        print(f"exported {result.rows:,} rows ({result.layout}) to {result.data_uri}")
    else:
        print(f"exported {result.rows:,} rows in {result.shards} shards to {result.dest}")
    print(f"manifest: {result.manifest_uri} (export {result.export_id}; trainer settings and provenance inside)")
    return 0


def _verify(args: argparse.Namespace) -> int:
    from tracegen.store.root import open_root

    root = open_root(_root(args), args.aws_conn_id)
    checked = len(root.commits.entries())
    damage = root.repair.verify_parts(deep=not args.quick)
    duplicates = root.repair.duplicates()
    how = "sizes, from the listing" if args.quick else "size and sha256"
    for line in duplicates:
        print(f"duplicate: {line}")
    if duplicates:
        # Not retired: either row may be the one the rest of the ledger was planned from.
        print("rows above are committed twice under one cap: two writers generated the same indices")
    if not damage:
        print(f"{root.storage.uri}: {checked} committed parts match their ledger entries ({how})")
        return 1 if duplicates else 0
    for item in damage:
        rows = "unknown" if item.n_rows is None else item.n_rows
        print(f"damaged: {item.part}: {item.problem} (entry {item.entry}, {rows} rows)")
    if args.retire:
        root.repair.retire(damage)
        rows = sum(item.n_rows or 0 for item in damage)
        print(
            f"retired {len(damage)} of {checked} entries: their {rows} rows are work again for the next run "
            "or rerun (the entries and parts stay in place)"
        )
    else:
        print(f"{len(damage)} of {checked} parts damaged; `verify --retire` makes their rows work again")
    return 1


def _fleet_validate(args: argparse.Namespace) -> int:
    from tracegen.fleet.command import launch_argv
    from tracegen.fleet.sources import load_fleet

    fleet = load_fleet(args.fleet_json)
    for host, gpu in fleet.servers():
        launch_argv(fleet, host, gpu)  # what provisioning builds next; it re-checks the flags
    hosts = ", ".join(f"{h.conn_id} (GPUs {', '.join(map(str, h.gpus))})" for h in fleet.hosts)
    print(f"{args.fleet_json}: valid: {len(fleet.servers())} servers of {fleet.model_name} on {hosts}")
    # Inline credentials were refused by load_fleet; say where each referenced one will come from.
    for name, ref in fleet.secret_refs().items():
        print(f"env {name}: from {ref.describe()}, read on the worker at launch")
    return 0


def _simulate(args: argparse.Namespace, rest: list[str]) -> int:
    from tracegen.simulator.http_server import main as simulator_main

    return simulator_main(rest) or 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tracegen", description=__doc__.splitlines()[0])
    parser.add_argument("--aws-conn-id", default="aws_default", help="Airflow connection for s3:// URIs")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("status", help="progress of an output root: done/left, failures, truncation, rate, ETA, runs")
    p.add_argument("output_uri")
    p.add_argument("--json", action="store_true", help="machine-readable output (with --watch: one JSON line "
                   "per snapshot of the newest run's progress)")
    p.add_argument("--watch", action="store_true", help="follow the newest run with a progress bar, its rate, "
                   "truncation and ETA, until it ends (exit 0) or Ctrl-C (exit 130)")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between two looks with --watch")
    p.set_defaults(func=_status)

    p = sub.add_parser("audit", help="audit the output root now and write runs/<newest run>/<name>.{json,html}")
    p.add_argument("output_uri")
    p.add_argument("--max-tokens", type=int, default=0, help="judge against this cap instead of the run's")
    p.add_argument("--name", default="audit", help="report file name under runs/<run_id>/")
    p.set_defaults(func=_audit)

    p = sub.add_parser("export", help="write the final deduplicated dataset with a manifest")
    p.add_argument("output_uri")
    p.add_argument("dest", help="destination directory or s3:// prefix")
    p.add_argument("--layout", choices=["messages", "tokens", "conversations"], default="messages",
                   help="messages: tracegen's shards (prompt messages + the generated turn, counts); tokens: one "
                   "plain JSONL file of {id, input_ids, loss_mask} (SpecForge data.prompts_path, speculators "
                   "prepare-data --data); conversations: one plain JSONL file of {id, conversations, tools}. "
                   "The manifest names the file and each trainer's settings")
    p.add_argument("--format", choices=["jsonl", "parquet"], default="jsonl",
                   help="shard format of the messages layout (the trainer layouts are plain JSONL)")
    p.add_argument("--shard-rows", type=int, default=10_000)
    p.add_argument("--include-truncated", action="store_true",
                   help="also export rows that still end with finish_reason=length (left out by default)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the export of the same output root already in DEST (kept whole until the new "
                   "manifest is published); another root's export, or other files, are refused")
    p.add_argument("--force", action="store_true",
                   help="replace whatever export DEST holds, even another output root's (implies --overwrite)")
    p.add_argument("--with-token-ids", action="store_true",
                   help="also export each row's prompt and response token ids (a drafter trainer then needs no "
                   "re-tokenisation)")
    p.set_defaults(func=_export)

    p = sub.add_parser("verify", help="check every committed part against its ledger entry (size, sha256) and "
                       "that no index is committed twice under one cap; exit 1 naming the damaged parts and "
                       "the duplicated indices")
    p.add_argument("output_uri")
    p.add_argument("--quick", action="store_true",
                   help="compare sizes from one listing instead of reading every part")
    p.add_argument("--retire", action="store_true",
                   help="retire the damaged parts' entries so their rows are generated again (nothing is deleted)")
    p.set_defaults(func=_verify)

    p = sub.add_parser("fleet", help="fleet descriptions")
    fleet_sub = p.add_subparsers(dest="fleet_command", required=True)
    p = fleet_sub.add_parser("validate", help="check a fleet JSON file as provisioning does; exit 2 naming the bad field")
    p.add_argument("fleet_json", help="path of the fleet JSON file (or 'local-sim')")
    p.set_defaults(func=_fleet_validate)

    sub.add_parser("simulate", help="run the SGLang stand-in (same flags as sglang.launch_server)",
                   add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if argv[:1] == ["simulate"]:
        return _simulate(argparse.Namespace(), argv[1:])
    args = build_parser().parse_args(argv)
    from tracegen.dataset.source import DatasetError
    from tracegen.store.entries import LedgerError
    from tracegen.store.storage import StorageError

    try:
        return args.func(args)
    except (LedgerError, DatasetError, StorageError, ValueError, RuntimeError, OSError) as exc:
        # What went wrong and where, not a traceback: every one of these names its file or object.
        print(f"error: {exc}", file=sys.stderr)
        return 2
