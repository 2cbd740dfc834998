"""Pure, synchronous validation, planning and merging for the SPMD layer
(docs/architecture.md, docs/spmd.md).

Nothing here waits, touches a socket or an event loop: the rank server and the group call these
functions and act on the returned :class:`Verdict` / plan. That is what lets the rules be tested
exhaustively without a network (``tests/spmd/test_planning.py``).

Validation rules for every block-moving command (after Dynamo KVBM's ``SpmdParallelWorkers``,
corrected as issue #4 asks):

* source and destination id lists have equal lengths;
* every id lies in ``[0, num_blocks)`` of its layout;
* destination ids are unique;
* when source and destination are the same layout (same tier of the same rank) the two id sets
  do not overlap;
* source and destination blocks have the same byte size (shape and dtype);
* G4 (the object tier) is never an endpoint of a local transfer;
* a tier without a pool on that rank (G1 where no GPU is present) is refused as
  "not registered".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from paramserver.errors import InvalidArgument, ParamServerError
from paramserver.spmd.layout import Layout, Tier
from paramserver.spmd.transfer_errors import BlocksBusy, TierNotRegistered

__all__ = [
    "BlockReservations",
    "KeyOutcome",
    "KeyPresence",
    "Placement",
    "RankTransferResult",
    "Run",
    "StreamPiece",
    "Verdict",
    "check_local_transfer",
    "check_object_transfer",
    "check_remote_transfer",
    "coalesce_runs",
    "expand_per_rank",
    "merge_key_results",
    "merge_presence",
    "server_budget_s",
    "split_stream",
]

MAX_CHUNK_BYTES = 1 << 20
"""Largest data payload of one stream message (1 MiB), far below gRPC's 4 MiB default limit."""


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Outcome of a validation: ``ok``, or a refusal with its reason and error class."""

    ok: bool
    reason: str = ""
    error: type[ParamServerError] = InvalidArgument

    @classmethod
    def accept(cls) -> Verdict:
        """An accepting verdict."""
        return cls(True)

    @classmethod
    def refuse(cls, reason: str, error: type[ParamServerError] = InvalidArgument) -> Verdict:
        """A refusing verdict with a human-readable reason."""
        return cls(False, reason, error)

    def raise_if_refused(self, prefix: str = "") -> None:
        """Raise ``error(prefix + reason)`` when refused.

        Raises:
            ParamServerError: the verdict's error class (INVALID_ARGUMENT by default,
                FAILED_PRECONDITION for unregistered tiers and busy blocks).
        """
        if not self.ok:
            raise self.error(f"{prefix}{self.reason}")


@dataclasses.dataclass(frozen=True)
class Run:
    """A maximal run of consecutive ids: ``src_start + k -> dst_start + k`` for ``k < count``.

    ``index`` is the position of the run's first pair within the request.
    """

    src_start: int
    dst_start: int
    count: int
    index: int


@dataclasses.dataclass(frozen=True)
class StreamPiece:
    """Part of a stream chunk that falls inside one block.

    Attributes:
        index: position of the block within the request's id list.
        offset_in_block_bytes: where the piece starts inside that block, bytes.
        offset_in_chunk_bytes: where the piece starts inside the chunk's data, bytes.
        length_bytes: piece length, bytes.
    """

    index: int
    offset_in_block_bytes: int
    offset_in_chunk_bytes: int
    length_bytes: int


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one block came from and where it landed.

    ``src`` is a block id, or a sequence hash when ``src_is_object``; likewise ``dst``.
    """

    src: int
    dst: int
    src_is_object: bool = False
    dst_is_object: bool = False


@dataclasses.dataclass(frozen=True)
class RankTransferResult:
    """Completion of one command on one rank.

    Attributes:
        rank: the rank.
        bytes_moved: payload bytes copied, bytes.
        elapsed_s: wall time on the rank server, seconds.
        placements: one per block, in request order (empty when the rank had no blocks).
        path: ``"local"``, ``"shared-memory"``, ``"grpc"`` or ``"object"``.
    """

    rank: int
    bytes_moved: int
    elapsed_s: float
    placements: tuple[Placement, ...]
    path: str


