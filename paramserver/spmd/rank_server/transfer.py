"""Block transfers of one rank: between its own tiers, and with the same rank of a peer instance.

One path for both directions (:class:`Direction`): *onboard* pulls a peer's blocks into a local
tier, *offload* pushes local blocks into a peer's tier. The direction decides only which side is
the source (validity is required there, destination blocks are reserved and invalidated here or
by the peer) and which stream runs:

* onboard from a peer's G2 on the same host (equal ``host_key``) maps the peer's shared-memory
  segment and copies without the network, after the peer confirmed with ``CheckBlocks`` that
  the source blocks are valid; like an RDMA read it does not lock them against a concurrent
  overwrite by the peer;
* every other remote transfer streams chunks of <= 1 MiB over gRPC: onboard reads the peer's
  ``ReadBlocks``, offload writes the peer's ``WriteBlocks``; the receiving side tracks validity.

The same chunk streams serve this rank's own ``ReadBlocks`` / ``WriteBlocks``
(:func:`send_stream`, :func:`receive_stream`).
"""

from __future__ import annotations

import asyncio
import enum
import threading
import time
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Sequence

import grpc

from paramserver.api.v1 import spmd_pb2
from paramserver.errors import InvalidArgument, MalformedStream
from paramserver.method_handlers import ServicerContext
from paramserver.spmd.layout import Tier
from paramserver.spmd.planning import (
    MAX_CHUNK_BYTES,
    check_local_transfer,
    check_remote_transfer,
    coalesce_runs,
    split_stream,
)
from paramserver.spmd.pools import BlockPool, CopyCancelled, HostPool, PeerSegment, copy_blocks
from paramserver.spmd.rank_server.rank_state import RankState, Remote, parse_tier
from paramserver.spmd.transfer_errors import BlockNotValid, CommandTimeout

__all__ = [
    "Direction",
    "RemoteBlocks",
    "local_transfer",
    "placements",
    "receive_stream",
    "remote_transfer",
    "send_stream",
    "stream_blocks",
]


class Direction(enum.Enum):
    """Which way a remote transfer moves blocks (the command is ``remote_<value>``)."""

    ONBOARD = "onboard"
    """Into this rank, from a peer (or from objects)."""
    OFFLOAD = "offload"
    """Out of this rank, to a peer (or to objects)."""


class RemoteBlocks:
    """Decoded ``RemoteLayoutBlocks``: blocks of a connected peer instance's tier."""

    def __init__(self, message: spmd_pb2.RemoteLayoutBlocks, what: str) -> None:
        self.instance_id = str(message.instance_id)
        self.tier = parse_tier(message.tier, what)
        self.block_ids = [int(b) for b in message.block_ids]


