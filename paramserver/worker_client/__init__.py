"""Worker client: async sessions with a parameter-server shard, plus a blocking wrapper.

``connect(address, worker_name=...)`` returns an async context manager
(:class:`WorkerClient`); ``connect_sync`` returns the blocking :class:`SyncWorkerClient`.
Given any shard of a sharded cluster, ``connect`` routes over every shard
(:class:`ClusterWorkerClient`, also ``connect_cluster``).
``connect_reduction(address, worker_name=...)`` opens a session with a reduction server
(:class:`ReductionClient`); :class:`GossipWorker` averages by push-sum among peers found through
a reduction server in gossip mode. Sparse embedding tables: ``init_table`` / ``pull_rows`` /
``push_rows`` with a :class:`TableSpec` (see ``docs/embedding-tables.md``).
"""

from paramserver.server.optimizers import UpdateRule
from paramserver.server.tables import Initializer, TableRule, TableSpec
from paramserver.worker_client.client import PushAck, WorkerClient, connect
from paramserver.worker_client.gossip import GossipWorker
from paramserver.worker_client.reduction import ReductionClient, connect_reduction
from paramserver.worker_client.retry import RetryPolicy
from paramserver.worker_client.sharded import ClusterWorkerClient, connect_cluster
from paramserver.worker_client.sync import SyncWorkerClient, connect_sync
from paramserver.worker_client.tables import RowPushAck

__all__ = [
    "ClusterWorkerClient",
    "GossipWorker",
    "Initializer",
    "PushAck",
    "ReductionClient",
    "RetryPolicy",
    "RowPushAck",
    "SyncWorkerClient",
    "TableRule",
    "TableSpec",
    "UpdateRule",
    "WorkerClient",
    "connect",
    "connect_cluster",
    "connect_reduction",
    "connect_sync",
]
