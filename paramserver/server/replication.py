"""Shard replication: a primary streams its write-ahead-log records to its backups.

A replicated shard (``--replicas R``) has one primary and R-1 backups. The primary's log is
the shard's ordered mutation stream (:mod:`paramserver.server.wal_records`); every record it
appends is also sent, in sequence order, to each backup over one ``Replicate`` stream
(``protos/paramserver/api/v1/replication.proto``). A backup replays each batch into its own
core through :func:`~paramserver.server.wal_records.replay_into` (the code a restart replays
its log with), appends the same records, with the same sequence numbers, to its own log, and
acknowledges once they are fsynced. :meth:`ServerEngine.mutate
<paramserver.server.engine.ServerEngine.mutate>` acknowledges a mutation only after its local
fsync **and** :meth:`Primary.replicated`: every backup *in sync* holds it durably (as
PostgreSQL's synchronous standbys).

A backup joins by a seed: the primary takes a checkpoint snapshot at its log's last sequence
(one consistent cut, as a checkpoint), sends it, and streams every record after it; the
backup writes the seed as a checkpoint of its own, restarts its log after that sequence, and
is *in sync* once it acknowledged the seed. A backup whose stream breaks is out of sync until
it is seeded again; training goes on meanwhile.

Fencing: every message carries the primary's epoch. A backup remembers the highest epoch it
has seen and refuses older ones (:class:`~paramserver.errors.StaleEpoch`), so a deposed
primary's mutations are never acknowledged. Which replica is primary, under which epoch, is
decided outside this module (:mod:`paramserver.server.election`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeAlias

import grpc
import numpy as np
from safetensors.numpy import load, save

from paramserver.api.v1 import replication_pb2 as rpb
from paramserver.api.v1 import replication_pb2_grpc as rpb_grpc
from paramserver.api.v1 import wal_pb2 as wal_pb
from paramserver.closing import cancelled
from paramserver.core.shard import ServerCore
from paramserver.errors import (
    ERROR_CLASS_METADATA_KEY,
    InvalidArgument,
    NotPrimary,
    ParamServerError,
    StaleEpoch,
)
from paramserver.method_handlers import ServicerContext
from paramserver.security.tls import ClientSecurity, open_channel
from paramserver.server.checkpoint import (
    CheckpointManager,
    Snapshot,
    _from_storable,
    _to_storable,
)
from paramserver.server.wal_records import replay_into

if TYPE_CHECKING:
    from paramserver.server.engine import ServerEngine

logger = logging.getLogger(__name__)

#: The primary's end of one Replicate stream.
_ReplicateCall: TypeAlias = "grpc.aio.StreamStreamCall[rpb.ReplicateRequest, rpb.ReplicaAck]"

SERVICE_NAME = "paramserver.api.v1.Replication"
#: Seed bytes per message.
SEED_CHUNK_BYTES = 1 << 20
#: Pause before a broken stream to a backup is opened again (seconds).
RECONNECT_S = 0.2
#: A backup in sync that acknowledges nothing for this long (hung, stopped, cut off without a
#: reset) is taken out of sync, so mutations go on without it (seconds).
ACK_TIMEOUT_S = 5.0


# ------------------------------------------------------------------------------ seeds
def encode_seed(snap: Snapshot) -> tuple[bytes, bytes]:
    """A snapshot as (manifest JSON, safetensors bytes); checksums filled in."""
    tensors = {}
    for name, array in snap.tensors.items():
        stored, dtype = _to_storable(array)
        tensors[name] = stored
        info = snap.manifest["tensors"][name]
        info["dtype"] = dtype
    data = save(tensors) if tensors else b""
    return json.dumps(snap.manifest).encode(), data


def decode_seed(manifest_json: bytes, data: bytes) -> Snapshot:
    """Inverse of :func:`encode_seed`."""
    manifest = json.loads(manifest_json)
    raw = load(data) if data else {}
    tensors: dict[str, np.ndarray] = {}
    for name, info in manifest["tensors"].items():
        tensors[name] = _from_storable(raw[name], info["dtype"]).reshape(info["shape"])
    return Snapshot(tensors, manifest)


def reset_core(engine: ServerEngine) -> ServerCore:
    """Empty ``engine``'s core in place (the servicers hold it), keeping its hooks."""
    core = engine.core
    keep: dict[str, object] = {
        name: core.__dict__[name]
        for name in ("observer", "step_applier", "on_progress")
        if name in core.__dict__
    }
    fresh = ServerCore(engine.config)
    core.__dict__.clear()
    core.__dict__.update(fresh.__dict__)
    core.__dict__.update(keep)
    return core