@dataclasses.dataclass(frozen=True)
class KeyPresence:
    """Merged presence of one sequence hash over every rank of a group.

    Attributes:
        sequence_hash: the key.
        present: true only when every rank holds its shard.
        size_bytes: sum of the shards' sizes when present, else ``None``.
        ranks_present: ranks that hold their shard.
    """

    sequence_hash: int
    present: bool
    size_bytes: int | None
    ranks_present: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class KeyOutcome:
    """Merged outcome of one key of a put or get over every rank of a group.

    Attributes:
        sequence_hash: the key.
        ok: true only when every rank succeeded for this key.
        already_present: put only: every rank found its shard committed before this call.
        rank_status: rank -> status name (``"stored"``, ``"already_present"``,
            ``"retrieved"``, ``"not_found"``, ``"failed"``, ``"missing"``).
        errors: rank -> error message for every rank that failed this key.
    """

    sequence_hash: int
    ok: bool
    already_present: bool
    rank_status: Mapping[int, str]
    errors: Mapping[int, str]


# --------------------------------------------------------------------------- validation


def _check_ids(ids: Sequence[int], layout: Layout, role: str) -> Verdict:
    n = layout.num_blocks
    bad = [b for b in ids if not 0 <= b < n]
    if bad:
        shown = ", ".join(str(b) for b in bad[:8]) + (" ..." if len(bad) > 8 else "")
        return Verdict.refuse(f"{role} block ids out of range [0, {n}): {shown}")
    return Verdict.accept()


def _check_unique(ids: Sequence[int], role: str) -> Verdict:
    seen: set[int] = set()
    dups: list[int] = []
    for b in ids:
        if b in seen:
            dups.append(b)
        seen.add(b)
    if dups:
        return Verdict.refuse(f"{role} ids are not unique: {sorted(set(dups))[:8]}")
    return Verdict.accept()


def _first_refusal(*verdicts: Verdict) -> Verdict:
    for v in verdicts:
        if not v.ok:
            return v
    return Verdict.accept()


def check_local_transfer(
    *,
    src_tier: Tier,
    dst_tier: Tier,
    src_ids: Sequence[int],
    dst_ids: Sequence[int],
    layouts: Mapping[Tier, Layout],
) -> Verdict:
    """Validate a transfer between two tiers of one rank.

    Args:
        src_tier: source tier.
        dst_tier: destination tier.
        src_ids: source block ids, length n.
        dst_ids: destination block ids, length n.
        layouts: the rank's registered layouts by tier.

    Returns:
        Accept, or a refusal naming the first broken rule (INVALID_ARGUMENT; unregistered tiers
        FAILED_PRECONDITION).
    """
    for tier in (src_tier, dst_tier):
        if tier is Tier.G4:
            return Verdict.refuse(
                "G4 (object tier) is never a local-transfer endpoint; use put/get or "
                "remote onboard/offload with object keys"
            )
    for tier in (src_tier, dst_tier):
        if tier not in layouts:
            return Verdict.refuse(f"tier {tier.name} not registered", TierNotRegistered)
    src_layout, dst_layout = layouts[src_tier], layouts[dst_tier]
    if len(src_ids) != len(dst_ids):
        return Verdict.refuse(
            f"src_block_ids has {len(src_ids)} ids but dst_block_ids has {len(dst_ids)}"
        )
    verdict = _first_refusal(
        _check_ids(src_ids, src_layout, f"source ({src_tier.name})"),
        _check_ids(dst_ids, dst_layout, f"destination ({dst_tier.name})"),
        _check_unique(dst_ids, "destination"),
        _check_format(src_layout, dst_layout),
    )
    if not verdict.ok:
        return verdict
    if src_tier == dst_tier:
        overlap = sorted(set(src_ids) & set(dst_ids))
        if overlap:
            return Verdict.refuse(
                f"source and destination overlap within layout {src_tier.name}: {overlap[:8]}"
            )
    return Verdict.accept()


def _check_format(src: Layout, dst: Layout) -> Verdict:
    if src.bytes_per_block != dst.bytes_per_block or not src.same_block_format(dst):
        return Verdict.refuse(
            f"block formats differ: source {src.block_shape} {src.dtype} "
            f"({src.bytes_per_block} bytes) vs destination {dst.block_shape} {dst.dtype} "
            f"({dst.bytes_per_block} bytes)"
        )
    return Verdict.accept()


