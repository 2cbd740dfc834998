"""Async worker client: register, push gradients, pull parameters, clock, leave.

Usage::

    async with connect("127.0.0.1:50051", worker_name="w0") as ps:
        await ps.init({"w": np.zeros(10, np.float32)}, rule=UpdateRule("sgd", lr=0.1))
        params = await ps.pull(["w"])          # waits as BSP/SSP require
        await ps.push({"w": grad}, num_samples=32)
        await ps.clock()

Every push carries ``(worker id, request id)``; a push retried after UNAVAILABLE reuses its
request id, so the server applies it at most once.

Pushes and pulls travel over one persistent ``Session`` stream per client (opened on first use,
reopened after a broken link): small tensors inline, larger ones through shared memory when the
server is on the same host (negotiated automatically), otherwise over the chunked Push/Pull
streams: each request takes one :class:`~paramserver.worker_client.transport.base.Transport`
(see :mod:`paramserver.worker_client.transport`).
:meth:`WorkerClient.push_pull` pushes and
pulls in one round trip. Retries use exponential backoff with full
jitter up to a deadline. A background task renews the lease every quarter lease. No channel is
cached across event loops: the channel is created in ``__aenter__`` on the running loop.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

import grpc
import numpy as np

from paramserver.api.v1 import parameter_server_pb2 as pb
from paramserver.api.v1 import parameter_server_pb2_grpc as pb_grpc
from paramserver.core.optimizers import UpdateRule
from paramserver.errors import (
    AlreadyExists,
    InvalidArgument,
    ParamServerError,
    WorkerNotFound,
)
from paramserver.protocol import shm, tensor
from paramserver.protocol.addresses import REPLICA_SEPARATOR, replicas_moved
from paramserver.protocol.keepalive import ChannelOption
from paramserver.security.tls import ClientSecurity
from paramserver.worker_client.compression import Compression, GradientCompressor
from paramserver.worker_client.embedding import TableClientMixin
from paramserver.worker_client.lifecycle import ServiceSession, name_taken

# Re-exported: these lived here before progress.py, and callers import them from here.
from paramserver.worker_client.progress import WorkerProgress as WorkerProgress
from paramserver.worker_client.progress import await_workers as await_workers
from paramserver.worker_client.progress import progress_of as progress_of
from paramserver.worker_client.pull_buffers import DEFAULT_MAX_BYTES, PullBuffers
from paramserver.worker_client.request_ids import RequestIds
from paramserver.worker_client.retry import RETRYABLE, RetryPolicy
from paramserver.worker_client.transport.base import PullResult, PullSpec, PushPayload, Transports
from paramserver.worker_client.transport.session_stream import SessionTransport
from paramserver.worker_client.transport.streams import SEND_CHUNK_BYTES, StreamTransport
from paramserver.worker_client.transport.stub import ParameterServerStub

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Longest the client waits for a pull that leaves the wait deadline to the server (seconds).
SERVER_DEFAULT_WAIT_CAP_S = 600.0

_PUSH_RETRYABLE = RETRYABLE | {grpc.StatusCode.DEADLINE_EXCEEDED}

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


class WorkerClient(TableClientMixin, ServiceSession["pb_grpc.ParameterServerAsyncStub"]):
    """One worker's session with a parameter-server shard.

    Args:
        address: ``host:port`` of the server.
        worker_name: Stable name; one live registration per name.
        replace: Fence a live registration of the same name (a restarted worker).
        resume: This worker continues its name's iterations where its predecessor stopped
            (it skips the ``steps`` that :meth:`progress` reports done and redoes the batch
            in flight at its clock). Its pushes (dense and row) are numbered from its name,
            clock and order within the clock, and a registration that replaces a predecessor (which
            resumed too) carries over its applied request ids: the predecessor's push of a
            batch it never clocked (it died between the two) and the successor's push of the
            same batch are one push, applied once. Without it a replacement's pushes are all
            new.
        rpc_timeout_s: Deadline of each unary call, and of a pull's transfer beyond its wait.
        retry: Backoff policy for UNAVAILABLE / RESOURCE_EXHAUSTED.
        heartbeat: Renew the lease in the background.
        channel_options: Extra grpc channel options.
        security: TLS / mutual TLS and bearer token
        (:class:`paramserver.security.tls.ClientSecurity`);
            None: plain text, no token.
        wait_timeout_s: Deadline of a pull's consistency wait (server side); None uses the
            server's ``--wait-timeout-ms`` (the client then allows up to
            :data:`SERVER_DEFAULT_WAIT_CAP_S` for it).
        auto_reregister: When the server no longer knows this worker (it restarted without
            its state, or evicted the worker), register again under the same name and carry
            on from the cluster's current clock. A fenced worker is never re-registered.
        close_timeout_s: Deadline (seconds) of the clean Leave sent by :meth:`close`.
        compression: key -> :class:`~paramserver.worker_client.compression.Cast` or
            :class:`~paramserver.worker_client.compression.TopK` (opt-in wire compression of
            pushed gradients; a scheme for key K also covers K's slices in a sharded cluster).
        session: Send pushes and pulls over one persistent Session stream (False: one Push or
            Pull stream per call, as before).
        shared_memory: Offer the server a shared-memory segment for tensor bytes when it is
            on the same host (False: network only; the server can refuse too,
            ``--no-shared-memory``). Negotiated on the Session stream; a declined offer falls
            back to the network silently.
        shared_memory_dir: Directory of the segments (default ``/dev/shm``; the server must
            see the same directory, which is how another host or container is told apart).
        local_link: With ``shared_memory``, move the Session onto the server's local-link
            socket when it is on the same host (:mod:`paramserver.server.transports.link_service`:
            the same
            messages without gRPC's per-message cost); unreachable or refused, the session
            stays on gRPC silently.
        recycle_pull_buffers: Receive a key's pulled value into the memory of one of the
            key's last two results that nothing refers to any more (as in a loop that
            replaces its parameters each round), instead of into new memory: no fresh pages
            to fault in and zero for every large pull. Results stay fresh arrays to the caller
            (an array anyone still refers to, weakly too, is never reused); values of 1 MiB and
            up, CPython with the GIL. Costs memory: results the caller dropped are kept
            rather than given back, and a kept result refuses ``ndarray.resize``
            (:mod:`paramserver.worker_client.pull_buffers`).
        pull_buffer_max_bytes: Most bytes of results kept for reuse by this client (an int
            >= 0; else InvalidArgument, INVALID_ARGUMENT, here).
        register: False: a reader that never registers (no lease, heartbeats or leave);
            every pull is an observer read, admitted at once whatever the consistency;
            calls made as a worker (push, clock) fail without a registration. What a
            read-only server (``paramserver serve --read-only``) needs: it refuses every
            registration.
        cast_gradients: Cast every pushed gradient to its key's stored dtype first (e.g. a
            float64 gradient, numpy's default, for a float32 key), as ``push(..., cast=True)``
            does for one push. Off by default: a gradient of another dtype is refused
            (INVALID_ARGUMENT naming the key and both dtypes), never cast silently.
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
        retry: RetryPolicy | None = None,
        heartbeat: bool = True,
        channel_options: Sequence[ChannelOption] = (),
        security: ClientSecurity | None = None,
        wait_timeout_s: float | None = None,
        resume: bool = False,
        auto_reregister: bool = True,
        close_timeout_s: float = 2.0,
        compression: Mapping[str, Compression] | None = None,
        session: bool = True,
        shared_memory: bool = True,
        shared_memory_dir: str | Path | None = None,
        local_link: bool = True,
        recycle_pull_buffers: bool = True,
        pull_buffer_max_bytes: int = DEFAULT_MAX_BYTES,
        cast_gradients: bool = False,
        register: bool = True,
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
            security=security,
        )
        self.auto_reregister = auto_reregister
        self.registers = bool(register)
        self.cast_gradients = bool(cast_gradients)
        #: Stored dtype of each key this client has learnt (for ``cast``).
        self._key_dtypes: dict[str, np.dtype[np.generic]] = {}
        self.compressor = GradientCompressor(dict(compression or {}))
        self.reregistrations = 0
        self.clock_value = 0
        self.resume = bool(resume)
        #: Request ids of dense pushes and of row pushes (one id space per kind on the
        #: server): from the name, clock and count at the clock with ``resume``.
        self._push_ids = RequestIds(worker_name, self.resume)
        self._row_push_ids = RequestIds(worker_name, self.resume)
        self.view: pb.ClusterView | None = None
        self.last_version = 0
        #: Memory of dropped pull results, reused by the next pull of their key.
        self.pull_buffers = PullBuffers(
            enabled=recycle_pull_buffers, max_bytes=pull_buffer_max_bytes
        )
        #: The Session stream (None: ``session=False``).
        self.fastpath: SessionTransport | None = (
            SessionTransport(
                lambda: self.stub,
                shared_memory=shared_memory,
                shm_dir=Path(shared_memory_dir) if shared_memory_dir is not None else None,
                local_link=local_link,
                pull_buffers=self.pull_buffers,
            )
            if session
            else None
        )
        #: How data-plane requests travel: the Session while it carries them, else the streams.
        self.transports = Transports(
            StreamTransport(
                lambda: self.stub,
                self.pull_buffers,
                self.fastpath.known_nbytes if self.fastpath is not None else None,
            ),
            self.fastpath,
        )

    # ------------------------------------------------------------------ session hooks
    async def open(self) -> None:
        """Open the channel, register, start heartbeats; first remove shared-memory segments
        that clients killed before offering them left behind (their pid is dead)."""
        fp = self.fastpath
        if fp is not None and fp.shared_memory:
            shm.sweep_dead(fp.shm_dir)
        await super().open()

    async def close(self) -> None:
        """Drop the Session stream and its segment, leave, stop heartbeats, close the channel."""
        if self.fastpath is not None:
            self.fastpath.close()
        self.pull_buffers.clear()
        await super().close()

    def _new_stub(self, channel: grpc.aio.Channel) -> pb_grpc.ParameterServerAsyncStub:
        return ParameterServerStub(channel)

    def _open_options(self) -> list[ChannelOption]:
        given = {name for name, _ in self.channel_options}
        return [o for o in _RECONNECT_OPTIONS if o[0] not in given] + self.channel_options

    def _heartbeat_request(self) -> pb.HeartbeatRequest:
        return pb.HeartbeatRequest(worker_id=self.worker_id)

    def _leave_request(self) -> pb.LeaveRequest:
        return pb.LeaveRequest(worker_id=self.worker_id)

    def _heartbeat_answered(self, resp: pb.HeartbeatResponse) -> None:
        """Follow a replicated shard's replicas: when its primary names other addresses than
        this client's (a replica was placed again on another host), reconnect to those, so a
        later failover to the moved replica still reaches it."""
        now = REPLICA_SEPARATOR.join(resp.replicas)
        if REPLICA_SEPARATOR in self.address and replicas_moved(self.address, now):
            self.retarget(now)

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
        if not self.registers:
            return False  # a reader stays one
        old = self.worker_id
        try:
            # Continue the old registration: a push retried after this is still applied once.
            await self.register(replace=False, resume_worker_id=old)
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
    async def register(self, *, replace: bool | None = None, resume_worker_id: str = "") -> int:
        """Register (idempotent across retries); returns the starting clock.

        ``resume_worker_id``: the registration this one continues (after the server forgot or
        evicted it), so the server carries its push request ids over and a push retried under
        the new registration is still applied once.

        Raises:
            AlreadyExists: the name is live elsewhere and ``replace`` is False (ALREADY_EXISTS;
                the message says whose it is, when its lease lapses, and to pass
                ``replace=True``: ``exc.hint``, which the command line words as ``--replace``).
        """
        req = pb.RegisterRequest(
            worker_name=self.worker_name,
            replace=self.replace if replace is None else replace,
            client_nonce=self._nonce,
            resume_worker_id=resume_worker_id,
            resume=self.resume,
        )
        try:
            resp = await self._call(
                lambda: self.stub.Register(req, timeout=self.rpc_timeout_s), "register"
            )
        except AlreadyExists as exc:
            raise name_taken(exc) from exc.__cause__  # (the RpcError, as every mapped error)
        self.worker_id = resp.worker_id
        self.clock_value = resp.clock
        self.lease_ms = resp.lease_ms
        self.view = resp.view
        self.evicted = False
        self._left = False
        return int(resp.clock)

    async def heartbeat(self) -> pb.HeartbeatResponse:
        """Renew the lease now. Raises WorkerNotFound (FAILED_PRECONDITION) if evicted."""
        resp: pb.HeartbeatResponse = await self._renew_lease()
        return resp

    async def wait_for_workers(self, n: int, *, timeout_s: float = 60.0) -> int:
        """Start barrier: wait until ``n`` workers are registered, so that no worker steps
        alone before the others join (call it after :meth:`init`, before the first pull).

        A worker that polls late may never see all ``n`` live: under ASP the others start the
        moment they see ``n`` and may finish and leave between two polls. Updates applied
        already mean they did see ``n`` (this worker, registered before polling, among them),
        so the barrier is over for this worker too. Polls the server (heartbeat, then status)
        at 10 ms, doubling up to 200 ms.

        Args:
            n: Workers to wait for, this one included (an int >= 1).
            timeout_s: Deadline in seconds (> 0).

        Returns:
            The live workers seen when the barrier passed (0 when it passed because updates
            were applied already).

        Raises:
            InvalidArgument: ``n`` < 1 or ``timeout_s`` <= 0 (INVALID_ARGUMENT).
            WaitTimeout: fewer than ``n`` workers registered within ``timeout_s``, naming how
                many did (DEADLINE_EXCEEDED).
        """
        return await await_workers(self, n, timeout_s, where=self.address)

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
        arrays = normalized_tensors(tensors)
        await self.declare(arrays, rule or UpdateRule())
        return await self.pull(list(arrays), observer=True)

    async def declare(self, arrays: Mapping[str, np.ndarray], rule: UpdateRule) -> dict[str, bool]:
        """One Init of ``arrays`` (normalized: see :func:`normalized_tensors`) under ``rule``,
        without reading the values back.

        Returns:
            Stored name -> whether this call created it.
        """

        def messages() -> Iterator[pb.InitRequest]:
            yield pb.InitRequest(
                header=pb.InitHeader(worker_id=self.worker_id, rule=rule.to_proto())
            )
            for key, value in arrays.items():
                yield from tensor.encode_messages(pb.InitRequest, key, value, SEND_CHUNK_BYTES)

        resp = await self._call(
            lambda: self.stub.Init(messages(), timeout=self.rpc_timeout_s), "init"
        )
        return {k.key: k.created for k in resp.keys}

    async def push(
        self,
        grads: Mapping[str, np.ndarray],
        *,
        num_samples: int = 1,
        base_version: int | None = None,
        timeout_s: float | None = None,
        cast: bool | None = None,
    ) -> PushAck:
        """Push gradients for the current clock. Retried pushes are applied at most once.

        Args:
            grads: key -> gradient of the key's dtype and shape.
            num_samples: Examples behind the gradients (weighted_mean aggregation).
            base_version: Parameter version the gradients were computed from (ASP
                ``max_staleness``); defaults to the version of the last pull.
            timeout_s: Deadline of each attempt (default ``rpc_timeout_s``).
            cast: True: cast each gradient to its key's stored dtype first (numpy
                ``same_kind`` casting: float64 -> float32 yes, float -> int no); False: send
                as given; None (default): the client's ``cast_gradients``.

        Raises:
            KeyNotFound (NOT_FOUND), InvalidArgument (INVALID_ARGUMENT: shape/dtype/NaN, or a
            cast that is not ``same_kind``), WorkerNotFound / StaleUpdate
            (FAILED_PRECONDITION), WaitTimeout, Unavailable.
        """
        grads = await self._cast(grads, cast)
        payload = self._prepare_push(grads, num_samples, base_version, timeout_s)

        async def attempt() -> pb.PushResponse:
            return await self.transports.send(lambda t: t.push(payload))

        resp = await self._member_call(attempt, "push", _PUSH_RETRYABLE)
        return self._ack(payload, resp)

    async def _key_dtypes_of(self, keys: Sequence[str]) -> dict[str, np.dtype[np.generic]]:
        """Stored dtypes of ``keys`` (those that exist), asking the server once for keys not
        seen yet."""
        if any(k not in self._key_dtypes for k in keys):
            for ki in (await self.status()).keys:
                self._key_dtypes[ki.key] = tensor.dtype_from_wire(ki.dtype, ki.key)
        return {k: self._key_dtypes[k] for k in keys if k in self._key_dtypes}

    async def _cast(
        self, grads: Mapping[str, np.ndarray], cast: bool | None
    ) -> Mapping[str, np.ndarray]:
        return await cast_gradients(self, grads, cast)

    def _push_request_id(self) -> int:
        """The next dense push's request id (:class:`RequestIds`: with ``resume``, a
        successor that replaces a lost worker continues at its predecessor's clock and takes
        over its dedup window, so its push of the batch the predecessor pushed but never
        clocked carries the same id and is answered as a duplicate, applied once on every
        shard that applied the original)."""
        return self._push_ids.take(self.clock_value)

    def _row_push_request_id(self, tables: int = 1) -> int:
        """The first of ``tables`` consecutive request ids of the next row push (one per
        table of a multi-table push), numbered as dense pushes are."""
        return self._row_push_ids.take(self.clock_value, tables)

    def _prepare_push(
        self,
        grads: Mapping[str, np.ndarray],
        num_samples: int,
        base_version: int | None,
        timeout_s: float | None,
    ) -> PushPayload:
        """What every transport needs once per push (not per attempt): a fresh request id,
        the gradients normalised and encoded (error-feedback residuals advance once), a
        factory of the push header (the clock and version are read at each attempt) and the
        deadline of the push's call (``timeout_s``, default ``rpc_timeout_s``).

        Raises:
            InvalidArgument: no gradients, an empty key or an unsupported dtype
                (INVALID_ARGUMENT).
        """
        if not grads:
            raise InvalidArgument("a push needs at least one gradient; got none")
        request_id = self._push_request_id()
        arrays = normalized_tensors(grads)
        parts = self.compressor.encode_all(arrays)

        def header() -> pb.PushHeader:
            return pb.PushHeader(
                worker_id=self.worker_id,
                request_id=request_id,
                clock=self.clock_value,
                num_samples=num_samples,
                base_version=self.last_version if base_version is None else base_version,
            )

        return PushPayload.of(request_id, header, parts, timeout_s or self.rpc_timeout_s)

    def _ack(self, push: PushPayload, resp: pb.PushResponse) -> PushAck:
        self.view = resp.view
        return PushAck(
            request_id=push.request_id,
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
        copy: bool = True,
    ) -> dict[str, np.ndarray]:
        """Pull parameters, waiting as the consistency model requires.

        Args:
            keys: Keys to read; None or empty reads every key.
            timeout_s: Deadline of the consistency wait (default ``wait_timeout_s``).
            observer: Read without waiting (not as this worker).
            copy: True (default): every value is a fresh array. False: values that came
                through shared memory are read-write views of this client's pull region,
                valid only until the client's next push, pull or push_pull (which may
                overwrite them) — copy what you keep. Values that came otherwise are fresh.

        Returns:
            key -> a writeable ndarray of the key's dtype and shape.

        Raises:
            KeyNotFound (NOT_FOUND); WaitTimeout (DEADLINE_EXCEEDED) naming the workers waited
            for; Aborted (ABORTED) under the fail_fast policy; WorkerNotFound.
        """
        key_list = list(keys or [])
        timeout_ms, call_deadline_s = self._pull_deadlines(timeout_s)

        def request() -> pb.PullRequest:
            return pb.PullRequest(
                worker_id="" if observer else self.worker_id, keys=key_list, timeout_ms=timeout_ms
            )

        async def attempt() -> dict[str, np.ndarray]:
            info, values = await self.transports.send(
                lambda t: t.pull(PullSpec(request(), call_deadline_s, copy))
            )
            self._note_pull(info, observer)
            return values

        if observer:
            return await self._call(attempt, "pull")
        return await self._member_call(attempt, "pull")

    def _note_pull(self, info: pb.PullInfo, observer: bool) -> None:
        self.view = info.view
        if not observer:
            self.last_version = info.version

    def _pull_deadlines(self, timeout_s: float | None) -> tuple[int, float]:
        """(timeout_ms sent to the server, the client's deadline in seconds) of a pull."""
        wait_s = self.wait_timeout_s if timeout_s is None else timeout_s
        # 0 asks for the server's own default wait deadline.
        timeout_ms = 0 if wait_s is None else max(1, int(wait_s * 1000))
        call_deadline_s = (SERVER_DEFAULT_WAIT_CAP_S if wait_s is None else wait_s) + (
            self.rpc_timeout_s
        )
        return timeout_ms, call_deadline_s

    async def push_pull(
        self,
        grads: Mapping[str, np.ndarray],
        keys: Iterable[str] | None = None,
        *,
        num_samples: int = 1,
        base_version: int | None = None,
        timeout_s: float | None = None,
        copy: bool = True,
        cast: bool | None = None,
    ) -> dict[str, np.ndarray]:
        """Push gradients, then pull parameters, in one round trip (BytePS's ``push_pull``).

        The push is applied exactly as :meth:`push` applies it (once, however often it is
        retried); the pull then waits as the consistency model requires and reads the values
        after the push, like :meth:`pull`. Over the Session stream both go in one request;
        gradients that must take the Push stream (compressed, or large without shared memory)
        are pushed and then pulled with two calls.

        Args:
            grads: key -> gradient of the key's dtype and shape.
            keys: Keys to pull; None pulls the pushed keys; empty (``[]``) pulls every key.
            num_samples: Examples behind the gradients (weighted_mean aggregation).
            base_version: Parameter version the gradients were computed from (default: the
                version of the last pull).
            timeout_s: Deadline of the pull's consistency wait in seconds (default
                ``wait_timeout_s``); each attempt also gets ``rpc_timeout_s`` beyond it.
            copy: As in :meth:`pull`: False returns shared-memory values as views of the pull
                region, valid until this client's next request.
            cast: As in :meth:`push`.

        Returns:
            key -> a writeable ndarray of the key's dtype and shape.

        Raises:
            The errors of :meth:`push` and :meth:`pull`, with the same classes and status codes.
        """
        grads = await self._cast(grads, cast)
        # (the push's own call, over the streams, has the RPC deadline)
        payload = self._prepare_push(grads, num_samples, base_version, None)
        key_list = list(payload.parts) if keys is None else list(keys)
        timeout_ms, call_deadline_s = self._pull_deadlines(timeout_s)

        def request() -> pb.PullRequest:
            return pb.PullRequest(worker_id=self.worker_id, keys=key_list, timeout_ms=timeout_ms)

        async def attempt() -> dict[str, np.ndarray]:
            pushed, pulled = await self.transports.send(
                lambda t: t.push_pull(payload, PullSpec(request(), call_deadline_s, copy))
            )
            self._ack(payload, pushed)
            if pulled is None:  # the values come by a Pull stream of their own
                pulled = await self._pull_separately(PullSpec(request(), call_deadline_s))
            info, values = pulled
            self._note_pull(info, False)
            return values

        return await self._member_call(attempt, "push_pull")

    async def _pull_separately(self, pull: PullSpec) -> PullResult:
        streams = self.transports.streams
        assert isinstance(streams, StreamTransport)
        return await streams.pull(pull, record_sizes=False)

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

    async def progress(self, worker_name: str | None = None) -> WorkerProgress:
        """What the registrations of ``worker_name`` (default: this worker's name) completed:
        a worker that restarts, or replaces another under its name, resumes its data here
        (e.g. skips ``steps`` batches it already trained). Asks the server (one Status call).
        """
        return progress_of([await self.status()], worker_name or self.worker_name)


