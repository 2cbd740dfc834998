"""``paramserver serve``, ``status`` and ``checkpoint``: run a shard (or a reduction server) and
ask a running one for its status or a checkpoint."""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, TypeVar

from paramserver.cli.flags import (
    Subcommands,
    add_client_security_flags,
    add_metrics_flags,
    add_server_security_flags,
)
from paramserver.cli.server_arg import add_server_arguments, server_address

if TYPE_CHECKING:
    from paramserver.api.v1.parameter_server_pb2_grpc import ParameterServerAsyncStub
    from paramserver.reduction.reduce_daemon import ReductionDaemon
    from paramserver.server.config import ServerConfig
    from paramserver.server.shard_daemon import ParameterServerDaemon

logger = logging.getLogger(__name__)

R = TypeVar("R")


def daemon_for(config: ServerConfig) -> ParameterServerDaemon | ReductionDaemon:
    """The daemon of ``config.mode``: a parameter-server shard (``ps``) or a reduction server."""
    from paramserver.reduction.reduce_daemon import ReductionDaemon
    from paramserver.server.shard_daemon import ParameterServerDaemon

    return ReductionDaemon(config) if config.mode == "reduce" else ParameterServerDaemon(config)


async def run_daemon(
    config: ServerConfig, *, port_file: str | None = None, notes: Sequence[str] = ()
) -> None:
    """Serve ``config`` until SIGTERM/SIGINT, then shut down gracefully (``notes``: INFO lines
    logged once the server listens)."""
    from paramserver.serving.bootstrap import serve_until_signalled

    await serve_until_signalled(
        daemon_for(config), grace_s=config.grace_s, port_file=port_file, notes=notes
    )


def _ordinal_placement(args: argparse.Namespace) -> dict[str, int | str]:
    """``--ordinal N`` (a StatefulSet pod's ordinal, with ``--replicas R``): this server is
    replica ``N % R`` of shard ``N // R``, and its replicas are that shard's group in
    ``--shard-addresses`` (``a|b,c|d``: each shard's replicas joined by ``|``). Empty without
    ``--ordinal``.

    Raises:
        InvalidArgument: ``--ordinal`` beside ``--shard-index``, ``--replica-index`` or
            ``--replica-addresses``, or a shard map whose groups do not name R replicas
            (INVALID_ARGUMENT).
    """
    from paramserver.errors import InvalidArgument
    from paramserver.protocol.addresses import REPLICA_SEPARATOR, parse_addresses

    ordinal = getattr(args, "ordinal", None)
    if ordinal is None:
        return {}
    given = [
        f
        for f in ("shard_index", "replica_index", "replica_addresses")
        if getattr(args, f) is not None
    ]
    if given:
        raise InvalidArgument(
            f"--ordinal sets {', '.join('--' + f.replace('_', '-') for f in given)}: give one"
        )
    replicas = args.replicas or 1
    if ordinal < 0:
        raise InvalidArgument(f"--ordinal must be >= 0, got {ordinal}")
    if not args.shard_addresses:
        raise InvalidArgument("--ordinal needs --shard-addresses (each shard's replicas a|b)")
    groups = [g.split(REPLICA_SEPARATOR) for g in parse_addresses(args.shard_addresses)]
    shard, replica = divmod(ordinal, replicas)
    if shard >= len(groups):
        raise InvalidArgument(
            f"--ordinal {ordinal} with --replicas {replicas} is shard {shard}, but "
            f"--shard-addresses names {len(groups)} shards"
        )
    if len(groups[shard]) != replicas:
        raise InvalidArgument(
            f"--shard-addresses names {len(groups[shard])} replicas of shard {shard}, "
            f"--replicas says {replicas}"
        )
    out: dict[str, int | str] = {"shard_index": shard}
    if replicas > 1:
        out |= {"replica_index": replica, "replica_addresses": ",".join(groups[shard])}
    return out


