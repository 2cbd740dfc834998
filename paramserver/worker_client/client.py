"""Async worker client: register, push gradients, pull parameters, clock, leave.

Usage::

    async with connect("127.0.0.1:50051", worker_name="w0") as ps:
        await ps.init({"w": np.zeros(10, np.float32)}, rule=UpdateRule("sgd", lr=0.1))
        params = await ps.pull(["w"])          # waits as BSP/SSP require
        await ps.push({"w": grad}, num_samples=32)
        await ps.clock()

Every push carries ``(worker id, request id)``; a push retried after UNAVAILABLE reuses its
request id, so the server applies it at most once. Retries use exponential backoff with full
jitter up to a deadline. A background task renews the lease every quarter lease. No channel is
cached across event loops: the channel is created in ``__aenter__`` on the running loop.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import numpy as np

from paramserver import tensor
from paramserver.api.v1 import parameter_server_pb2 as pb
from paramserver.api.v1 import parameter_server_pb2_grpc as pb_grpc
from paramserver.errors import (
    AlreadyExists,
    InvalidArgument,
    MalformedStream,
    ParamServerError,
    WorkerNotFound,
)
from paramserver.server.optimizers import UpdateRule
from paramserver.worker_client.compression import Compression, GradientCompressor
from paramserver.worker_client.retry import RETRYABLE, RetryPolicy
from paramserver.worker_client.session import ServiceSession

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Longest the client waits for a pull that leaves the wait deadline to the server (seconds).
SERVER_DEFAULT_WAIT_CAP_S = 600.0

_PUSH_RETRYABLE = RETRYABLE | {grpc.StatusCode.DEADLINE_EXCEEDED}

#: Payload bytes per frame sent to the server: 16 KiB under 1 MiB, so a whole message (frame
#: header, key, shape, proto framing) stays within a server receive limit as low as 1 MiB
#: (cases/large-tensor-default-limits.md).
_SEND_CHUNK_BYTES = tensor.DEFAULT_CHUNK_BYTES - (16 << 10)

#: Reconnect soon after a server restart: gRPC's own first reconnect backoff is 1 s (growing
#: 1.6x per failed attempt up to 120 s), which would dominate the time to ride through a
#: restart; the retry funnel above it adds its own backoff and jitter.
_RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


@dataclass(frozen=True)
class PushAck:
    """Server's answer to a push.

    Attributes:
        request_id: The id the push carried.
        duplicate: The server had applied this request id before (a retry); nothing re-applied.
        applied_updates: Server-wide applied pushes after this one (the parameter version).
        dropped_stale: ASP ``max_staleness`` dropped the gradient as too old.
        live_workers: Live members as the server saw them.
    """

    request_id: int
    duplicate: bool
    applied_updates: int
    dropped_stale: bool
    live_workers: int


class WorkerClient(ServiceSession[pb_grpc.ParameterServerStub]):
    """One worker's session with a parameter-server shard.

    Args:
        address: ``host:port`` of the server.
        worker_name: Stable name; one live registration per name.
        replace: Fence a live registration of the same name (a restarted worker).
        rpc_timeout_s: Deadline of each unary call, and of a pull's transfer beyond its wait.
        wait_timeout_s: Deadline of a pull's consistency wait (server side); None uses the
            server's ``--wait-timeout-ms`` (the client then allows up to
            :data:`SERVER_DEFAULT_WAIT_CAP_S` for it).
        retry: Backoff policy for UNAVAILABLE / RESOURCE_EXHAUSTED.
        heartbeat: Renew the lease in the background.
        close_timeout_s: Deadline (seconds) of the clean Leave sent by :meth:`close`.
        compression: key -> :class:`~paramserver.worker_client.compression.Cast` or
            :class:`~paramserver.worker_client.compression.TopK` (opt-in wire compression of
            pushed gradients; a scheme for key K also covers K's slices in a sharded cluster).
        auto_reregister: When the server no longer knows this worker (it restarted without
            its state, or evicted the worker), register again under the same name and carry
            on from the cluster's current clock. A fenced worker is never re-registered.
        channel_options: Extra grpc channel options.
    """

    _heartbeat_task_prefix = "paramserver-heartbeat-"
    _connect_name = "connect"

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
        auto_reregister: bool = True,
        close_timeout_s: float = 2.0,
        compression: Mapping[str, Compression] | None = None,
        channel_options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        super().__init__(
            address,
            worker_name,
            replace=replace,
            rpc_timeout_s=rpc_timeout_s,
            wait_timeout_s=wait_timeout_s,
            retry=retry,
            heartbeat=heartbeat,
            close_timeout_s=close_timeout_s,
            channel_options=channel_options,
        )
        self.auto_reregister = auto_reregister
        self.compressor = GradientCompressor(dict(compression or {}))
        self.reregistrations = 0
        self.clock_value = 0
        self.view: pb.ClusterView | None = None
        self.last_version = 0

    # ------------------------------------------------------------------ session hooks
    def _new_stub(self, channel: grpc.aio.Channel) -> pb_grpc.ParameterServerStub:
        return pb_grpc.ParameterServerStub(channel)

    def _open_options(self) -> list[tuple[str, Any]]:
        given = {name for name, _ in self.channel_options}
        return [o for o in _RECONNECT_OPTIONS if o[0] not in given] + self.channel_options

    def _heartbeat_request(self) -> pb.HeartbeatRequest:
        return pb.HeartbeatRequest(worker_id=self.worker_id)

    async def _heartbeat_evicted(self) -> bool:
        if not self.auto_reregister:
            return False
        try:
            return await self._reregister("heartbeat")
        except ParamServerError as exc:  # re-registration failed for another reason
            logger.warning("heartbeat: %s", exc)
            return True

    # ------------------------------------------------------------------ retry funnel
    async def _member_call(
        self,
        attempt: Callable[[], Awaitable[T]],
        what: str,
        retryable: Collection[grpc.StatusCode] = RETRYABLE,
    ) -> T:
        """:meth:`_call` for calls made as this worker: when the server no longer knows the
        worker (restarted without its state, or evicted it), re-register under the same name
        and try once more. ``attempt`` must read ``self.worker_id`` / ``self.clock_value`` when
        it runs. A fenced worker (a newer incarnation holds the name) is not re-registered."""
        try:
            return await self._call(attempt, what, retryable)
        except WorkerNotFound:
            if not self.auto_reregister or not await self._reregister(what):
                raise
            return await self._call(attempt, what, retryable)

    async def _reregister(self, why: str) -> bool:
        old = self.worker_id
        try:
            await self.register(replace=False)
        except AlreadyExists:
            logger.warning("worker %s was fenced by a newer registration of its name", old)
            self.evicted = True
            return False
        self.reregistrations += 1
        logger.warning(
            "worker %s is unknown to the server (%s); re-registered as %s at clock %d",
            old,
            why,
            self.worker_id,
            self.clock_value,
        )
        return True

    # ------------------------------------------------------------------ membership
    async def register(self, *, replace: bool | None = None) -> int:
        """Register (idempotent across retries); returns the starting clock.

        Raises:
            AlreadyExists: the name is live elsewhere and ``replace`` is False (ALREADY_EXISTS).
        """
        req = pb.RegisterRequest(
            worker_name=self.worker_name,
            replace=self.replace if replace is None else replace,
            client_nonce=self._nonce,
        )
        resp = await self._call(
            lambda: self.stub.Register(req, timeout=self.rpc_timeout_s), "register"
        )
        self.worker_id = resp.worker_id
        self.clock_value = resp.clock
        self.lease_ms = resp.lease_ms
        self.view = resp.view
        self.evicted = False
        self._left = False
        return int(resp.clock)

    async def heartbeat(self) -> pb.HeartbeatResponse:
        """Renew the lease now. Raises WorkerNotFound (FAILED_PRECONDITION) if evicted."""
        resp = await self._call(
            lambda: self.stub.Heartbeat(
                pb.HeartbeatRequest(worker_id=self.worker_id), timeout=self.rpc_timeout_s
            ),
            "heartbeat",
        )
        self.view = resp.view
        return resp

    async def leave(self) -> None:
        """Leave cleanly: BSP steps stop waiting for this worker at once."""
        resp = await self._call(
            lambda: self.stub.Leave(
                pb.LeaveRequest(worker_id=self.worker_id), timeout=self.rpc_timeout_s
            ),
            "leave",
        )
        self.view = resp.view
        self._left = True

    # ------------------------------------------------------------------ data plane
    async def init(
        self, tensors: Mapping[str, np.ndarray], rule: UpdateRule | None = None
    ) -> dict[str, np.ndarray]:
        """Declare keys with a server-side update rule; first writer wins.

        Args:
            tensors: key -> initial value (any supported dtype/shape; the caller's arrays are
                never modified).
            rule: Update rule for these keys (default: ``UpdateRule()``, plain SGD).

        Returns:
            key -> the stored value (the caller's own if it created the key, else the first
            writer's).

        Raises:
            InvalidArgument: unsupported dtype or bad rule (INVALID_ARGUMENT).
        """
        rule = rule or UpdateRule()
        arrays = normalized_tensors(tensors)

        def messages() -> Iterator[pb.InitRequest]:
            yield pb.InitRequest(
                header=pb.InitHeader(worker_id=self.worker_id, rule=rule.to_proto())
            )
            for key, value in arrays.items():
                for frame in tensor.encode_frames(key, value, _SEND_CHUNK_BYTES):
                    yield pb.InitRequest(frame=frame)

        await self._call(lambda: self.stub.Init(messages(), timeout=self.rpc_timeout_s), "init")
        return await self.pull(list(arrays), observer=True)

    async def push(
        self,
        grads: Mapping[str, np.ndarray],
        *,
        num_samples: int = 1,
        base_version: int | None = None,
        timeout_s: float | None = None,
    ) -> PushAck:
        """Push gradients for the current clock. Retried pushes are applied at most once.

        Args:
            grads: key -> gradient of the key's dtype and shape.
            num_samples: Examples behind the gradients (weighted_mean aggregation).
            base_version: Parameter version the gradients were computed from (ASP
                ``max_staleness``); defaults to the version of the last pull.
            timeout_s: Deadline of each attempt (default ``rpc_timeout_s``).

        Raises:
            KeyNotFound (NOT_FOUND), InvalidArgument (INVALID_ARGUMENT: shape/dtype/NaN),
            WorkerNotFound / StaleUpdate (FAILED_PRECONDITION), WaitTimeout, Unavailable.
        """
        request_id = self._next_request_id
        self._next_request_id += 1
        arrays = normalized_tensors(grads)
        # Encoded once per push (not per attempt): error-feedback residuals advance once.
        parts = {k: self.compressor.encode(k, v) for k, v in arrays.items()}

        def messages() -> Iterator[pb.PushRequest]:
            yield pb.PushRequest(
                header=pb.PushHeader(
                    worker_id=self.worker_id,
                    request_id=request_id,
                    clock=self.clock_value,
                    num_samples=num_samples,
                    base_version=self.last_version if base_version is None else base_version,
                )
            )
            for key, key_parts in parts.items():
                for part in key_parts:
                    for frame in tensor.encode_frames(
                        key,
                        part.array,
                        _SEND_CHUNK_BYTES,
                        role=part.role,
                        dense_shape=part.dense_shape,
                    ):
                        yield pb.PushRequest(frame=frame)

        resp = await self._member_call(
            lambda: self.stub.Push(messages(), timeout=timeout_s or self.rpc_timeout_s),
            "push",
            _PUSH_RETRYABLE,
        )
        self.view = resp.view
        return PushAck(
            request_id=request_id,
            duplicate=resp.duplicate,
            applied_updates=resp.applied_updates,
            dropped_stale=resp.dropped_stale,
            live_workers=resp.view.live_workers,
        )

    async def pull(
        self,
        keys: Iterable[str] | None = None,
        *,
        timeout_s: float | None = None,
        observer: bool = False,
    ) -> dict[str, np.ndarray]:
        """Pull parameters, waiting as the consistency model requires.

        Args:
            keys: Keys to read; None or empty reads every key.
            timeout_s: Deadline of the consistency wait (default ``wait_timeout_s``).
            observer: Read without waiting (not as this worker).

        Returns:
            key -> a fresh writeable ndarray of the key's dtype and shape.

        Raises:
            KeyNotFound (NOT_FOUND); WaitTimeout (DEADLINE_EXCEEDED) naming the workers waited
            for; Aborted (ABORTED) under the fail_fast policy; WorkerNotFound.
        """
        wait_s = self.wait_timeout_s if timeout_s is None else timeout_s
        key_list = list(keys or [])
        # 0 asks for the server's own default wait deadline.
        timeout_ms = 0 if wait_s is None else max(1, int(wait_s * 1000))
        call_deadline_s = (SERVER_DEFAULT_WAIT_CAP_S if wait_s is None else wait_s) + (
            self.rpc_timeout_s
        )

        async def attempt() -> dict[str, np.ndarray]:
            req = pb.PullRequest(
                worker_id="" if observer else self.worker_id,
                keys=key_list,
                timeout_ms=timeout_ms,
            )
            call = self.stub.Pull(req, timeout=call_deadline_s)
            out: dict[str, np.ndarray] = {}
            assembler = tensor.TensorAssembler()
            info_seen = False
            async for resp in call:
                if resp.WhichOneof("body") == "info":
                    info_seen = True
                    self.view = resp.info.view
                    if not observer:
                        self.last_version = resp.info.version
                    continue
                done = assembler.feed(resp.frame)
                if done is not None:
                    out[done[0]] = done[1]
            assembler.finish()
            if not info_seen:
                raise MalformedStream("pull stream ended without its info message")
            return out

        if observer:
            return await self._call(attempt, "pull")
        return await self._member_call(attempt, "pull")

    async def clock(self) -> int:
        """End the current iteration; returns the new clock (idempotent when retried).

        Raises:
            WorkerNotFound: evicted or fenced (FAILED_PRECONDITION).
        """
        req = pb.ClockRequest(worker_id=self.worker_id, clock=self.clock_value)
        try:
            resp = await self._call(
                lambda: self.stub.Clock(req, timeout=self.rpc_timeout_s), "clock"
            )
        except WorkerNotFound:
            # Re-registered workers start at the live minimum: that is the new clock.
            if not self.auto_reregister or not await self._reregister("clock"):
                raise
            return self.clock_value
        self.clock_value = resp.clock
        self.view = resp.view
        return int(resp.clock)

    async def status(self) -> pb.StatusResponse:
        """The server's status (workers, keys, counters)."""
        return await self._call(
            lambda: self.stub.Status(pb.StatusRequest(), timeout=self.rpc_timeout_s), "status"
        )


def normalized_tensors(tensors: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Check keys and normalise arrays before a stream starts (a stream cannot report an
    error raised while its request messages are produced).

    Raises:
        InvalidArgument: an empty or non-string key, or an unsupported dtype (INVALID_ARGUMENT).
    """
    out = {}
    for key, value in tensors.items():
        if not isinstance(key, str) or not key:
            raise InvalidArgument(f"tensor keys must be non-empty strings, got {key!r}")
        out[key] = tensor.normalize(value, key)
    return out


def connect(address: str, worker_name: str, **kwargs: Any) -> WorkerClient:
    """Open a worker session: ``async with connect(addr, worker_name="w0") as ps: ...``.

    ``address`` may be any shard of a sharded cluster: the session asks it for the shard map
    on open and routes every call over the shards (see
    :class:`paramserver.worker_client.sharded.ClusterWorkerClient`; ``discover=False`` talks
    to ``address`` alone). Other keyword arguments are those of :class:`WorkerClient`.
    """
    from paramserver.worker_client.sharded import ClusterWorkerClient

    return ClusterWorkerClient(address, worker_name, **kwargs)
