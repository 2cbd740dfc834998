"""The session lifecycle the worker clients share: open a channel, register, renew the lease in
the background, and on close stop the heartbeats, leave cleanly (within a bound, when one is
set) and close the channel.

:class:`ServiceSession` is subclassed by :class:`~paramserver.worker_client.client.WorkerClient`
(the parameter-server service) and :class:`~paramserver.reduction.reduce_client.ReductionClient`
(the reduction service); each supplies its stub, its register call and its heartbeat and leave
requests, and decides what an eviction seen by the heartbeats means.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from abc import abstractmethod
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Any, ClassVar, Generic, TypeVar

import grpc
from google.protobuf.message import Message

from paramserver.closing import AsyncClosing, cancelled
from paramserver.errors import AlreadyExists, OptionHint, ParamServerError, WorkerNotFound
from paramserver.protocol.keepalive import ChannelOption
from paramserver.security.tls import ClientSecurity, open_channel
from paramserver.worker_client.retry import RETRYABLE, RetryPolicy, call_with_retry

logger = logging.getLogger(__name__)

T = TypeVar("T")
StubT = TypeVar("StubT")

#: What to do about a name that is live elsewhere (a killed worker's registration whose lease
#: has not lapsed yet): ``replace=True`` from Python, ``--replace`` on the command line.
REPLACE_HINT = OptionHint(
    "replace",
    "pass {option} to fence it now (a restarted worker), or start again once its lease has lapsed",
)


def name_taken(exc: AlreadyExists) -> AlreadyExists:
    """A registration's ALREADY_EXISTS as the client raises it: the server's words (whose the
    name is, when its lease lapses) with :data:`REPLACE_HINT`."""
    return exc if exc.hint is not None else exc.with_hint(REPLACE_HINT)


class ServiceSession(AsyncClosing, Generic[StubT]):
    """One worker's session with a service: channel, registration and lease.

    Args:
        address: ``host:port`` of the server.
        worker_name: Stable name; one live registration per name.
        replace: Fence a live registration of the same name (a restarted worker).
        rpc_timeout_s: Deadline of each unary call, seconds.
        wait_timeout_s: Default deadline of the service's waits, seconds.
        retry: Backoff policy for UNAVAILABLE / RESOURCE_EXHAUSTED.
        heartbeat: Renew the lease in the background.
        close_timeout_s: Deadline (seconds) of the clean Leave sent by :meth:`close`; None: no
            bound beyond the retry policy's.
        channel_options: Extra grpc channel options.
        security: TLS / mutual TLS and bearer token of the channel (see
            :mod:`paramserver.security.tls`); None: plain text, no token.
    """

    #: Prefix of the heartbeat task's name (the worker name follows).
    _heartbeat_task_prefix: ClassVar[str]
    #: The function that opens such a session, named when the client is used unopened.
    _connect_name: ClassVar[str]

    #: The server's view as last seen (the service's own view message).
    view: object
    #: Register on open (False: a reader that never registers; no heartbeats, no leave).
    registers: bool = True

    def __init__(
        self,
        address: str,
        worker_name: str,
        *,
        replace: bool = False,
        rpc_timeout_s: float = 30.0,
        wait_timeout_s: float | None = None,
        retry: RetryPolicy | None = None,
        heartbeat: bool = True,
        close_timeout_s: float | None = None,
        channel_options: Sequence[ChannelOption] = (),
        security: ClientSecurity | None = None,
    ) -> None:
        self.address = address
        self.security = security
        self.worker_name = worker_name
        self.replace = replace
        self.rpc_timeout_s = rpc_timeout_s
        self.wait_timeout_s = wait_timeout_s
        self.retry = retry or RetryPolicy()
        self.heartbeat_enabled = heartbeat
        self.close_timeout_s = close_timeout_s
        self.channel_options = list(channel_options)
        self.worker_id = ""
        self.lease_ms = 0
        self.evicted = False
        self._nonce = secrets.token_hex(8)
        self._next_request_id = secrets.randbits(62)
        self._channel: grpc.aio.Channel | None = None
        #: Channels left by :meth:`retarget` (closing once their calls finish), by the task
        #: that closes them.
        self._old_channels: dict[asyncio.Task[None], grpc.aio.Channel] = {}
        self._stub: StubT | None = None
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._left = False

    # ------------------------------------------------------------------ service hooks
    @abstractmethod
    def _new_stub(self, channel: grpc.aio.Channel) -> StubT:
        """The service's stub over ``channel``."""

    @abstractmethod
    async def register(self) -> object:
        """Register with the server (sets ``worker_id`` and ``lease_ms``)."""

    @abstractmethod
    def _heartbeat_request(self) -> Message:
        """The service's heartbeat request for this worker."""

    @abstractmethod
    def _leave_request(self) -> Message:
        """The service's leave request for this worker."""

    def _open_options(self) -> list[ChannelOption]:
        """The options the channel is opened with."""
        return self.channel_options

    async def _heartbeat_evicted(self) -> bool:
        """A heartbeat was refused with FAILED_PRECONDITION: True to keep heartbeating (the
        worker is a member again), False to stop and mark the worker evicted."""
        return False

    def _heartbeat_answered(self, resp: Any) -> None:
        """A heartbeat's answer arrived (the service's hook: e.g. follow moved replicas)."""

    # ------------------------------------------------------------------ membership
    async def _renew_lease(self) -> Any:
        """One Heartbeat now, through the retry funnel; returns the service's response and keeps
        the view it carries.

        Raises:
            WorkerNotFound: (FAILED_PRECONDITION) evicted or departed.
        """
        resp = await self._call(
            lambda: self.stub.Heartbeat(  # type: ignore[attr-defined]
                self._heartbeat_request(), timeout=self.rpc_timeout_s
            ),
            "heartbeat",
        )
        self.view = resp.view
        self._heartbeat_answered(resp)
        return resp

    async def leave(self) -> None:
        """Leave cleanly, at once: no quorum waits for this worker any more (a BSP step of the
        parameter server, every quorum and the gossip directory of the reduction service)."""
        resp = await self._call(
            lambda: self.stub.Leave(  # type: ignore[attr-defined]
                self._leave_request(), timeout=self.rpc_timeout_s
            ),
            "leave",
        )
        self.view = resp.view
        self._left = True

    # ------------------------------------------------------------------ lifecycle
    async def open(self) -> None:
        """Open the channel, register, and start heartbeats (a reader: the channel only)."""
        self._channel = open_channel(self.address, self.security, self._open_options())
        self._stub = self._new_stub(self._channel)
        if not self.registers:
            return
        try:
            await self.register()
        except BaseException:
            await self._channel.close()
            self._channel = None
            raise
        if self.heartbeat_enabled:
            self._heartbeat_task = asyncio.get_running_loop().create_task(
                self._heartbeat_forever(), name=f"{self._heartbeat_task_prefix}{self.worker_name}"
            )

    async def close(self) -> None:
        """Leave (if still a member), stop heartbeats and close the channel."""
        await cancelled(self._heartbeat_task)
        self._heartbeat_task = None
        if self._channel is not None:
            if not self._left and not self.evicted and self.worker_id:
                # A server that is gone must not hold close() for the whole retry deadline:
                # its lease reaper removes the worker anyway.
                try:
                    async with asyncio.timeout(self.close_timeout_s):
                        await self.leave()
                except (ParamServerError, TimeoutError) as exc:
                    logger.debug("leave on close failed: %r", exc)
            await self._channel.close()
            self._channel = None
        for task, channel in list(self._old_channels.items()):
            await cancelled(task)
            await channel.close()

    def retarget(self, address: str) -> None:
        """Send this session's calls to ``address`` from now on (a replicated shard whose
        replica moved to another host): a new channel, the same registration. The old
        channel is closed once its calls in flight finish (at most ``rpc_timeout_s``)."""
        old = self._channel
        if old is None:
            self.address = address
            return
        self._channel = open_channel(address, self.security, self._open_options())
        self._stub = self._new_stub(self._channel)
        logger.warning("%s: now served at %s (was %s)", self.worker_name, address, self.address)
        self.address = address
        task = asyncio.get_running_loop().create_task(old.close(grace=self.rpc_timeout_s))
        self._old_channels[task] = old
        task.add_done_callback(lambda t: self._old_channels.pop(t, None))

    @property
    def stub(self) -> StubT:
        """The service stub (the client must be open)."""
        if self._stub is None:
            raise ParamServerError(
                f"client is not open: use `async with {self._connect_name}(...)`"
            )
        return self._stub

    async def _heartbeat_forever(self) -> None:
        while True:
            await asyncio.sleep(max(self.lease_ms / 4000.0, 0.05))
            try:
                resp = await self.stub.Heartbeat(  # type: ignore[attr-defined]
                    self._heartbeat_request(), timeout=max(self.lease_ms / 2000.0, 0.2)
                )
                self.view = resp.view
                self._heartbeat_answered(resp)
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    logger.warning("worker %s was evicted: %s", self.worker_id, err.details())
                    if not await self._heartbeat_evicted():
                        self.evicted = True
                        return
                    continue
                logger.debug("heartbeat failed: %s", err.code().name)

    # ------------------------------------------------------------------ retry funnel
    async def _call(
        self,
        attempt: Callable[[], Awaitable[T]],
        what: str,
        retryable: Collection[grpc.StatusCode] = RETRYABLE,
    ) -> T:
        return await call_with_retry(attempt, self.retry, what, retryable, target=self.address)

    def require_member(self) -> None:
        """Raise WorkerNotFound (FAILED_PRECONDITION) if heartbeats saw an eviction."""
        if self.evicted:
            raise WorkerNotFound(f"worker {self.worker_id!r} was evicted")
