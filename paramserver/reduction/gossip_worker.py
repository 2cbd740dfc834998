"""Decentralised averaging over the network: push-sum workers that find their peers through the
reduction server (``paramserver serve --mode reduce --reduce-strategy gossip --fanout K``).

Source: Kempe, Dobra and Gehrke, "Gossip-Based Computation of Aggregate Information", FOCS 2003
(Protocol Push-Sum); the math is :class:`paramserver.core.push_sum.PushSumNode`.

Each :class:`GossipWorker` runs a small ``grpc.aio`` endpoint (service ``PushSumPeer``, bound to
``127.0.0.1:0`` by default) that receives shares ``(s, w)`` from its peers, registers that
endpoint's address with the server (the peer directory), and in every round:

1. asks the server for the current peers (``Peers``; it also renews the lease),
2. splits its ``(s, w)`` into ``k + 1`` equal shares (``k = min(fanout, peers)``), keeps one and
   pushes one to each of ``k`` peers drawn uniformly at random, one task per peer,
3. takes back every share that could not be delivered (:meth:`PushSumNode.reclaim`).

Mass is conserved: a receiver absorbs a share exactly once per ``(sender, share_id)`` (retries
reuse the id), a node that has left refuses shares (FAILED_PRECONDITION) so their senders take
them back, and a leaving worker hands its whole mass to a live peer before it leaves the
directory (:meth:`GossipWorker.leave`). So every live estimate ``s / w`` converges to the mean of
all initial values, the departed workers' included. A worker that crashes takes its mass with
it (push-sum cannot recover it); a share whose delivery outcome stays unknown after every retry
is taken back, which double-counts it in the rare case the receiver did absorb it.

Usage::

    async with GossipWorker(server_address, "w0", value) as node:
        for _ in range(rounds):
            await node.run_round()
        mean_estimate = node.estimate()
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator
from typing import Final

import grpc
import numpy as np
import numpy.typing as npt

from paramserver.api.v1 import reduction_pb2 as pb
from paramserver.api.v1 import reduction_pb2_grpc as pb_grpc
from paramserver.core.push_sum import PushSumMessage, PushSumNode
from paramserver.errors import (
    FailedPrecondition,
    InvalidArgument,
    MalformedStream,
    ParamServerError,
    WorkerNotFound,
)
from paramserver.method_handlers import ServicerContext
from paramserver.protocol import headed_stream, tensor
from paramserver.reduction.reduce_client import ReductionClient
from paramserver.security.tls import (
    ClientSecurity,
    ServerSecurity,
    endpoint_security,
    open_channel,
)
from paramserver.serving.bootstrap import start_grpc_server
from paramserver.serving.error_status import grpc_errors

__all__ = ["GossipWorker"]

from paramserver.closing import AsyncClosing

logger = logging.getLogger(__name__)

#: (sender, share id) pairs remembered per node to absorb a retried share once.
DEDUP_WINDOW: Final[int] = 1 << 16

_RETRYABLE: Final[frozenset[grpc.StatusCode]] = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)


_endpoint_of = endpoint_security  # the parameter of GossipWorker shadows the function


class _PushSumEndpoint(pb_grpc.PushSumPeerServicer):
    """The worker's ``PushSumPeer`` service: decode a share, absorb it once."""

    def __init__(self, worker: GossipWorker) -> None:
        self.worker = worker

    @grpc_errors
    async def PushShare(
        self, request_iterator: AsyncIterator[pb.PushShareRequest], context: ServicerContext
    ) -> pb.PushShareResponse:
        # A share is "s" (this node's value shape, float64) and "w" (a float64 scalar): a frame
        # header claiming more is refused before anything is allocated for it.
        limit = max(self.worker.value_nbytes, np.dtype(np.float64).itemsize)
        header, tensors = await headed_stream.read_headed_stream(
            request_iterator, head="header", what="push-sum share", max_tensor_bytes=limit
        )
        if set(tensors) != {"s", "w"} or tensors["w"].shape != ():
            raise MalformedStream(
                f"a push-sum share carries tensors 's' and 'w' (shape ()), got "
                f"{ {k: v.shape for k, v in tensors.items()} }"
            )
        duplicate = self.worker._absorb(
            PushSumMessage(
                sender=header.sender_id,
                receiver=header.receiver_id,
                s=np.asarray(tensors["s"], dtype=np.float64),
                w=float(tensors["w"]),
                round_index=int(header.round_index),
            ),
            int(header.share_id),
            handoff=header.handoff,
        )
        return pb.PushShareResponse(duplicate=duplicate)


