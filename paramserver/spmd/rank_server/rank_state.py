"""What one rank server holds and the one funnel every block-moving command goes through.

:class:`RankState` owns the rank's tier pools, its object store (G4), its incarnation id, the
block reservations, the imported peer metadata (with a channel per peer address and the
same-host peers' mapped G2 segments) and the counters. :meth:`RankState.run_command` runs a
command:

1. the incarnation check (the callers in :mod:`~paramserver.spmd.rank_server.transfer` and
   :mod:`~paramserver.spmd.rank_server.object_tier` make it first, before validating with
   the pure rules of :mod:`paramserver.spmd.planning` against this rank's state);
2. a reservation of the blocks it reads and writes (concurrent commands never write the same
   blocks or read blocks being written);
3. destination blocks are marked *invalid* before the first byte is written;
4. the work runs under the command's deadline; copies run in worker threads and stop between
   chunks when cancelled; a command that runs out of time is cancelled, waits for its thread to
   stop, and answers DEADLINE_EXCEEDED: its destination blocks stay invalid, so no later read
   hands them out as valid;
5. on success the destination blocks become valid.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

import grpc

from paramserver.api.v1 import spmd_pb2, spmd_pb2_grpc
from paramserver.errors import InvalidArgument, ParamServerError, from_rpc_error
from paramserver.method_handlers import ServicerContext
from paramserver.security.tls import open_channel
from paramserver.spmd.layout import Layout, Tier
from paramserver.spmd.objects import FilesystemObjectStore, ObjectStore
from paramserver.spmd.planning import BlockReservations, Verdict, server_budget_s
from paramserver.spmd.pools import (
    BlockPool,
    CopyCancelled,
    DiskPool,
    HostPool,
    PeerSegment,
    attach_peer_segment,
    make_device_pool,
)
from paramserver.spmd.rank_metrics import RankMetrics
from paramserver.spmd.rank_server.rank_config import CHANNEL_OPTIONS, RankServerConfig
from paramserver.spmd.transfer_errors import (
    BlockNotValid,
    CommandTimeout,
    RemoteNotConnected,
    StaleIncarnation,
    TierNotRegistered,
)

__all__ = ["RankState", "Remote", "Work", "parse_tier"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

Work = Callable[[threading.Event], Awaitable[tuple[int, str, list[spmd_pb2.Placement]]]]
"""A command's work: given its cancel event, returns (bytes moved, path, placements)."""


def _host_key() -> str:
    boot = ""
    with contextlib.suppress(OSError):
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return f"{socket.gethostname()}/{boot}"


def parse_tier(value: int, what: str) -> Tier:
    """The tier of a wire enum value; ``what`` names the field in the refusal.

    Raises:
        InvalidArgument: unspecified or unknown (INVALID_ARGUMENT).
    """
    if value == spmd_pb2.TIER_UNSPECIFIED:
        raise InvalidArgument(f"{what} tier is unspecified")
    return Tier.parse(int(value))


@dataclasses.dataclass
class Remote:
    """An imported peer rank: its metadata, layouts and G2 segment names by tier."""

    metadata: spmd_pb2.RankMetadata
    layouts: dict[Tier, Layout]
    shm_names: dict[Tier, str]