def placements(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[spmd_pb2.Placement]:
    """One ``Placement`` per source -> destination block pair."""
    return [
        spmd_pb2.Placement(src_block_id=s, dst_block_id=d)
        for s, d in zip(src_ids, dst_ids, strict=True)
    ]


async def local_transfer(
    state: RankState,
    options: spmd_pb2.CommandOptions,
    context: ServicerContext,
    src: tuple[Tier, list[int]],
    dst: tuple[Tier, list[int]],
) -> spmd_pb2.TransferResponse:
    """Copy blocks between two local tiers (``LocalTransfer``)."""
    state.check_incarnation(options.incarnation_id)  # before anything read from this rank
    (src_tier, src_ids), (dst_tier, dst_ids) = src, dst
    state.refuse(
        check_local_transfer(
            src_tier=src_tier,
            dst_tier=dst_tier,
            src_ids=src_ids,
            dst_ids=dst_ids,
            layouts=state.layouts,
        )
    )
    state.require_valid(src_tier, src_ids)
    src_pool, dst_pool = state.pools[src_tier], state.pools[dst_tier]
    runs = coalesce_runs(src_ids, dst_ids)
    done = placements(src_ids, dst_ids)

    async def work(cancel: threading.Event) -> tuple[int, str, list[spmd_pb2.Placement]]:
        faults = state.config.faults
        moved = await state.in_thread(
            lambda: copy_blocks(src_pool, dst_pool, runs, cancel=cancel, faults=faults), cancel
        )
        return moved, "local", done

    return await state.run_command(
        "local_transfer",
        options,
        context,
        reads={src_tier: src_ids},
        writes={dst_tier: dst_ids},
        work=work,
    )


async def remote_transfer(
    state: RankState,
    direction: Direction,
    options: spmd_pb2.CommandOptions,
    context: ServicerContext,
    local: tuple[Tier, list[int]],
    peer: RemoteBlocks,
    *,
    allow_shared_memory: bool = False,
) -> spmd_pb2.TransferResponse:
    """Move blocks between a local tier and the same rank of a connected peer instance.

    Args:
        state: this rank.
        direction: ONBOARD (peer -> local) or OFFLOAD (local -> peer).
        options: the command's options (deadline, incarnation, command id).
        context: the RPC's context (its deadline caps the command's).
        local: local tier and block ids (the destination onboard, the source offload).
        peer: the peer's blocks (the source onboard, the destination offload).
        allow_shared_memory: onboard only: copy a same-host peer's G2 through shared memory.

    Raises:
        RemoteNotConnected: no metadata of ``peer.instance_id`` imported (NOT_FOUND).
        InvalidArgument: a rule of :func:`~paramserver.spmd.planning.check_remote_transfer`
            broken (INVALID_ARGUMENT).
        BlockNotValid: a source block holds no valid data (FAILED_PRECONDITION).
    """
    state.check_incarnation(options.incarnation_id)
    onboard = direction is Direction.ONBOARD
    local_tier, local_ids = local
    remote = state.remote(peer.instance_id)
    state.refuse(
        check_remote_transfer(
            local_tier=local_tier,
            local_ids=local_ids,
            local_layouts=state.layouts,
            remote_tier=peer.tier,
            remote_ids=peer.block_ids,
            remote_layouts=remote.layouts,
            onboard=onboard,
        )
    )
    if not onboard:
        state.require_valid(local_tier, local_ids)
    pool = state.pools[local_tier]
    pairs = (peer.block_ids, local_ids) if onboard else (local_ids, peer.block_ids)
    done = placements(*pairs)
    use_shm = (
        onboard
        and allow_shared_memory
        and peer.tier in remote.shm_names
        and remote.metadata.host_key == state.host_key
    )

    async def work(cancel: threading.Event) -> tuple[int, str, list[spmd_pb2.Placement]]:
        if not local_ids:
            return 0, "local", done
        seg = state.peer_segment(remote, peer.tier) if use_shm else None
        if seg is not None:
            moved = await _onboard_shared_memory(state, remote, peer, seg, pool, local_ids, cancel)
            return moved, "shared-memory", done
        moved = await _peer_stream(state, direction, remote, peer, pool, local_ids, cancel)
        return moved, "grpc", done

    held = {local_tier: local_ids}
    return await state.run_command(
        f"remote_{direction.value}",
        options,
        context,
        reads={} if onboard else held,
        writes=held if onboard else {},
        work=work,
    )


async def _onboard_shared_memory(
    state: RankState,
    remote: Remote,
    peer: RemoteBlocks,
    seg: PeerSegment,
    dst: BlockPool,
    dst_ids: list[int],
    cancel: threading.Event,
) -> int:
    md = remote.metadata
    check_request = spmd_pb2.CheckBlocksRequest(
        tier=peer.tier.wire, block_ids=peer.block_ids, incarnation_id=md.incarnation_id
    )
    try:
        check = await state.peer_stub(remote).CheckBlocks(check_request)
    except grpc.aio.AioRpcError as exc:
        raise state.peer_error(remote, "checking blocks of", exc) from exc
    if check.invalid_block_ids:
        raise BlockNotValid(
            f"{state.prefix}: peer {md.instance_id} rank {md.rank} {peer.tier.name} blocks "
            f"{list(check.invalid_block_ids)[:8]} hold no valid data"
        )
    runs = coalesce_runs(peer.block_ids, dst_ids)
    bpb = remote.layouts[peer.tier].bytes_per_block
    faults = state.config.faults
    return await state.in_thread(
        lambda: copy_blocks(seg, dst, runs, src_bytes_per_block=bpb, cancel=cancel, faults=faults),
        cancel,
    )


async def _peer_stream(
    state: RankState,
    direction: Direction,
    remote: Remote,
    peer: RemoteBlocks,
    pool: BlockPool,
    ids: list[int],
    cancel: threading.Event,
) -> int:
    """Stream blocks over gRPC: onboard reads the peer's ``ReadBlocks`` into ``pool``, offload
    writes ``pool``'s blocks into the peer's ``WriteBlocks``. Returns the bytes moved."""
    tier, incarnation_id = peer.tier.wire, remote.metadata.incarnation_id
    stub = state.peer_stub(remote)
    try:
        if direction is Direction.ONBOARD:
            call = stub.ReadBlocks(
                spmd_pb2.ReadBlocksRequest(
                    tier=tier, block_ids=peer.block_ids, incarnation_id=incarnation_id
                )
            )
            try:
                return await _receive_chunks(state, call, pool, ids, cancel)
            finally:
                call.cancel()

        async def requests() -> AsyncIterator[spmd_pb2.WriteBlocksRequest]:
            header = spmd_pb2.WriteBlocksHeader(
                tier=tier, block_ids=peer.block_ids, incarnation_id=incarnation_id
            )
            yield spmd_pb2.WriteBlocksRequest(header=header)
            async for chunk in stream_blocks(state, pool, ids, cancel):
                yield spmd_pb2.WriteBlocksRequest(chunk=chunk)

        response = await stub.WriteBlocks(requests())
        return int(response.bytes_written)
    except grpc.aio.AioRpcError as exc:
        what = "reading from" if direction is Direction.ONBOARD else "writing to"
        raise state.peer_error(remote, what, exc) from exc


# --------------------------------------------------------------------------- chunk streams


async def _move_pieces(
    state: RankState,
    pool: BlockPool,
    ids: list[int],
    offset: int,
    buf: memoryview,
    direction: Direction,
    cancel: threading.Event,
) -> None:
    """Copy one stream chunk ``buf`` (stream bytes ``[offset, offset + len(buf))`` of the
    concatenated blocks ``ids``) into the pool (ONBOARD) or out of it (OFFLOAD)."""
    bpb = pool.bytes_per_block
    pieces = split_stream(offset, len(buf), bpb, len(ids))
    delay_s = state.config.faults.io_delay_s

    def move() -> None:
        if delay_s:
            time.sleep(delay_s)
        for p in pieces:
            if cancel.is_set():
                raise CopyCancelled()
            at = ids[p.index] * bpb + p.offset_in_block_bytes
            part = buf[p.offset_in_chunk_bytes : p.offset_in_chunk_bytes + p.length_bytes]
            if direction is Direction.ONBOARD:
                pool.write_bytes(at, part)
            else:
                pool.read_bytes(at, part)

    if isinstance(pool, HostPool) and not delay_s:
        move()  # a memcpy of <= 1 MiB; no thread hop
    else:
        await state.in_thread(move, cancel)


def _join_pieces(
    pool: HostPool, ids: list[int], offset: int, length: int, cancel: threading.Event
) -> bytes:
    """Stream bytes ``[offset, offset + length)`` of the concatenated blocks ``ids`` of a host
    pool as one ``bytes``, copied once; contiguous pieces are merged into one slice first."""
    bpb = pool.bytes_per_block
    runs: list[list[int]] = []
    for p in split_stream(offset, length, bpb, len(ids)):
        at = ids[p.index] * bpb + p.offset_in_block_bytes
        if runs and runs[-1][0] + runs[-1][1] == at:
            runs[-1][1] += p.length_bytes
        else:
            runs.append([at, p.length_bytes])
    if cancel.is_set():
        raise CopyCancelled()
    views = [pool.view_bytes(at, n) for at, n in runs]
    if len(views) == 1:
        return bytes(views[0])  # type: ignore[arg-type]
    return b"".join(views)  # type: ignore[arg-type]


async def stream_blocks(
    state: RankState, src: BlockPool, ids: list[int], cancel: threading.Event
) -> AsyncIterator[spmd_pb2.BlockChunk]:
    """The concatenated bytes of blocks ``ids`` of ``src`` in chunks of <= 1 MiB."""
    total = src.bytes_per_block * len(ids)
    step = max(1, min(MAX_CHUNK_BYTES, total))
    host = src if isinstance(src, HostPool) and not state.config.faults.io_delay_s else None
    for offset in range(0, total, step):
        if host is not None:
            # One copy: the chunk's pieces are joined straight out of the segment into the
            # message's bytes (a bytearray first, then bytes(), would copy twice).
            yield spmd_pb2.BlockChunk(
                offset_bytes=offset,
                data=_join_pieces(host, ids, offset, min(step, total - offset), cancel),
            )
            continue
        out = bytearray(min(step, total - offset))
        await _move_pieces(state, src, ids, offset, memoryview(out), Direction.OFFLOAD, cancel)
        yield spmd_pb2.BlockChunk(offset_bytes=offset, data=bytes(out))


async def _receive_chunks(
    state: RankState,
    chunks: AsyncIterable[spmd_pb2.BlockChunk],
    dst: BlockPool,
    dst_ids: list[int],
    cancel: threading.Event,
) -> int:
    expected = 0
    async for chunk in chunks:
        if chunk.offset_bytes != expected:
            raise MalformedStream(
                f"{state.prefix}: chunk at offset {chunk.offset_bytes}, expected {expected}"
            )
        data = memoryview(chunk.data)
        await _move_pieces(state, dst, dst_ids, expected, data, Direction.ONBOARD, cancel)
        expected += len(data)
    total = dst.bytes_per_block * len(dst_ids)
    if expected != total:
        raise MalformedStream(f"{state.prefix}: stream ended after {expected} of {total} bytes")
    return expected


async def receive_stream(
    state: RankState,
    header: spmd_pb2.WriteBlocksHeader,
    chunks: AsyncIterator[spmd_pb2.BlockChunk],
    context: ServicerContext,
) -> int:
    """Serve ``WriteBlocks``: overwrite the header's blocks from the chunk stream.

    The blocks are reserved and invalid while the stream runs; valid only once every byte
    arrived in time.

    Returns:
        Bytes written.

    Raises:
        InvalidArgument: ids out of range or not unique (INVALID_ARGUMENT).
        MalformedStream: chunks out of order or the wrong total (INVALID_ARGUMENT).
        CommandTimeout: past the deadline; the blocks stay invalid (DEADLINE_EXCEEDED).
    """
    tier = parse_tier(header.tier, "write")
    ids = [int(b) for b in header.block_ids]
    pool = state.checked_pool(tier, ids, header.incarnation_id)
    if len(set(ids)) != len(ids):
        raise InvalidArgument(f"{state.prefix}: destination ids are not unique")
    budget = state.budget_s(header.timeout_ms, context)
    command_id = f"write-{uuid.uuid4().hex}"
    state.refuse(state.reservations.reserve(command_id, writes={tier: ids}))
    pool.valid[ids] = False
    cancel = threading.Event()
    try:
        async with asyncio.timeout(budget):
            written = await _receive_chunks(state, chunks, pool, ids, cancel)
    except TimeoutError:
        raise CommandTimeout(
            f"{state.prefix}: block write ran past its deadline; blocks left invalid"
        ) from None
    finally:
        cancel.set()
        state.reservations.release(command_id)
    pool.valid[ids] = True
    state.bytes_moved += written
    return written


async def send_stream(
    state: RankState, request: spmd_pb2.ReadBlocksRequest
) -> AsyncIterator[spmd_pb2.BlockChunk]:
    """Serve ``ReadBlocks``: the valid blocks' bytes, reserved against writes while streamed.

    Raises:
        InvalidArgument: ids out of range (INVALID_ARGUMENT).
        BlockNotValid: a block holds no valid data (FAILED_PRECONDITION).
    """
    tier = parse_tier(request.tier, "read")
    ids = [int(b) for b in request.block_ids]
    pool = state.checked_pool(tier, ids, request.incarnation_id)
    state.require_valid(tier, ids)
    command_id = f"read-{uuid.uuid4().hex}"
    state.refuse(state.reservations.reserve(command_id, reads={tier: ids}))
    cancel = threading.Event()
    try:
        async for chunk in stream_blocks(state, pool, ids, cancel):
            yield chunk
    finally:
        cancel.set()
        state.reservations.release(command_id)