def normalized_tensors(
    tensors: Mapping[str, np.ndarray | np.generic | float | int],
) -> dict[str, np.ndarray]:
    """Check keys and normalise arrays before a stream starts (a stream cannot report an
    error raised while its request messages are produced).

    Raises:
        InvalidArgument: an empty or non-string key, or an unsupported dtype (INVALID_ARGUMENT).
    """
    out = {}
    ready = tensor.WIRE_READY_DTYPES
    for key, value in tensors.items():
        if not isinstance(key, str) or not key:
            raise InvalidArgument(f"tensor keys must be non-empty strings, got {key!r}")
        if type(value) is np.ndarray and value.dtype in ready and value.flags.c_contiguous:
            out[key] = value  # already what normalize returns (as is): skip its checks
        else:
            out[key] = tensor.normalize(value, key)
    return out


class _Casting(Protocol):
    cast_gradients: bool

    async def _key_dtypes_of(self, keys: Sequence[str]) -> dict[str, np.dtype[np.generic]]: ...


async def cast_gradients(
    client: _Casting, grads: Mapping[str, np.ndarray], cast: bool | None
) -> Mapping[str, np.ndarray]:
    """``grads`` with each gradient cast to its key's stored dtype (as ``client`` knows it)
    when casting is on (``cast``, else the client's ``cast_gradients``); keys the server lacks
    are left to its refusal.

    Raises:
        InvalidArgument: a cast numpy's ``same_kind`` rule forbids (INVALID_ARGUMENT).
    """
    if not (client.cast_gradients if cast is None else cast) or not grads:
        return grads
    arrays = normalized_tensors(grads)
    dtypes = await client._key_dtypes_of(list(arrays))
    out: dict[str, np.ndarray] = {}
    for key, value in arrays.items():
        want = dtypes.get(key)
        if want is None or value.dtype == want:
            out[key] = value
            continue
        if not np.can_cast(value.dtype, want, casting="same_kind"):
            raise InvalidArgument(
                f"gradient for key {key!r}: cannot cast dtype {value.dtype} to the key's "
                f"dtype {want} (only same-kind casts, e.g. float64 -> float32); nothing "
                "was pushed"
            )
        out[key] = value.astype(want)
    return out