class RankState:
    """One rank's pools, object store, peers and counters (see the module docstring).

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
        self.prefix = f"rank {self.rank} of {config.instance_id}"
        self.remotes: dict[str, Remote] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._segments: dict[str, PeerSegment] = {}
        self.reservations = BlockReservations()
        self.inflight = 0
        self.completed = 0
        self.failed = 0
        self.bytes_moved = 0
        #: Transfer series (set by the daemon when metrics are on).
        self.metrics: RankMetrics | None = None

    @classmethod
    def create(cls, config: RankServerConfig) -> RankState:
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

    # ------------------------------------------------------------------ checks

    def pool(self, tier: Tier) -> BlockPool:
        """The pool of ``tier``.

        Raises:
            TierNotRegistered: this rank has no such tier (FAILED_PRECONDITION).
        """
        try:
            return self.pools[tier]
        except KeyError:
            raise TierNotRegistered(f"{self.prefix}: tier {tier.name} not registered") from None

    def object_store(self) -> ObjectStore:
        """The object store (G4).

        Raises:
            TierNotRegistered: this rank has none (FAILED_PRECONDITION).
        """
        if self.store is None:
            raise TierNotRegistered(f"{self.prefix}: tier G4 not registered (no object store)")
        return self.store

    def check_incarnation(self, incarnation_id: str) -> None:
        """Refuse a caller that read this rank's metadata before a restart (empty: no check)."""
        if incarnation_id and incarnation_id != self.incarnation_id:
            raise StaleIncarnation(
                f"{self.prefix}: restarted since its metadata was read (incarnation "
                f"{self.incarnation_id[:8]}, caller expected {incarnation_id[:8]})"
            )

    def checked_pool(self, tier: Tier, ids: Sequence[int], incarnation_id: str) -> BlockPool:
        """The pool of ``tier`` after the incarnation and range checks of ``ids``."""
        self.check_incarnation(incarnation_id)
        pool = self.pool(tier)
        n = pool.layout.num_blocks
        bad = [b for b in ids if not 0 <= b < n]
        if bad:
            raise InvalidArgument(
                f"{self.prefix}: {tier.name} ids out of range [0, {n}): {bad[:8]}"
            )
        return pool

    def require_valid(self, tier: Tier, ids: Sequence[int]) -> None:
        """Refuse (BlockNotValid, FAILED_PRECONDITION) unless every block holds valid data."""
        pool = self.pool(tier)
        invalid = [b for b in ids if not pool.valid[b]]
        if invalid:
            raise BlockNotValid(
                f"{self.prefix}: {tier.name} blocks {invalid[:8]} hold no valid data "
                "(never written, or the last write failed or timed out)"
            )

    def budget_s(self, timeout_ms: int, context: ServicerContext) -> float:
        """The server-side budget of a command: its own timeout, capped by the RPC deadline."""
        requested = timeout_ms / 1000.0 if timeout_ms else self.config.default_timeout_s
        budget = server_budget_s(requested)
        remaining = context.time_remaining()
        if remaining is not None:
            budget = min(budget, max(0.001, server_budget_s(remaining)))
        return budget

    def refuse(self, verdict: Verdict) -> None:
        """Raise the verdict's error (its message prefixed with this rank) unless it is ok."""
        verdict.raise_if_refused(f"{self.prefix}: ")

    # ------------------------------------------------------------------ peers

    def remote(self, instance_id: str) -> Remote:
        """The imported peer of ``instance_id``.

        Raises:
            RemoteNotConnected: none imported (NOT_FOUND).
        """
        remote = self.remotes.get(instance_id)
        if remote is None:
            raise RemoteNotConnected(
                f"{self.prefix}: no metadata imported for remote instance {instance_id!r}"
            )
        return remote

    def peer_stub(self, remote: Remote) -> spmd_pb2_grpc.RankServerAsyncStub:
        """A stub on the (cached) channel to ``remote``'s rank server."""
        address = remote.metadata.address
        channel = self._channels.get(address)
        if channel is None:
            channel = open_channel(address, self.config.peer_security, CHANNEL_OPTIONS)
            self._channels[address] = channel
        return spmd_pb2_grpc.RankServerStub(channel)

    def peer_error(self, remote: Remote, what: str, exc: grpc.aio.AioRpcError) -> ParamServerError:
        """The peer's refusal as the same error class, its message prefixed with both ranks."""
        base = from_rpc_error(exc)
        md = remote.metadata
        err = type(base)(
            f"{self.prefix}: {what} peer {md.instance_id} rank {md.rank} at {md.address} "
            f"failed: {exc.code().name}: {exc.details()}"
        )
        err.code = base.code
        return err

    def peer_segment(self, remote: Remote, tier: Tier) -> PeerSegment | None:
        """The peer's G2 segment of ``tier`` mapped here (cached), or None when it cannot be."""
        name = remote.shm_names[tier]
        seg = self._segments.get(name)
        if seg is None:
            try:
                seg = attach_peer_segment(name, remote.layouts[tier].total_bytes)
            except (FileNotFoundError, ValueError, OSError) as exc:
                logger.info(
                    "%s: cannot map peer segment %s (%s); using gRPC", self.prefix, name, exc
                )
                return None
            self._segments[name] = seg
        return seg

    async def import_remote(self, remote: spmd_pb2.RankMetadata) -> bool:
        """Record (or replace) a peer rank's metadata; True when an older mapping was replaced.

        Raises:
            InvalidArgument: no instance id or address, another rank index, or a repeated or
                malformed layout (INVALID_ARGUMENT); nothing is recorded.
        """
        if not remote.instance_id:
            raise InvalidArgument(f"{self.prefix}: imported metadata has no instance_id")
        if remote.rank != self.rank:
            raise InvalidArgument(
                f"{self.prefix}: rank {self.rank} pairs only with rank {self.rank} of a peer "
                f"instance, got rank {remote.rank} of {remote.instance_id}"
            )
        if not remote.address:
            raise InvalidArgument(f"{self.prefix}: imported metadata has no address")
        layouts: dict[Tier, Layout] = {}
        shm: dict[Tier, str] = {}
        for spec in remote.layouts:
            tier = parse_tier(spec.tier, "imported layout")
            if tier in layouts:
                raise InvalidArgument(f"{self.prefix}: imported metadata repeats {tier.name}")
            layouts[tier] = Layout.from_proto(spec)
            if spec.shm_name:
                shm[tier] = spec.shm_name
        old = self.remotes.get(remote.instance_id)
        if old is not None and old.metadata.address != remote.address:
            await self._drop_channel(old.metadata.address)
        if old is not None:
            for tier, name in old.shm_names.items():
                if shm.get(tier) != name:
                    self._drop_segment(name)
        copy = spmd_pb2.RankMetadata()
        copy.CopyFrom(remote)
        self.remotes[remote.instance_id] = Remote(copy, layouts, shm)
        logger.info(
            "%s imported metadata of %s rank %d at %s (%s)",
            self.prefix,
            remote.instance_id,
            remote.rank,
            remote.address,
            "replaced" if old else "new",
        )
        return old is not None

    async def forget_remote(self, instance_id: str) -> bool:
        """Forget a peer (its channel when no other peer shares it, its mapped segments)."""
        old = self.remotes.pop(instance_id, None)
        if old is None:
            return False
        if not any(r.metadata.address == old.metadata.address for r in self.remotes.values()):
            await self._drop_channel(old.metadata.address)
        for name in old.shm_names.values():
            self._drop_segment(name)
        return True

    async def _drop_channel(self, address: str) -> None:
        channel = self._channels.pop(address, None)
        if channel is not None:
            await channel.close(grace=None)

    def _drop_segment(self, name: str) -> None:
        seg = self._segments.pop(name, None)
        if seg is not None:
            seg.close()

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

    # ------------------------------------------------------------------ commands

    async def in_thread(self, fn: Callable[[], T], cancel: threading.Event) -> T:
        """Run ``fn`` in a worker thread; on cancellation stop it and wait until it stopped."""
        future = asyncio.get_running_loop().run_in_executor(None, fn)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            cancel.set()
            with contextlib.suppress(BaseException):
                await asyncio.wait([future])
            raise

    async def run_command(
        self,
        name: str,
        options: spmd_pb2.CommandOptions,
        context: ServicerContext,
        *,
        reads: Mapping[Tier, Sequence[int]],
        writes: Mapping[Tier, Sequence[int]],
        work: Work,
        mark_valid: bool = True,
    ) -> spmd_pb2.TransferResponse:
        """Run one validated command (steps 1-5 of the module docstring).

        Raises:
            StaleIncarnation: options name another incarnation (FAILED_PRECONDITION).
            CommandTimeout: past the deadline; destination blocks left invalid
                (DEADLINE_EXCEEDED).
            ParamServerError: a disk error (INTERNAL), or whatever ``work`` raised.
        """
        command_id = options.command_id or uuid.uuid4().hex
        self.check_incarnation(options.incarnation_id)
        budget_s = self.budget_s(options.timeout_ms, context)
        self.refuse(self.reservations.reserve(command_id, reads=reads, writes=writes))
        for tier, ids in writes.items():
            self.pool(tier).valid[list(ids)] = False
        cancel = threading.Event()
        self.inflight += 1
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
                f"{self.prefix}: {name} ran past its deadline of {budget_s * 1000:.0f} ms "
                f"and was cancelled; destination blocks {dst} are not valid"
            ) from None
        except CopyCancelled:  # pragma: no cover - only set together with a cancellation
            raise CommandTimeout(f"{self.prefix}: {name} cancelled") from None
        except OSError as exc:
            raise ParamServerError(f"{self.prefix}: {name} failed: {exc}") from exc
        finally:
            cancel.set()
            self.reservations.release(command_id)
            self.inflight -= 1
        if mark_valid:
            for tier, ids in writes.items():
                self.pool(tier).valid[list(ids)] = True
        elapsed = time.perf_counter() - started
        self.completed += 1
        self.bytes_moved += moved
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

    async def close(self) -> None:
        """Close peer channels, unmap peer segments, release every pool (idempotent)."""
        for address in list(self._channels):
            await self._drop_channel(address)
        for name in list(self._segments):
            self._drop_segment(name)
        for pool in self.pools.values():
            pool.close()
