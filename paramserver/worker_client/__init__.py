"""Worker client: async sessions with a parameter-server shard, plus a blocking wrapper.

``connect(address, worker_name=...)`` returns an async context manager
(:class:`WorkerClient`); ``connect_sync`` returns the blocking :class:`SyncWorkerClient`.
Given any shard of a sharded cluster, ``connect`` routes over every shard
(:class:`ClusterWorkerClient`, also ``connect_cluster``).
``connect_reduction(address, worker_name=...)`` opens a session with a reduction server
(:class:`ReductionClient`); :class:`GossipWorker` averages by push-sum among peers found through
a reduction server in gossip mode.
"""

from paramserver.server.optimizers import UpdateRule
from paramserver.worker_client.client import PushAck, WorkerClient, connect
from paramserver.worker_client.gossip import GossipWorker
from paramserver.worker_client.reduction import ReductionClient, connect_reduction
from paramserver.worker_client.retry import RetryPolicy
from paramserver.worker_client.sharded import ClusterWorkerClient, connect_cluster
from paramserver.worker_client.sync import SyncWorkerClient, connect_sync

__all__ = [
    "ClusterWorkerClient",
    "GossipWorker",
    "PushAck",
    "ReductionClient",
    "RetryPolicy",
    "SyncWorkerClient",
    "UpdateRule",
    "WorkerClient",
    "connect",
    "connect_cluster",
    "connect_reduction",
    "connect_sync",
]