# ------------------------------------------------------------------------------ primary
@dataclass
class _Link:
    """The primary's stream to one backup."""

    index: int
    address: str
    #: Record batches appended since the seed, not yet sent: (last sequence, payloads).
    pending: list[tuple[int, list[bytes]]] = field(default_factory=list)
    #: Set while the link buffers records (from its seed's snapshot on).
    buffering: bool = False
    #: The sequence the seed reflects; the backup is in sync once it acknowledged it.
    seed_sequence: int = -1
    acked: int = 0
    in_sync: bool = False
    #: Consecutive failed streams (the first is logged as a warning, the rest at debug).
    failures: int = 0
    #: (last sequence, monotonic time) of each batch sent and not yet acknowledged.
    sent: deque[tuple[int, float]] = field(default_factory=deque)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None


class Primary:
    """The primary role: streams the log to every backup; :meth:`replicated` waits for them.

    Args:
        engine: The shard's engine (its log must be open).
        checkpoints: The shard's checkpoints (seeds are snapshots as checkpoints take them).
        epoch: The epoch this replica holds the primary role under (> 0).
        shard_index: The shard.
        index: This replica's index.
        address: This replica's client address.
        backups: Replica index -> address of every backup.
        security: Client security towards the backups (None: plain text).
        sync_changed: Awaited with the set of replica indexes in sync (this one included)
            before a backup joins or leaves it (the authority records it, conditioned on this
            replica still holding ``epoch``); returns False when this replica was deposed.
            None: nothing to record (a fixed primary).
        on_deposed: Called once when a backup reports a newer epoch.
    """

    def __init__(
        self,
        engine: ServerEngine,
        checkpoints: CheckpointManager,
        *,
        epoch: int,
        shard_index: int,
        index: int,
        address: str,
        backups: dict[int, str],
        security: ClientSecurity | None = None,
        sync_changed: Callable[[set[int]], Awaitable[bool]] | None = None,
        on_deposed: Callable[[str], None] | None = None,
    ) -> None:
        self.engine = engine
        self.checkpoints = checkpoints
        self.epoch = epoch
        self.shard_index = shard_index
        self.index = index
        self.address = address
        self.security = security
        self.sync_changed = sync_changed
        self.on_deposed = on_deposed
        self.links = {i: _Link(i, a) for i, a in backups.items()}
        #: Why this primary no longer holds the role (set once).
        self.deposed: str | None = None
        self._change: asyncio.Future[None] | None = None
        self._sync_lock = asyncio.Lock()
        #: Seeds sent and streams broken, for status and tests.
        self.seeds_sent = 0
        self.streams_lost = 0

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        assert self.engine.wal is not None
        self.engine.wal.on_append = self._on_append
        loop = asyncio.get_running_loop()
        for link in self.links.values():
            link.task = loop.create_task(
                self._run_link(link), name=f"paramserver-replicate-to-{link.index}"
            )

    async def stop(self) -> None:
        if self.engine.wal is not None and self.engine.wal.on_append == self._on_append:
            self.engine.wal.on_append = None
        for link in self.links.values():
            await cancelled(link.task)
            link.task = None
        self._notify()

    def depose(self, why: str) -> None:
        """Give the role up: every waiting and later :meth:`replicated` raises NotPrimary."""
        if self.deposed is not None:
            return
        self.deposed = why
        logger.warning("replica %d of shard %d deposed: %s", self.index, self.shard_index, why)
        self._notify()
        if self.on_deposed is not None:
            self.on_deposed(why)

    # ------------------------------------------------------------------ the funnel's wait
    def check_primary(self) -> None:
        if self.deposed is not None:
            raise NotPrimary(
                f"replica {self.index} of shard {self.shard_index} is no longer primary "
                f"({self.deposed}); retry at the shard's primary"
            )

    async def replicated(self, sequence: int) -> None:
        while True:
            self.check_primary()
            if all(link.acked >= sequence for link in self.links.values() if link.in_sync):
                return
            if self._change is None or self._change.done():
                self._change = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._change)

    def _notify(self) -> None:
        fut, self._change = self._change, None
        if fut is not None and not fut.done():
            fut.set_result(None)

    def in_sync(self) -> set[int]:
        """Replica indexes holding every acknowledged record: this one and the backups in sync."""
        return {self.index} | {i for i, link in self.links.items() if link.in_sync}

    # ------------------------------------------------------------------ the stream
    def _on_append(self, payloads: list[bytes]) -> None:
        wal = self.engine.wal
        assert wal is not None
        last = wal.next_sequence - 1
        for link in self.links.values():
            if link.buffering:
                link.pending.append((last, payloads))
                link.wake.set()

    async def _set_sync(self, link: _Link, in_sync: bool) -> None:
        """Move ``link`` into or out of the set in sync, recording it first."""
        async with self._sync_lock:
            if link.in_sync == in_sync:
                return
            members = self.in_sync()
            members = members | {link.index} if in_sync else members - {link.index}
            if self.sync_changed is not None and not await self.sync_changed(members):
                self.depose("the authority no longer names it primary")
                return
            link.in_sync = in_sync
            logger.info(
                "shard %d: backup %d (%s) %s sync",
                self.shard_index,
                link.index,
                link.address,
                "in" if in_sync else "out of",
            )
            self._notify()

    async def _run_link(self, link: _Link) -> None:
        while self.deposed is None:
            try:
                await self._stream(link)
            except asyncio.CancelledError:
                raise
            except StaleEpoch as exc:
                self.depose(exc.message)
                return
            except Exception as exc:  # the backup is gone or refused: out of sync, seed again
                self.streams_lost += 1
                link.failures += 1
                logger.log(
                    logging.WARNING if link.failures == 1 else logging.DEBUG,
                    "shard %d: stream to backup %d (%s) broke: %s",
                    self.shard_index,
                    link.index,
                    link.address,
                    _describe(exc),
                )
            link.buffering = False
            link.pending.clear()
            await self._set_sync(link, False)
            await asyncio.sleep(RECONNECT_S)

    async def _stream(self, link: _Link) -> None:
        engine = self.engine
        channel = open_channel(link.address, self.security)
        try:
            stub = rpb_grpc.ReplicationStub(channel)
            call = stub.Replicate()
            await call.write(
                rpb.ReplicateRequest(
                    epoch=self.epoch,
                    hello=rpb.ReplicaHello(
                        shard_index=self.shard_index,
                        primary_index=self.index,
                        primary_address=self.address,
                    ),
                )
            )
            # The seed: one consistent cut at the log's last sequence; every record after it
            # is buffered for this link from here on (no await in between).
            async with engine.offload.quiesced():
                assert engine.wal is not None
                sequence = engine.wal.next_sequence - 1
                snap = self.checkpoints.snapshot(engine.core, wal_sequence=sequence)
                link.pending.clear()
                link.buffering = True
                link.seed_sequence = sequence
                link.acked = 0
            manifest, data = await asyncio.to_thread(encode_seed, snap)
            link.sent.clear()
            reader = asyncio.get_running_loop().create_task(self._acks(link, call))
            # A write blocked on a backup that stopped reading ends when the acks give up.
            reader.add_done_callback(lambda _: call.cancel())
            try:
                await self._send_seed(call, sequence, manifest, data)
                self.seeds_sent += 1
                while True:
                    if reader.done():
                        reader.result()  # raises what ended the acks
                        raise ConnectionError("the backup ended the stream")
                    if not link.pending:
                        link.wake.clear()
                        waiting = asyncio.ensure_future(link.wake.wait())
                        await asyncio.wait({waiting, reader}, return_when=asyncio.FIRST_COMPLETED)
                        waiting.cancel()
                        continue
                    batches, link.pending = link.pending, []
                    for last, payloads in batches:
                        await call.write(
                            rpb.ReplicateRequest(
                                epoch=self.epoch, records=rpb.ReplicaRecords(records=payloads)
                            )
                        )
                        link.sent.append((last, time.monotonic()))
            finally:
                await cancelled(reader)
                call.cancel()
        finally:
            await channel.close()

    async def _send_seed(
        self, call: _ReplicateCall, sequence: int, manifest: bytes, data: bytes
    ) -> None:
        view = memoryview(data)
        first = True
        while first or view:
            chunk, view = view[:SEED_CHUNK_BYTES], view[SEED_CHUNK_BYTES:]
            seed = rpb.ReplicaSeed(tensors=bytes(chunk), last=not view)
            if first:
                seed.wal_sequence = sequence
                seed.manifest_json = manifest
                first = False
            await call.write(rpb.ReplicateRequest(epoch=self.epoch, seed=seed))

    async def _acks(self, link: _Link, call: _ReplicateCall) -> None:
        """Read the backup's acknowledgments; raise TimeoutError when a backup in sync has
        acknowledged nothing sent :data:`ACK_TIMEOUT_S` ago (it is then taken out of sync)."""
        read = asyncio.get_running_loop().create_task(self._read_acks(link, call))
        try:
            while not read.done():
                await asyncio.wait({read}, timeout=ACK_TIMEOUT_S / 4)
                if read.done():
                    break
                if link.in_sync and link.sent:
                    waited = time.monotonic() - link.sent[0][1]
                    if waited > ACK_TIMEOUT_S:
                        raise TimeoutError(
                            f"backup {link.index} acknowledged nothing for {waited:.1f} s"
                        )
            read.result()
        finally:
            await cancelled(read)

    async def _read_acks(self, link: _Link, call: _ReplicateCall) -> None:
        try:
            async for ack in call:
                if ack.epoch > self.epoch:
                    raise StaleEpoch(
                        f"backup {link.index} has seen epoch {ack.epoch} > {self.epoch}"
                    )
                link.acked = max(link.acked, int(ack.durable_sequence))
                while link.sent and link.sent[0][0] <= link.acked:
                    link.sent.popleft()
                if not link.in_sync and link.acked >= link.seed_sequence >= 0:
                    link.failures = 0
                    await self._set_sync(link, True)
                self._notify()
        except grpc.aio.AioRpcError as err:
            trailers = dict(err.trailing_metadata() or ())
            if trailers.get(ERROR_CLASS_METADATA_KEY) == "StaleEpoch":
                raise StaleEpoch(err.details() or "stale epoch") from err
            raise


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    if isinstance(exc, ParamServerError):
        return exc.message
    return repr(exc)