class GossipWorker(AsyncClosing):
    """One push-sum participant over gRPC (Kempe et al. 2003).

    Args:
        address: ``host:port`` of a reduction server in gossip mode (the peer directory).
        worker_name: Stable worker name.
        value: Initial value, any shape; averaged in float64.
        host: Interface of this worker's push-sum endpoint (port chosen by the OS).
        seed: Seed of the peer choice (None: fresh entropy).
        rpc_timeout_s: Deadline of each call (directory and shares), seconds.
        share_attempts: Tries per share on UNAVAILABLE / DEADLINE_EXCEEDED before it is
            taken back.
        heartbeat: Renew the lease in the background (rounds renew it too).
        security: TLS / mutual TLS and bearer token towards the directory and the peers
            (:class:`paramserver.security.tls.ClientSecurity`); None: plain text, no token.
        endpoint_security: TLS and tokens of this worker's push-sum endpoint; default
            :func:`paramserver.security.tls.endpoint_security` of ``security`` (the worker's
            certificate and CA, its own token accepted as a worker token).

    Raises:
        InvalidArgument: (INVALID_ARGUMENT) a non-finite value or ``share_attempts < 1``; TLS
            without a certificate of the worker's own and no ``endpoint_security``.

    Attributes:
        node: The push-sum state (None before :meth:`open`).
        fanout: Peers pushed to per round (the server's ``--fanout``).
        rounds: Rounds run.
        received_shares: Shares absorbed (duplicates excluded).
        reclaimed_shares: Own shares taken back because they were not delivered.
    """

    def __init__(
        self,
        address: str,
        worker_name: str,
        value: npt.ArrayLike,
        *,
        host: str = "127.0.0.1",
        seed: int | None = None,
        rpc_timeout_s: float = 5.0,
        share_attempts: int = 3,
        heartbeat: bool = True,
        security: ClientSecurity | None = None,
        endpoint_security: ServerSecurity | None = None,
    ) -> None:
        if share_attempts < 1:
            raise InvalidArgument(f"share_attempts must be >= 1, got {share_attempts}")
        self.security = security
        self.endpoint_security = (
            endpoint_security if endpoint_security is not None else _endpoint_of(security)
        )
        self.address = address
        self.worker_name = worker_name
        self.host = host
        self.rpc_timeout_s = rpc_timeout_s
        self.share_attempts = share_attempts
        self._value = np.array(value, dtype=np.float64)
        if not np.isfinite(self._value).all():
            raise InvalidArgument(f"gossip worker {worker_name!r}: initial value is not finite")
        self._rng = np.random.default_rng(seed)
        self._heartbeat = heartbeat
        self.node: PushSumNode | None = None
        self.fanout = 0
        self.rounds = 0
        self.received_shares = 0
        self.reclaimed_shares = 0
        self.client: ReductionClient | None = None
        self._server: grpc.aio.Server | None = None
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._seen: OrderedDict[tuple[str, int], None] = OrderedDict()
        self._next_share_id = secrets.randbits(62)
        self._lock = asyncio.Lock()
        self._left = False

    # ------------------------------------------------------------------ lifecycle

    @property
    def worker_id(self) -> str:
        """The id the server gave this worker (its push-sum node id); empty before open."""
        return self.client.worker_id if self.client is not None else ""

    @property
    def value_nbytes(self) -> int:
        """Bytes of this node's value as float64 (the size of the "s" of every share)."""
        return int(self._value.nbytes)

    @property
    def endpoint(self) -> str:
        """``host:port`` of this worker's push-sum endpoint (empty before open)."""
        return self.client.gossip_address if self.client is not None else ""

    async def open(self) -> None:
        """Start the push-sum endpoint, register it with the directory, create the node.

        Raises:
            ParamServerError: the endpoint could not bind.
            FailedPrecondition: (FAILED_PRECONDITION) the server is not in gossip mode.
            AlreadyExists: (ALREADY_EXISTS) the name is live.
        """
        sec = self.endpoint_security
        worker = self
        try:
            endpoint = await start_grpc_server(
                f"{self.host}:0",
                lambda server: pb_grpc.add_PushSumPeerServicer_to_server(
                    _PushSumEndpoint(worker), server
                ),
                security=sec,
                interceptors=sec.interceptors() if sec is not None else (),
                health_and_reflection=False,
            )
        except ParamServerError as exc:
            raise ParamServerError(
                f"could not bind a push-sum endpoint on {self.host}:0: {exc.message}"
            ) from exc
        server, port = endpoint.server, endpoint.port
        self._server = server
        client = ReductionClient(
            self.address,
            self.worker_name,
            rpc_timeout_s=self.rpc_timeout_s,
            heartbeat=self._heartbeat,
            gossip_address=f"{self.host}:{port}",
            security=self.security,
        )
        try:
            await client.open()
        except BaseException:
            await server.stop(0)
            self._server = None
            raise
        if client.view is None or client.view.strategy != pb.REDUCTION_STRATEGY_GOSSIP:
            await client.close()
            await server.stop(0)
            self._server = None
            raise FailedPrecondition(
                f"server {self.address} is not a gossip directory "
                "(paramserver serve --mode reduce --reduce-strategy gossip)"
            )
        self.client = client
        self.node = PushSumNode(client.worker_id, self._value)
        self.fanout = int(client.view.fanout) if client.view is not None else 0

    async def close(self) -> None:
        """Leave the directory (without a hand-over if :meth:`leave` was not called), stop the
        endpoint and close every channel."""
        if self.client is not None:
            await self.client.close()
        if self._server is not None:
            await self._server.stop(0)
            self._server = None
        channels, self._channels = self._channels, {}
        for channel in channels.values():
            await channel.close()

    # ------------------------------------------------------------------ push-sum
    def estimate(self) -> npt.NDArray[np.float64]:
        """Current estimate ``s / w`` of the global mean (float64, the value's shape).

        Raises:
            InvalidArgument: (INVALID_ARGUMENT) not open, or the worker has left.
        """
        return self._require_node().estimate()

    async def run_round(self) -> int:
        """One push-sum round: fetch peers, push ``fanout`` shares, take back undelivered ones.

        Do not cancel a round mid-way: shares in flight would be lost.

        Returns:
            Shares delivered.

        Raises:
            InvalidArgument: (INVALID_ARGUMENT) not open, or the worker has left.
            WorkerNotFound: (FAILED_PRECONDITION) evicted from the directory.
            FailedPrecondition: (FAILED_PRECONDITION) the server is not in gossip mode.
        """
        async with self._lock:
            node = self._require_node()
            directory = await self._directory()
            fanout = int(directory.fanout) or self.fanout
            addresses = {p.worker_id: p.address for p in directory.peers}
            messages = node.push(list(addresses), fanout, self._rng)
            delivered = await asyncio.gather(
                *(self._deliver(m, addresses[m.receiver]) for m in messages)
            )
            for message, ok in zip(messages, delivered, strict=True):
                if not ok:
                    node.reclaim(message)
                    self.reclaimed_shares += 1
            self.rounds += 1
            return sum(delivered)

    async def run_rounds(self, rounds: int) -> int:
        """Run ``rounds`` rounds back to back; returns the shares delivered."""
        return sum([await self.run_round() for _ in range(rounds)])

    async def leave(self) -> str | None:
        """Hand the whole mass ``(s, w)`` to a live peer, then leave the directory.

        Waits for a running round to finish. If the chosen heir refuses or cannot be reached,
        the other peers are tried in random order.

        Returns:
            The heir's worker id, or None when no peer took the mass (it leaves with this
            worker; logged as a warning).

        Raises:
            InvalidArgument: (INVALID_ARGUMENT) not open, or already left.
        """
        async with self._lock:
            node = self._require_node()
            client = self._require_client()
            try:
                peers = list((await self._directory()).peers)
            except ParamServerError as exc:
                logger.warning("%s: no peer directory on leave: %s", self.worker_id, exc)
                peers = []
            addresses = {p.worker_id: p.address for p in peers}
            message = node.leave(list(addresses), self._rng)
            heir: str | None = None
            if message is not None:
                others = [p for p in addresses if p != message.receiver]
                order = [
                    message.receiver,
                    *(others[int(i)] for i in self._rng.permutation(len(others))),
                ]
                for receiver in order:
                    handoff = dataclasses.replace(message, receiver=receiver)
                    if await self._deliver(handoff, addresses[receiver], handoff=True):
                        heir = receiver
                        break
            if heir is None:
                logger.warning(
                    "push-sum node %s left without an heir: its mass (w=%.6g) leaves with it",
                    self.worker_id,
                    message.w if message is not None else node.w,
                )
            else:
                logger.debug("push-sum node %s handed its mass to %s", self.worker_id, heir)
            self._left = True
            await client.leave()
            return heir

    # ------------------------------------------------------------------ internals
    def _require_node(self) -> PushSumNode:
        if self.node is None:
            raise InvalidArgument(f"gossip worker {self.worker_name!r} is not open")
        if self.node.departed:
            raise InvalidArgument(f"gossip worker {self.worker_id!r} has left")
        return self.node

    def _require_client(self) -> ReductionClient:
        if self.client is None:
            raise InvalidArgument(f"gossip worker {self.worker_name!r} is not open")
        return self.client

    async def _directory(self) -> pb.PeersResponse:
        return await self._require_client().peers()

    def _stub(self, address: str) -> pb_grpc.PushSumPeerAsyncStub:
        channel = self._channels.get(address)
        if channel is None:
            channel = open_channel(address, self.security)
            self._channels[address] = channel
        return pb_grpc.PushSumPeerStub(channel)

    def _absorb(self, message: PushSumMessage, share_id: int, *, handoff: bool) -> bool:
        """Add a received share once; True if it was a duplicate (called by the endpoint)."""
        node = self.node
        if node is None:
            raise FailedPrecondition(
                f"push-sum node {self.worker_name!r} is not ready; take the share back"
            )
        if node.departed:
            raise WorkerNotFound(f"push-sum node {node.node_id!r} has left; take the share back")
        if message.receiver != node.node_id:
            raise FailedPrecondition(
                f"push-sum share for {message.receiver!r} reached {node.node_id!r}; take it back"
            )
        key = (message.sender, share_id)
        if key in self._seen:
            return True
        node.receive(message)
        self._seen[key] = None
        if len(self._seen) > DEDUP_WINDOW:
            self._seen.popitem(last=False)
        self.received_shares += 1
        if handoff:
            logger.debug("push-sum node %s took over the mass of %s", node.node_id, message.sender)
        return False

    async def _deliver(
        self, message: PushSumMessage, address: str, *, handoff: bool = False
    ) -> bool:
        """Send one share (retrying with the same share id); False if it was not absorbed."""
        share_id = self._next_share_id
        self._next_share_id += 1
        header = pb.PushShareHeader(
            sender_id=message.sender,
            receiver_id=message.receiver,
            share_id=share_id,
            round_index=message.round_index,
            handoff=handoff,
        )
        s = np.ascontiguousarray(message.s, dtype=np.float64)
        w = np.asarray(message.w, dtype=np.float64)

        def frames() -> Iterator[pb.PushShareRequest]:
            yield pb.PushShareRequest(header=header)
            for key, value in (("s", s), ("w", w)):
                for frame in tensor.encode_frames(key, value):
                    yield pb.PushShareRequest(frame=frame)

        stub = self._stub(address)
        delay_s = 0.01
        for attempt in range(1, self.share_attempts + 1):
            try:
                await stub.PushShare(frames(), timeout=self.rpc_timeout_s)
                return True
            except grpc.aio.AioRpcError as err:
                if err.code() in _RETRYABLE and attempt < self.share_attempts:
                    await asyncio.sleep(delay_s)
                    delay_s *= 2
                    continue
                logger.debug(
                    "push-sum share %d from %s to %s at %s not delivered: %s %s",
                    share_id,
                    message.sender,
                    message.receiver,
                    address,
                    err.code().name,
                    err.details(),
                )
                return False
        return False  # pragma: no cover - the loop always returns
