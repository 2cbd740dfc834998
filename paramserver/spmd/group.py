"""``SpmdParallelWorkers``: one logical block-transfer command, fanned out to every rank.

After Dynamo KVBM's ``SpmdParallelWorkers`` (``kvbm-engine`` ``worker/group``): a group of
rank-indexed workers that executes every operation on all of them in parallel and aggregates
their transfer completions into one notification per logical operation. Here each rank is a
``paramserver rank-server`` process reached over gRPC, and the seed's faults are corrected:

* **Validate everywhere, then execute.** Every command is validated for *every* rank before any
  rank is contacted, with the same pure rules the rank servers apply
  (:mod:`paramserver.spmd.planning`), against the layouts each rank exported when the group was
  opened (and, for remote commands, the layouts the peer ranks exported to
  :meth:`SpmdParallelWorkers.connect_remote`). A refusal on any rank raises before dispatch and
  names every refusing rank, so no rank starts a command another rank would refuse. Each
  command also carries each rank's incarnation id, so a rank server restarted since the group
  read its metadata refuses (FAILED_PRECONDITION) instead of acting on stale layouts; the rank
  servers re-validate everything (they serve other clients too).
* **Concurrent dispatch, merged completion.** One task per rank; one
  :class:`~paramserver.spmd.notification.TransferCompleteNotification` that completes only when
  every rank has finished and fails with the error of every failing rank, each naming its rank,
  carrying the other ranks' results. Every rank call carries the command's deadline, so a dead
  or hung rank cannot stall the merge.
* **connect_remote is idempotent.** Re-connecting an instance replaces all of its old mappings
  (including ranks that no longer exist); the group records the mapping only after every rank
  imported successfully, and rolls the ranks back to the previous mapping when one fails.
* **Object results merge by key.** ``has_blocks`` reports a block present only if every rank has
  its shard; ``put_blocks`` / ``get_blocks`` merge per-rank answers by sequence hash, never by
  list position, and a key succeeds only if every rank succeeded for it.

Lifecycle: ``async with SpmdParallelWorkers(addresses) as group`` or
``group = await SpmdParallelWorkers.create(addresses)`` then ``await group.close()``. The
constructor opens nothing; channels belong to the loop that opened the group. Opening, the
per-rank channels and the fan-out are the base class's
(:class:`~paramserver.spmd.rank_group.RankGroup`); this module holds the commands.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import uuid
from collections.abc import Mapping, Sequence
from typing import Literal

import numpy as np
import numpy.typing as npt

from paramserver.api.v1 import spmd_pb2
from paramserver.errors import InvalidArgument, ParamServerError
from paramserver.spmd.layout import Layout, Tier
from paramserver.spmd.notification import TransferCompleteNotification, TransferResult
from paramserver.spmd.planning import (
    KeyOutcome,
    KeyPresence,
    check_local_transfer,
    check_object_transfer,
    check_remote_transfer,
    expand_per_rank,
    merge_key_results,
    merge_presence,
)
from paramserver.spmd.rank_client import RankClient
from paramserver.spmd.rank_group import RankGroup, layouts_of
from paramserver.spmd.transfer_errors import RankFailures, RemoteNotConnected, TierNotRegistered

__all__ = [
    "BlockIds",
    "ObjectKeys",
    "RemoteDescriptor",
    "RemoteLayout",
    "SpmdParallelWorkers",
    "TransferResult",
]

logger = logging.getLogger(__name__)

BlockIds = Sequence[int] | Mapping[int, Sequence[int]]
"""Block ids: one list for every rank (SPMD), or ``{rank: ids}`` (missing ranks: none)."""

_KEY_STATUS = {
    spmd_pb2.KEY_STATUS_STORED: "stored",
    spmd_pb2.KEY_STATUS_ALREADY_PRESENT: "already_present",
    spmd_pb2.KEY_STATUS_RETRIEVED: "retrieved",
    spmd_pb2.KEY_STATUS_NOT_FOUND: "not_found",
    spmd_pb2.KEY_STATUS_FAILED: "failed",
}


@dataclasses.dataclass(frozen=True)
class RemoteLayout:
    """Blocks of a connected remote instance's tier (rank i addresses the peer's rank i).

    Attributes:
        instance_id: the remote instance (see :meth:`SpmdParallelWorkers.connect_remote`).
        tier: remote tier (G1, G2 or G3).
        block_ids: remote block ids, one list for every rank or ``{rank: ids}``.
    """

    instance_id: str
    tier: Tier
    block_ids: BlockIds


@dataclasses.dataclass(frozen=True)
class ObjectKeys:
    """Objects of the object tier: each rank uses its own shard ``"{rank}/{sequence_hash}"``.

    Attributes:
        sequence_hashes: one list for every rank, or ``{rank: hashes}``; unique per rank.
    """

    sequence_hashes: BlockIds


RemoteDescriptor = RemoteLayout | ObjectKeys
"""Source of an onboard / destination of an offload (Dynamo's ``RemoteDescriptor``)."""


@dataclasses.dataclass(frozen=True)
class _Connected:
    metadata: tuple[spmd_pb2.RankMetadata, ...]
    layouts: tuple[dict[Tier, Layout], ...]


class SpmdParallelWorkers(RankGroup):
    """A group of rank servers driven as one SPMD worker (Dynamo KVBM's SpmdParallelWorkers).

    Args:
        rank_addresses: ``host:port`` of rank 0, 1, ... of one instance; position i must be
            the rank server whose rank is i (checked on open).
        default_timeout_s: deadline of commands called without ``timeout_s``, seconds.
        security: TLS / mutual TLS and bearer token towards every rank server
            (:class:`paramserver.security.tls.ClientSecurity`; ``connect_remote`` needs an admin
            token when the rank servers check tokens); None: plain text, no token.

    Raises:
        InvalidArgument: no addresses (INVALID_ARGUMENT).
    """

    @functools.cached_property
    def _remotes(self) -> dict[str, _Connected]:
        """The remote instances connected so far, by instance id (empty at first)."""
        return {}

    def has_remote_metadata(self, instance_id: str) -> bool:
        """True when :meth:`connect_remote` for ``instance_id`` succeeded (and was not replaced
        by a failed re-connect)."""
        return instance_id in self._remotes

    # ------------------------------------------------------------------ metadata

    async def export_metadata(self, timeout_s: float | None = None) -> list[spmd_pb2.RankMetadata]:
        """Every rank's metadata, ordered by rank (what a peer passes to connect_remote).

        Raises:
            RankFailures: a rank failed (every failing rank named).
        """
        self._require_open()
        t = self._timeout(timeout_s)
        results = await self._fan_out("export_metadata", lambda c: c.export_metadata(t))
        return [results[r] for r in range(self.worker_count())]

    async def import_metadata(
        self, metadata: Sequence[spmd_pb2.RankMetadata], timeout_s: float | None = None
    ) -> list[bool]:
        """Raw import: rank i imports ``metadata[i]`` (no group-side bookkeeping; prefer
        :meth:`connect_remote`).

        Returns:
            Per rank, whether an older mapping of that instance was replaced.

        Raises:
            InvalidArgument: ``len(metadata) != worker_count()`` (INVALID_ARGUMENT).
            RankFailures: a rank refused (every failing rank named).
        """
        self._require_open()
        if len(metadata) != self.worker_count():
            raise InvalidArgument(
                f"import_metadata got {len(metadata)} entries for {self.worker_count()} ranks"
            )
        t = self._timeout(timeout_s)
        results = await self._fan_out(
            "import_metadata",
            lambda c: c.unary(
                "ImportMetadata", spmd_pb2.ImportMetadataRequest(remote=metadata[c.rank]), t
            ),
        )
        return [bool(results[r].replaced) for r in range(self.worker_count())]

    async def connect_remote(
        self,
        instance_id: str,
        metadata: Sequence[spmd_pb2.RankMetadata],
        timeout_s: float | None = None,
    ) -> None:
        """Connect to (or re-connect) remote instance ``instance_id``: rank i imports the
        peer's rank i. Idempotent; replaces every old mapping of that instance.

        The metadata is matched to ranks by its ``rank`` field, not by list position. The
        mapping is recorded only after every rank imported; if any rank fails, ranks that did
        import are rolled back to the previous mapping (or forget the instance) and the group
        keeps its previous state.

        Args:
            instance_id: the remote instance.
            metadata: one entry per remote rank (``export_metadata`` of the remote group).
            timeout_s: deadline, seconds.

        Raises:
            InvalidArgument: wrong count, wrong instance ids, duplicate or missing ranks, or
                malformed layouts (INVALID_ARGUMENT); nothing is imported.
            RankFailures: a rank refused the import (every failing rank named).
        """
        self._require_open()
        n = self.worker_count()
        if len(metadata) != n:
            raise InvalidArgument(
                f"connect_remote({instance_id!r}): {len(metadata)} remote ranks but this group "
                f"has {n}; rank i pairs with rank i"
            )
        by_rank: dict[int, spmd_pb2.RankMetadata] = {}
        for md in metadata:
            if md.instance_id != instance_id:
                raise InvalidArgument(
                    f"connect_remote({instance_id!r}): metadata of rank {md.rank} belongs to "
                    f"instance {md.instance_id!r}"
                )
            if md.rank in by_rank:
                raise InvalidArgument(f"connect_remote: rank {md.rank} appears twice")
            by_rank[int(md.rank)] = md
        if sorted(by_rank) != list(range(n)):
            raise InvalidArgument(
                f"connect_remote: remote ranks {sorted(by_rank)} are not 0..{n - 1}"
            )
        ordered = tuple(by_rank[r] for r in range(n))
        layouts = tuple(layouts_of(md) for md in ordered)  # validates the layouts
        t = self._timeout(timeout_s)
        outcomes = await self._fan_out_settled(
            lambda c: c.unary(
                "ImportMetadata", spmd_pb2.ImportMetadataRequest(remote=ordered[c.rank]), t
            )
        )
        failures = {r: o for r, o in outcomes.items() if isinstance(o, ParamServerError)}
        if failures:
            await self._roll_back(instance_id, [r for r in outcomes if r not in failures], t)
            ok = {r: o for r, o in outcomes.items() if r not in failures}
            raise RankFailures("connect_remote", failures, ok, n)
        self._remotes[instance_id] = _Connected(ordered, layouts)
        logger.debug("connected remote instance %s (%d ranks)", instance_id, n)

    async def _roll_back(self, instance_id: str, ranks: list[int], timeout_s: float) -> None:
        previous = self._remotes.get(instance_id)

        async def undo(c: RankClient) -> object:
            if previous is not None:
                request = spmd_pb2.ImportMetadataRequest(remote=previous.metadata[c.rank])
                return await c.unary("ImportMetadata", request, timeout_s)
            return await c.unary(
                "ForgetRemote", spmd_pb2.ForgetRemoteRequest(instance_id=instance_id), timeout_s
            )

        undone = await self._fan_out_settled(undo, ranks=ranks)
        for rank, outcome in undone.items():
            if isinstance(outcome, ParamServerError):
                logger.warning(
                    "could not roll back rank %d after a failed connect: %s", rank, outcome
                )

    async def disconnect_remote(self, instance_id: str, timeout_s: float | None = None) -> None:
        """Forget remote instance ``instance_id`` on every rank and in the group.

        Raises:
            RankFailures: a rank failed (every failing rank named); the group forgets anyway.
        """
        self._require_open()
        t = self._timeout(timeout_s)
        self._remotes.pop(instance_id, None)
        await self._fan_out(
            "disconnect_remote",
            lambda c: c.unary(
                "ForgetRemote", spmd_pb2.ForgetRemoteRequest(instance_id=instance_id), t
            ),
        )

    # ------------------------------------------------------------------ transfers

    async def execute_local_transfer(
        self,
        src_tier: Tier | str,
        dst_tier: Tier | str,
        src_block_ids: BlockIds,
        dst_block_ids: BlockIds,
        *,
        timeout_s: float | None = None,
    ) -> TransferCompleteNotification:
        """Copy blocks between two tiers on every rank (G1/G2/G3; never G4).

        Args:
            src_tier: source tier.
            dst_tier: destination tier.
            src_block_ids: source ids, one list for all ranks or ``{rank: ids}``.
            dst_block_ids: destination ids (unique), same shape as ``src_block_ids``.
            timeout_s: deadline of the command on every rank, seconds.

        Returns:
            The merged completion (await it or poll it).

        Raises:
            InvalidArgument: a rule broken on any rank (INVALID_ARGUMENT), raised before any
                rank starts; TierNotRegistered (FAILED_PRECONDITION) for a tier a rank lacks.
        """
        self._require_open()
        src_t, dst_t = Tier.parse(src_tier), Tier.parse(dst_tier)
        n = self.worker_count()
        src_ids = expand_per_rank(src_block_ids, n, "src_block_ids")
        dst_ids = expand_per_rank(dst_block_ids, n, "dst_block_ids")
        self._refuse_if_any(
            "execute_local_transfer",
            {
                r: check_local_transfer(
                    src_tier=src_t,
                    dst_tier=dst_t,
                    src_ids=src_ids[r],
                    dst_ids=dst_ids[r],
                    layouts=self._layouts[r],
                )
                for r in range(n)
            },
        )
        t = self._timeout(timeout_s)
        cid = uuid.uuid4().hex
        requests = {
            r: spmd_pb2.LocalTransferRequest(
                options=self._options(r, t, cid),
                src_tier=src_t.wire,
                dst_tier=dst_t.wire,
                src_block_ids=src_ids[r],
                dst_block_ids=dst_ids[r],
            )
            for r in range(n)
        }
        return self._dispatch("execute_local_transfer", "LocalTransfer", requests, t)

    async def execute_remote_onboard(
        self,
        src: RemoteDescriptor,
        dst_tier: Tier | str,
        dst_block_ids: BlockIds,
        *,
        timeout_s: float | None = None,
        allow_shared_memory: bool = True,
    ) -> TransferCompleteNotification:
        """Pull blocks into a local tier on every rank, from a connected instance's layout
        (rank i reads the peer's rank i) or from the object tier (rank i reads its shards).

        Args:
            src: :class:`RemoteLayout` or :class:`ObjectKeys`.
            dst_tier: local destination tier.
            dst_block_ids: destination ids (unique), one list for all ranks or per rank.
            timeout_s: deadline, seconds.
            allow_shared_memory: a G2 source on the same host is copied through shared memory
                instead of a gRPC stream.

        Returns:
            The merged completion; each rank's placements list source -> destination.

        Raises:
            InvalidArgument: a rule broken on any rank, before any rank starts
                (INVALID_ARGUMENT), e.g. three hashes for two destination ids.
            RemoteNotConnected: ``src`` names an instance never connected (NOT_FOUND).
        """
        return self._remote_command(
            "onboard", dst_tier, dst_block_ids, src, timeout_s, allow_shared_memory
        )

    async def execute_remote_offload(
        self,
        src_tier: Tier | str,
        src_block_ids: BlockIds,
        dst: RemoteDescriptor,
        *,
        timeout_s: float | None = None,
    ) -> TransferCompleteNotification:
        """Push blocks of a local tier on every rank to a connected instance's layout (rank i
        writes the peer's rank i) or to the object tier (rank i writes its shards).

        Args:
            src_tier: local source tier.
            src_block_ids: source ids, one list for all ranks or per rank.
            dst: :class:`RemoteLayout` (destination ids unique) or :class:`ObjectKeys`.
            timeout_s: deadline, seconds.

        Returns:
            The merged completion.

        Raises:
            InvalidArgument: a rule broken on any rank, before any rank starts
                (INVALID_ARGUMENT).
            RemoteNotConnected: ``dst`` names an instance never connected (NOT_FOUND).
        """
        return self._remote_command("offload", src_tier, src_block_ids, dst, timeout_s, False)

    def _remote_command(
        self,
        direction: Literal["onboard", "offload"],
        local_tier: Tier | str,
        local_block_ids: BlockIds,
        other: RemoteDescriptor,
        timeout_s: float | None,
        allow_shared_memory: bool,
    ) -> TransferCompleteNotification:
        """The one remote path: validate on every rank, then send ``RemoteOnboard`` (the local
        blocks are the destination, ``other`` the source) or ``RemoteOffload`` (the reverse)."""
        self._require_open()
        onboard = direction == "onboard"
        operation = f"execute_remote_{direction}"
        tier = Tier.parse(local_tier)
        n = self.worker_count()
        local_ids = expand_per_rank(local_block_ids, n, f"{'dst' if onboard else 'src'}_block_ids")
        t = self._timeout(timeout_s)
        cid = uuid.uuid4().hex
        # Each rank's other end: objects, or a connected instance's blocks (with the shared
        # memory choice of an onboard).
        objects: list[spmd_pb2.ObjectBlocks | None] = [None] * n
        layouts: list[spmd_pb2.RemoteLayoutBlocks | None] = [None] * n
        shared_memory = False
        if isinstance(other, ObjectKeys):
            hashes = expand_per_rank(other.sequence_hashes, n, "sequence_hashes")
            self._refuse_objects(operation, tier, local_ids, hashes, into_blocks=onboard)
            objects = [spmd_pb2.ObjectBlocks(sequence_hashes=hashes[r]) for r in range(n)]
        else:
            if other.instance_id not in self._remotes:
                raise RemoteNotConnected(
                    f"no remote metadata for instance {other.instance_id!r}; call "
                    "connect_remote first"
                )
            connected = self._remotes[other.instance_id]
            r_tier = Tier.parse(other.tier)
            remote_ids = expand_per_rank(
                other.block_ids, n, f"{'src' if onboard else 'dst'} block_ids"
            )
            self._refuse_if_any(
                operation,
                {
                    r: check_remote_transfer(
                        local_tier=tier,
                        local_ids=local_ids[r],
                        local_layouts=self._layouts[r],
                        remote_tier=r_tier,
                        remote_ids=remote_ids[r],
                        remote_layouts=connected.layouts[r],
                        onboard=onboard,
                    )
                    for r in range(n)
                },
            )
            layouts = [
                spmd_pb2.RemoteLayoutBlocks(
                    instance_id=other.instance_id, tier=r_tier.wire, block_ids=remote_ids[r]
                )
                for r in range(n)
            ]
            shared_memory = allow_shared_memory
        requests: dict[int, spmd_pb2.RemoteOnboardRequest | spmd_pb2.RemoteOffloadRequest] = {}
        for r in range(n):
            options = self._options(r, t, cid)
            if onboard:
                requests[r] = spmd_pb2.RemoteOnboardRequest(
                    options=options,
                    dst_tier=tier.wire,
                    dst_block_ids=local_ids[r],
                    object=objects[r],
                    layout=layouts[r],
                    allow_shared_memory=shared_memory,
                )
            else:
                requests[r] = spmd_pb2.RemoteOffloadRequest(
                    options=options,
                    src_tier=tier.wire,
                    src_block_ids=local_ids[r],
                    object=objects[r],
                    layout=layouts[r],
                )
        method = "RemoteOnboard" if onboard else "RemoteOffload"
        return self._dispatch(operation, method, requests, t)

    def _refuse_objects(
        self,
        operation: str,
        tier: Tier,
        ids: Sequence[Sequence[int]],
        hashes: Sequence[Sequence[int]],
        *,
        into_blocks: bool,
    ) -> None:
        """Refuse before dispatch unless every rank may move ``ids`` <-> its ``hashes``."""
        self._refuse_if_any(
            operation,
            {
                r: check_object_transfer(
                    tier=tier,
                    ids=ids[r],
                    sequence_hashes=hashes[r],
                    layouts=self._layouts[r],
                    into_blocks=into_blocks,
                    object_tier=self._metadata[r].object_tier,
                )
                for r in range(self.worker_count())
            },
        )

    async def execute_remote_onboard_for_instance(
        self,
        instance_id: str,
        remote_tier: Tier | str,
        src_block_ids: BlockIds,
        dst_tier: Tier | str,
        dst_block_ids: BlockIds,
        *,
        timeout_s: float | None = None,
        allow_shared_memory: bool = True,
    ) -> TransferCompleteNotification:
        """Onboard from a connected instance by tier: the shorthand of
        ``execute_remote_onboard(RemoteLayout(instance_id, remote_tier, src_block_ids), ...)``.

        Raises:
            RemoteNotConnected: ``instance_id`` never connected (NOT_FOUND).
            InvalidArgument: a rule broken on any rank, before any rank starts.
        """
        return await self.execute_remote_onboard(
            RemoteLayout(instance_id, Tier.parse(remote_tier), src_block_ids),
            dst_tier,
            dst_block_ids,
            timeout_s=timeout_s,
            allow_shared_memory=allow_shared_memory,
        )

    # ------------------------------------------------------------------ object tier

    async def has_blocks(
        self, sequence_hashes: Sequence[int], *, timeout_s: float | None = None
    ) -> list[KeyPresence]:
        """Which blocks are in the object tier: present only if *every* rank has its shard.

        Args:
            sequence_hashes: keys to look up.
            timeout_s: deadline, seconds.

        Returns:
            One :class:`~paramserver.spmd.planning.KeyPresence` per key, in the given order; a
            rank that cannot answer counts as not having the shard.
        """
        self._require_open()
        keys = [int(h) for h in sequence_hashes]
        t = self._timeout(timeout_s)
        outcomes = await self._fan_out_settled(lambda c: c.has_objects(keys, timeout_s=t))
        per_rank = {r: o for r, o in outcomes.items() if not isinstance(o, ParamServerError)}
        for o in outcomes.values():
            if isinstance(o, ParamServerError):
                logger.warning("has_blocks: %s", o)
        return merge_presence(keys, per_rank, self.worker_count())

    async def put_blocks(
        self,
        sequence_hashes: Sequence[int],
        src_tier: Tier | str,
        block_ids: BlockIds,
        *,
        timeout_s: float | None = None,
    ) -> list[KeyOutcome]:
        """Store blocks as objects: rank r writes ``"{r}/{sequence_hash}"`` from its block.

        Args:
            sequence_hashes: unique keys, length n.
            src_tier: local source tier.
            block_ids: source ids (length n), one list for all ranks or per rank.
            timeout_s: deadline, seconds.

        Returns:
            One :class:`~paramserver.spmd.planning.KeyOutcome` per key in the given order,
            merged by key; ``ok`` only if every rank stored it or found it already present.

        Raises:
            InvalidArgument: a rule broken on any rank, before any rank starts.
        """
        return await self._object_op(
            "put_blocks", sequence_hashes, Tier.parse(src_tier), block_ids, False, timeout_s
        )

    async def get_blocks(
        self,
        sequence_hashes: Sequence[int],
        dst_tier: Tier | str,
        block_ids: BlockIds,
        *,
        timeout_s: float | None = None,
    ) -> list[KeyOutcome]:
        """Load objects into blocks: rank r copies ``"{r}/{sequence_hash}"`` into its block.

        Returns:
            One :class:`~paramserver.spmd.planning.KeyOutcome` per key in the given order,
            merged by key; ``ok`` only if every rank retrieved it.

        Raises:
            InvalidArgument: a rule broken on any rank, before any rank starts.
        """
        return await self._object_op(
            "get_blocks", sequence_hashes, Tier.parse(dst_tier), block_ids, True, timeout_s
        )

    async def _object_op(
        self,
        operation: str,
        sequence_hashes: Sequence[int],
        tier: Tier,
        block_ids: BlockIds,
        into_blocks: bool,
        timeout_s: float | None,
    ) -> list[KeyOutcome]:
        self._require_open()
        n = self.worker_count()
        keys = [int(h) for h in sequence_hashes]
        ids = expand_per_rank(block_ids, n, "block_ids")
        self._refuse_objects(operation, tier, ids, [keys] * n, into_blocks=into_blocks)
        t = self._timeout(timeout_s)
        cid = uuid.uuid4().hex

        async def call(c: RankClient) -> spmd_pb2.ObjectBlocksResponse:
            options = self._options(c.rank, t, cid)
            response: spmd_pb2.ObjectBlocksResponse
            if into_blocks:
                get = spmd_pb2.GetBlocksRequest(
                    options=options,
                    sequence_hashes=keys,
                    dst_tier=tier.wire,
                    dst_block_ids=ids[c.rank],
                )
                response = await c.unary("GetBlocks", get, t)
                return response
            put = spmd_pb2.PutBlocksRequest(
                options=options, sequence_hashes=keys, src_tier=tier.wire, src_block_ids=ids[c.rank]
            )
            response = await c.unary("PutBlocks", put, t)
            return response

        outcomes = await self._fan_out_settled(call)
        per_rank: dict[int, dict[int, tuple[str, str]]] = {}
        rank_errors: dict[int, str] = {}
        for r, o in outcomes.items():
            if isinstance(o, ParamServerError):
                rank_errors[r] = f"{o.code.name}: {o.message}"
                continue
            per_rank[r] = {
                int(k.sequence_hash): (_KEY_STATUS.get(k.status, "failed"), k.error)
                for k in o.results
            }
        return merge_key_results(keys, per_rank, rank_errors, n)

    # ------------------------------------------------------------------ block data helpers

    async def write_blocks(
        self,
        rank: int,
        tier: Tier | str,
        block_ids: Sequence[int],
        data: bytes | bytearray | memoryview | npt.NDArray[np.generic],
        *,
        timeout_s: float | None = None,
    ) -> int:
        """Overwrite blocks of one rank's tier from ``data`` (their bytes in id order).

        Args:
            rank: the rank.
            tier: its tier.
            block_ids: unique ids, length n.
            data: ``n * bytes_per_block`` bytes, or an array of shape ``(n, *block_shape)``
                and the layout's dtype (any array with exactly that many bytes is accepted).
            timeout_s: deadline, seconds.

        Returns:
            Bytes written.
        """
        self._require_open()
        t = Tier.parse(tier)
        return await self._clients[rank].write_blocks(
            t,
            [int(b) for b in block_ids],
            data,
            timeout_s=self._timeout(timeout_s),
            incarnation_id=self._metadata[rank].incarnation_id,
        )

    async def read_blocks(
        self,
        rank: int,
        tier: Tier | str,
        block_ids: Sequence[int],
        *,
        timeout_s: float | None = None,
    ) -> npt.NDArray[np.generic]:
        """Read blocks of one rank's tier.

        Returns:
            Array of shape ``(n, num_layers, outer_dim, page_size, inner_dim)`` and the
            layout's dtype.

        Raises:
            TierNotRegistered: the rank has no such tier (FAILED_PRECONDITION).
            BlockNotValid: a block holds no valid data (FAILED_PRECONDITION).
        """
        self._require_open()
        t = Tier.parse(tier)
        layout = self._layouts[rank].get(t)
        if layout is None:
            raise TierNotRegistered(f"rank {rank}: tier {t.name} not registered")
        raw = await self._clients[rank].read_blocks(
            t,
            [int(b) for b in block_ids],
            layout.bytes_per_block,
            timeout_s=self._timeout(timeout_s),
            incarnation_id=self._metadata[rank].incarnation_id,
        )
        return np.frombuffer(raw, dtype=layout.np_dtype).reshape(
            (len(block_ids), *layout.block_shape)
        )

    async def status(self, timeout_s: float = 5.0) -> list[spmd_pb2.RankStatusResponse]:
        """Every rank's counters, ordered by rank.

        Raises:
            RankFailures: a rank did not answer (every failing rank named).
        """
        results = await self._fan_out("status", lambda c: c.status(timeout_s))
        return [results[r] for r in range(self.worker_count())]
