"""Operator commands: ``paramserver reshard`` (the health check is :mod:`paramserver.cli.health`).

``paramserver reshard --from DIR... --to-shards N --out OUT`` rewrites a sharded cluster's newest
common checkpoint cut for another shard count, offline.
"""

from __future__ import annotations

import argparse
import json
import sys

from paramserver.cli.flags import Subcommands


def _cmd_reshard(args: argparse.Namespace) -> int:
    from paramserver.errors import ParamServerError
    from paramserver.protocol.addresses import parse_addresses
    from paramserver.server import reshard

    try:
        summary = reshard.reshard(
            args.sources,
            args.to_shards,
            args.out,
            slice_bytes=args.slice_bytes,
            addresses=parse_addresses(args.to_addresses) if args.to_addresses else None,
            allow_inexact=args.allow_inexact,
        )
    except ParamServerError as exc:
        print(f"paramserver reshard: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(summary, sort_keys=True))
    return 0


def add_subcommands(sub: Subcommands) -> None:
    """Register ``reshard``."""
    p = sub.add_parser(
        "reshard",
        help="rewrite a sharded cluster's newest common checkpoint cut for another shard count",
        description="Merge the newest consistent cut of S shards' checkpoints and write it as "
        "checkpoints of N shards: OUT/shard-i for i < N (start shard i with "
        "--checkpoint-dir OUT/shard-i).",
    )
    p.add_argument(
        "--from",
        dest="sources",
        nargs="+",
        required=True,
        metavar="DIR",
        help="checkpoint directory of each old shard (or one directory holding shard-*)",
    )
    p.add_argument("--to-shards", type=int, required=True, help="shards of the new cluster")
    p.add_argument("--out", required=True, help="output directory (shard-0, shard-1, ...)")
    p.add_argument("--slice-bytes", type=int, help="slice size of the new cluster")
    p.add_argument("--to-addresses", help="host:port,... of the new shards (recorded only)")
    p.add_argument(
        "--allow-inexact",
        action="store_true",
        help="accept SSP/ASP cuts (the state at a minimum clock; see docs)",
    )
    p.set_defaults(func=_cmd_reshard)
