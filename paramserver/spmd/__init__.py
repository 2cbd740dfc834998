"""SPMD block-transfer layer: tiered block pools on rank servers, driven as one group.

After Dynamo KVBM's ``SpmdParallelWorkers`` (docs/spmd.md). Importing this package creates no
asyncio objects and opens no sockets.

Public API::

    from paramserver.spmd import SpmdParallelWorkers, Tier, ObjectKeys, RemoteLayout

    async with SpmdParallelWorkers(["127.0.0.1:50051", "127.0.0.1:50052"]) as group:
        note = await group.execute_local_transfer(Tier.G2, Tier.G3, [0, 1], [0, 1])
        result = await note            # TransferResult, or raises TransferFailed

Modules: :mod:`~paramserver.spmd.layout` (layouts, tiers), :mod:`~paramserver.spmd.hashing`
(sequence hashes), :mod:`~paramserver.spmd.planning` (pure validation/planning/merging),
:mod:`~paramserver.spmd.pools` (G1/G2/G3 pools), :mod:`~paramserver.spmd.objects` (G4 store),
:mod:`~paramserver.spmd.rank_server` (servicer, transfers, daemon),
:mod:`~paramserver.spmd.rank_client`,
:mod:`~paramserver.spmd.group` (the group), :mod:`~paramserver.spmd.notification`,
:mod:`~paramserver.cli.demos.rank_launcher`, :mod:`~paramserver.cli.demos.spmd_demo`,
:mod:`~paramserver.cli.rank`.
"""

from __future__ import annotations

from paramserver.spmd.group import ObjectKeys, RemoteDescriptor, RemoteLayout, SpmdParallelWorkers
from paramserver.spmd.hashing import content_hash, object_key, sequence_hash, sequence_hashes
from paramserver.spmd.layout import Layout, Tier
from paramserver.spmd.notification import TransferCompleteNotification, TransferResult
from paramserver.spmd.objects import FilesystemObjectStore, ObjectStore
from paramserver.spmd.planning import KeyOutcome, KeyPresence, Placement, RankTransferResult
from paramserver.spmd.transfer_errors import (
    BlockNotValid,
    BlocksBusy,
    CommandTimeout,
    ObjectNotFound,
    RankFailures,
    RemoteNotConnected,
    StaleIncarnation,
    TierNotRegistered,
    TransferFailed,
)

__all__ = [
    "BlockNotValid",
    "BlocksBusy",
    "CommandTimeout",
    "FilesystemObjectStore",
    "KeyOutcome",
    "KeyPresence",
    "Layout",
    "ObjectKeys",
    "ObjectNotFound",
    "ObjectStore",
    "Placement",
    "RankFailures",
    "RankTransferResult",
    "RemoteDescriptor",
    "RemoteLayout",
    "RemoteNotConnected",
    "SpmdParallelWorkers",
    "StaleIncarnation",
    "Tier",
    "TierNotRegistered",
    "TransferCompleteNotification",
    "TransferFailed",
    "TransferResult",
    "content_hash",
    "object_key",
    "sequence_hash",
    "sequence_hashes",
]
