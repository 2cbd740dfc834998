"""paramserver: an asyncio, gRPC-networked parameter server with an SPMD block-transfer layer.

``paramserver.local_cluster(shards=..., consistency=...)`` starts real server processes on
127.0.0.1 for one ``async with`` / ``with`` block; ``paramserver.connect(address,
worker_name)`` opens a worker session (see :mod:`paramserver.worker_client`).

Importing this package creates no asyncio objects and opens no sockets; the names above load
their modules on first use (the command line starts without them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from paramserver.cli.demos.local_cluster import LocalCluster, local_cluster
    from paramserver.worker_client import connect, connect_sync

__version__ = "0.1.0"

__all__ = ["LocalCluster", "__version__", "connect", "connect_sync", "local_cluster"]

_LAZY = {
    "LocalCluster": "paramserver.cli.demos.local_cluster",
    "local_cluster": "paramserver.cli.demos.local_cluster",
    "connect": "paramserver.worker_client",
    "connect_sync": "paramserver.worker_client",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'paramserver' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