def check_remote_transfer(
    *,
    local_tier: Tier,
    local_ids: Sequence[int],
    local_layouts: Mapping[Tier, Layout],
    remote_tier: Tier,
    remote_ids: Sequence[int],
    remote_layouts: Mapping[Tier, Layout],
    onboard: bool,
) -> Verdict:
    """Validate an onboard (remote -> local) or offload (local -> remote) between two ranks.

    Args:
        local_tier: tier on this rank (destination when ``onboard``, else source).
        local_ids: block ids on this rank, length n.
        local_layouts: this rank's layouts by tier.
        remote_tier: tier on the peer rank.
        remote_ids: block ids on the peer rank, length n.
        remote_layouts: the peer rank's layouts by tier (from its exported metadata).
        onboard: true for onboard (destination is local), false for offload.

    Returns:
        Accept or a refusal naming the first broken rule.
    """
    for tier, layouts, where in (
        (local_tier, local_layouts, "local"),
        (remote_tier, remote_layouts, "remote"),
    ):
        if tier is Tier.G4:
            return Verdict.refuse(f"{where} tier G4 is addressed by sequence hashes, not block ids")
        if tier not in layouts:
            return Verdict.refuse(f"{where} tier {tier.name} not registered", TierNotRegistered)
    if len(local_ids) != len(remote_ids):
        src_n, dst_n = (remote_ids, local_ids) if onboard else (local_ids, remote_ids)
        return Verdict.refuse(f"source has {len(src_n)} block ids but destination has {len(dst_n)}")
    dst_ids = local_ids if onboard else remote_ids
    src_layout, dst_layout = (
        (remote_layouts[remote_tier], local_layouts[local_tier])
        if onboard
        else (local_layouts[local_tier], remote_layouts[remote_tier])
    )
    return _first_refusal(
        _check_ids(local_ids, local_layouts[local_tier], f"local ({local_tier.name})"),
        _check_ids(remote_ids, remote_layouts[remote_tier], f"remote ({remote_tier.name})"),
        _check_unique(dst_ids, "destination"),
        _check_format(src_layout, dst_layout),
    )


def check_object_transfer(
    *,
    tier: Tier,
    ids: Sequence[int],
    sequence_hashes: Sequence[int],
    layouts: Mapping[Tier, Layout],
    into_blocks: bool,
    object_tier: bool = True,
) -> Verdict:
    """Validate a transfer between a local tier and the object tier (put, get, onboard,
    offload with object keys).

    Args:
        tier: the local tier.
        ids: local block ids, length n.
        sequence_hashes: object keys (this rank's prefix), length n, unique.
        layouts: this rank's layouts by tier.
        into_blocks: true when objects are copied into the blocks (ids must be unique).
        object_tier: whether the rank has an object store at all.

    Returns:
        Accept or a refusal naming the first broken rule.
    """
    if not object_tier:
        return Verdict.refuse("tier G4 not registered (no object store)", TierNotRegistered)
    if tier is Tier.G4:
        return Verdict.refuse("the local side of an object transfer cannot be G4")
    if tier not in layouts:
        return Verdict.refuse(f"tier {tier.name} not registered", TierNotRegistered)
    if len(sequence_hashes) != len(ids):
        return Verdict.refuse(f"{len(sequence_hashes)} sequence hashes but {len(ids)} block ids")
    bad = [h for h in sequence_hashes if not 0 <= h < (1 << 64)]
    if bad:
        return Verdict.refuse(f"sequence hashes outside [0, 2**64): {bad[:4]}")
    return _first_refusal(
        _check_ids(ids, layouts[tier], f"{tier.name}"),
        _check_unique(sequence_hashes, "sequence hash"),
        _check_unique(ids, "destination") if into_blocks else Verdict.accept(),
    )


# --------------------------------------------------------------------------- planning