def serve_config(args: argparse.Namespace, env: Mapping[str, str]) -> ServerConfig:
    """The :class:`ServerConfig` of parsed ``paramserver serve`` flags over ``env``'s
    ``PARAMSERVER_*`` variables (what ``serve`` runs; launchers that host a shard in-process,
    such as :mod:`paramserver.integrations.ray`, build it the same way).

    Raises:
        InvalidArgument: a bad flag, or unreadable certificates or token file (INVALID_ARGUMENT).
    """
    from paramserver.security.tls import ServerSecurity
    from paramserver.server.config import ServerConfig

    cli = {
        "host": args.host,
        "port": args.port,
        "consistency": args.consistency,
        "staleness": args.staleness,
        "aggregation": args.aggregation,
        "lease_ms": args.lease_ms,
        "death_policy": args.death_policy,
        "wait_timeout_ms": args.wait_timeout_ms,
        "allow_non_finite": True if args.allow_non_finite else None,
        "max_staleness": args.max_staleness,
        "max_receive_message_bytes": args.max_receive_message_bytes,
        "max_tensor_bytes": args.max_tensor_bytes,
        "table_max_tables": args.table_max_tables,
        "table_memory_bytes": args.table_memory_bytes,
        "offload_min_bytes": args.offload_min_bytes,
        "checkpoint_dir": args.checkpoint_dir,
        "checkpoint_every_steps": args.checkpoint_every_steps,
        "keep_checkpoints": args.keep_checkpoints,
        "checkpoint_every_s": args.checkpoint_every_s,
        "max_inflight_pushes_per_worker": args.max_inflight_pushes_per_worker,
        "max_inflight_pushes": args.max_inflight_pushes,
        "max_inflight_push_bytes": args.max_inflight_push_bytes,
        "wal": True if args.wal else None,
        "wal_dir": args.wal_dir,
        "wal_fsync_interval_ms": args.wal_fsync_interval_ms,
        "wal_fsync": False if args.no_wal_fsync else None,
        "grace_s": args.grace_s,
        "use_uvloop": False if args.no_uvloop else None,
        "mode": args.mode,
        "reduce_strategy": args.reduce_strategy,
        "replicas_to_aggregate": args.replicas_to_aggregate,
        "staleness_threshold": args.staleness_threshold,
        "scale_by_staleness": True if args.scale_by_staleness else None,
        "min_updates": args.min_updates,
        "fanout": args.fanout,
        "shard_index": args.shard_index,
        "shard_addresses": args.shard_addresses,
        "slice_bytes": args.slice_bytes,
        "shard_map_epoch": args.shard_map_epoch,
        "restore_from": args.restore_from,
        "read_only": True if args.read_only else None,
        "from_export": args.from_export,
        "replicas": args.replicas,
        "replica_index": args.replica_index,
        "replica_addresses": args.replica_addresses,
        "election_endpoints": args.election_endpoints,
        "election_prefix": args.election_prefix,
        "election_ttl_s": args.election_ttl_s,
        **_ordinal_placement(args),
        "metrics_port": args.metrics_port,
        "metrics_host": args.metrics_host,
        "metrics_token_file": args.metrics_token_file,
        "metrics_tls_cert": args.metrics_tls_cert,
        "metrics_tls_key": args.metrics_tls_key,
        "tls_cert": args.tls_cert,
        "tls_key": args.tls_key,
        "tls_ca": args.tls_ca,
        "auth_tokens": args.auth_tokens,
        "shared_memory": False if args.no_shared_memory else None,
        "malloc_retain_bytes": args.malloc_retain_bytes,
    }
    config = ServerConfig.from_sources(cli, env)
    ServerSecurity.of_config(config)
    return config


def _cmd_serve(args: argparse.Namespace) -> int:
    # Bad flags, unreadable certificates or token file: InvalidArgument here, before any
    # socket (the entry point prints one line and exits 2; paramserver.cli.main.run_command).
    from paramserver.serving.bootstrap import run_loop

    config = serve_config(args, os.environ)
    note = _retain_freed_memory(config.malloc_retain_bytes)
    daemon = run_daemon(config, port_file=args.port_file, notes=(note,))
    run_loop(daemon, use_uvloop=config.use_uvloop)
    return 0


