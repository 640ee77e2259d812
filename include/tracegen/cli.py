"""`python -m tracegen ...`: status, audit, export and the stand-in, from any shell, without a scheduler.

Every command reads the output root (ledger, run records, reports) and nothing else, so what it prints
can never disagree with the data.
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


def _status(args: argparse.Namespace) -> int:
    from tracegen.status import dataset_status, format_status

    status = dataset_status(_uri(args.output_uri), aws_conn_id=args.aws_conn_id)
    print(json.dumps(status, indent=2, default=str) if args.json else format_status(status))
    return 0


def _audit(args: argparse.Namespace) -> int:
    from tracegen.pipeline import audit_and_report, latest_run
    from tracegen.store.ledger import Ledger
    from tracegen.store.storage import open_storage

    ledger = Ledger(open_storage(_uri(args.output_uri), aws_conn_id=args.aws_conn_id))
    record = latest_run(ledger)
    if record is None:
        print(f"{args.output_uri}: no runs yet", file=sys.stderr)
        return 1
    config = record.config
    if args.max_tokens:
        from dataclasses import replace

        config = replace(config, max_tokens=args.max_tokens)
    outcome = audit_and_report(config, record.run_id, name=args.name)
    print(outcome.summary)
    print(f"report: {outcome.html_uri}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from tracegen.export import export_dataset

    result = export_dataset(
        _uri(args.output_uri), _uri(args.dest), fmt=args.format, shard_rows=args.shard_rows,
        include_truncated=args.include_truncated, aws_conn_id=args.aws_conn_id,
    )
    print(f"exported {result.rows:,} rows in {result.shards} shards to {result.dest}")
    print(f"manifest: {result.manifest_uri}")
    return 0


def _simulate(args: argparse.Namespace, rest: list[str]) -> int:
    from tracegen.simulator.app import main as simulator_main

    return simulator_main(rest) or 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tracegen", description=__doc__.splitlines()[0])
    parser.add_argument("--aws-conn-id", default="aws_default", help="Airflow connection for s3:// URIs")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("status", help="progress of an output root: done/left, failures, truncation, rate, ETA, runs")
    p.add_argument("output_uri")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_status)

    p = sub.add_parser("audit", help="audit the output root now and write runs/<newest run>/<name>.{json,html}")
    p.add_argument("output_uri")
    p.add_argument("--max-tokens", type=int, default=0, help="judge against this cap instead of the run's")
    p.add_argument("--name", default="audit", help="report file name under runs/<run_id>/")
    p.set_defaults(func=_audit)

    p = sub.add_parser("export", help="write the final deduplicated dataset with a manifest")
    p.add_argument("output_uri")
    p.add_argument("dest", help="destination directory or s3:// prefix")
    p.add_argument("--format", choices=["jsonl", "parquet"], default="jsonl")
    p.add_argument("--shard-rows", type=int, default=10_000)
    p.add_argument("--include-truncated", action="store_true",
                   help="also export rows that still end with finish_reason=length (left out by default)")
    p.set_defaults(func=_export)

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
    try:
        return args.func(args)
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
