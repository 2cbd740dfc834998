"""The worker client of a cluster of one or many shards (what :func:`connect` returns).

:class:`ClusterWorkerClient` is a composite over per-shard
:class:`~paramserver.worker_client.client.WorkerClient` objects: it asks the server it is given
for the cluster's shard map (``GetShardMap``) when it opens. A single-shard cluster is one
``WorkerClient`` (every call is that client's). Over S > 1 shards, a
:class:`~paramserver.worker_client.sharded.ShardedWorkerClient` opens one ``WorkerClient`` per
shard and routes every call over them (how each call is split, fanned out and merged: that
module). Either way the session is this one object, so callers never see the difference.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Unpack

import grpc
import numpy as np
import numpy.typing as npt
from numpy.typing import ArrayLike

from paramserver.api.v1 import parameter_server_pb2 as pb
from paramserver.api.v1 import parameter_server_pb2_grpc as pb_grpc
from paramserver.closing import AsyncClosing
from paramserver.core.optimizers import UpdateRule
from paramserver.core.sharding import ShardMap, shard_map_from_proto
from paramserver.core.tables import TableSpec
from paramserver.protocol.addresses import replicas_moved
from paramserver.protocol.keepalive import ChannelOption
from paramserver.security.tls import ClientSecurity, open_channel
from paramserver.waiting import Wait
from paramserver.worker_client.client import PushAck, WorkerClient, WorkerProgress
from paramserver.worker_client.compression import GradientCompressor
from paramserver.worker_client.embedding import RowPushAck, ValidatedRows
from paramserver.worker_client.forwarding import Forwarded
from paramserver.worker_client.keyed import TableIds
from paramserver.worker_client.options import (
    ClientOptions,
    PullOptions,
    PullRowsManyOptions,
    PushOptions,
    PushPullOptions,
    ValidatedPullOptions,
)
from paramserver.worker_client.pull_buffers import PullBuffers
from paramserver.worker_client.pull_waits import PullWatch
from paramserver.worker_client.retry import RetryPolicy, call_with_retry
from paramserver.worker_client.sharded import ShardedWorkerClient, merge_views
from paramserver.worker_client.transport.session_stream import SessionTransport

__all__ = [
    "ClusterWorkerClient",
    "ShardedWorkerClient",
    "connect",
    "connect_cluster",
    "fetch_shard_map",
    "merge_views",
]

logger = logging.getLogger(__name__)


async def fetch_shard_map(
    address: str,
    *,
    retry: RetryPolicy | None = None,
    timeout_s: float = 10.0,
    channel_options: Sequence[ChannelOption] = (),
    security: ClientSecurity | None = None,
) -> ShardMap | None:
    """Ask the server at ``address`` for the cluster's shard map (over TLS / with a token as
    ``security`` says).

    Retries UNAVAILABLE / RESOURCE_EXHAUSTED with backoff (the server may still be starting).

    Returns:
        The map, or None when the server predates shard maps (UNIMPLEMENTED).

    Raises:
        ParamServerError: the mapped error once the retry deadline has passed.
    """
    async with open_channel(address, security, channel_options) as channel:
        stub = pb_grpc.ParameterServerStub(channel)

        async def attempt() -> ShardMap | None:
            try:
                resp = await stub.GetShardMap(pb.GetShardMapRequest(), timeout=timeout_s)
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                    return None
                raise
            return shard_map_from_proto(resp)

        return await call_with_retry(attempt, retry or RetryPolicy(), "shard map", target=address)


class ClusterWorkerClient(AsyncClosing):
    """A worker session with a parameter server of one or many shards (what
    :func:`~paramserver.worker_client.connect` returns).

    On open it asks ``address`` for the shard map: a single-shard server is served by one
    :class:`WorkerClient`, a cluster of S > 1 shards by a :class:`ShardedWorkerClient` over one
    ``WorkerClient`` per shard; every call is that client's.

    Args:
        address: ``host:port`` of any shard of the cluster.
        worker_name: Stable name; registered on every shard.
        discover: Ask for the shard map (False: talk to ``address`` alone, as one shard).
        **options: Those of :class:`WorkerClient`
            (:class:`~paramserver.worker_client.options.ClientOptions`); every per-shard
            client gets them. Checked here (e.g. InvalidArgument, INVALID_ARGUMENT, for a bad
            ``pull_buffer_max_bytes``).

    Attributes:
        shard_map: The map in use once open (None: a single-shard server).
        shards: The per-shard clients once open (one for a single-shard server).
    """

    def __init__(
        self,
        address: str,
        worker_name: str,
        *,
        discover: bool = True,
        **options: Unpack[ClientOptions],
    ) -> None:
        self.discover = discover
        #: Makes the client of one shard, given its address: every shard gets the options.
        self._client_of = functools.partial(WorkerClient, worker_name=worker_name, **options)
        #: The client of ``address`` itself: the whole session when the server has one shard.
        self.client = self._client_of(address)
        self._api: WorkerClient | ShardedWorkerClient = self.client
        self.shard_map: ShardMap | None = None
        self.shards: list[WorkerClient] = []
        #: Reports pulls the servers hold for long (whom they wait for).
        self._pull_watch = PullWatch(self, self.client.wait_timeout_s)

    @property
    def sharded(self) -> bool:
        """True when talking to a cluster of more than one shard (while open)."""
        return len(self.shards) > 1

    # ------------------------------------------------------------------ lifecycle
    async def open(self) -> None:
        """Fetch the shard map, then open one session per shard (or the one client's).

        Connecting is a wait a person can see (:mod:`paramserver.waiting`): when it lasts,
        ``waiting for ADDRESS (connection refused; retrying until HH:MM:SS, N s left)`` is
        logged once at INFO (and handed to the wait hook every few seconds).
        """
        retry = self.client.retry
        with Wait(
            self.address,
            address=self.address,
            detail="no answer yet",
            deadline=time.monotonic() + retry.deadline_s,
            until="retrying until",
            logger=logger,
        ):
            await self._open()

    async def _open(self) -> None:
        single = self.client
        if self.discover:
            shard_map = await fetch_shard_map(
                self.address,
                retry=single.retry,
                timeout_s=single.rpc_timeout_s,
                channel_options=single.channel_options,
                security=single.security,
            )
            if shard_map is not None and shard_map.num_shards > 1:
                clients = [self._client_of(addr) for addr in shard_map.addresses]
                sharded = ShardedWorkerClient(shard_map, clients)
                await sharded.open()
                self.shard_map, self.shards, self._api = shard_map, clients, sharded
                return
            if shard_map is not None and replicas_moved(self.address, shard_map.addresses[0]):
                single.address = shard_map.addresses[0]  # a replica serves elsewhere now
        await single.open()
        self.shards = [single]

    async def close(self) -> None:
        """Leave every shard and close every channel (the worker's state stays readable)."""
        self._pull_watch.close()
        self.shards = []
        await self._api.close()

    # ------------------------------------------------------------------ state
    address = Forwarded[str]("client", "``host:port`` the session was opened with.")
    worker_name = Forwarded[str]("client", "The worker's stable name (the same on every shard).")
    worker_id = Forwarded[str]("_api", "The worker's id (a sharded cluster: the first shard's).")
    clock_value = Forwarded[int]("_api", "The worker's clock (one number cluster-wide).")
    view = Forwarded[pb.ClusterView | None](
        "_api", "The cluster as last seen (merged over shards: fewest live, lowest clock)."
    )
    last_version = Forwarded[int]("_api", "Parameter version of the last pull (shards: summed).")
    lease_ms = Forwarded[int]("_api", "The lease in milliseconds (shards: the shortest).")
    evicted = Forwarded[bool]("_api", "The server (some shard) evicted the worker.")
    reregistrations = Forwarded[int](
        "_api", "Re-registrations after a server forgot the worker (shards: summed)."
    )
    stub = Forwarded["pb_grpc.ParameterServerAsyncStub"](
        "client", "The single shard's stub (the client must be open)."
    )
    fastpath = Forwarded[SessionTransport | None](
        "client", "The single shard's Session transport (None: ``session=False``)."
    )
    pull_buffers = Forwarded[PullBuffers]("client", "The single shard's recycled pull memory.")
    compressor = Forwarded[GradientCompressor]("client", "The single shard's compressor.")

    # ------------------------------------------------------------------ calls
    async def register(self, *, replace: bool | None = None, resume_worker_id: str = "") -> int:
        """:meth:`WorkerClient.register` (on every shard)."""
        return await self._api.register(replace=replace, resume_worker_id=resume_worker_id)

    async def heartbeat(self) -> pb.HeartbeatResponse:
        """:meth:`WorkerClient.heartbeat` (on every shard)."""
        return await self._api.heartbeat()

    async def leave(self) -> None:
        """:meth:`WorkerClient.leave` (on every shard)."""
        await self._api.leave()

    def require_member(self) -> None:
        """:meth:`WorkerClient.require_member` (over every shard)."""
        self._api.require_member()

    async def wait_for_workers(self, n: int, *, timeout_s: float = 60.0) -> int:
        """:meth:`WorkerClient.wait_for_workers` (the start barrier)."""
        return await self._api.wait_for_workers(n, timeout_s=timeout_s)

    async def init(
        self, tensors: Mapping[str, np.ndarray], rule: UpdateRule | None = None
    ) -> dict[str, np.ndarray]:
        """:meth:`WorkerClient.init` (declared over the shards: first writer wins per key)."""
        return await self._api.init(tensors, rule)

    async def push(
        self, grads: Mapping[str, np.ndarray], **options: Unpack[PushOptions]
    ) -> PushAck:
        """:meth:`WorkerClient.push` (split like the keys over the shards)."""
        return await self._api.push(grads, **options)

    async def pull(
        self, keys: Iterable[str] | None = None, **options: Unpack[PullOptions]
    ) -> dict[str, np.ndarray]:
        """:meth:`WorkerClient.pull` (reassembled from every shard holding a part). A pull the
        servers hold for long is reported, naming whom it waits for
        (:mod:`paramserver.worker_client.pull_waits`)."""
        watch = self._pull_watch
        if options.get("observer") or not watch.may_wait():
            return await self._api.pull(keys, **options)
        watch.enter(options.get("timeout_s"))
        try:
            return await self._api.pull(keys, **options)
        finally:
            watch.exit()

    async def push_pull(
        self,
        grads: Mapping[str, np.ndarray],
        keys: Iterable[str] | None = None,
        **options: Unpack[PushPullOptions],
    ) -> dict[str, np.ndarray]:
        """:meth:`WorkerClient.push_pull` (over several shards: a push, then a pull); reported
        as :meth:`pull` when the servers hold it for long."""
        watch = self._pull_watch
        if not watch.may_wait():
            return await self._api.push_pull(grads, keys, **options)
        watch.enter(options.get("timeout_s"))
        try:
            return await self._api.push_pull(grads, keys, **options)
        finally:
            watch.exit()

    async def clock(self) -> int:
        """:meth:`WorkerClient.clock` (on every shard)."""
        return await self._api.clock()

    async def status(self) -> pb.StatusResponse:
        """:meth:`WorkerClient.status` (over several shards: counters summed, keys whole)."""
        return await self._api.status()

    async def progress(self, worker_name: str | None = None) -> WorkerProgress:
        """:meth:`WorkerClient.progress`: what the registrations of ``worker_name`` (default:
        this worker's) completed, over every shard."""
        return await self._api.progress(worker_name)

    async def shard_statuses(self) -> list[pb.StatusResponse]:
        """Every shard's own status, in shard order."""
        if isinstance(self._api, ShardedWorkerClient):
            return await self._api.shard_statuses()
        return [await self._api.status()]

    async def init_table(self, spec: TableSpec) -> tuple[bool, TableSpec]:
        """:meth:`WorkerClient.init_table` (on every shard)."""
        return await self._api.init_table(spec)

    async def pull_rows(
        self, table: str, ids: ArrayLike, *, timeout_s: float | None = None, observer: bool = False
    ) -> np.ndarray:
        """:meth:`WorkerClient.pull_rows` (from the rows' shards concurrently)."""
        return await self._api.pull_rows(table, ids, timeout_s=timeout_s, observer=observer)

    async def push_rows(
        self, table: str, ids: ArrayLike, grads: ArrayLike, *, timeout_s: float | None = None
    ) -> RowPushAck:
        """:meth:`WorkerClient.push_rows` (split by shard, one request id)."""
        return await self._api.push_rows(table, ids, grads, timeout_s=timeout_s)

    async def push_pull_rows(
        self,
        table: str,
        push_ids: ArrayLike,
        grads: ArrayLike,
        pull_ids: ArrayLike,
        *,
        timeout_s: float | None = None,
    ) -> np.ndarray:
        """:meth:`WorkerClient.push_pull_rows` (one call per shard, one request id)."""
        return await self._api.push_pull_rows(table, push_ids, grads, pull_ids, timeout_s=timeout_s)

    async def pull_rows_many(
        self, ids: TableIds, **options: Unpack[PullRowsManyOptions]
    ) -> dict[str, np.ndarray]:
        """:meth:`WorkerClient.pull_rows_many` (one request per shard, concurrently)."""
        return await self._api.pull_rows_many(ids, **options)

    async def pull_rows_validated(
        self,
        ids: Mapping[str, npt.NDArray[np.int64]],
        held: Mapping[str, npt.NDArray[np.int64]],
        **options: Unpack[ValidatedPullOptions],
    ) -> dict[str, ValidatedRows]:
        """:meth:`WorkerClient.pull_rows_validated` (one request per shard, concurrently)."""
        return await self._api.pull_rows_validated(ids, held, **options)

    async def push_rows_many(
        self, ids: TableIds, grads: Mapping[str, ArrayLike], *, timeout_s: float | None = None
    ) -> dict[str, RowPushAck]:
        """:meth:`WorkerClient.push_rows_many` (one request per shard, all or nothing on
        each shard)."""
        return await self._api.push_rows_many(ids, grads, timeout_s=timeout_s)


def connect(
    address: str, worker_name: str, *, discover: bool = True, **options: Unpack[ClientOptions]
) -> ClusterWorkerClient:
    """Open a worker session: ``async with connect(addr, worker_name="w0") as ps: ...``.

    ``address`` may be any shard of a sharded cluster: the session asks it for the shard map
    on open and routes every call over the shards (see
    :class:`paramserver.worker_client.cluster.ClusterWorkerClient`; ``discover=False`` talks
    to ``address`` alone). The other keyword arguments are those of :class:`WorkerClient`
    (:class:`~paramserver.worker_client.options.ClientOptions`).
    """
    return ClusterWorkerClient(address, worker_name, discover=discover, **options)


def connect_cluster(
    address: str, worker_name: str, *, discover: bool = True, **options: Unpack[ClientOptions]
) -> ClusterWorkerClient:
    """Open a session with the cluster that serves ``address`` (any shard): ``async with``
    (the same as :func:`~paramserver.worker_client.connect`)."""
    return connect(address, worker_name, discover=discover, **options)
