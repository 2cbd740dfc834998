"""``paramserver export-tables``: write trained embedding tables for serving
(:mod:`paramserver.server.table_export`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from paramserver.cli.flags import Subcommands


def add_subcommands(sub: Subcommands) -> None:
    """Register ``export-tables``."""
    p = sub.add_parser(
        "export-tables",
        help="write embedding tables' stored ids and rows (safetensors + id index) for serving",
        description="Read the newest committed checkpoint of every shard of a cluster and write "
        "each table's stored ids (ascending: the id index) and rows as OUT/table-NNNN."
        "safetensors, indexed by OUT/tables.json (declarations included, so a loader answers "
        "unstored ids with their initial rows).",
    )
    p.add_argument(
        "--checkpoint-dir",
        dest="sources",
        nargs="+",
        required=True,
        metavar="DIR",
        help="checkpoint directory of each shard of the cluster",
    )
    p.add_argument("--out", required=True, help="export directory (created)")
    p.add_argument(
        "--table", dest="tables", action="append", help="a table to export (default: all)"
    )
    p.set_defaults(func=_cmd_export)


def _cmd_export(args: argparse.Namespace) -> int:
    from paramserver.server.table_export import export_tables

    written = export_tables([Path(d) for d in args.sources], Path(args.out), tables=args.tables)
    print(json.dumps({"out": str(args.out), "rows": written}))
    return 0
