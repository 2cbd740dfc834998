"""The worker's API, defined once: what every parameter-server client offers a training loop.

:class:`ParameterClient` is the asyncio surface that
:class:`~paramserver.worker_client.client.WorkerClient` (one shard),
:class:`~paramserver.worker_client.sharded.ShardedWorkerClient` (several) and
:class:`~paramserver.worker_client.cluster.ClusterWorkerClient` (either, chosen from the shard
map: what :func:`~paramserver.worker_client.connect` returns) implement;
:class:`SyncParameterClient` is the same surface, blocking, that
:class:`~paramserver.worker_client.sync.SyncWorkerClient` implements. Code written against a
protocol runs on any of its clients; mypy checks every client against it (below), and
``tests/worker_client/test_surface.py`` checks that their call signatures agree at run time.

The options of the calls that take many (push, pull, push_pull) are the TypedDicts of
:mod:`paramserver.worker_client.options`, also defined once. Each method's semantics, shapes,
dtypes and errors are documented on :class:`~paramserver.worker_client.client.WorkerClient`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Protocol, Unpack

import numpy as np
from numpy.typing import ArrayLike

from paramserver.api.v1 import parameter_server_pb2 as pb
from paramserver.core.optimizers import UpdateRule
from paramserver.worker_client.options import (
    PullOptions,
    PullRowsManyOptions,
    PushOptions,
    PushPullOptions,
)

if TYPE_CHECKING:
    from paramserver.worker_client import (
        PushAck,
        RowPushAck,
        TableSpec,
        WorkerProgress,
    )
    from paramserver.worker_client.keyed import TableIds

__all__ = ["METHODS", "ParameterClient", "SyncParameterClient"]

#: The methods of both protocols, in the order a training loop meets them.
METHODS = (
    "init",
    "wait_for_workers",
    "progress",
    "push",
    "pull",
    "push_pull",
    "clock",
    "init_table",
    "pull_rows",
    "push_rows",
    "push_pull_rows",
    "pull_rows_many",
    "push_rows_many",
    "status",
    "leave",
    "close",
)


class ParameterClient(Protocol):
    """The asyncio worker surface (see the module docstring)."""

    async def init(
        self, tensors: Mapping[str, np.ndarray], rule: UpdateRule | None = None
    ) -> dict[str, np.ndarray]: ...

    async def wait_for_workers(self, n: int, *, timeout_s: float = 60.0) -> int: ...

    async def progress(self, worker_name: str | None = None) -> WorkerProgress: ...

    async def push(
        self, grads: Mapping[str, np.ndarray], **options: Unpack[PushOptions]
    ) -> PushAck: ...

    async def pull(
        self, keys: Iterable[str] | None = None, **options: Unpack[PullOptions]
    ) -> dict[str, np.ndarray]: ...

    async def push_pull(
        self,
        grads: Mapping[str, np.ndarray],
        keys: Iterable[str] | None = None,
        **options: Unpack[PushPullOptions],
    ) -> dict[str, np.ndarray]: ...

    async def clock(self) -> int: ...

    async def init_table(self, spec: TableSpec) -> tuple[bool, TableSpec]: ...

    async def pull_rows(
        self, table: str, ids: ArrayLike, *, timeout_s: float | None = None, observer: bool = False
    ) -> np.ndarray: ...

    async def push_rows(
        self, table: str, ids: ArrayLike, grads: ArrayLike, *, timeout_s: float | None = None
    ) -> RowPushAck: ...

    async def push_pull_rows(
        self,
        table: str,
        push_ids: ArrayLike,
        grads: ArrayLike,
        pull_ids: ArrayLike,
        *,
        timeout_s: float | None = None,
    ) -> np.ndarray: ...

    async def pull_rows_many(
        self, ids: TableIds, **options: Unpack[PullRowsManyOptions]
    ) -> dict[str, np.ndarray]: ...

    async def push_rows_many(
        self, ids: TableIds, grads: Mapping[str, ArrayLike], *, timeout_s: float | None = None
    ) -> dict[str, RowPushAck]: ...

    async def status(self) -> pb.StatusResponse: ...

    async def leave(self) -> None: ...

    async def close(self) -> None: ...


class SyncParameterClient(Protocol):
    """The blocking worker surface: :class:`ParameterClient`'s methods, each returning its
    result instead of a coroutine."""

    def init(
        self, tensors: Mapping[str, np.ndarray], rule: UpdateRule | None = None
    ) -> dict[str, np.ndarray]: ...

    def wait_for_workers(self, n: int, *, timeout_s: float = 60.0) -> int: ...

    def progress(self, worker_name: str | None = None) -> WorkerProgress: ...

    def push(self, grads: Mapping[str, np.ndarray], **options: Unpack[PushOptions]) -> PushAck: ...

    def pull(
        self, keys: Iterable[str] | None = None, **options: Unpack[PullOptions]
    ) -> dict[str, np.ndarray]: ...

    def push_pull(
        self,
        grads: Mapping[str, np.ndarray],
        keys: Iterable[str] | None = None,
        **options: Unpack[PushPullOptions],
    ) -> dict[str, np.ndarray]: ...

    def clock(self) -> int: ...

    def init_table(self, spec: TableSpec) -> tuple[bool, TableSpec]: ...

    def pull_rows(
        self, table: str, ids: ArrayLike, *, timeout_s: float | None = None, observer: bool = False
    ) -> np.ndarray: ...

    def push_rows(
        self, table: str, ids: ArrayLike, grads: ArrayLike, *, timeout_s: float | None = None
    ) -> RowPushAck: ...

    def push_pull_rows(
        self,
        table: str,
        push_ids: ArrayLike,
        grads: ArrayLike,
        pull_ids: ArrayLike,
        *,
        timeout_s: float | None = None,
    ) -> np.ndarray: ...

    def pull_rows_many(
        self, ids: TableIds, **options: Unpack[PullRowsManyOptions]
    ) -> dict[str, np.ndarray]: ...

    def push_rows_many(
        self, ids: TableIds, grads: Mapping[str, ArrayLike], *, timeout_s: float | None = None
    ) -> dict[str, RowPushAck]: ...

    def status(self) -> pb.StatusResponse: ...

    def leave(self) -> None: ...

    def close(self) -> None: ...


if TYPE_CHECKING:  # mypy checks each client against its protocol here
    from paramserver.worker_client.client import WorkerClient
    from paramserver.worker_client.cluster import ClusterWorkerClient
    from paramserver.worker_client.sharded import ShardedWorkerClient
    from paramserver.worker_client.sync import SyncWorkerClient

    def _implements(
        one: WorkerClient,
        many: ShardedWorkerClient,
        either: ClusterWorkerClient,
        blocking: SyncWorkerClient,
    ) -> tuple[ParameterClient, ParameterClient, ParameterClient, SyncParameterClient]:
        return one, many, either, blocking
