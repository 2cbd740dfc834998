"""Server configuration: a frozen dataclass, validated, with units in field names.

Precedence (highest first): command-line flag, ``PARAMSERVER_*`` environment variable, default.
Each field ``x`` reads ``PARAMSERVER_X`` (upper case), e.g. ``PARAMSERVER_LEASE_MS=2000``.
The environment mapping is passed in (:meth:`ServerConfig.from_sources`), so tests never touch
``os.environ``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from paramserver.core.consistency import Consistency, DeathPolicy
from paramserver.core.sharding import parse_addresses
from paramserver.errors import InvalidArgument
from paramserver.security.http_access import MetricsEndpointConfig
from paramserver.server.allocator import DEFAULT_RETAIN_BYTES, check_limit

ENV_PREFIX = "PARAMSERVER_"
AGGREGATIONS = ("mean", "sum", "weighted_mean")
MODES = ("ps", "reduce")
REDUCE_STRATEGIES = ("synchronous", "asynchronous", "federated_average", "gossip")


@dataclass(frozen=True)
class ServerConfig(MetricsEndpointConfig):
    """Configuration of one server shard (``paramserver serve``); the ``metrics_*`` fields of
    its metrics endpoint are those of
    :class:`~paramserver.security.http_access.MetricsEndpointConfig`.

    Attributes:
        host: Interface to bind (``127.0.0.1``; ``0.0.0.0`` inside containers).
        port: TCP port; 0 picks an ephemeral port.
        consistency: ``bsp``, ``ssp`` or ``asp``.
        staleness: SSP bound s in clocks (ignored by BSP, which is s = 0, and ASP).
        aggregation: ``mean``, ``sum`` or ``weighted_mean`` (by num_samples) for BSP steps.
        lease_ms: Worker lease in milliseconds; heartbeats renew it.
        death_policy: BSP/SSP worker-death policy: ``shrink`` (default), ``fail_fast``, ``wait``.
        wait_timeout_ms: Deadline of a consistency wait when the request gives none.
        allow_non_finite: Accept NaN/Inf gradients (refused by default).
        max_staleness: ASP only: drop gradients computed from parameters more than this many
            versions old (None: never drop).
        max_receive_message_bytes: gRPC receive limit per message (frames are ~1 MiB).
        max_tensor_bytes: Largest tensor accepted in one push/init (None: unlimited).
        table_max_ids: Most ids one embedding-table pull or push may carry.
        table_max_request_bytes: Most row bytes (ids x dim x itemsize) one embedding-table
            pull or push may carry.
        table_max_tables: Most embedding tables one shard holds (CapacityExceeded beyond).
        table_memory_bytes: Budget of the shard's stored table rows and their optimizer state;
            a push whose new rows would pass it is refused with CapacityExceeded
            (RESOURCE_EXHAUSTED). 0: 90% of the machine's physical memory.
        offload_min_bytes: Pushes, pull snapshots and NaN scans of at least this many bytes
            run in a worker thread (off the event loop); smaller ones inline, where a thread
            hand-off (~0.1 ms each) would cost more than the numpy work it moves.
        checkpoint_dir: Directory of checkpoints; None disables them.
        checkpoint_every_steps: Periodic checkpoint every N closed steps / min clocks (0: off).
        checkpoint_every_s: Periodic checkpoint every this many seconds (0: off).
        max_inflight_pushes_per_worker: Pushes one worker may have in flight; beyond that
            RESOURCE_EXHAUSTED (retryable).
        max_inflight_pushes: Pushes in flight over all workers.
        max_inflight_push_bytes: Tensor bytes of the pushes in flight (one push larger than
            this is still admitted alone).
        wal: Keep a write-ahead log: every update is durable before it is acknowledged, and a
            restart replays it after the newest checkpoint (needs ``checkpoint_dir`` or
            ``wal_dir``).
        wal_dir: Directory of the log (default ``<checkpoint_dir>/wal``).
        wal_fsync_interval_ms: Group-commit window: extra wait before each fsync, batching
            the records of concurrent pushes (0: fsync as soon as a record waits).
        wal_fsync: fsync the log (False: survive a process kill but not a power cut).
        keep_checkpoints: Committed checkpoints kept.
        grace_s: Graceful-shutdown grace period in seconds.
        use_uvloop: Run the daemon on uvloop when it is installed.
        mode: ``ps`` (parameter server, the default) or ``reduce`` (reduction server: workers
            submit per-layer gradients for a step and get the aggregate back; no parameters;
            see :mod:`paramserver.reduction.reduce_service`).
        reduce_strategy: ``reduce`` mode: ``synchronous``, ``asynchronous``,
            ``federated_average`` or ``gossip`` (the strategies of
            :mod:`paramserver.core.aggregation`); ``aggregation`` is the reduction.
        replicas_to_aggregate: ``synchronous``: aggregate once the first N active workers
            have sent (backup workers); None: every active worker.
        staleness_threshold: ``asynchronous``: largest accepted staleness, in steps.
        scale_by_staleness: ``asynchronous``: scale each gradient by 1 / (1 + staleness).
        min_updates: ``federated_average``: distinct workers per round.
        fanout: ``gossip``: peers each worker pushes to per round.
        shard_index: This shard's index in ``shard_addresses`` (0 for a single server).
        shard_addresses: Comma-separated ``host:port`` of every shard in index order, as
            workers reach them (the shard map every shard serves); None: a single server.
        slice_bytes: Tensors above this many bytes are split into slices of it over the
            shards (see :mod:`paramserver.core.sharding`).
        shard_map_epoch: Epoch of the shard map (bump it when the cluster is resharded).
        restore_from: Comma-separated state directories of an earlier cluster's shards (any
            shard count; see :mod:`paramserver.server.restore`): when ``checkpoint_dir`` holds
            no checkpoint yet, this shard's part of their state (each old shard's newest
            checkpoint plus its write-ahead log replayed after it) is written into it on
            start.
        read_only: Serve pulls only: every mutation (register, leave, clock, init, push,
            table declaration, row push) is refused with ReadOnly (FAILED_PRECONDITION) at
            the engine's one mutation funnel. Needs ``from_export``; no ``wal``,
            ``checkpoint_dir``, ``restore_from`` or replicas (nothing is ever written).
        from_export: A table export (``paramserver export-tables``; see
            :mod:`paramserver.server.table_export`) whose tables this shard serves, its own
            ids only in a sharded cluster. Needs ``read_only``.
        shared_memory: Same-host data paths: accept workers' shared-memory segments for tensor
            bytes on the Session stream, and offer them the local-link socket for the Session
            itself (:mod:`paramserver.server.transports.link_service`). False: gRPC only, as
            between hosts.
        tls_cert: PEM certificate the server presents; with ``tls_key`` the server speaks TLS
            (see :mod:`paramserver.security.tls`).
        tls_key: PEM private key of ``tls_cert``.
        tls_ca: PEM CA bundle: require client certificates signed by it (mutual TLS).
        auth_tokens: File of ``ROLE TOKEN`` lines (roles ``worker``, ``admin``): every RPC but
            health and reflection then needs a bearer token.
        replicas: Replicas of this shard (1: no replication). With more, one replica is the
            primary and streams every write-ahead-log record to the others (backups); a
            mutation is acknowledged only once every backup in sync holds it durably (see
            :mod:`paramserver.server.replication`). Needs ``wal`` and ``checkpoint_dir``.
        replica_index: This replica's index in ``replica_addresses``.
        replica_addresses: Comma-separated ``host:port`` of every replica of this shard, in
            replica-index order (each serves clients and the replication stream there).
        election_endpoints: Comma-separated ``host:port`` of etcd (v3 API, through its
            HTTP/JSON gateway) electing the primary under an epoch (see
            :mod:`paramserver.server.election`); None: replica 0 is primary at epoch 1, with
            no failover.
        election_prefix: This job's key prefix in etcd (one per cluster).
        election_ttl_s: Lease of the primary role in etcd, whole seconds (etcd may round it
            up to its minimum): a primary that cannot renew it for this long stops serving,
            and a backup in sync takes over.
        malloc_retain_bytes: glibc malloc keeps freed blocks below this many bytes in the
            process for reuse instead of returning them to the kernel (no fresh zeroed pages
            for every round's buffers; see :mod:`paramserver.server.allocator`); 0 keeps glibc's
            defaults.
            Applied by ``paramserver serve`` at process start (process-wide), not by a daemon
            started inside another program.
    """

    host: str = "127.0.0.1"
    port: int = 50051
    consistency: str = "bsp"
    staleness: int = 0
    aggregation: str = "mean"
    lease_ms: int = 10_000
    death_policy: str = "shrink"
    wait_timeout_ms: int = 60_000
    allow_non_finite: bool = False
    max_staleness: int | None = None
    max_receive_message_bytes: int = 4 * 1024 * 1024
    max_tensor_bytes: int | None = None
    table_max_ids: int = 1 << 20
    table_max_request_bytes: int = 256 << 20
    table_max_tables: int = 1024
    table_memory_bytes: int = 0
    offload_min_bytes: int = 8 << 20
    checkpoint_dir: str | None = None
    checkpoint_every_steps: int = 0
    keep_checkpoints: int = 3
    checkpoint_every_s: float = 0.0
    max_inflight_pushes_per_worker: int = 8
    max_inflight_pushes: int = 1024
    max_inflight_push_bytes: int = 1 << 30
    wal: bool = False
    wal_dir: str | None = None
    wal_fsync_interval_ms: float = 1.0
    wal_fsync: bool = True
    grace_s: float = 5.0
    use_uvloop: bool = True
    mode: str = "ps"
    reduce_strategy: str = "synchronous"
    replicas_to_aggregate: int | None = None
    staleness_threshold: int = 0
    scale_by_staleness: bool = False
    min_updates: int = 1
    fanout: int = 1
    shard_index: int = 0
    shard_addresses: str | None = None
    slice_bytes: int = 4 << 20
    shard_map_epoch: int = 0
    restore_from: str | None = None
    read_only: bool = False
    from_export: str | None = None
    shared_memory: bool = True
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    auth_tokens: str | None = None
    malloc_retain_bytes: int = DEFAULT_RETAIN_BYTES
    replicas: int = 1
    replica_index: int = 0
    replica_addresses: str | None = None
    election_endpoints: str | None = None
    election_prefix: str = "paramserver"
    election_ttl_s: int = 2

    def __post_init__(self) -> None:
        try:
            Consistency(self.consistency)
        except ValueError:
            raise InvalidArgument(
                f"consistency must be one of bsp, ssp, asp; got {self.consistency!r}"
            ) from None
        try:
            DeathPolicy(self.death_policy)
        except ValueError:
            raise InvalidArgument(
                f"death_policy must be one of shrink, fail_fast, wait; got {self.death_policy!r}"
            ) from None
        if self.aggregation not in AGGREGATIONS:
            raise InvalidArgument(
                f"aggregation must be one of {', '.join(AGGREGATIONS)}; got {self.aggregation!r}"
            )
        if self.mode not in MODES:
            raise InvalidArgument(f"mode must be one of {', '.join(MODES)}; got {self.mode!r}")
        if self.reduce_strategy not in REDUCE_STRATEGIES:
            raise InvalidArgument(
                f"reduce_strategy must be one of {', '.join(REDUCE_STRATEGIES)}; "
                f"got {self.reduce_strategy!r}"
            )
        for name in ("min_updates", "fanout"):
            if getattr(self, name) < 1:
                raise InvalidArgument(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.replicas_to_aggregate is not None and self.replicas_to_aggregate < 1:
            raise InvalidArgument(
                f"replicas_to_aggregate must be >= 1, got {self.replicas_to_aggregate}"
            )
        if not 0 <= self.port <= 65535:
            raise InvalidArgument(f"port must be in [0, 65535], got {self.port}")
        for name in (
            "staleness",
            "checkpoint_every_steps",
            "table_memory_bytes",
            "staleness_threshold",
            "offload_min_bytes",
        ):
            if getattr(self, name) < 0:
                raise InvalidArgument(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in (
            "lease_ms",
            "wait_timeout_ms",
            "max_receive_message_bytes",
            "keep_checkpoints",
            "max_inflight_pushes_per_worker",
            "max_inflight_pushes",
            "max_inflight_push_bytes",
            "table_max_ids",
            "table_max_request_bytes",
            "table_max_tables",
        ):
            if getattr(self, name) <= 0:
                raise InvalidArgument(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise InvalidArgument(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.wal and not (self.checkpoint_dir or self.wal_dir):
            raise InvalidArgument("wal needs checkpoint_dir or wal_dir")
        if self.checkpoint_every_s < 0 or self.wal_fsync_interval_ms < 0:
            raise InvalidArgument("checkpoint_every_s and wal_fsync_interval_ms must be >= 0")
        if self.grace_s < 0:
            raise InvalidArgument(f"grace_s must be >= 0, got {self.grace_s}")
        try:
            check_limit(self.malloc_retain_bytes)
        except ValueError as exc:
            raise InvalidArgument(f"malloc_retain_bytes: {exc}") from None
        self._check_sharding()
        self._check_read_only()
        self._check_replicas()

    def _check_replicas(self) -> None:
        if self.replicas < 1 or not 0 <= self.replica_index < self.replicas:
            raise InvalidArgument(
                f"replicas must be >= 1 and replica_index in [0, replicas); got replicas "
                f"{self.replicas}, replica_index {self.replica_index}"
            )
        if self.election_ttl_s < 1:
            raise InvalidArgument(f"election_ttl_s must be >= 1, got {self.election_ttl_s}")
        if self.replicas == 1:
            return
        if self.mode != "ps" or not self.wal or not self.checkpoint_dir:
            raise InvalidArgument(
                "replicas > 1 needs mode ps, wal and checkpoint_dir (backups copy the log)"
            )
        given = len(parse_addresses(self.replica_addresses)) if self.replica_addresses else 0
        if given != self.replicas:
            raise InvalidArgument(
                f"replica_addresses must name {self.replicas} replicas, names {given}"
            )

    @property
    def replica_address_list(self) -> tuple[str, ...]:
        """Every replica's ``host:port`` (empty without replicas)."""
        return parse_addresses(self.replica_addresses) if self.replica_addresses else ()

    def _check_read_only(self) -> None:
        if bool(self.read_only) != bool(self.from_export):
            raise InvalidArgument(
                "read_only and from_export go together: a read-only server serves a table "
                "export (paramserver serve --read-only --from-export DIR; an export holds no "
                "optimizer state to train on)"
            )
        if not self.read_only:
            return
        writes = [
            name
            for name in ("wal", "checkpoint_dir", "wal_dir", "restore_from")
            if getattr(self, name)
        ]
        if writes or self.mode != "ps" or getattr(self, "replicas", 1) != 1:
            raise InvalidArgument(
                "a read-only server writes nothing and has no replicas: drop "
                + ", ".join(writes or ["mode reduce / replicas"])
            )

    def _check_sharding(self) -> None:
        shards = len(parse_addresses(self.shard_addresses)) if self.shard_addresses else 1
        if not 0 <= self.shard_index < shards:
            raise InvalidArgument(f"shard_index must be in [0, {shards}), got {self.shard_index}")
        if self.slice_bytes < 8 or self.shard_map_epoch < 0:
            raise InvalidArgument("slice_bytes must be >= 8 and shard_map_epoch >= 0")
        if self.restore_from and not self.checkpoint_dir:
            raise InvalidArgument("restore_from needs checkpoint_dir (the cut is written there)")
        self.check_metrics_port(self.port)

    @property
    def num_shards(self) -> int:
        """Shards in the cluster (1 without ``shard_addresses``)."""
        return len(parse_addresses(self.shard_addresses)) if self.shard_addresses else 1

    @property
    def consistency_model(self) -> Consistency:
        return Consistency(self.consistency)

    @property
    def policy(self) -> DeathPolicy:
        return DeathPolicy(self.death_policy)

    @classmethod
    def from_sources(
        cls, cli: Mapping[str, object] | None = None, env: Mapping[str, str] | None = None
    ) -> ServerConfig:
        """Build a config: CLI values (None = not given) over ``PARAMSERVER_*`` env over defaults.

        Raises:
            InvalidArgument: a value that does not parse or validate (INVALID_ARGUMENT).
        """
        values: dict[str, Any] = {}
        cli = cli or {}
        env = env or {}
        for f in fields(cls):
            if cli.get(f.name) is not None:
                values[f.name] = cli[f.name]
                continue
            raw = env.get(ENV_PREFIX + f.name.upper())
            if raw is None:
                continue
            values[f.name] = _parse(f, raw)
        return cls(**values)

    def replace(self, **changes: Any) -> ServerConfig:
        return dataclasses.replace(self, **changes)


def _parse(f: dataclasses.Field[object], raw: str) -> str | int | float | bool | None:
    kind = str(f.type)
    name = ENV_PREFIX + f.name.upper()
    raw = raw.strip()
    try:
        if "None" in kind and raw.lower() in ("", "none"):
            return None
        if kind.startswith("bool"):
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if kind.startswith("int"):
            return int(raw)
        if kind.startswith("float"):
            return float(raw)
    except ValueError:
        raise InvalidArgument(f"{name}={raw!r} is not a valid {kind}") from None
    return raw
