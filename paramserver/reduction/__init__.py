"""Reduction service: gradients in, aggregates out, and push-sum gossip among peers.

``paramserver serve --mode reduce`` runs :mod:`paramserver.reduction.reduce_service`;
``connect_reduction(address, worker_name=...)`` opens a session with it
(:class:`ReductionClient`), and :class:`GossipWorker` averages by push-sum among peers found
through a reduction server in gossip mode (Kempe et al. 2003, :mod:`paramserver.core.push_sum`).
"""

from paramserver.reduction.gossip_worker import GossipWorker
from paramserver.reduction.reduce_client import ReductionClient, connect_reduction

__all__ = ["GossipWorker", "ReductionClient", "connect_reduction"]
