"""Worker client: async sessions with a parameter-server shard, plus a blocking wrapper.

``connect(address, worker_name=...)`` returns an async context manager
(:class:`ClusterWorkerClient`: one :class:`WorkerClient` for a single-shard server, one per shard
for a sharded cluster, routing over every shard; also ``connect_cluster``); ``connect_sync``
returns the blocking :class:`SyncWorkerClient`; ``connect_from_env`` / ``connect_sync_from_env``
open the session a launcher's environment describes (:mod:`paramserver.worker_client.env`).
Their keyword arguments are typed once
(:class:`~paramserver.worker_client.options.ClientOptions`).
The reduction service's clients (``connect_reduction``, ``GossipWorker``) are in
:mod:`paramserver.reduction`. Sparse embedding tables: ``init_table`` / ``pull_rows`` /
``push_rows`` with a :class:`TableSpec`, and ``pull_rows_many`` / ``push_rows_many`` over several
tables in one request per shard (``{table: ids}`` or :class:`KeyedIds`; see
``docs/embedding-tables.md``).
"""

from paramserver.core.optimizers import UpdateRule
from paramserver.core.tables import Initializer, TableRule, TableSpec
from paramserver.worker_client.client import PushAck, WorkerClient, WorkerProgress
from paramserver.worker_client.cluster import ClusterWorkerClient, connect, connect_cluster
from paramserver.worker_client.embedding import RowPushAck
from paramserver.worker_client.env import WorkerEnv, connect_from_env, connect_sync_from_env
from paramserver.worker_client.keyed import KeyedIds
from paramserver.worker_client.retry import RetryPolicy
from paramserver.worker_client.sync import SyncWorkerClient, connect_sync

__all__ = [
    "ClusterWorkerClient",
    "Initializer",
    "KeyedIds",
    "PushAck",
    "RetryPolicy",
    "RowPushAck",
    "SyncWorkerClient",
    "TableRule",
    "TableSpec",
    "UpdateRule",
    "WorkerClient",
    "WorkerEnv",
    "WorkerProgress",
    "connect",
    "connect_cluster",
    "connect_from_env",
    "connect_sync",
    "connect_sync_from_env",
]
