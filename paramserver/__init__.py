"""paramserver: an asyncio, gRPC-networked parameter server with an SPMD block-transfer layer.

The public API is this package's ``__all__``::

    import paramserver as ps

    with ps.local_cluster(shards=2, consistency="ssp", staleness=2) as cluster:
        with ps.connect_sync(cluster.address, worker_name="w0") as worker:
            worker.init({"w": np.zeros(4, np.float32)}, rule=ps.UpdateRule("sgd", lr=0.1))
            worker.push({"w": np.ones(4, np.float32)})
            print(worker.pull(["w"])["w"])

- Sessions with a server: :func:`connect` (async; routes over every shard of a sharded cluster),
  :func:`connect_sync` (blocking), :func:`connect_from_env` / :func:`connect_sync_from_env`
  (the server and worker name a launcher such as ``paramserver run`` sets in the environment),
  :class:`WorkerClient`, :class:`ClusterWorkerClient`,
  :class:`SyncWorkerClient`, :class:`PushAck`, :class:`RowPushAck`, :class:`RetryPolicy`,
  :class:`ClientSecurity`.
- What a key or table is: :class:`UpdateRule` (server-side optimizer of a dense key),
  :class:`TableSpec`, :class:`TableRule`, :class:`Initializer` (embedding tables).
- Compression of pushed gradients: :class:`Cast`, :class:`TopK`.
- A cluster on this host: :func:`local_cluster`, :class:`LocalCluster`.
- Reduction service and gossip: :func:`connect_reduction`, :class:`ReductionClient`,
  :class:`GossipWorker`.
- SPMD block transfers: :class:`SpmdParallelWorkers`, :class:`Tier`, :class:`Layout`.
- Errors: :class:`ParamServerError` and its subclasses (each knows its gRPC status code;
  :mod:`paramserver.errors` holds the whole tree).

Importing this package creates no asyncio objects and opens no sockets; every name above loads
its module on first use (the command line starts without them).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from paramserver.cli.demos.local_cluster import LocalCluster, local_cluster
    from paramserver.core.optimizers import UpdateRule
    from paramserver.core.tables import Initializer, TableRule, TableSpec
    from paramserver.errors import (
        Aborted,
        AlreadyExists,
        DimensionMismatch,
        FailedPrecondition,
        InvalidArgument,
        KeyNotFound,
        ParamServerError,
        PermissionDenied,
        ResourceExhausted,
        Unauthenticated,
        Unavailable,
        WaitTimeout,
    )
    from paramserver.reduction import GossipWorker, ReductionClient, connect_reduction
    from paramserver.security.tls import ClientSecurity
    from paramserver.spmd import Layout, SpmdParallelWorkers, Tier
    from paramserver.worker_client import (
        ClusterWorkerClient,
        PushAck,
        RetryPolicy,
        RowPushAck,
        SyncWorkerClient,
        WorkerClient,
        connect,
        connect_from_env,
        connect_sync,
        connect_sync_from_env,
    )
    from paramserver.worker_client.compression import Cast, TopK

__version__ = "0.1.0"

_LAZY = {
    "LocalCluster": "paramserver.cli.demos.local_cluster",
    "local_cluster": "paramserver.cli.demos.local_cluster",
    "UpdateRule": "paramserver.core.optimizers",
    "Initializer": "paramserver.core.tables",
    "TableRule": "paramserver.core.tables",
    "TableSpec": "paramserver.core.tables",
    "GossipWorker": "paramserver.reduction",
    "ReductionClient": "paramserver.reduction",
    "connect_reduction": "paramserver.reduction",
    "ClientSecurity": "paramserver.security.tls",
    "Layout": "paramserver.spmd",
    "SpmdParallelWorkers": "paramserver.spmd",
    "Tier": "paramserver.spmd",
    "ClusterWorkerClient": "paramserver.worker_client",
    "PushAck": "paramserver.worker_client",
    "RetryPolicy": "paramserver.worker_client",
    "RowPushAck": "paramserver.worker_client",
    "SyncWorkerClient": "paramserver.worker_client",
    "WorkerClient": "paramserver.worker_client",
    "connect": "paramserver.worker_client",
    "connect_sync": "paramserver.worker_client",
    "connect_from_env": "paramserver.worker_client.env",
    "connect_sync_from_env": "paramserver.worker_client.env",
    "Cast": "paramserver.worker_client.compression",
    "TopK": "paramserver.worker_client.compression",
    **{
        name: "paramserver.errors"
        for name in (
            "Aborted",
            "AlreadyExists",
            "DimensionMismatch",
            "FailedPrecondition",
            "InvalidArgument",
            "KeyNotFound",
            "ParamServerError",
            "PermissionDenied",
            "ResourceExhausted",
            "Unauthenticated",
            "Unavailable",
            "WaitTimeout",
        )
    },
}

__all__ = [
    "Aborted",
    "AlreadyExists",
    "Cast",
    "ClientSecurity",
    "ClusterWorkerClient",
    "DimensionMismatch",
    "FailedPrecondition",
    "GossipWorker",
    "Initializer",
    "InvalidArgument",
    "KeyNotFound",
    "Layout",
    "LocalCluster",
    "ParamServerError",
    "PermissionDenied",
    "PushAck",
    "ReductionClient",
    "ResourceExhausted",
    "RetryPolicy",
    "RowPushAck",
    "SpmdParallelWorkers",
    "SyncWorkerClient",
    "TableRule",
    "TableSpec",
    "Tier",
    "TopK",
    "Unauthenticated",
    "Unavailable",
    "UpdateRule",
    "WaitTimeout",
    "WorkerClient",
    "__version__",
    "connect",
    "connect_from_env",
    "connect_reduction",
    "connect_sync",
    "connect_sync_from_env",
    "local_cluster",
]


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'paramserver' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