def _retain_freed_memory(limit: int) -> str:
    """Apply ``--malloc-retain-bytes`` to this process (before it allocates much); returns what
    took effect, logged once the server listens (a failed start stays one line)."""
    from paramserver.server.allocator import retain_freed_memory, user_malloc_settings

    applied = retain_freed_memory(limit, os.environ)
    if applied:
        return f"malloc: freed blocks under {applied} bytes are kept for reuse"
    if limit and user_malloc_settings(os.environ):
        return "malloc: the environment's own glibc malloc settings are used"
    if limit:
        return "malloc: allocator left as it is (not glibc, or the setting was refused)"
    return "malloc: glibc's defaults kept (--malloc-retain-bytes 0)"


def _ask(
    args: argparse.Namespace,
    address: str,
    call: Callable[[ParameterServerAsyncStub], Awaitable[R]],
    what: str | None = None,
) -> R:
    """One call to the server at ``address`` with the security of ``args`` (``args.timeout_s``
    its deadline); a failed RPC becomes one line and exit 1
    (:func:`paramserver.cli.main.run_command`). A call that takes long is a wait the command
    shows (``waiting for ADDRESS (no answer yet; gives up at ...)``)."""
    from paramserver.api.v1 import parameter_server_pb2_grpc as pb_grpc
    from paramserver.security.tls import client_security_from_args, open_channel
    from paramserver.serving.bootstrap import run_loop
    from paramserver.waiting import Wait

    security = client_security_from_args(args, os.environ)

    async def ask() -> R:
        with Wait(
            what or address,
            address=address,
            detail="no answer yet",
            deadline=time.monotonic() + args.timeout_s,
            logger=logger,
        ):
            async with open_channel(address, security) as channel:
                return await call(pb_grpc.ParameterServerStub(channel))

    return run_loop(ask(), use_uvloop=False)


def _cmd_status(args: argparse.Namespace) -> int:
    from paramserver.api.v1 import parameter_server_pb2 as pb
    from paramserver.server.observability.status_table import render_status, status_to_dict

    address = server_address(args)
    resp = _ask(args, address, lambda stub: stub.Status(pb.StatusRequest(), timeout=args.timeout_s))
    if args.json:
        print(json.dumps(status_to_dict(resp), indent=2, sort_keys=True))
    else:
        print(render_status(resp, address), end="")
    return 0


def _cmd_checkpoint(args: argparse.Namespace) -> int:
    from paramserver.api.v1 import parameter_server_pb2 as pb

    address = server_address(args)
    resp = _ask(
        args,
        address,
        lambda stub: stub.Checkpoint(pb.CheckpointRequest(), timeout=args.timeout_s),
        what=f"{address} to write a checkpoint",
    )
    print(
        json.dumps(
            {"path": resp.path, "wal_sequence": resp.wal_sequence, "duration_ms": resp.duration_ms}
        )
    )
    return 0


