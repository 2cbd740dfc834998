"""Blocking wrapper over :class:`~paramserver.worker_client.cluster.ClusterWorkerClient` (what
:func:`~paramserver.worker_client.connect` returns) for scripts.

The wrapper runs a private event loop in a daemon thread; each method submits the async call
to it and waits for the result with a deadline. Usage::

    with connect_sync("127.0.0.1:50051", worker_name="w0") as ps:
        ps.init({"w": np.zeros(3, np.float32)})
        ps.push({"w": np.ones(3, np.float32)})
        ps.clock()
        print(ps.pull(["w"]))
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
from collections.abc import Coroutine, Iterable, Mapping
from typing import TypeVar, Unpack

import numpy as np
from numpy.typing import ArrayLike

from paramserver.api.v1 import parameter_server_pb2 as pb
from paramserver.closing import Closing
from paramserver.core.optimizers import UpdateRule
from paramserver.core.tables import TableSpec
from paramserver.errors import WaitTimeout
from paramserver.worker_client.client import PushAck, WorkerProgress
from paramserver.worker_client.cluster import ClusterWorkerClient, connect
from paramserver.worker_client.embedding import RowPushAck
from paramserver.worker_client.forwarding import Forwarded
from paramserver.worker_client.keyed import TableIds
from paramserver.worker_client.options import (
    ClientOptions,
    PullOptions,
    PullRowsManyOptions,
    PushOptions,
    PushPullOptions,
)

T = TypeVar("T")


class SyncWorkerClient(Closing):
    """Blocking worker session; the same arguments as :func:`~paramserver.worker_client.connect`.

    Args:
        address: ``host:port`` of any shard of the cluster.
        worker_name: Stable name; one live registration per name.
        call_timeout_s: Extra deadline (seconds) for each blocking call on top of the client's
            own RPC and wait deadlines; a call past it raises WaitTimeout (DEADLINE_EXCEEDED).
        discover: As for :func:`~paramserver.worker_client.connect`.
        **options: Those of :class:`~paramserver.worker_client.client.WorkerClient`
            (:class:`~paramserver.worker_client.options.ClientOptions`).
    """

    def __init__(
        self,
        address: str,
        worker_name: str,
        *,
        call_timeout_s: float = 600.0,
        discover: bool = True,
        **options: Unpack[ClientOptions],
    ) -> None:
        #: Builds the (unopened) async client on the private loop.
        self._connect = functools.partial(
            connect, address, worker_name, discover=discover, **options
        )
        self._name = worker_name
        self._call_timeout_s = call_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._client: ClusterWorkerClient | None = None

    def _run(self, coro: Coroutine[object, object, T]) -> T:
        if self._loop is None:
            coro.close()
            raise RuntimeError("SyncWorkerClient is not open: use `with connect_sync(...)`")
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(self._call_timeout_s)
        except TimeoutError:
            fut.cancel()
            raise WaitTimeout(f"call did not finish within {self._call_timeout_s} s") from None

    @property
    def client(self) -> ClusterWorkerClient:
        if self._client is None:
            raise RuntimeError("SyncWorkerClient is not open")
        return self._client

    def open(self) -> SyncWorkerClient:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"paramserver-sync-{self._name}", daemon=True
        )
        self._thread.start()

        async def make() -> ClusterWorkerClient:
            client = self._connect()
            await client.open()
            return client

        try:
            self._client = self._run(make())
        except BaseException:
            self._shutdown_loop()
            raise
        return self

    def close(self) -> None:
        if self._client is not None:
            try:
                self._run(self._client.close())
            finally:
                self._client = None
                self._shutdown_loop()

    def _shutdown_loop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._thread is not None:
                self._thread.join(timeout=10)
            self._loop.close()
            self._loop = None
            self._thread = None

    # The blocking API mirrors WorkerClient's async one.
    worker_id = Forwarded[str]("client", "The worker's id (see :class:`ClusterWorkerClient`).")
    clock_value = Forwarded[int]("client", "The worker's clock.")

    def init(
        self, tensors: Mapping[str, np.ndarray], rule: UpdateRule | None = None
    ) -> dict[str, np.ndarray]:
        return self._run(self.client.init(tensors, rule))

    def push(self, grads: Mapping[str, np.ndarray], **options: Unpack[PushOptions]) -> PushAck:
        """:meth:`WorkerClient.push`, blocking (the same keyword arguments)."""
        return self._run(self.client.push(grads, **options))

    def push_async(
        self, grads: Mapping[str, np.ndarray], **options: Unpack[PushOptions]
    ) -> concurrent.futures.Future[PushAck]:
        """Start :meth:`WorkerClient.push` on the client's loop and return at once (e.g. from
        a backward hook, so the push overlaps the rest of backward); ``.result()`` of the
        future waits for the acknowledgement and raises what the push raised. The caller must
        not modify ``grads`` until then."""
        if self._loop is None:
            raise RuntimeError("SyncWorkerClient is not open: use `with connect_sync(...)`")
        return asyncio.run_coroutine_threadsafe(self.client.push(grads, **options), self._loop)

    def pull(
        self, keys: Iterable[str] | None = None, **options: Unpack[PullOptions]
    ) -> dict[str, np.ndarray]:
        """:meth:`WorkerClient.pull`, blocking (``copy=False`` views live until the next call)."""
        return self._run(self.client.pull(keys, **options))

    def push_pull(
        self,
        grads: Mapping[str, np.ndarray],
        keys: Iterable[str] | None = None,
        **options: Unpack[PushPullOptions],
    ) -> dict[str, np.ndarray]:
        """Push, then pull, in one round trip (see :meth:`WorkerClient.push_pull`)."""
        return self._run(self.client.push_pull(grads, keys, **options))

    def init_table(self, spec: TableSpec) -> tuple[bool, TableSpec]:
        """:meth:`WorkerClient.init_table`, blocking."""
        return self._run(self.client.init_table(spec))

    def pull_rows(
        self, table: str, ids: ArrayLike, *, timeout_s: float | None = None, observer: bool = False
    ) -> np.ndarray:
        """:meth:`WorkerClient.pull_rows`, blocking: (len(ids), dim) rows in the ids' order."""
        return self._run(self.client.pull_rows(table, ids, timeout_s=timeout_s, observer=observer))

    def push_rows(
        self, table: str, ids: ArrayLike, grads: ArrayLike, *, timeout_s: float | None = None
    ) -> RowPushAck:
        """:meth:`WorkerClient.push_rows`, blocking."""
        return self._run(self.client.push_rows(table, ids, grads, timeout_s=timeout_s))

    def push_pull_rows(
        self,
        table: str,
        push_ids: ArrayLike,
        grads: ArrayLike,
        pull_ids: ArrayLike,
        *,
        timeout_s: float | None = None,
    ) -> np.ndarray:
        """:meth:`WorkerClient.push_pull_rows`, blocking: (len(pull_ids), dim) rows in the
        pull ids' order."""
        return self._run(
            self.client.push_pull_rows(table, push_ids, grads, pull_ids, timeout_s=timeout_s)
        )

    def pull_rows_many(
        self, ids: TableIds, **options: Unpack[PullRowsManyOptions]
    ) -> dict[str, np.ndarray]:
        """:meth:`WorkerClient.pull_rows_many`, blocking: ``{table: rows}``."""
        return self._run(self.client.pull_rows_many(ids, **options))

    def push_rows_many(
        self, ids: TableIds, grads: Mapping[str, ArrayLike], *, timeout_s: float | None = None
    ) -> dict[str, RowPushAck]:
        """:meth:`WorkerClient.push_rows_many`, blocking: ``{table: ack}``."""
        return self._run(self.client.push_rows_many(ids, grads, timeout_s=timeout_s))

    def clock(self) -> int:
        return self._run(self.client.clock())

    def wait_for_workers(self, n: int, *, timeout_s: float = 60.0) -> int:
        """:meth:`WorkerClient.wait_for_workers`, blocking (the start barrier)."""
        return self._run(self.client.wait_for_workers(n, timeout_s=timeout_s))

    def leave(self) -> None:
        self._run(self.client.leave())

    def status(self) -> pb.StatusResponse:
        return self._run(self.client.status())

    def progress(self, worker_name: str | None = None) -> WorkerProgress:
        """:meth:`WorkerClient.progress`, blocking."""
        return self._run(self.client.progress(worker_name))


def connect_sync(
    address: str,
    worker_name: str,
    *,
    call_timeout_s: float = 600.0,
    discover: bool = True,
    **options: Unpack[ClientOptions],
) -> SyncWorkerClient:
    """Blocking counterpart of :func:`paramserver.worker_client.connect` (the same arguments;
    ``call_timeout_s`` as for :class:`SyncWorkerClient`)."""
    return SyncWorkerClient(
        address, worker_name, call_timeout_s=call_timeout_s, discover=discover, **options
    )