# ------------------------------------------------------------------------------ backup
class Backup:
    """The backup side: applies a primary's stream into this replica's core and log.

    Args:
        engine: This replica's engine (its log open; not serving clients).
        checkpoints: Where a seed is written as a checkpoint.
        shard_index: The shard (a stream for another shard is refused).
        index: This replica's index.
    """

    def __init__(
        self, engine: ServerEngine, checkpoints: CheckpointManager, *, shard_index: int, index: int
    ) -> None:
        self.engine = engine
        self.checkpoints = checkpoints
        self.shard_index = shard_index
        self.index = index
        #: The highest primary epoch seen (a stream of an older one is refused).
        self.epoch = 0
        #: The current primary's client address and index, as its hello said.
        self.primary_address = ""
        self.primary_index = -1
        #: Whether this replica accepts streams (False while it is primary itself).
        self.accepting = True
        #: Awaited when a primary of a newer epoch connects while this replica is primary
        #: (it was deposed without noticing yet): it must step down first.
        self.on_newer_epoch: Callable[[int], Awaitable[None]] | None = None
        self.seeds_applied = 0
        self.records_applied = 0
        #: A primary's stream was accepted since this process started: the primary that sent
        #: it (elected after any earlier one) decides whether this replica is in sync.
        self.followed = False
        self._stream_no = 0

    def observe_epoch(self, epoch: int) -> None:
        """Remember ``epoch`` (this replica promoted under it, or the authority named it)."""
        self.epoch = max(self.epoch, epoch)

    def _check(self, epoch: int, stream_no: int) -> None:
        if epoch < self.epoch:
            raise StaleEpoch(
                f"replica {self.index} of shard {self.shard_index} has seen epoch {self.epoch}; "
                f"a primary of epoch {epoch} was deposed"
            )
        if stream_no != self._stream_no:
            raise StaleEpoch(f"replica {self.index}: a newer stream replaced this one")
        if not self.accepting:
            raise NotPrimary(f"replica {self.index} is primary of shard {self.shard_index}")

    async def serve(
        self,
        requests: AsyncIterator[rpb.ReplicateRequest],
        send: Callable[[rpb.ReplicaAck], Awaitable[None]],
    ) -> None:
        """Handle one Replicate stream until it ends.

        Raises:
            StaleEpoch: (FAILED_PRECONDITION) the sender's epoch is older than one seen.
            InvalidArgument: a stream that does not start with a hello for this shard.
        """
        engine = self.engine
        first = await anext(aiter(requests), None)
        if first is None:
            return
        if first.WhichOneof("body") != "hello" or first.hello.shard_index != self.shard_index:
            raise InvalidArgument(
                f"replication stream to shard {self.shard_index} must start with its hello"
            )
        if not self.accepting and first.epoch > self.epoch and self.on_newer_epoch is not None:
            await self.on_newer_epoch(first.epoch)
        self._check(first.epoch, self._stream_no)
        self.epoch = max(self.epoch, first.epoch)
        self._stream_no += 1
        self.followed = True
        mine = self._stream_no
        self.primary_address = first.hello.primary_address
        self.primary_index = first.hello.primary_index
        logger.info(
            "replica %d of shard %d follows primary %d (%s), epoch %d",
            self.index,
            self.shard_index,
            self.primary_index,
            self.primary_address,
            first.epoch,
        )
        appended = 0
        acked = -1  # a seed at sequence 0 (an empty log) is acknowledged too
        more = asyncio.Event()
        failure: list[BaseException] = []

        async def acker() -> None:
            nonlocal acked
            wal = engine.wal
            assert wal is not None
            while True:
                await more.wait()
                more.clear()
                target = appended
                if target <= acked:
                    continue
                if target > 0:
                    await wal.durable(target)
                acked = target
                await send(rpb.ReplicaAck(durable_sequence=target, epoch=self.epoch))

        seed_parts: list[bytes] = []
        seed_head: rpb.ReplicaSeed | None = None
        ack_task = asyncio.get_running_loop().create_task(acker())
        try:
            async for req in requests:
                if ack_task.done():
                    failure.append(ack_task.exception() or ConnectionError("acks ended"))
                    break
                self._check(req.epoch, mine)
                which = req.WhichOneof("body")
                if which == "seed":
                    if seed_head is None:
                        seed_head = req.seed
                    seed_parts.append(req.seed.tensors)
                    if req.seed.last:
                        appended = await self._apply_seed(seed_head, b"".join(seed_parts))
                        seed_parts, seed_head = [], None
                        more.set()
                elif which == "records":
                    appended = self._apply_records(list(req.records.records))
                    more.set()
            if failure:
                raise failure[0]
        finally:
            # Let the last acknowledgment out when the stream ends normally.
            await cancelled(ack_task)

    async def _apply_seed(self, head: rpb.ReplicaSeed, data: bytes) -> int:
        engine = self.engine
        wal = engine.wal
        assert wal is not None
        snap = await asyncio.to_thread(decode_seed, head.manifest_json, data)
        sequence = int(head.wal_sequence)
        # Old records (perhaps another history) go first: a crash before the seed's
        # checkpoint commits restarts from an older state, never from a mixture.
        async with engine.offload.quiesced():
            wal.restart_at(sequence)
            core = reset_core(engine)
            CheckpointManager._apply(core, snap.tensors, snap.manifest)
        await asyncio.to_thread(self.checkpoints.write, snap)
        engine.notify()
        self.seeds_applied += 1
        logger.info(
            "replica %d of shard %d seeded at sequence %d (%d tensors)",
            self.index,
            self.shard_index,
            sequence,
            len(snap.tensors),
        )
        return sequence

    def _apply_records(self, payloads: list[bytes]) -> int:
        engine = self.engine
        wal = engine.wal
        assert wal is not None
        records = []
        for payload in payloads:
            record = wal_pb.WalRecord()
            record.ParseFromString(payload)
            records.append(record)
        last = wal.append_copies(
            [(int(r.sequence), p) for r, p in zip(records, payloads, strict=True)]
        )
        replay_into(engine.core, iter(records))
        engine.notify()
        self.records_applied += len(records)
        return last