def add_subcommands(sub: Subcommands) -> None:
    """Register ``status``, ``checkpoint`` and ``serve`` on the ``paramserver`` command line."""
    st = sub.add_parser(
        "status", help="print a server's workers, clocks, stragglers and keys (table or JSON)"
    )
    add_server_arguments(st)
    st.add_argument("--json", action="store_true", help="machine-readable JSON instead of tables")
    st.add_argument("--timeout-s", type=float, default=10.0)
    add_client_security_flags(st)
    st.set_defaults(func=_cmd_status)
    ck = sub.add_parser("checkpoint", help="ask a server to write a checkpoint now")
    add_server_arguments(ck)
    ck.add_argument("--timeout-s", type=float, default=300.0)
    add_client_security_flags(ck)
    ck.set_defaults(func=_cmd_checkpoint)

    p = sub.add_parser(
        "serve",
        help="run a parameter-server shard",
        description="Run a parameter-server shard. Every flag can also be set as "
        "PARAMSERVER_<FLAG> (e.g. PARAMSERVER_LEASE_MS); flags win over the environment.",
    )
    p.add_argument("--host", help="interface to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="TCP port, 0 = ephemeral (default 50051)")
    p.add_argument("--consistency", choices=["bsp", "ssp", "asp"], help="default bsp")
    p.add_argument("--staleness", type=int, help="SSP staleness bound s in clocks")
    p.add_argument("--aggregation", choices=["mean", "sum", "weighted_mean"])
    p.add_argument("--lease-ms", type=int, help="worker lease in ms (default 10000)")
    p.add_argument("--death-policy", choices=["shrink", "fail_fast", "wait"])
    p.add_argument("--wait-timeout-ms", type=int, help="default deadline of a pull's wait")
    p.add_argument("--allow-non-finite", action="store_true", help="accept NaN/Inf gradients")
    p.add_argument("--max-staleness", type=int, help="ASP: drop gradients older than N versions")
    p.add_argument("--max-receive-message-bytes", type=int)
    p.add_argument("--max-tensor-bytes", type=int)
    p.add_argument(
        "--table-max-tables",
        type=int,
        help="most embedding tables this shard holds (default 1024)",
    )
    p.add_argument(
        "--table-memory-bytes",
        type=int,
        help="budget of stored table rows and optimizer state; a push past it is refused "
        "(RESOURCE_EXHAUSTED, CapacityExceeded). Default 0: 90%% of physical memory",
    )
    p.add_argument(
        "--offload-min-bytes",
        type=int,
        help="tensors of at least this many bytes are applied/copied in worker threads "
        "(default 8 MiB)",
    )
    p.add_argument("--checkpoint-dir", help="directory of checkpoints (restored on start)")
    p.add_argument("--checkpoint-every-steps", type=int)
    p.add_argument("--keep-checkpoints", type=int)
    p.add_argument("--checkpoint-every-s", type=float, help="periodic checkpoint interval")
    p.add_argument("--max-inflight-pushes-per-worker", type=int, help="back-pressure bound")
    p.add_argument("--max-inflight-pushes", type=int, help="back-pressure bound, all workers")
    p.add_argument("--max-inflight-push-bytes", type=int, help="back-pressure bound in bytes")
    p.add_argument("--wal", action="store_true", help="write-ahead log: no acked update lost")
    p.add_argument("--wal-dir", help="WAL directory (default <checkpoint-dir>/wal)")
    p.add_argument("--wal-fsync-interval-ms", type=float, help="group-commit window (ms)")
    p.add_argument("--no-wal-fsync", action="store_true", help="skip fsync (not power-safe)")
    p.add_argument("--grace-s", type=float, help="graceful shutdown period (default 5 s)")
    p.add_argument("--no-uvloop", action="store_true", help="use the default asyncio loop")
    p.add_argument(
        "--no-shared-memory",
        action="store_true",
        help="no same-host data paths (shared-memory segments, the local-link socket): tensor "
        "bytes go over gRPC as between hosts (PARAMSERVER_SHARED_MEMORY=0)",
    )
    p.add_argument(
        "--malloc-retain-bytes",
        type=int,
        help="glibc malloc keeps freed blocks below this many bytes for reuse instead of "
        "returning them to the kernel, so large per-round buffers do not fault in fresh pages "
        # The numbers are paramserver.server.allocator's (the parser does not import it).
        "every round (default 536870912 = 512 MiB; "
        "0 keeps glibc's defaults; otherwise 131072 (128 KiB, glibc's own "
        "threshold) to 2147483647; env PARAMSERVER_MALLOC_RETAIN_BYTES; "
        "MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_, MALLOC_TOP_PAD_ or those "
        "GLIBC_TUNABLES in the environment take precedence)",
    )
    p.add_argument("--port-file", help="write the bound port to this file once serving")
    g = p.add_argument_group("sharded cluster and metrics")
    g.add_argument("--shard-index", type=int, help="this shard's index in --shard-addresses")
    g.add_argument(
        "--shard-addresses",
        help="host:port,host:port,... of every shard in index order, as workers reach them",
    )
    g.add_argument("--slice-bytes", type=int, help="slice tensors above this size (4 MiB)")
    g.add_argument("--shard-map-epoch", type=int, help="bump when the cluster is resharded")
    g.add_argument(
        "--restore-from",
        help="DIR,DIR,...: state of an earlier cluster's shards (state dirs with "
        "checkpoints/ and wal/, checkpoint dirs, or a dir of shard-<i> dirs; any shard count): "
        "an empty --checkpoint-dir starts from their newest checkpoints plus their write-ahead "
        "logs replayed after them, so nothing they acknowledged is lost",
    )
    add_metrics_flags(g)
    ro = p.add_argument_group(
        "serving trained tables (docs/embedding-tables.md#export-for-serving)"
    )
    ro.add_argument(
        "--read-only",
        action="store_true",
        help="answer pulls only: every mutation (register, clock, init, push, table "
        "declaration, row push) is refused with ReadOnly (FAILED_PRECONDITION); needs "
        "--from-export. Readers connect without registering (register=False)",
    )
    ro.add_argument(
        "--from-export",
        metavar="DIR",
        help="serve the tables of this export (paramserver export-tables) read-only, as the "
        "training cluster answered pulls: stored rows bit for bit, the initial row of any "
        "other id; a sharded server loads only its own ids",
    )
    rep = p.add_argument_group("shard replicas (docs/durability.md#shard-replicas)")
    rep.add_argument(
        "--replicas",
        type=int,
        help="replicas of this shard (1: none, the default); more needs --wal and "
        "--checkpoint-dir: the primary acknowledges a mutation once every backup in sync "
        "holds it durably",
    )
    rep.add_argument("--replica-index", type=int, help="this replica's index (0-based)")
    rep.add_argument(
        "--ordinal",
        type=int,
        help="a StatefulSet pod's ordinal N: with --replicas R this server is replica N %% R "
        "of shard N // R, its replicas that shard's group in --shard-addresses (a|b,c|d); "
        "instead of --shard-index, --replica-index and --replica-addresses",
    )
    rep.add_argument(
        "--replica-addresses",
        help="host:port,host:port,... of every replica of this shard in index order",
    )
    rep.add_argument(
        "--election-endpoints",
        help="etcd host:port[,...] electing the primary under an epoch (failover); without "
        "it replica 0 is primary and no backup takes over",
    )
    rep.add_argument("--election-prefix", help="this job's etcd key prefix (paramserver)")
    rep.add_argument(
        "--election-ttl-s", type=int, help="lease of the primary role in etcd, seconds (2)"
    )
    add_server_security_flags(p)
    r = p.add_argument_group("reduction server (--mode reduce)")
    r.add_argument(
        "--mode",
        choices=["ps", "reduce"],
        help="ps: parameter server (default); reduce: reduction server (gradients in, "
        "aggregates out, no parameters)",
    )
    r.add_argument(
        "--reduce-strategy",
        choices=["synchronous", "asynchronous", "federated_average", "gossip"],
        help="aggregation strategy of --mode reduce (default synchronous)",
    )
    r.add_argument(
        "--replicas-to-aggregate", type=int, help="synchronous: aggregate the first N workers"
    )
    r.add_argument(
        "--staleness-threshold", type=int, help="asynchronous: largest accepted staleness (steps)"
    )
    r.add_argument(
        "--scale-by-staleness", action="store_true", help="asynchronous: scale by 1/(1+staleness)"
    )
    r.add_argument("--min-updates", type=int, help="federated_average: workers per round")
    r.add_argument("--fanout", type=int, help="gossip: peers per push-sum round")
    p.set_defaults(func=_cmd_serve)
