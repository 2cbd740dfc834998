"""``paramserver run``: a user's training script on a cluster, as ``torchrun`` runs one.

``paramserver run [--shards S] [--workers N] [serve flags] train.py ARGS...`` starts a local
cluster of S shards (or uses ``--server`` / ``--shard-addresses`` of a running one), then N
processes of ``train.py ARGS...``, each with the environment a worker reads
(:mod:`paramserver.worker_client.env`: ``PARAMSERVER_ADDRESS``,
``PARAMSERVER_SHARD_ADDRESSES``, ``WORKER_INDEX``, ``NUM_WORKERS``, ``WORKER_NAME``,
``PARAMSERVER_REPLACE=1``, ``PARAMSERVER_TOKEN_FILE`` when given), so the script connects
with ``ps.connect_sync_from_env()`` or builds a
:class:`~paramserver.integrations.torch.ServerOptimizer` with no address at all.

Every line a worker prints is shown as ``[worker I] line``. SIGINT and SIGTERM are forwarded
to every worker (each runs in its own session, so a terminal's Ctrl-C reaches it once,
through here); a worker still running 10 s later is killed. A worker that fails (exit code
other than 0) is started again under its name, up to ``--max-restarts`` times: it
re-registers replacing its predecessor and, with a :class:`ShardSampler`, resumes its data
where its name left off. The command exits with the worst worker's code (a worker killed by
signal S counts as 128 + S) and reaps every process it started, servers included, pass or
fail.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from types import FrameType
from typing import IO

from paramserver.cli.flags import Subcommands

#: Seconds a worker gets after a forwarded SIGINT/SIGTERM before it is killed.
STOP_GRACE_S = 10.0


class _Worker:
    """One worker slot: its process (restarted in place) and its output pump."""

    def __init__(self, index: int, argv: list[str], env: dict[str, str], out: IO[str]) -> None:
        self.index = index
        self.argv = argv
        self.env = env
        self.out = out
        self.restarts = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self._pump: threading.Thread | None = None
        self.lock = threading.Lock()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            self.argv,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # signals reach it only through this launcher
        )
        self._pump = threading.Thread(
            target=self._copy, args=(self.proc,), name=f"worker-{self.index}-output", daemon=True
        )
        self._pump.start()

    def _copy(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        prefix = f"[worker {self.index}] "
        for raw in iter(proc.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            with _PRINT:
                self.out.write(prefix + line + "\n")
                self.out.flush()
        proc.stdout.close()

    def drain(self) -> None:
        """Wait until its output is all shown (the process has exited)."""
        if self._pump is not None:
            self._pump.join(timeout=5)

    def code(self) -> int | None:
        """Its exit status (128 + S for a signal S), or None while it runs."""
        assert self.proc is not None
        rc = self.proc.poll()
        if rc is None:
            return None
        return 128 - rc if rc < 0 else rc


_PRINT = threading.Lock()


def worker_argv(script: str, args: list[str]) -> list[str]:
    """``python SCRIPT ARGS`` for a ``.py`` file (this interpreter), else ``SCRIPT ARGS``."""
    if script.endswith(".py"):
        return [sys.executable, "-u", script, *args]
    return [script, *args]


def worker_env(
    base: dict[str, str],
    *,
    address: str,
    shard_addresses: list[str],
    index: int,
    num_workers: int,
    name: str,
    token_file: str | None,
) -> dict[str, str]:
    """The environment of worker ``index`` (:mod:`paramserver.worker_client.env`)."""
    from paramserver.worker_client import env as names

    out = dict(base)
    out[names.ADDRESS_ENV] = address
    if len(shard_addresses) > 1:
        out[names.SHARD_ADDRESSES_ENV] = ",".join(shard_addresses)
    else:
        out.pop(names.SHARD_ADDRESSES_ENV, None)
    out[names.WORKER_INDEX_ENV] = str(index)
    out[names.NUM_WORKERS_ENV] = str(num_workers)
    out[names.WORKER_NAME_ENV] = name
    out[names.REPLACE_ENV] = "1"
    out["PYTHONUNBUFFERED"] = "1"
    if token_file:
        out["PARAMSERVER_TOKEN_FILE"] = token_file
    return out


def supervise(workers: list[_Worker], max_restarts: int, stop: threading.Event) -> int:
    """Run every worker to its end (restarting failed ones); the worst exit code."""
    for w in workers:
        w.start()
    final: dict[int, int] = {}
    stop_deadline: float | None = None
    while len(final) < len(workers):
        if stop.is_set() and stop_deadline is None:
            stop_deadline = time.monotonic() + STOP_GRACE_S
        if stop_deadline is not None and time.monotonic() > stop_deadline:
            for w in workers:
                if w.index not in final and w.proc is not None and w.proc.poll() is None:
                    w.proc.kill()
        for w in workers:
            if w.index in final:
                continue
            code = w.code()
            if code is None:
                continue
            w.drain()
            if code != 0 and not stop.is_set() and w.restarts < max_restarts:
                w.restarts += 1
                with _PRINT:
                    print(
                        f"paramserver run: worker {w.index} exited with {code}; restarting it "
                        f"({w.restarts} of {max_restarts})",
                        file=sys.stderr,
                        flush=True,
                    )
                w.start()
                continue
            final[w.index] = code
        time.sleep(0.05)
    return max(final.values(), default=0)


def _cmd_run(args: argparse.Namespace) -> int:
    from paramserver.errors import InvalidArgument
    from paramserver.protocol.addresses import parse_address, parse_addresses

    if args.workers < 1 or args.shards < 1 or args.max_restarts < 0:
        raise InvalidArgument("--workers and --shards must be >= 1, --max-restarts >= 0")
    if args.server and args.shard_addresses:
        raise InvalidArgument("give the cluster once: --server or --shard-addresses")
    if not os.path.exists(args.script) and args.script.endswith(".py"):
        raise InvalidArgument(f"no such script: {args.script}")
    argv = worker_argv(args.script, list(args.args))
    stop = threading.Event()

    def forward(signum: int, _frame: FrameType | None) -> None:
        stop.set()
        for w in workers:
            if w.proc is not None and w.proc.poll() is None:
                w.proc.send_signal(signum)

    workers: list[_Worker] = []
    cluster = None
    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        if args.server or args.shard_addresses:
            shards = list(parse_addresses(args.shard_addresses)) if args.shard_addresses else []
            address = parse_address(args.server, "--server") if args.server else shards[0]
        else:
            from paramserver.cli.demos.local_cluster import LocalCluster

            cluster = LocalCluster(  # a flag left None is not passed to serve
                args.shards,
                consistency=args.consistency,
                staleness=args.staleness,
                log_dir=args.log_dir,
                aggregation=args.aggregation,
                lease_ms=args.lease_ms,
                death_policy=args.death_policy,
            )
            cluster.serve_cmd += shlex.split(args.serve_args)
            cluster.start()
            shards, address = list(cluster.addresses), cluster.address
            where = ", ".join(shards)
            with _PRINT:
                print(
                    f"paramserver run: {args.shards} shard(s) at {where} ({args.consistency}); "
                    f"starting {args.workers} worker(s) of {args.script}",
                    file=sys.stderr,
                    flush=True,
                )
        for i in range(args.workers):
            env = worker_env(
                dict(os.environ),
                address=address,
                shard_addresses=shards,
                index=i,
                num_workers=args.workers,
                name=f"{args.name_prefix}-{i}",
                token_file=args.token_file,
            )
            workers.append(_Worker(i, argv, env, sys.stdout))
        code = supervise(workers, args.max_restarts, stop)
        if code:
            with _PRINT:
                print(f"paramserver run: worst worker exit code {code}", file=sys.stderr)
        return code
    finally:
        for w in workers:
            if w.proc is not None and w.proc.poll() is None:
                w.proc.kill()
            if w.proc is not None:
                w.proc.wait()
                w.drain()
        if cluster is not None:
            cluster.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)


def add_subcommands(sub: Subcommands) -> None:
    """Register ``run``."""
    p = sub.add_parser(
        "run",
        allow_abbrev=False,  # the script's own flags pass through, never taken for ours
        help="run your training script as N workers on a local (or given) cluster",
        description="Start a local cluster of --shards servers (or use --server / "
        "--shard-addresses of a running one) and --workers processes of SCRIPT ARGS, each "
        "with PARAMSERVER_ADDRESS, PARAMSERVER_SHARD_ADDRESSES, WORKER_INDEX, NUM_WORKERS and "
        "WORKER_NAME set (read them with paramserver.connect_sync_from_env()). Worker output "
        "is prefixed '[worker I]'; SIGINT/SIGTERM are forwarded; a failed worker is restarted "
        "under its name up to --max-restarts times. Exit status: the worst worker's.",
    )
    p.add_argument("--workers", "-n", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--shards", type=int, default=1, help="local servers to start (default 1)")
    p.add_argument(
        "--consistency", choices=["bsp", "ssp", "asp"], default="bsp", help="default bsp"
    )
    p.add_argument("--staleness", type=int, default=None, help="SSP bound in clocks")
    p.add_argument("--aggregation", choices=["mean", "sum", "weighted_mean"], default=None)
    p.add_argument("--lease-ms", type=int, default=None, help="worker lease of the servers")
    p.add_argument("--death-policy", choices=["shrink", "fail_fast", "wait"], default=None)
    p.add_argument(
        "--serve-args",
        default="",
        help="more `paramserver serve` flags for the local servers, one string",
    )
    p.add_argument("--log-dir", default=None, help="where the local servers' logs go")
    p.add_argument("--server", metavar="ADDR", help="use this running server instead")
    p.add_argument(
        "--shard-addresses", metavar="LIST", help="use this running sharded cluster instead"
    )
    p.add_argument(
        "--max-restarts", type=int, default=0, help="restarts of a failed worker (default 0)"
    )
    p.add_argument("--name-prefix", default="worker", help="worker names PREFIX-I")
    p.add_argument("--token-file", default=None, help="bearer token file handed to the workers")
    p.add_argument("script", metavar="SCRIPT", help="the training script (train.py)")
    p.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS", help="its arguments")
    p.set_defaults(func=_cmd_run)