class Replica:
    """One replica of a shard: a backup, or the primary under an epoch; the engine's
    :class:`~paramserver.server.engine.ReplicaRole`.

    Args:
        engine: The replica's engine (state recovered, log open).
        checkpoints: Its checkpoint directory.
        shard_index: The shard.
        index: This replica's index.
        addresses: Every replica's client address, by index.
        security: Client security towards the other replicas.
        set_health: Awaited with True when this replica starts serving clients as primary,
            False when it stops.
    """

    def __init__(
        self,
        engine: ServerEngine,
        checkpoints: CheckpointManager,
        *,
        shard_index: int,
        index: int,
        addresses: tuple[str, ...],
        security: ClientSecurity | None = None,
        set_health: Callable[[bool], Awaitable[None]] | None = None,
    ) -> None:
        self.engine = engine
        self.checkpoints = checkpoints
        self.shard_index = shard_index
        self.index = index
        self.addresses = addresses
        self.security = security
        self.set_health = set_health
        self.backup = Backup(engine, checkpoints, shard_index=shard_index, index=index)
        self.backup.on_newer_epoch = self._newer_primary
        self.primary: Primary | None = None
        #: This process restored state from its own disk (a checkpoint or log records) at start.
        #: A replica that did not, and that no primary has streamed to yet, holds none of the
        #: shard's state, whatever the last recorded in-sync set says of its index.
        self.recovered = False
        #: Promotions of this replica (its epochs, in order).
        self.epochs: list[int] = []
        #: Why this replica stopped being primary (None: never deposed).
        self.deposed: str | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def epoch(self) -> int:
        return self.backup.epoch

    @property
    def holds_state(self) -> bool:
        """Whether this replica may stand for election when the in-sync set names it: it
        restored its own durable state, or a primary has streamed to it since it started.

        A replica placed again with an empty disk (its node lost) keeps its index, so an
        in-sync set recorded before the loss still names it; elected, it would serve an empty
        shard and lose every acknowledged update.
        """
        return self.recovered or self.backup.followed

    # ------------------------------------------------------------------ ReplicaRole
    def check_primary(self) -> None:
        if self.primary is None:
            where = self.backup.primary_address or "not known yet"
            was = f", deposed: {self.deposed}" if self.deposed else ""
            raise NotPrimary(
                f"replica {self.index} of shard {self.shard_index} is a backup "
                f"(primary: {where}{was}); retry at the shard's primary"
            )
        self.primary.check_primary()

    async def replicated(self, sequence: int) -> None:
        primary = self.primary
        if primary is None:
            self.check_primary()
            return
        await primary.replicated(sequence)

    def move(self, index: int, address: str) -> None:
        """Replica ``index`` now serves at ``address`` (it was placed again on another host):
        the primary's stream to it reconnects there."""
        if self.addresses[index] == address:
            return
        logger.warning(
            "shard %d: replica %d moved from %s to %s",
            self.shard_index,
            index,
            self.addresses[index],
            address,
        )
        self.addresses = (*self.addresses[:index], address, *self.addresses[index + 1 :])
        if self.primary is not None and index in self.primary.links:
            self.primary.links[index].address = address

    # ------------------------------------------------------------------ roles
    async def promote(
        self, epoch: int, sync_changed: Callable[[set[int]], Awaitable[bool]] | None = None
    ) -> Primary:
        """Become primary under ``epoch``: stream to every other replica, serve clients.

        Every live worker's lease restarts now (they renewed it at the old primary).
        """
        engine = self.engine
        self.backup.accepting = False
        self.backup.observe_epoch(epoch)
        self.epochs.append(epoch)
        cluster = engine.core.cluster
        now = engine.now()
        for worker in cluster.live_workers():
            worker.lease_expiry_s = now + cluster.lease_s
        primary = Primary(
            engine,
            self.checkpoints,
            epoch=epoch,
            shard_index=self.shard_index,
            index=self.index,
            address=self.addresses[self.index],
            backups={i: a for i, a in enumerate(self.addresses) if i != self.index},
            security=self.security,
            sync_changed=sync_changed,
            on_deposed=self._deposed,
        )
        self.primary = primary
        primary.start()
        engine.start()  # the lease reaper: a primary evicts, backups copy its evictions
        logger.warning(
            "replica %d of shard %d is primary (epoch %d)", self.index, self.shard_index, epoch
        )
        if self.set_health is not None:
            await self.set_health(True)
        return primary

    async def demote(self, why: str) -> None:
        """Stop being primary: nothing more is acknowledged or served; accept a newer
        primary's stream (which seeds this replica again)."""
        primary, self.primary = self.primary, None
        if primary is None:
            return
        primary.depose(why)
        self.deposed = why
        # Without the primary, check_primary refuses every call from here on.
        self.primary = None
        if self.set_health is not None:
            await self.set_health(False)
        await primary.stop()
        # The lease reaper only (ServerEngine.stop also closes the apply threads).
        await super(type(self.engine), self.engine).stop()
        self.backup.accepting = True

    async def _newer_primary(self, epoch: int) -> None:
        await self.demote(f"a primary of epoch {epoch} connected")

    def _deposed(self, why: str) -> None:
        task = asyncio.get_running_loop().create_task(self.demote(why))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self) -> None:
        if self.primary is not None:
            await self.primary.stop()
        for task in list(self._tasks):
            await cancelled(task)


class ReplicationServicer(rpb_grpc.ReplicationServicer):
    """The ``Replication`` service of a replica (decode, call, encode)."""

    def __init__(self, backup: Backup) -> None:
        self.backup = backup

    async def Replicate(  # type: ignore[override]  # writes through context.write, yields none
        self, request_iterator: AsyncIterator[rpb.ReplicateRequest], context: ServicerContext
    ) -> None:
        try:
            await self.backup.serve(request_iterator, context.write)
        except ParamServerError as exc:  # its status code, its class in the trailers
            context.set_trailing_metadata(((ERROR_CLASS_METADATA_KEY, type(exc).__name__),))
            await context.abort(exc.code, exc.message)


def add_to_server(servicer: ReplicationServicer, server: grpc.aio.Server) -> None:
    rpb_grpc.add_ReplicationServicer_to_server(servicer, server)


__all__ = [
    "SERVICE_NAME",
    "Backup",
    "Primary",
    "Replica",
    "ReplicationServicer",
    "add_to_server",
    "decode_seed",
    "encode_seed",
    "reset_core",
]
