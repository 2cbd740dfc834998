"""``paramserver cluster-check``: the verdict job of the docker-compose cluster.

It waits until every expected job has written its exit status to ``--results-dir`` (the compose
services run ``sh -c '<job>; echo $? > /data/results/<name>.rc'``), requires every status to be
0 (the digits workers exit 1 below their accuracy bar; the SPMD demo exits 0 only when every
byte it moved matched), then reads the trained parameters from the cluster through any shard and
computes the digits test accuracy itself against ``--min-accuracy``. It prints one JSON summary
line and exits 0 only when everything passed — so ``docker wait`` on this container is the
cluster's verdict.

At start it removes stale ``*.rc`` files of an earlier run (the results volume outlives runs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from paramserver.cli.flags import Subcommands, add_client_security_flags
from paramserver.cli.server_arg import add_server_arguments, server_address

if TYPE_CHECKING:
    from paramserver.security.tls import ClientSecurity


async def evaluate(
    server: str, seed: int = 0, security: ClientSecurity | None = None
) -> dict[str, float]:
    """Test accuracy of the cluster's current digits model (an observer read)."""
    from paramserver.cli.demos.digits import accuracy, load_digits_split
    from paramserver.worker_client.cluster import connect

    async with connect(
        server, worker_name="cluster-check", heartbeat=False, security=security
    ) as ps:
        params = await ps.pull(observer=True)
        shard_map = getattr(ps, "shard_map", None)
        shards = shard_map.num_shards if shard_map is not None else 1
        clock = (await ps.status()).view.min_clock
    data = load_digits_split(seed)
    return {
        "test_accuracy": accuracy(params, data.x_test, data.y_test),
        "keys": len(params),
        "shards": shards,
        "min_clock": int(clock),
    }


def wait_for_results(directory: Path, names: list[str], timeout_s: float) -> dict[str, int | None]:
    """Exit status per expected job (None: not reported within ``timeout_s``)."""
    from paramserver.waiting import Wait

    deadline = time.monotonic() + timeout_s
    found: dict[str, int | None] = dict.fromkeys(names)
    with Wait(f"jobs to report in {directory}", deadline=deadline) as waiting:
        while True:
            for name in names:
                if found[name] is not None:
                    continue
                path = directory / f"{name}.rc"
                try:
                    text = path.read_text().strip()
                except OSError:
                    continue
                if text:
                    found[name] = int(text) if text.lstrip("-").isdigit() else 255
            if all(v is not None for v in found.values()) or time.monotonic() > deadline:
                return found
            pending = [n for n, v in found.items() if v is None]
            waiting.update(detail=f"{len(pending)} of {len(names)} to go: {', '.join(pending)}")
            waiting.tick()
            time.sleep(0.5)


def _cmd_cluster_check(args: argparse.Namespace) -> int:
    from paramserver.errors import ParamServerError
    from paramserver.security.tls import client_security_from_args

    server = server_address(args)
    results = Path(args.results_dir)
    results.mkdir(parents=True, exist_ok=True)
    for stale in results.glob("*.rc"):
        stale.unlink(missing_ok=True)
    names = [n for n in args.expect.split(",") if n]
    t0 = time.monotonic()
    print(f"cluster-check: waiting for {', '.join(names)} ({args.timeout_s:.0f} s)", flush=True)
    statuses = wait_for_results(results, names, args.timeout_s)
    summary: dict[str, object] = {"event": "cluster-check", "jobs": statuses}
    ok = all(v == 0 for v in statuses.values())
    try:
        security = client_security_from_args(args, os.environ)
        metrics = asyncio.run(evaluate(server, args.seed, security))
        summary.update(metrics)
        ok = ok and metrics["test_accuracy"] >= args.min_accuracy
    except (ParamServerError, OSError) as exc:
        summary["error"] = f"{type(exc).__name__}: {exc}"
        ok = False
    summary["min_accuracy"] = args.min_accuracy
    summary["elapsed_s"] = round(time.monotonic() - t0, 1)
    summary["ok"] = ok
    print(json.dumps(summary, sort_keys=True), flush=True)
    return 0 if ok else 1


def add_subcommands(sub: Subcommands) -> None:
    """Register ``cluster-check``."""
    p = sub.add_parser(
        "cluster-check",
        help="verdict job of the compose cluster: jobs' exit codes + the model's accuracy",
    )
    add_server_arguments(p, "any parameter-server shard")
    p.add_argument("--results-dir", required=True, help="where jobs write <name>.rc")
    p.add_argument("--expect", required=True, help="comma-separated job names to wait for")
    p.add_argument("--min-accuracy", type=float, default=0.93)
    p.add_argument("--seed", type=int, default=0, help="the workers' data split seed")
    p.add_argument("--timeout-s", type=float, default=900.0)
    add_client_security_flags(p)
    p.set_defaults(func=_cmd_cluster_check)
