"""The rank server: one rank's tier pools behind the ``paramserver.api.v1.RankServer`` service.

One process per rank (``paramserver rank-server``). It owns that rank's G2 host pool (shared
memory), G3 disk pool (one file), G1 device pool (GPU hosts only) and a handle on the object tier
G4, and executes the commands that :class:`paramserver.spmd.SpmdParallelWorkers` fans out to
every rank (after Dynamo KVBM's ``SpmdParallelWorkers`` / ``PhysicalWorker`` split).

Every block-moving command goes through :meth:`RankServicer._run_command`:

1. validation with the pure rules of :mod:`paramserver.spmd.planning` (INVALID_ARGUMENT,
   FAILED_PRECONDITION) and the incarnation check;
2. a reservation of the blocks it reads and writes (concurrent commands never write the same
   blocks or read blocks being written);
3. destination blocks are marked *invalid* before the first byte is written;
4. the work runs under the command's deadline; copies run in worker threads and stop between
   chunks when cancelled; a command that runs out of time is cancelled, waits for its thread to
   stop, and answers DEADLINE_EXCEEDED — its destination blocks stay invalid, so no later read
   hands them out as valid;
5. on success the destination blocks become valid.

Remote onboard from a peer's G2 on the same host (equal ``host_key``) maps the peer's
shared-memory segment and copies without the network, after the peer confirmed with
``CheckBlocks`` that the source blocks are valid; like an RDMA read it does not lock them against
a concurrent overwrite by the peer. Every other remote path streams chunks of <= 1 MiB over gRPC
(``ReadBlocks`` / ``WriteBlocks``), and the receiving side tracks validity.

Refusals map to status codes through the :mod:`paramserver.errors` tree; anything unexpected is
logged with its traceback and becomes INTERNAL.

Each rank server also serves the standard gRPC health service (``grpc.health.v1.Health``):
SERVING for the whole server (``""``) and for :data:`SERVICE_NAME` once it listens, NOT_SERVING
from the start of a graceful shutdown, so ``paramserver health --server HOST:PORT`` (a compose
health check) and :func:`paramserver.cli.demos.rank_launcher.wait_serving` can probe it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import functools
import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from paramserver.api.v1 import spmd_pb2, spmd_pb2_grpc
from paramserver.errors import (
    ERROR_CLASS_METADATA_KEY,
    InvalidArgument,
    MalformedStream,
    ParamServerError,
    ResourceExhausted,
    from_rpc_error,
)
from paramserver.protocol.keepalive import SERVER_KEEPALIVE_OPTIONS
from paramserver.security.http_access import DEFAULT_METRICS_HOST
from paramserver.security.tls import ClientSecurity, ServerSecurity, bind, open_channel
from paramserver.server.observability.dashboard import Dashboard
from paramserver.server.observability.prometheus import (
    MetricsServer,
    auth_refusal_counter,
    enable_reflection,
    metrics_security,
)
from paramserver.spmd.faults import Faults
from paramserver.spmd.hashing import object_key
from paramserver.spmd.layout import Layout, Tier
from paramserver.spmd.objects import FilesystemObjectStore, ObjectStore
from paramserver.spmd.planning import (
    MAX_CHUNK_BYTES,
    BlockReservations,
    Verdict,
    check_local_transfer,
    check_object_transfer,
    check_remote_transfer,
    coalesce_runs,
    server_budget_s,
    split_stream,
)
from paramserver.spmd.pools import (
    BlockPool,
    CopyCancelled,
    DiskPool,
    HostPool,
    PeerSegment,
    attach_peer_segment,
    copy_blocks,
    make_device_pool,
)
from paramserver.spmd.rank_metrics import RankMetrics
from paramserver.spmd.transfer_errors import (
    BlockNotValid,
    CommandTimeout,
    ObjectNotFound,
    RemoteNotConnected,
    StaleIncarnation,
    TierNotRegistered,
)

__all__ = [
    "SERVICE_NAME",
    "RankServerConfig",
    "RankServerHandle",
    "RankServicer",
    "serve",
    "start_rank_server",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", 8 << 20),
    ("grpc.max_receive_message_length", 8 << 20),
]
"""Channel/server options: chunks are <= 1 MiB, so 8 MiB leaves ample headroom."""

_OBJECT_IO_CONCURRENCY = 8

SERVICE_NAME = "paramserver.api.v1.RankServer"
"""Full gRPC service name of the rank server (also its health-check service name)."""
#: Default largest object PutObject accepts (bytes): a block, or many, with room to spare.
DEFAULT_MAX_OBJECT_BYTES = 16 << 30


def _default_root() -> Path:
    return Path(os.environ.get("TMPDIR", "/tmp")) / "paramserver-spmd"


@dataclasses.dataclass(frozen=True)
class RankServerConfig:
    """Configuration of one rank server.

    Precedence (applied by :func:`paramserver.cli.rank.config_from_args`): CLI flag, then the
    ``PARAMSERVER_SPMD_*`` environment variable, then the default here.

    Attributes:
        instance_id: instance (group of ranks) this rank belongs to.
        rank: rank index within the instance, from 0.
        host: interface to bind (loopback by default).
        port: TCP port; 0 picks an ephemeral port (reported via ``port_file`` and stdout).
        layout: block format (``num_blocks`` is ignored; per-tier counts below).
        host_blocks: blocks of the G2 host pool (0 = no G2).
        disk_blocks: blocks of the G3 disk pool (0 = no G3).
        device_blocks: blocks of the G1 device pool (0 = no G1; needs a GPU).
        disk_dir: directory of the G3 pool file.
        object_dir: root of the filesystem object store (G4); ``None`` = no G4.
        object_durable: fsync objects before they become visible.
        port_file: file to write the bound port to (atomically), or ``None``.
        default_timeout_s: deadline of commands that carry none, seconds.
        faults: TEST-ONLY fault injection (see :mod:`paramserver.spmd.faults`).
        security: TLS / mutual TLS and bearer tokens of this server
            (:class:`paramserver.security.tls.ServerSecurity`); None: plain text, no tokens.
        peer_security: How this rank reaches its peers' rank servers (TLS and the token it
            presents; :func:`paramserver.security.tls.peer_security`); None: plain text, no token.
        metrics_port: serve Prometheus metrics (:mod:`paramserver.spmd.rank_metrics`) and the
            dashboard on this TCP port of ``metrics_host`` (0: ephemeral); ``None``: none.
        metrics_host: interface of the metrics endpoint (default loopback, ``127.0.0.1``).
        metrics_token_file: file with the bearer token every metrics request must present.
        metrics_tls_cert: PEM certificate to serve the metrics over HTTPS (with the key).
        metrics_tls_key: PEM private key of ``metrics_tls_cert``.
        max_object_bytes: largest object ``PutObject`` accepts, bytes (larger declared sizes
            are refused, INVALID_ARGUMENT, before a byte is written).
    """

    instance_id: str
    rank: int
    host: str = "127.0.0.1"
    port: int = 0
    layout: Layout = dataclasses.field(default_factory=lambda: Layout(num_blocks=0))
    host_blocks: int = 64
    disk_blocks: int = 64
    device_blocks: int = 0
    disk_dir: Path = dataclasses.field(default_factory=lambda: _default_root() / "disk")
    object_dir: Path | None = dataclasses.field(default_factory=lambda: _default_root() / "objects")
    object_durable: bool = True
    port_file: Path | None = None
    default_timeout_s: float = 30.0
    faults: Faults = dataclasses.field(default_factory=Faults)
    security: ServerSecurity | None = None
    peer_security: ClientSecurity | None = None
    metrics_port: int | None = None
    metrics_host: str = DEFAULT_METRICS_HOST
    metrics_token_file: str | None = None
    metrics_tls_cert: str | None = None
    metrics_tls_key: str | None = None
    max_object_bytes: int = DEFAULT_MAX_OBJECT_BYTES

    def __post_init__(self) -> None:
        if not self.instance_id or "/" in self.instance_id:
            raise InvalidArgument(
                f"instance_id must be non-empty without '/': {self.instance_id!r}"
            )
        if self.rank < 0:
            raise InvalidArgument(f"rank must be >= 0, got {self.rank}")
        if not 0 <= self.port < 65536:
            raise InvalidArgument(f"port must be in [0, 65535], got {self.port}")
        if self.max_object_bytes < 0:
            raise InvalidArgument(
                "max_object_bytes: --max-object-bytes (PARAMSERVER_SPMD_MAX_OBJECT_BYTES) must "
                f"be >= 0, got {self.max_object_bytes}"
            )
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise InvalidArgument(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        if self.metrics_port and self.metrics_port == self.port:
            raise InvalidArgument(
                f"--metrics-port {self.metrics_port} is also --port: the metrics endpoint "
                "needs a port of its own"
            )
        for name in ("host_blocks", "disk_blocks", "device_blocks"):
            if getattr(self, name) < 0:
                raise InvalidArgument(f"{name} must be >= 0")
        if self.default_timeout_s <= 0:
            raise InvalidArgument("default_timeout_s must be > 0")


def _host_key() -> str:
    boot = ""
    with contextlib.suppress(OSError):
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return f"{socket.gethostname()}/{boot}"


def _tier(value: int, what: str) -> Tier:
    if value == spmd_pb2.TIER_UNSPECIFIED:
        raise InvalidArgument(f"{what} tier is unspecified")
    return Tier.parse(int(value))


def _ids(values: Sequence[int]) -> list[int]:
    return [int(v) for v in values]


# --------------------------------------------------------------------------- error mapping


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    if isinstance(exc, ParamServerError):
        context.set_trailing_metadata(((ERROR_CLASS_METADATA_KEY, type(exc).__name__),))
        await context.abort(exc.code, exc.message)
    logger.error("unexpected error in rank server handler", exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")


def _cancel_when_rpc_ends(context: grpc.aio.ServicerContext) -> Callable[[], None]:
    """Cancel the handler task if the RPC ends (client gone, deadline) while it still runs.

    A belt-and-braces guard: whatever the handler awaits (a peer rank, a worker thread, the
    request stream), it unwinds once its RPC is over, so reservations and temp objects are
    released. (With a client SIGKILLed mid-stream, grpc.aio 1.85 sometimes closes the handler
    coroutine instead of cancelling it; cleanup in ``finally`` blocks is therefore synchronous.)
    Returns the "handler finished" marker to call when the handler returns.
    """
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    finished = False

    def cancel_if_running() -> None:
        if not finished and task is not None and not task.done():
            task.cancel()

    def on_done(_: Any) -> None:
        loop.call_soon_threadsafe(cancel_if_running)

    context.add_done_callback(on_done)

    def mark_finished() -> None:
        nonlocal finished
        finished = True

    return mark_finished


def _unary(
    fn: Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[T]],
) -> Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[T]]:
    """Turn ParamServerError into ``context.abort(code)``; anything else into INTERNAL."""

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> T:
        mark_finished = _cancel_when_rpc_ends(context)
        try:
            return await fn(self, request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            self._count_failure()
            mark_finished()
            await _abort(context, exc)
            raise AssertionError("unreachable") from exc  # abort always raises
        finally:
            mark_finished()

    return wrapper


def _streaming(
    fn: Callable[[Any, Any, grpc.aio.ServicerContext], AsyncIterator[T]],
) -> Callable[[Any, Any, grpc.aio.ServicerContext], AsyncIterator[T]]:
    """:func:`_unary` for server-streaming handlers."""

    @functools.wraps(fn)
    async def wrapper(
        self: Any, request: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[T]:
        mark_finished = _cancel_when_rpc_ends(context)
        try:
            async for item in fn(self, request, context):
                yield item
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            self._count_failure()
            mark_finished()
            await _abort(context, exc)
        finally:
            mark_finished()

    return wrapper


# --------------------------------------------------------------------------- servicer


@dataclasses.dataclass
class _Remote:
    metadata: spmd_pb2.RankMetadata
    layouts: dict[Tier, Layout]
    shm_names: dict[Tier, str]


class RankServicer:
    """Implements ``paramserver.api.v1.RankServer`` for one rank (decode, validate, act, encode).

    Construct with :meth:`create` (allocates the pools); call :meth:`close` to release them.
    """

    def __init__(
        self,
        config: RankServerConfig,
        pools: Mapping[Tier, BlockPool],
        store: ObjectStore | None,
    ) -> None:
        self.config = config
        self.rank = config.rank
        self.pools: dict[Tier, BlockPool] = dict(pools)
        self.layouts: dict[Tier, Layout] = {t: p.layout for t, p in self.pools.items()}
        self.store = store
        self.incarnation_id = uuid.uuid4().hex
        self.host_key = _host_key()
        self.address = ""
        self._remotes: dict[str, _Remote] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._segments: dict[str, PeerSegment] = {}
        self._reservations = BlockReservations()
        self._inflight = 0
        self._completed = 0
        self._failed = 0
        self._bytes_moved = 0
        #: Transfer series (set by :func:`start_rank_server` when metrics are on).
        self.metrics: RankMetrics | None = None

    @classmethod
    def create(cls, config: RankServerConfig) -> RankServicer:
        """Allocate the pools and the object store described by ``config``.

        Raises:
            TierNotRegistered: ``device_blocks > 0`` on a host without a GPU
                (FAILED_PRECONDITION).
        """
        pools: dict[Tier, BlockPool] = {}
        stem = f"{config.instance_id}-r{config.rank}"
        try:
            if config.device_blocks:
                pools[Tier.G1] = make_device_pool(config.layout.with_blocks(config.device_blocks))
            if config.host_blocks:
                pools[Tier.G2] = HostPool(config.layout.with_blocks(config.host_blocks))
            if config.disk_blocks:
                pools[Tier.G3] = DiskPool(
                    config.layout.with_blocks(config.disk_blocks),
                    config.disk_dir,
                    stem=stem,
                    faults=config.faults,
                )
            store = (
                FilesystemObjectStore(config.object_dir, durable=config.object_durable)
                if config.object_dir is not None
                else None
            )
        except BaseException:
            for pool in pools.values():
                pool.close()
            raise
        return cls(config, pools, store)

    def _prefix(self) -> str:
        return f"rank {self.rank} of {self.config.instance_id}"

    def _count_failure(self) -> None:
        self._failed += 1

    # ------------------------------------------------------------------ helpers

    def _pool(self, tier: Tier) -> BlockPool:
        pool = self.pools.get(tier)
        if pool is None:
            raise TierNotRegistered(f"{self._prefix()}: tier {tier.name} not registered")
        return pool

    def _check_incarnation(self, incarnation_id: str) -> None:
        if incarnation_id and incarnation_id != self.incarnation_id:
            raise StaleIncarnation(
                f"{self._prefix()}: restarted since its metadata was read (incarnation "
                f"{self.incarnation_id[:8]}, caller expected {incarnation_id[:8]})"
            )

    def _require_valid(self, tier: Tier, ids: Sequence[int]) -> None:
        pool = self._pool(tier)
        invalid = [b for b in ids if not pool.valid[b]]
        if invalid:
            raise BlockNotValid(
                f"{self._prefix()}: {tier.name} blocks {invalid[:8]} hold no valid data "
                "(never written, or the last write failed or timed out)"
            )

    def _budget_s(self, timeout_ms: int, context: grpc.aio.ServicerContext) -> float:
        requested = timeout_ms / 1000.0 if timeout_ms else self.config.default_timeout_s
        budget = server_budget_s(requested)
        remaining = context.time_remaining()
        if remaining is not None:
            budget = min(budget, max(0.001, server_budget_s(remaining)))
        return budget

    def _raise(self, verdict: Verdict) -> None:
        verdict.raise_if_refused(f"{self._prefix()}: ")

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = open_channel(address, self.config.peer_security, CHANNEL_OPTIONS)
            self._channels[address] = channel
        return channel

    def _peer_error(
        self, remote: _Remote, what: str, exc: grpc.aio.AioRpcError
    ) -> ParamServerError:
        """The peer's refusal as the same error class, its message prefixed with both ranks."""
        base = from_rpc_error(exc)
        md = remote.metadata
        err = type(base)(
            f"{self._prefix()}: {what} peer {md.instance_id} rank {md.rank} at {md.address} "
            f"failed: {exc.code().name}: {exc.details()}"
        )
        err.code = base.code
        return err

    def _remote(self, instance_id: str) -> _Remote:
        remote = self._remotes.get(instance_id)
        if remote is None:
            raise RemoteNotConnected(
                f"{self._prefix()}: no metadata imported for remote instance {instance_id!r}"
            )
        return remote

    async def _in_thread(self, fn: Callable[[], T], cancel: threading.Event) -> T:
        """Run ``fn`` in a worker thread; on cancellation stop it and wait until it stopped."""
        future = asyncio.get_running_loop().run_in_executor(None, fn)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            cancel.set()
            with contextlib.suppress(BaseException):
                await asyncio.wait([future])
            raise

    async def _run_command(
        self,
        name: str,
        options: spmd_pb2.CommandOptions,
        context: grpc.aio.ServicerContext,
        *,
        reads: Mapping[Tier, Sequence[int]],
        writes: Mapping[Tier, Sequence[int]],
        work: Callable[[threading.Event], Awaitable[tuple[int, str, list[spmd_pb2.Placement]]]],
        mark_valid: bool = True,
    ) -> spmd_pb2.TransferResponse:
        command_id = options.command_id or uuid.uuid4().hex
        self._check_incarnation(options.incarnation_id)
        budget_s = self._budget_s(options.timeout_ms, context)
        self._raise(self._reservations.reserve(command_id, reads=reads, writes=writes))
        for tier, ids in writes.items():
            self._pool(tier).valid[list(ids)] = False
        cancel = threading.Event()
        self._inflight += 1
        started = time.perf_counter()
        try:
            async with asyncio.timeout(budget_s):
                if self.config.faults.hang_commands:
                    logger.warning("TEST FAULT: %s %s hangs until cancelled", name, command_id)
                    await asyncio.Event().wait()
                moved, path, placements = await work(cancel)
        except TimeoutError:
            cancel.set()
            dst = {t.name: list(ids)[:8] for t, ids in writes.items()}
            raise CommandTimeout(
                f"{self._prefix()}: {name} ran past its deadline of {budget_s * 1000:.0f} ms "
                f"and was cancelled; destination blocks {dst} are not valid"
            ) from None
        except CopyCancelled:  # pragma: no cover - only set together with a cancellation
            raise CommandTimeout(f"{self._prefix()}: {name} cancelled") from None
        except OSError as exc:
            raise ParamServerError(f"{self._prefix()}: {name} failed: {exc}") from exc
        finally:
            cancel.set()
            self._reservations.release(command_id)
            self._inflight -= 1
        if mark_valid:
            for tier, ids in writes.items():
                self._pool(tier).valid[list(ids)] = True
        elapsed = time.perf_counter() - started
        self._completed += 1
        self._bytes_moved += moved
        if self.metrics is not None:
            other = "G4" if path == "object" else "remote"
            self.metrics.transfer(
                name,
                next((t.name for t in reads), other),
                next((t.name for t in writes), other),
                path,
                moved,
                elapsed,
            )
        logger.debug(
            "%s %s moved %d bytes in %.3f s via %s", name, command_id, moved, elapsed, path
        )
        return spmd_pb2.TransferResponse(
            rank=self.rank,
            bytes_moved=moved,
            elapsed_us=int(elapsed * 1e6),
            placements=placements,
            path=path,
        )

    # ------------------------------------------------------------------ metadata

    def metadata(self) -> spmd_pb2.RankMetadata:
        """This rank's metadata (what ``ExportMetadata`` returns)."""
        return spmd_pb2.RankMetadata(
            instance_id=self.config.instance_id,
            rank=self.rank,
            address=self.address,
            host_key=self.host_key,
            incarnation_id=self.incarnation_id,
            layouts=[
                pool.layout.to_proto(tier, **pool.spec_extras())
                for tier, pool in sorted(self.pools.items())
            ],
            object_tier=self.store is not None,
        )

    @_unary
    async def ExportMetadata(
        self, request: spmd_pb2.ExportMetadataRequest, context: grpc.aio.ServicerContext
    ) -> spmd_pb2.RankMetadata:
        return self.metadata()

    @_unary
    async def ImportMetadata(
        self, request: spmd_pb2.ImportMetadataRequest, context: grpc.aio.ServicerContext
    ) -> spmd_pb2.ImportMetadataResponse:
        remote = request.remote
        if not remote.instance_id:
            raise InvalidArgument(f"{self._prefix()}: imported metadata has no instance_id")
        if remote.rank != self.rank:
            raise InvalidArgument(
                f"{self._prefix()}: rank {self.rank} pairs only with rank {self.rank} of a peer "
                f"instance, got rank {remote.rank} of {remote.instance_id}"
            )
        if not remote.address:
            raise InvalidArgument(f"{self._prefix()}: imported metadata has no address")
        layouts: dict[Tier, Layout] = {}
        shm: dict[Tier, str] = {}
        for spec in remote.layouts:
            tier = _tier(spec.tier, "imported layout")
            if tier in layouts:
                raise InvalidArgument(f"{self._prefix()}: imported metadata repeats {tier.name}")
            layouts[tier] = Layout.from_proto(spec)
            if spec.shm_name:
                shm[tier] = spec.shm_name
        old = self._remotes.get(remote.instance_id)
        if old is not None and old.metadata.address != remote.address:
            await self._drop_channel(old.metadata.address)
        if old is not None:
            for tier, name in old.shm_names.items():
                if shm.get(tier) != name:
                    self._drop_segment(name)
        copy = spmd_pb2.RankMetadata()
        copy.CopyFrom(remote)
        self._remotes[remote.instance_id] = _Remote(copy, layouts, shm)
        logger.info(
            "%s imported metadata of %s rank %d at %s (%s)",
            self._prefix(),
            remote.instance_id,
            remote.rank,
            remote.address,
            "replaced" if old else "new",
        )
        return spmd_pb2.ImportMetadataResponse(replaced=old is not None)

    @_unary
    async def ForgetRemote(
        self, request: spmd_pb2.ForgetRemoteRequest, context: grpc.aio.ServicerContext
    ) -> spmd_pb2.ForgetRemoteResponse:
        old = self._remotes.pop(request.instance_id, None)
        if old is not None:
            if not any(r.metadata.address == old.metadata.address for r in self._remotes.values()):
                await self._drop_channel(old.metadata.address)
            for name in old.shm_names.values():
                self._drop_segment(name)
        return spmd_pb2.ForgetRemoteResponse(removed=old is not None)

    async def _drop_channel(self, address: str) -> None:
        channel = self._channels.pop(address, None)
        if channel is not None:
            await channel.close(grace=None)

    def _drop_segment(self, name: str) -> None:
        seg = self._segments.pop(name, None)
        if seg is not None:
            seg.close()

    # ------------------------------------------------------------------ local transfers

    @_unary
    async def LocalTransfer(
        self, request: spmd_pb2.LocalTransferRequest, context: grpc.aio.ServicerContext
    ) -> spmd_pb2.TransferResponse:
        src_tier = _tier(request.src_tier, "source")
        dst_tier = _tier(request.dst_tier, "destination")
        src_ids, dst_ids = _ids(request.src_block_ids), _ids(request.dst_block_ids)
        self._raise(
            check_local_transfer(
                src_tier=src_tier,
                dst_tier=dst_tier,
                src_ids=src_ids,
                dst_ids=dst_ids,
                layouts=self.layouts,
            )
        )
        self._require_valid(src_tier, src_ids)
        src, dst = self.pools[src_tier], self.pools[dst_tier]
        runs = coalesce_runs(src_ids, dst_ids)
        placements = [
            spmd_pb2.Placement(src_block_id=s, dst_block_id=d)
            for s, d in zip(src_ids, dst_ids, strict=True)
        ]

        async def work(cancel: threading.Event) -> tuple[int, str, list[spmd_pb2.Placement]]:
            faults = self.config.faults
            moved = await self._in_thread(
                lambda: copy_blocks(src, dst, runs, cancel=cancel, faults=faults), cancel
            )
            return moved, "local", placements

        return await self._run_command(
            "local_transfer",
            request.options,
            context,
            reads={src_tier: src_ids},
            writes={dst_tier: dst_ids},
            work=work,
        )

    # ------------------------------------------------------------------ remote onboard

    @_unary
    async def RemoteOnboard(
        self, request: spmd_pb2.RemoteOnboardRequest, context: grpc.aio.ServicerContext
    ) -> spmd_pb2.TransferResponse:
        dst_tier = _tier(request.dst_tier, "destination")
        dst_ids = _ids(request.dst_block_ids)
        which = request.WhichOneof("source")
        if which == "object":
            hashes = [int(h) for h in request.object.sequence_hashes]
            return await self._onboard_objects(request.options, context, hashes, dst_tier, dst_ids)
        if which != "layout":
            raise InvalidArgument(f"{self._prefix()}: onboard without a source")
        src = request.layout
        remote = self._remote(src.instance_id)
        remote_tier = _tier(src.tier, "remote source")
        src_ids = _ids(src.block_ids)
        self._raise(
            check_remote_transfer(
                local_tier=dst_tier,
                local_ids=dst_ids,
                local_layouts=self.layouts,
                remote_tier=remote_tier,
                remote_ids=src_ids,
                remote_layouts=remote.layouts,
                onboard=True,
            )
        )
        dst = self.pools[dst_tier]
        placements = [
            spmd_pb2.Placement(src_block_id=s, dst_block_id=d)
            for s, d in zip(src_ids, dst_ids, strict=True)
        ]
        use_shm = (
            request.allow_shared_memory
            and remote_tier in remote.shm_names
            and remote.metadata.host_key == self.host_key
        )

        async def work(cancel: threading.Event) -> tuple[int, str, list[spmd_pb2.Placement]]:
            if not src_ids:
                return 0, "local", placements
            if use_shm:
                seg = await self._peer_segment(remote, remote_tier)
                if seg is not None:
                    moved = await self._onboard_shm(
                        remote, remote_tier, seg, src_ids, dst, dst_ids, cancel
                    )
                    return moved, "shared-memory", placements
            moved = await self._onboard_grpc(remote, remote_tier, src_ids, dst, dst_ids, cancel)
            return moved, "grpc", placements

        return await self._run_command(
            "remote_onboard",
            request.options,
            context,
            reads={},
            writes={dst_tier: dst_ids},
            work=work,
        )

    async def _peer_segment(self, remote: _Remote, tier: Tier) -> PeerSegment | None:
        name = remote.shm_names[tier]
        seg = self._segments.get(name)
        if seg is None:
            try:
                seg = attach_peer_segment(name, remote.layouts[tier].total_bytes)
            except (FileNotFoundError, ValueError, OSError) as exc:
                logger.info(
                    "%s: cannot map peer segment %s (%s); using gRPC", self._prefix(), name, exc
                )
                return None
            self._segments[name] = seg
        return seg

    async def _onboard_shm(
        self,
        remote: _Remote,
        tier: Tier,
        seg: PeerSegment,
        src_ids: list[int],
        dst: BlockPool,
        dst_ids: list[int],
        cancel: threading.Event,
    ) -> int:
        stub = spmd_pb2_grpc.RankServerStub(self._channel(remote.metadata.address))
        try:
            check = await stub.CheckBlocks(
                spmd_pb2.CheckBlocksRequest(
                    tier=int(tier),
                    block_ids=src_ids,
                    incarnation_id=remote.metadata.incarnation_id,
                )
            )
        except grpc.aio.AioRpcError as exc:
            raise self._peer_error(remote, "checking blocks of", exc) from exc
        if check.invalid_block_ids:
            raise BlockNotValid(
                f"{self._prefix()}: peer {remote.metadata.instance_id} rank {remote.metadata.rank} "
                f"{tier.name} blocks {list(check.invalid_block_ids)[:8]} hold no valid data"
            )
        runs = coalesce_runs(src_ids, dst_ids)
        bpb = remote.layouts[tier].bytes_per_block
        faults = self.config.faults
        return await self._in_thread(
            lambda: copy_blocks(
                seg, dst, runs, src_bytes_per_block=bpb, cancel=cancel, faults=faults
            ),
            cancel,
        )

    async def _onboard_grpc(
        self,
        remote: _Remote,
        tier: Tier,
        src_ids: list[int],
        dst: BlockPool,
        dst_ids: list[int],
        cancel: threading.Event,
    ) -> int:
        stub = spmd_pb2_grpc.RankServerStub(self._channel(remote.metadata.address))
        call = stub.ReadBlocks(
            spmd_pb2.ReadBlocksRequest(
                tier=int(tier), block_ids=src_ids, incarnation_id=remote.metadata.incarnation_id
            )
        )
        try:
            return await self._receive_blocks(call, dst, dst_ids, cancel)
        except grpc.aio.AioRpcError as exc:
            raise self._peer_error(remote, "reading from", exc) from exc
        finally:
            call.cancel()

    async def _receive_blocks(
        self,
        chunks: AsyncIterator[spmd_pb2.BlockChunk],
        dst: BlockPool,
        dst_ids: list[int],
        cancel: threading.Event,
    ) -> int:
        bpb = dst.bytes_per_block
        expected = 0
        async for chunk in chunks:
            if chunk.offset_bytes != expected:
                raise MalformedStream(
                    f"{self._prefix()}: chunk at offset {chunk.offset_bytes}, expected {expected}"
                )
            data = memoryview(chunk.data)
            await self._write_pieces(dst, dst_ids, expected, data, cancel)
            expected += len(data)
        if expected != bpb * len(dst_ids):
            raise MalformedStream(
                f"{self._prefix()}: stream ended after {expected} of {bpb * len(dst_ids)} bytes"
            )
        return expected

    async def _write_pieces(
        self,
        dst: BlockPool,
        dst_ids: list[int],
        offset: int,
        data: memoryview,
        cancel: threading.Event,
    ) -> None:
        bpb = dst.bytes_per_block
        pieces = split_stream(offset, len(data), bpb, len(dst_ids))

        def write() -> None:
            if self.config.faults.io_delay_s:
                time.sleep(self.config.faults.io_delay_s)
            for p in pieces:
                if cancel.is_set():
                    raise CopyCancelled()
                dst.write_bytes(
                    dst_ids[p.index] * bpb + p.offset_in_block_bytes,
                    data[p.offset_in_chunk_bytes : p.offset_in_chunk_bytes + p.length_bytes],
                )

        if isinstance(dst, HostPool) and not self.config.faults.io_delay_s:
            write()  # a memcpy of <= 1 MiB; no thread hop
        else:
            await self._in_thread(write, cancel)

    async def _onboard_objects(
        self,
        options: spmd_pb2.CommandOptions,
        context: grpc.aio.ServicerContext,
        hashes: list[int],
        dst_tier: Tier,
        dst_ids: list[int],
    ) -> spmd_pb2.TransferResponse:
        self._raise(
            check_object_transfer(
                tier=dst_tier,
                ids=dst_ids,
                sequence_hashes=hashes,
                layouts=self.layouts,
                into_blocks=True,
                object_tier=self.store is not None,
            )
        )
        dst = self.pools[dst_tier]
        placements = [
            spmd_pb2.Placement(sequence_hash=h, dst_block_id=d)
            for h, d in zip(hashes, dst_ids, strict=True)
        ]

        async def work(cancel: threading.Event) -> tuple[int, str, list[spmd_pb2.Placement]]:
            results = await self._objects_to_blocks(hashes, dst, dst_ids, cancel)
            failed = [(h, err) for h, (status, err) in results.items() if status != "retrieved"]
            if failed:
                h, err = failed[0]
                cls = ObjectNotFound if results[h][0] == "not_found" else ParamServerError
                more = f" (and {len(failed) - 1} more keys)" if len(failed) > 1 else ""
                raise cls(f"{self._prefix()}: {err}{more}")
            return len(hashes) * dst.bytes_per_block, "object", placements

        return await self._run_command(
            "remote_onboard", options, context, reads={}, writes={dst_tier: dst_ids}, work=work
        )

    # ------------------------------------------------------------------ objects <-> blocks

    def _store(self) -> ObjectStore:
        if self.store is None:
            raise TierNotRegistered(f"{self._prefix()}: tier G4 not registered (no object store)")
        return self.store

    async def _per_object(
        self,
        hashes: list[int],
        block_ids: list[int],
        cancel: threading.Event,
        io: Callable[[str, int], str],
        failures: tuple[type[Exception], ...],
    ) -> dict[int, tuple[str, str]]:
        """Run ``io(object key, block id) -> status`` for each pair in worker threads, at most
        ``_OBJECT_IO_CONCURRENCY`` at once; per-key (status, error), in completion order.
        ObjectNotFound becomes ``not_found``; the ``failures`` exceptions become ``failed``."""
        sem = asyncio.Semaphore(_OBJECT_IO_CONCURRENCY)
        results: dict[int, tuple[str, str]] = {}

        def run(h: int, block: int) -> str:
            if cancel.is_set():
                raise CopyCancelled()
            if self.config.faults.io_delay_s:
                time.sleep(self.config.faults.io_delay_s)
            return io(object_key(self.rank, h), block)

        async def one(h: int, block: int) -> None:
            async with sem:
                try:
                    status = await self._in_thread(functools.partial(run, h, block), cancel)
                    results[h] = (status, "")
                except ObjectNotFound:
                    results[h] = ("not_found", f"object {object_key(self.rank, h)} not found")
                except failures as exc:
                    results[h] = ("failed", f"object {object_key(self.rank, h)}: {exc}")

        # A TaskGroup (not gather): if the command is cancelled it waits for every per-key task,
        # and each of those waits for its worker thread, before the command releases its blocks.
        async with asyncio.TaskGroup() as group:
            for h, block in zip(hashes, block_ids, strict=True):
                group.create_task(one(h, block))
        return results

    async def _objects_to_blocks(
        self,
        hashes: list[int],
        dst: BlockPool,
        dst_ids: list[int],
        cancel: threading.Event,
    ) -> dict[int, tuple[str, str]]:
        """Copy objects into blocks concurrently; per-key (status, error), completion order."""
        store = self._store()
        bpb = dst.bytes_per_block

        def fetch(key: str, block: int) -> str:
            view = dst.view_bytes(block * bpb, bpb)
            if view is not None:
                store.read_into(key, view)
            else:
                buf = bytearray(bpb)
                store.read_into(key, memoryview(buf))
                dst.write_bytes(block * bpb, memoryview(buf))
            return "retrieved"

        return await self._per_object(hashes, dst_ids, cancel, fetch, (ValueError, OSError))

    async def _blocks_to_objects(
        self,
        hashes: list[int],
        src: BlockPool,
        src_ids: list[int],
        cancel: threading.Event,
    ) -> dict[int, tuple[str, str]]:
        """Store blocks as objects concurrently; per-key (status, error), completion order."""
        store = self._store()
        bpb = src.bytes_per_block

        def put(key: str, block: int) -> str:
            if store.has(key):
                return "already_present"
            view = src.view_bytes(block * bpb, bpb)
            data = view if view is not None else memoryview(src.read_block(block))
            return "stored" if store.put(key, data) else "already_present"

        return await self._per_object(hashes, src_ids, cancel, put, (OSError,))

    # ------------------------------------------------------------------ remote offload

    @_unary
    async def RemoteOffload(
        self, request: spmd_pb2.RemoteOffloadRequest, context: grpc.aio.ServicerContext
    ) -> spmd_pb2.TransferResponse:
        src_tier = _tier(request.src_tier, "source")
        src_ids = _ids(request.src_block_ids)
        which = request.WhichOneof("destination")
        if which == "object":
            hashes = [int(h) for h in request.object.sequence_hashes]
            self._raise(
                check_object_transfer(
                    tier=src_tier,
                    ids=src_ids,
                    sequence_hashes=hashes,
                    layouts=self.layouts,
                    into_blocks=False,
                    object_tier=self.store is not None,
                )
            )
            self._require_valid(src_tier, src_ids)
            src = self.pools[src_tier]
            obj_placements = [
                spmd_pb2.Placement(src_block_id=b, dst_sequence_hash=h)
                for b, h in zip(src_ids, hashes, strict=True)
            ]

            async def obj_work(
                cancel: threading.Event,
            ) -> tuple[int, str, list[spmd_pb2.Placement]]:
                results = await self._blocks_to_objects(hashes, src, src_ids, cancel)
                failed = [err for status, err in results.values() if status == "failed"]
                if failed:
                    more = f" (and {len(failed) - 1} more keys)" if len(failed) > 1 else ""
                    raise ParamServerError(f"{self._prefix()}: {failed[0]}{more}")
                return len(hashes) * src.bytes_per_block, "object", obj_placements

            return await self._run_command(
                "remote_offload",
                request.options,
                context,
                reads={src_tier: src_ids},
                writes={},
                work=obj_work,
            )
        if which != "layout":
            raise InvalidArgument(f"{self._prefix()}: offload without a destination")
        target = request.layout
        remote = self._remote(target.instance_id)
        remote_tier = _tier(target.tier, "remote destination")
        dst_ids = _ids(target.block_ids)
        self._raise(
            check_remote_transfer(
                local_tier=src_tier,
                local_ids=src_ids,
                local_layouts=self.layouts,
                remote_tier=remote_tier,
                remote_ids=dst_ids,
                remote_layouts=remote.layouts,
                onboard=False,
            )
        )
        self._require_valid(src_tier, src_ids)
        src = self.pools[src_tier]
        placements = [
            spmd_pb2.Placement(src_block_id=s, dst_block_id=d)
            for s, d in zip(src_ids, dst_ids, strict=True)
        ]

        async def work(cancel: threading.Event) -> tuple[int, str, list[spmd_pb2.Placement]]:
            if not src_ids:
                return 0, "local", placements
            stub = spmd_pb2_grpc.RankServerStub(self._channel(remote.metadata.address))
            header = spmd_pb2.WriteBlocksHeader(
                tier=int(remote_tier),
                block_ids=dst_ids,
                incarnation_id=remote.metadata.incarnation_id,
            )
            requests = self._block_stream_requests(src, src_ids, header, cancel)
            try:
                response = await stub.WriteBlocks(requests)
            except grpc.aio.AioRpcError as exc:
                raise self._peer_error(remote, "writing to", exc) from exc
            return int(response.bytes_written), "grpc", placements

        return await self._run_command(
            "remote_offload",
            request.options,
            context,
            reads={src_tier: src_ids},
            writes={},
            work=work,
        )

    async def _block_stream_requests(
        self,
        src: BlockPool,
        src_ids: list[int],
        header: spmd_pb2.WriteBlocksHeader,
        cancel: threading.Event,
    ) -> AsyncIterator[spmd_pb2.WriteBlocksRequest]:
        yield spmd_pb2.WriteBlocksRequest(header=header)
        async for offset, data in self._read_stream(src, src_ids, cancel):
            yield spmd_pb2.WriteBlocksRequest(
                chunk=spmd_pb2.BlockChunk(offset_bytes=offset, data=data)
            )

    async def _read_stream(
        self, src: BlockPool, ids: list[int], cancel: threading.Event
    ) -> AsyncIterator[tuple[int, bytes]]:
        """The concatenated bytes of ``ids`` in chunks of <= 1 MiB: (offset, data)."""
        bpb = src.bytes_per_block
        total = bpb * len(ids)
        chunk = max(1, min(MAX_CHUNK_BYTES, total))
        offset = 0
        while offset < total:
            n = min(chunk, total - offset)
            pieces = split_stream(offset, n, bpb, len(ids))

            def gather(pieces: Any = pieces, n: int = n) -> bytes:
                if self.config.faults.io_delay_s:
                    time.sleep(self.config.faults.io_delay_s)
                out = bytearray(n)
                mv = memoryview(out)
                for p in pieces:
                    src.read_bytes(
                        ids[p.index] * bpb + p.offset_in_block_bytes,
                        mv[p.offset_in_chunk_bytes : p.offset_in_chunk_bytes + p.length_bytes],
                    )
                return bytes(out)

            if isinstance(src, HostPool) and not self.config.faults.io_delay_s:
                data = gather()
            else:
                data = await self._in_thread(gather, cancel)
            yield offset, data
            offset += n

    # ------------------------------------------------------------------ object ops

    @_unary
    async def HasObjects(
        self, request: spmd_pb2.HasObjectsRequest, context: grpc.aio.ServicerContext
    ) -> spmd_pb2.HasObjectsResponse:
        store = self._store()
        hashes = [int(h) for h in request.sequence_hashes]

        def lookup() -> list[spmd_pb2.ObjectPresence]:
            out = []
            for h in hashes:
                size = store.size(object_key(self.rank, h))
                out.append(
                    spmd_pb2.ObjectPresence(
                        sequence_hash=h, present=size is not None, size_bytes=size or 0
                    )
                )
            return out

        objects = await asyncio.to_thread(lookup)
        return spmd_pb2.HasObjectsResponse(rank=self.rank, objects=objects)

    @_unary
    async def PutBlocks(
        self, request: spmd_pb2.PutBlocksRequest, context: grpc.aio.ServicerContext
    ) -> spmd_pb2.ObjectBlocksResponse:
        src_tier = _tier(request.src_tier, "source")
        src_ids = _ids(request.src_block_ids)
        hashes = [int(h) for h in request.sequence_hashes]
        self._raise(
            check_object_transfer(
                tier=src_tier,
                ids=src_ids,
                sequence_hashes=hashes,
                layouts=self.layouts,
                into_blocks=False,
                object_tier=self.store is not None,
            )
        )
        self._require_valid(src_tier, src_ids)
        src = self.pools[src_tier]
        box: dict[int, tuple[str, str]] = {}

        async def work(cancel: threading.Event) -> tuple[int, str, list[spmd_pb2.Placement]]:
            box.update(await self._blocks_to_objects(hashes, src, src_ids, cancel))
            stored = sum(1 for s, _ in box.values() if s == "stored")
            return stored * src.bytes_per_block, "object", []

        response = await self._run_command(
            "put_blocks", request.options, context, reads={src_tier: src_ids}, writes={}, work=work
        )
        return self._key_response(box, response.bytes_moved)

    @_unary
    async def GetBlocks(
        self, request: spmd_pb2.GetBlocksRequest, context: grpc.aio.ServicerContext
    ) -> spmd_pb2.ObjectBlocksResponse:
        dst_tier = _tier(request.dst_tier, "destination")
        dst_ids = _ids(request.dst_block_ids)
        hashes = [int(h) for h in request.sequence_hashes]
        self._raise(
            check_object_transfer(
                tier=dst_tier,
                ids=dst_ids,
                sequence_hashes=hashes,
                layouts=self.layouts,
                into_blocks=True,
                object_tier=self.store is not None,
            )
        )
        dst = self.pools[dst_tier]
        box: dict[int, tuple[str, str]] = {}

        async def work(cancel: threading.Event) -> tuple[int, str, list[spmd_pb2.Placement]]:
            box.update(await self._objects_to_blocks(hashes, dst, dst_ids, cancel))
            got = sum(1 for s, _ in box.values() if s == "retrieved")
            return got * dst.bytes_per_block, "object", []

        # Every destination block is reserved and marked invalid up front; after the command
        # completes, only the blocks whose key was retrieved become valid (a failed key never
        # leaves an old block looking valid, a timed-out command marks none).
        response = await self._run_command(
            "get_blocks",
            request.options,
            context,
            reads={},
            writes={dst_tier: dst_ids},
            work=work,
            mark_valid=False,
        )
        for h, block in zip(hashes, dst_ids, strict=True):
            if box.get(h, ("", ""))[0] == "retrieved":
                dst.valid[block] = True
        return self._key_response(box, response.bytes_moved)

    def _key_response(
        self, results: Mapping[int, tuple[str, str]], moved: int
    ) -> spmd_pb2.ObjectBlocksResponse:
        status_enum = {
            "stored": spmd_pb2.KEY_STATUS_STORED,
            "already_present": spmd_pb2.KEY_STATUS_ALREADY_PRESENT,
            "retrieved": spmd_pb2.KEY_STATUS_RETRIEVED,
            "not_found": spmd_pb2.KEY_STATUS_NOT_FOUND,
            "failed": spmd_pb2.KEY_STATUS_FAILED,
        }
        return spmd_pb2.ObjectBlocksResponse(
            rank=self.rank,
            results=[
                spmd_pb2.KeyResult(sequence_hash=h, status=status_enum[s], error=e)
                for h, (s, e) in results.items()
            ],
            bytes_moved=moved,
        )

    @_unary
    async def PutObject(
        self,
        request_iterator: AsyncIterator[spmd_pb2.PutObjectRequest],
        context: grpc.aio.ServicerContext,
    ) -> spmd_pb2.PutObjectResponse:
        store = self._store()
        first = await anext(aiter(request_iterator), None)
        if first is None or first.WhichOneof("body") != "header":
            raise MalformedStream(f"{self._prefix()}: PutObject must start with a header")
        header = first.header
        key = object_key(self.rank, int(header.sequence_hash))
        limit = self.config.max_object_bytes
        if header.size_bytes > limit:
            raise InvalidArgument(
                f"{self._prefix()}: object {key} of {header.size_bytes} bytes exceeds "
                f"max_object_bytes {limit} (--max-object-bytes); nothing was stored"
            )
        existing = await asyncio.to_thread(store.size, key)
        if existing is not None:
            return spmd_pb2.PutObjectResponse(
                status=spmd_pb2.KEY_STATUS_ALREADY_PRESENT, size_bytes=existing
            )
        free = await asyncio.to_thread(store.free_bytes)
        if free is not None and header.size_bytes > free:
            raise ResourceExhausted(
                f"{self._prefix()}: object {key} needs {header.size_bytes} bytes but the object "
                f"store has {free} free; nothing was stored"
            )
        budget = self._budget_s(header.timeout_ms, context)
        writer = await asyncio.to_thread(store.begin_put, key)
        committed = False
        try:
            async with asyncio.timeout(budget):
                expected = 0
                async for message in request_iterator:
                    if message.WhichOneof("body") != "chunk":
                        raise MalformedStream(f"{self._prefix()}: second header in PutObject")
                    chunk = message.chunk
                    if chunk.offset_bytes != expected:
                        raise MalformedStream(
                            f"{self._prefix()}: chunk at {chunk.offset_bytes}, expected {expected}"
                        )
                    if expected + len(chunk.data) > header.size_bytes:
                        raise MalformedStream(
                            f"{self._prefix()}: object longer than its size_bytes "
                            f"{header.size_bytes}"
                        )
                    try:
                        await asyncio.to_thread(writer.write, chunk.data)
                    except OSError as exc:
                        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                            raise
                        raise ResourceExhausted(
                            f"{self._prefix()}: object store full writing {key} "
                            f"({expected} of {header.size_bytes} bytes): {exc.strerror}; "
                            "nothing was stored"
                        ) from None
                    expected += len(chunk.data)
                if expected != header.size_bytes:
                    raise MalformedStream(
                        f"{self._prefix()}: object stream ended after {expected} of "
                        f"{header.size_bytes} bytes"
                    )
                created = await asyncio.to_thread(writer.commit)
                committed = True
        except TimeoutError:
            raise CommandTimeout(
                f"{self._prefix()}: put of {key} ran past its deadline; nothing was stored"
            ) from None
        finally:
            if not committed:
                # Synchronous on purpose: a close + unlink. When grpc drops the handler of a
                # client that died mid-stream, this finally may run while the coroutine is being
                # closed, where no await is possible.
                writer.abort()
        return spmd_pb2.PutObjectResponse(
            status=spmd_pb2.KEY_STATUS_STORED if created else spmd_pb2.KEY_STATUS_ALREADY_PRESENT,
            size_bytes=header.size_bytes,
        )

    @_streaming
    async def GetObject(
        self, request: spmd_pb2.GetObjectRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[spmd_pb2.GetObjectResponse]:
        store = self._store()
        key = object_key(self.rank, int(request.sequence_hash))
        size, chunks = await asyncio.to_thread(store.iter_chunks, key, MAX_CHUNK_BYTES)
        yield spmd_pb2.GetObjectResponse(
            info=spmd_pb2.ObjectInfo(sequence_hash=request.sequence_hash, size_bytes=size)
        )
        offset = 0
        sentinel = b""
        try:
            while True:
                data = await asyncio.to_thread(next, chunks, sentinel)
                if not data:
                    break
                yield spmd_pb2.GetObjectResponse(
                    chunk=spmd_pb2.DataChunk(offset_bytes=offset, data=data)
                )
                offset += len(data)
        finally:
            close = getattr(chunks, "close", None)
            if close is not None:
                close()  # closes the file descriptor; synchronous (see PutObject)

    # ------------------------------------------------------------------ block streams

    def _check_read(self, tier: Tier, ids: list[int], incarnation_id: str) -> BlockPool:
        self._check_incarnation(incarnation_id)
        pool = self._pool(tier)
        n = pool.layout.num_blocks
        bad = [b for b in ids if not 0 <= b < n]
        if bad:
            raise InvalidArgument(
                f"{self._prefix()}: {tier.name} ids out of range [0, {n}): {bad[:8]}"
            )
        return pool

    @_streaming
    async def ReadBlocks(
        self, request: spmd_pb2.ReadBlocksRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[spmd_pb2.BlockChunk]:
        tier = _tier(request.tier, "read")
        ids = _ids(request.block_ids)
        pool = self._check_read(tier, ids, request.incarnation_id)
        self._require_valid(tier, ids)
        command_id = f"read-{uuid.uuid4().hex}"
        self._raise(self._reservations.reserve(command_id, reads={tier: ids}))
        cancel = threading.Event()
        try:
            async for offset, data in self._read_stream(pool, ids, cancel):
                yield spmd_pb2.BlockChunk(offset_bytes=offset, data=data)
        finally:
            cancel.set()
            self._reservations.release(command_id)

    @_unary
    async def WriteBlocks(
        self,
        request_iterator: AsyncIterator[spmd_pb2.WriteBlocksRequest],
        context: grpc.aio.ServicerContext,
    ) -> spmd_pb2.WriteBlocksResponse:
        first = await anext(aiter(request_iterator), None)
        if first is None or first.WhichOneof("body") != "header":
            raise MalformedStream(f"{self._prefix()}: WriteBlocks must start with a header")
        header = first.header
        tier = _tier(header.tier, "write")
        ids = _ids(header.block_ids)
        pool = self._check_read(tier, ids, header.incarnation_id)
        if len(set(ids)) != len(ids):
            raise InvalidArgument(f"{self._prefix()}: destination ids are not unique")
        budget = self._budget_s(header.timeout_ms, context)
        command_id = f"write-{uuid.uuid4().hex}"
        self._raise(self._reservations.reserve(command_id, writes={tier: ids}))
        pool.valid[ids] = False
        cancel = threading.Event()

        async def chunks() -> AsyncIterator[spmd_pb2.BlockChunk]:
            async for message in request_iterator:
                if message.WhichOneof("body") != "chunk":
                    raise MalformedStream(f"{self._prefix()}: second header in WriteBlocks")
                yield message.chunk

        try:
            async with asyncio.timeout(budget):
                written = await self._receive_blocks(chunks(), pool, ids, cancel)
        except TimeoutError:
            raise CommandTimeout(
                f"{self._prefix()}: block write ran past its deadline; blocks left invalid"
            ) from None
        finally:
            cancel.set()
            self._reservations.release(command_id)
        pool.valid[ids] = True
        self._bytes_moved += written
        return spmd_pb2.WriteBlocksResponse(bytes_written=written)

    @_unary
    async def CheckBlocks(
        self, request: spmd_pb2.CheckBlocksRequest, context: grpc.aio.ServicerContext
    ) -> spmd_pb2.CheckBlocksResponse:
        tier = _tier(request.tier, "check")
        ids = _ids(request.block_ids)
        pool = self._check_read(tier, ids, request.incarnation_id)
        return spmd_pb2.CheckBlocksResponse(invalid_block_ids=[b for b in ids if not pool.valid[b]])

    @_unary
    async def Status(
        self, request: spmd_pb2.RankStatusRequest, context: grpc.aio.ServicerContext
    ) -> spmd_pb2.RankStatusResponse:
        return spmd_pb2.RankStatusResponse(
            instance_id=self.config.instance_id,
            rank=self.rank,
            incarnation_id=self.incarnation_id,
            inflight_commands=self._inflight,
            object_writes_in_progress=self.store.writes_in_progress if self.store else 0,
            commands_completed=self._completed,
            commands_failed=self._failed,
            remote_instances=len(self._remotes),
            bytes_moved=self._bytes_moved,
        )

    # ------------------------------------------------------------------ lifecycle

    async def close(self) -> None:
        """Close peer channels, unmap peer segments, release every pool (idempotent)."""
        for address in list(self._channels):
            await self._drop_channel(address)
        for name in list(self._segments):
            self._drop_segment(name)
        for pool in self.pools.values():
            pool.close()


# --------------------------------------------------------------------------- daemon


@dataclasses.dataclass
class RankServerHandle:
    """A running rank server inside the current event loop (tests, embedding)."""

    server: grpc.aio.Server
    servicer: RankServicer
    port: int
    health: health.aio.HealthServicer
    metrics: MetricsServer | None = None

    @property
    def address(self) -> str:
        """``host:port`` the server listens on."""
        return self.servicer.address

    async def stop(self, grace_s: float = 1.0) -> None:
        """Stop serving (in-flight RPCs get ``grace_s`` seconds) and release the pools.

        Health turns NOT_SERVING first (watchers are told), then the server stops.
        """
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
        await self.servicer.close()
        if self.metrics is not None:
            await self.metrics.stop()


async def start_rank_server(config: RankServerConfig) -> RankServerHandle:
    """Allocate the pools, bind ``config.host:config.port`` (and the metrics port) and start
    serving.

    Returns:
        A handle whose ``port`` is the bound port (ephemeral when ``config.port == 0``).

    Raises:
        TierNotRegistered: G1 requested without a GPU (FAILED_PRECONDITION).
        Unavailable: the port or the metrics port cannot be bound, the address and the reason
            named (UNAVAILABLE); nothing is left running.
    """
    servicer = RankServicer.create(config)
    server: grpc.aio.Server | None = None
    metrics: MetricsServer | None = None
    try:
        sec = config.security
        on_refusal = None
        if config.metrics_port is not None:
            svc = servicer
            servicer.metrics = RankMetrics(lambda: (svc._failed, svc._inflight))
            registry = servicer.metrics.registry
            blocks = {"G1": config.device_blocks, "G2": config.host_blocks}
            blocks["G3"] = config.disk_blocks
            info: dict[str, Any] = {
                "instance_id": config.instance_id,
                "rank": config.rank,
                "tier_blocks": blocks,
                "object_store": config.object_dir is not None,
            }
            metrics = MetricsServer(
                registry,
                config.metrics_host,
                config.metrics_port,
                Dashboard("rank", registry, info=info),
                security=metrics_security(config),
            )
            on_refusal = auth_refusal_counter(servicer.metrics.registry)
            # Before the gRPC port: grpc.aio keeps a port bound by a server that never started.
            await metrics.start()
        server = grpc.aio.server(
            interceptors=sec.interceptors(on_refusal) if sec is not None else None,
            options=[*CHANNEL_OPTIONS, *SERVER_KEEPALIVE_OPTIONS],
        )
        spmd_pb2_grpc.add_RankServerServicer_to_server(servicer, server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        enable_reflection(server, SERVICE_NAME)
        port = bind(server, f"{config.host}:{config.port}", sec)
        host = config.host if config.host not in ("0.0.0.0", "::", "") else socket.gethostname()
        servicer.address = f"{host}:{port}"
        if metrics is not None:
            metrics.dashboard.info["address"] = servicer.address
        await server.start()
    except BaseException:
        if server is not None:
            await server.stop(None)
        if metrics is not None:
            await metrics.stop()
        await servicer.close()
        raise
    if servicer.store is not None and isinstance(servicer.store, FilesystemObjectStore):
        removed = await asyncio.to_thread(servicer.store.sweep_temp, 3600.0)
        if removed:
            logger.info("removed %d stale object temp files", removed)
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return RankServerHandle(server, servicer, port, health_servicer, metrics)


def _write_port_file(path: Path, port: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(f"{port}\n")
    os.replace(tmp, path)


async def serve(config: RankServerConfig) -> int:
    """Run one rank server until SIGTERM/SIGINT, then shut down cleanly (the daemon).

    Prints ``rank-server ready instance=... rank=... address=host:port`` on stdout once serving
    and writes the port to ``config.port_file`` when set. Shared memory and the pool file are
    released on the way out.

    Returns:
        Process exit status (0).
    """
    handle = await start_rank_server(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    try:
        if config.port_file is not None:
            _write_port_file(config.port_file, handle.port)
        if config.faults.any:
            logger.warning("TEST-ONLY fault injection active: %s", config.faults)
        print(
            f"rank-server ready instance={config.instance_id} rank={config.rank} "
            f"address={handle.address} incarnation={handle.servicer.incarnation_id}",
            flush=True,
        )
        logger.info(
            "rank server %s rank %d serving on %s with tiers %s",
            config.instance_id,
            config.rank,
            handle.address,
            ", ".join(
                [t.name for t in handle.servicer.pools]
                + (["G4 (objects)"] if handle.servicer.store is not None else [])
            )
            or "none",
        )
        await stop.wait()
        logger.info("rank server %s rank %d shutting down", config.instance_id, config.rank)
    finally:
        await handle.stop(1.0)
    return 0