def coalesce_runs(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[Run]:
    """Group ``src_ids[k] -> dst_ids[k]`` pairs into maximal runs consecutive on both sides.

    A run lets one ``pread``/``pwrite``/``memcpy`` move several blocks.

    Args:
        src_ids: source ids, length n.
        dst_ids: destination ids, length n.

    Returns:
        Runs in request order; their counts sum to n.

    Raises:
        InvalidArgument: unequal lengths (INVALID_ARGUMENT).
    """
    if len(src_ids) != len(dst_ids):
        raise InvalidArgument(f"{len(src_ids)} source ids but {len(dst_ids)} destination ids")
    runs: list[Run] = []
    k = 0
    n = len(src_ids)
    while k < n:
        start = k
        while k + 1 < n and src_ids[k + 1] == src_ids[k] + 1 and dst_ids[k + 1] == dst_ids[k] + 1:
            k += 1
        runs.append(Run(int(src_ids[start]), int(dst_ids[start]), k - start + 1, start))
        k += 1
    return runs


def split_stream(
    offset_bytes: int, length_bytes: int, bytes_per_block: int, num_blocks: int
) -> list[StreamPiece]:
    """Map a chunk of the concatenated block stream onto the blocks it covers.

    The stream of a read or write of ``num_blocks`` blocks is their bytes concatenated in
    request order, ``num_blocks * bytes_per_block`` bytes in all.

    Args:
        offset_bytes: offset of the chunk within the stream, bytes.
        length_bytes: chunk length, bytes.
        bytes_per_block: block size, bytes (>= 1).
        num_blocks: blocks in the stream.

    Returns:
        Pieces in stream order, one per block touched.

    Raises:
        InvalidArgument: the chunk runs past the end of the stream (INVALID_ARGUMENT).
    """
    total = bytes_per_block * num_blocks
    if offset_bytes < 0 or length_bytes < 0 or offset_bytes + length_bytes > total:
        raise InvalidArgument(
            f"chunk [{offset_bytes}, {offset_bytes + length_bytes}) outside the stream of "
            f"{total} bytes"
        )
    pieces: list[StreamPiece] = []
    pos = offset_bytes
    end = offset_bytes + length_bytes
    while pos < end:
        index, within = divmod(pos, bytes_per_block)
        take = min(bytes_per_block - within, end - pos)
        pieces.append(StreamPiece(index, within, pos - offset_bytes, take))
        pos += take
    return pieces


def expand_per_rank(
    ids: Sequence[int] | Mapping[int, Sequence[int]], worker_count: int, what: str
) -> list[list[int]]:
    """Broadcast one id list to every rank, or spread a per-rank mapping.

    Args:
        ids: one list for every rank (SPMD), or ``{rank: ids}``; ranks missing from the
            mapping get an empty list (they still report an empty completion).
        worker_count: ranks in the group.
        what: name of the argument, for messages.

    Returns:
        ``worker_count`` lists of Python ints.

    Raises:
        InvalidArgument: a rank outside ``[0, worker_count)`` or a non-integer id
            (INVALID_ARGUMENT).
    """
    if isinstance(ids, Mapping):
        bad = [r for r in ids if not 0 <= int(r) < worker_count]
        if bad:
            raise InvalidArgument(f"{what}: ranks {bad} outside [0, {worker_count})")
        return [_as_int_list(ids.get(r, ()), what) for r in range(worker_count)]
    one = _as_int_list(ids, what)
    return [list(one) for _ in range(worker_count)]


def _as_int_list(ids: Iterable[Any], what: str) -> list[int]:
    out: list[int] = []
    for b in ids:
        try:
            value = int(b)
        except (TypeError, ValueError):
            raise InvalidArgument(f"{what}: {b!r} is not an integer id") from None
        if value != b:
            raise InvalidArgument(f"{what}: {b!r} is not an integer id")
        out.append(value)
    return out


def server_budget_s(timeout_s: float) -> float:
    """Time the rank server gives a command out of the client's deadline, seconds.

    The server stops the command a little before the client's own gRPC deadline so that its
    DEADLINE_EXCEEDED (with the rank's message) normally arrives first; the client deadline is
    the hard bound even when the server is wedged or dead.
    """
    margin = min(0.25, 0.1 * timeout_s)
    return max(0.001, timeout_s - margin)


# --------------------------------------------------------------------------- reservations


class BlockReservations:
    """Which blocks in-flight commands read and write, per tier (one rank's bookkeeping).

    A command may start only if nothing it writes is read or written by another in-flight
    command, and nothing it reads is being written. Pure bookkeeping; the caller releases.
    """

    def __init__(self) -> None:
        self._writes: dict[str, dict[Tier, frozenset[int]]] = {}
        self._reads: dict[str, dict[Tier, frozenset[int]]] = {}

    def reserve(
        self,
        command_id: str,
        *,
        reads: Mapping[Tier, Iterable[int]] | None = None,
        writes: Mapping[Tier, Iterable[int]] | None = None,
    ) -> Verdict:
        """Reserve blocks for ``command_id`` or refuse with BlocksBusy (FAILED_PRECONDITION)."""
        if command_id in self._writes:
            return Verdict.refuse(f"command {command_id} already holds a reservation")
        want_w = {t: frozenset(ids) for t, ids in (writes or {}).items()}
        want_r = {t: frozenset(ids) for t, ids in (reads or {}).items()}
        for other, held_by_tier in self._writes.items():
            for tier, held in held_by_tier.items():
                clash = held & (want_w.get(tier, frozenset()) | want_r.get(tier, frozenset()))
                if clash:
                    return Verdict.refuse(
                        f"{tier.name} blocks {sorted(clash)[:8]} are being written by "
                        f"in-flight command {other}",
                        BlocksBusy,
                    )
        for other, held_by_tier in self._reads.items():
            for tier, held in held_by_tier.items():
                clash = held & want_w.get(tier, frozenset())
                if clash:
                    return Verdict.refuse(
                        f"{tier.name} blocks {sorted(clash)[:8]} are being read by in-flight "
                        f"command {other}",
                        BlocksBusy,
                    )
        self._writes[command_id] = want_w
        self._reads[command_id] = want_r
        return Verdict.accept()

    def release(self, command_id: str) -> None:
        """Drop every reservation of ``command_id`` (idempotent)."""
        self._writes.pop(command_id, None)
        self._reads.pop(command_id, None)

    @property
    def in_flight(self) -> int:
        """Number of commands holding reservations."""
        return len(self._writes)


# --------------------------------------------------------------------------- merging


def merge_presence(
    keys: Sequence[int],
    per_rank: Mapping[int, Mapping[int, int | None]],
    worker_count: int,
) -> list[KeyPresence]:
    """Merge per-rank object presence by key: present only if every rank has its shard.

    Args:
        keys: the hashes asked about, in the caller's order.
        per_rank: rank -> {sequence hash -> size in bytes, or ``None`` when absent}; a rank
            missing from the mapping (it failed) or a key missing from a rank's answer counts
            as absent.
        worker_count: ranks in the group.

    Returns:
        One :class:`KeyPresence` per key, in the order of ``keys``.
    """
    out: list[KeyPresence] = []
    for key in keys:
        sizes: list[int] = []
        ranks: list[int] = []
        for rank in range(worker_count):
            size = per_rank.get(rank, {}).get(key)
            if size is not None:
                sizes.append(size)
                ranks.append(rank)
        present = worker_count > 0 and len(ranks) == worker_count
        out.append(KeyPresence(key, present, sum(sizes) if present else None, tuple(ranks)))
    return out


_OK_STATUSES = frozenset({"stored", "already_present", "retrieved"})


def merge_key_results(
    keys: Sequence[int],
    per_rank: Mapping[int, Mapping[int, tuple[str, str]]],
    rank_errors: Mapping[int, str],
    worker_count: int,
) -> list[KeyOutcome]:
    """Merge per-rank put/get results **by key** (never by list position).

    Args:
        keys: the keys of the request, in the caller's order.
        per_rank: rank -> {sequence hash -> (status name, error message)} as that rank
            reported them, in any order.
        rank_errors: rank -> error message for ranks whose whole call failed.
        worker_count: ranks in the group.

    Returns:
        One :class:`KeyOutcome` per key in the order of ``keys``; ``ok`` only when every rank
        reported a success status for that key.
    """
    out: list[KeyOutcome] = []
    for key in keys:
        statuses: dict[int, str] = {}
        errors: dict[int, str] = {}
        for rank in range(worker_count):
            if rank in rank_errors:
                statuses[rank] = "failed"
                errors[rank] = rank_errors[rank]
                continue
            entry = per_rank.get(rank, {}).get(key)
            if entry is None:
                statuses[rank] = "missing"
                errors[rank] = f"rank {rank} returned no result for key {key:016x}"
                continue
            status, message = entry
            statuses[rank] = status
            if status not in _OK_STATUSES:
                errors[rank] = message or status
        ok = worker_count > 0 and not errors
        already = ok and all(s == "already_present" for s in statuses.values())
        out.append(KeyOutcome(key, ok, already, statuses, errors))
    return out
