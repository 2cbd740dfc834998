"""Worker client: async sessions with a parameter-server shard, plus a blocking wrapper.

``connect(address, worker_name=...)`` returns an async context manager
(:class:`WorkerClient`); ``connect_sync`` returns the blocking :class:`SyncWorkerClient`.
"""

from paramserver.server.optimizers import UpdateRule
from paramserver.worker_client.client import PushAck, RetryPolicy, WorkerClient, connect
from paramserver.worker_client.sync import SyncWorkerClient, connect_sync

__all__ = [
    "PushAck",
    "RetryPolicy",
    "SyncWorkerClient",
    "UpdateRule",
    "WorkerClient",
    "connect",
    "connect_sync",
]
