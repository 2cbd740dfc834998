"""The object tier (G4) of one rank: blocks <-> objects, and whole-object streams.

Each rank keeps its own shard of an object: key ``"{rank}/{sequence_hash}"``
(:func:`~paramserver.spmd.hashing.object_key`). One path moves blocks and objects in either
direction (:class:`~paramserver.spmd.rank_server.transfer.Direction`): ONBOARD copies objects
into blocks (``RemoteOnboard`` from objects, ``GetBlocks``), OFFLOAD stores blocks as objects
(``RemoteOffload`` to objects, ``PutBlocks``). At most :data:`OBJECT_IO_CONCURRENCY` keys move at
once, each in a worker thread.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping

from paramserver.api.v1 import spmd_pb2
from paramserver.errors import InvalidArgument, MalformedStream, ParamServerError, ResourceExhausted
from paramserver.method_handlers import ServicerContext
from paramserver.spmd.hashing import object_key
from paramserver.spmd.layout import Tier
from paramserver.spmd.planning import MAX_CHUNK_BYTES, check_object_transfer
from paramserver.spmd.pools import BlockPool, CopyCancelled
from paramserver.spmd.rank_server.rank_state import RankState
from paramserver.spmd.rank_server.transfer import Direction
from paramserver.spmd.transfer_errors import CommandTimeout, ObjectNotFound

__all__ = [
    "OBJECT_IO_CONCURRENCY",
    "KeyResults",
    "get_object",
    "has_objects",
    "key_response",
    "object_command",
    "put_object",
]

OBJECT_IO_CONCURRENCY = 8
"""Keys one command moves at once (each in a worker thread)."""

KeyResults = dict[int, tuple[str, str]]
"""sequence hash -> (status, error): ``stored``, ``already_present``, ``retrieved``,
``not_found`` or ``failed``, in completion order."""

_SUCCESS = {Direction.ONBOARD: ("retrieved",), Direction.OFFLOAD: ("stored", "already_present")}
_MOVED = {Direction.ONBOARD: "retrieved", Direction.OFFLOAD: "stored"}

_KEY_STATUS = {
    "stored": spmd_pb2.KEY_STATUS_STORED,
    "already_present": spmd_pb2.KEY_STATUS_ALREADY_PRESENT,
    "retrieved": spmd_pb2.KEY_STATUS_RETRIEVED,
    "not_found": spmd_pb2.KEY_STATUS_NOT_FOUND,
    "failed": spmd_pb2.KEY_STATUS_FAILED,
}


def _block_io(state: RankState, direction: Direction, pool: BlockPool) -> Callable[[str, int], str]:
    """``io(object key, block id) -> status`` for one key (run in a worker thread)."""
    store = state.object_store()
    bpb = pool.bytes_per_block

    def fetch(key: str, block: int) -> str:
        view = pool.view_bytes(block * bpb, bpb)
        if view is not None:
            store.read_into(key, view)
        else:
            buf = bytearray(bpb)
            store.read_into(key, memoryview(buf))
            pool.write_bytes(block * bpb, memoryview(buf))
        return "retrieved"

    def put(key: str, block: int) -> str:
        if store.has(key):
            return "already_present"
        view = pool.view_bytes(block * bpb, bpb)
        data = view if view is not None else memoryview(pool.read_block(block))
        return "stored" if store.put(key, data) else "already_present"

    return fetch if direction is Direction.ONBOARD else put


async def _move_objects(
    state: RankState,
    direction: Direction,
    hashes: list[int],
    pool: BlockPool,
    block_ids: list[int],
    cancel: threading.Event,
) -> KeyResults:
    """Move every (key, block) pair concurrently; ObjectNotFound becomes ``not_found``, a
    ValueError or OSError ``failed`` (only an OSError when storing)."""
    io = _block_io(state, direction, pool)
    failures: tuple[type[Exception], ...] = (
        (ValueError, OSError) if direction is Direction.ONBOARD else (OSError,)
    )
    sem = asyncio.Semaphore(OBJECT_IO_CONCURRENCY)
    results: KeyResults = {}

    def run(h: int, block: int) -> str:
        if cancel.is_set():
            raise CopyCancelled()
        if state.config.faults.io_delay_s:
            time.sleep(state.config.faults.io_delay_s)
        return io(object_key(state.rank, h), block)

    async def one(h: int, block: int) -> None:
        async with sem:
            try:
                status = await state.in_thread(functools.partial(run, h, block), cancel)
                results[h] = (status, "")
            except ObjectNotFound:
                results[h] = ("not_found", f"object {object_key(state.rank, h)} not found")
            except failures as exc:
                results[h] = ("failed", f"object {object_key(state.rank, h)}: {exc}")

    # A TaskGroup (not gather): if the command is cancelled it waits for every per-key task,
    # and each of those waits for its worker thread, before the command releases its blocks.
    async with asyncio.TaskGroup() as group:
        for h, block in zip(hashes, block_ids, strict=True):
            group.create_task(one(h, block))
    return results


async def object_command(
    state: RankState,
    direction: Direction,
    name: str,
    options: spmd_pb2.CommandOptions,
    context: ServicerContext,
    blocks: tuple[Tier, list[int]],
    hashes: list[int],
    *,
    per_key: bool,
) -> tuple[spmd_pb2.TransferResponse, KeyResults]:
    """Move objects into blocks (ONBOARD) or blocks into objects (OFFLOAD) as one command.

    Args:
        state: this rank.
        direction: ONBOARD (objects -> blocks) or OFFLOAD (blocks -> objects).
        name: the command's name (``remote_onboard``, ``get_blocks``, ...).
        options: the command's options.
        context: the RPC's context.
        blocks: the local tier and block ids, one per hash.
        hashes: the sequence hashes (unique).
        per_key: False: the command fails with the first failed key's error and every
            destination block becomes valid; True: each key's outcome is returned and, onboard,
            only the blocks of retrieved keys become valid (``GetBlocks`` / ``PutBlocks``).

    Returns:
        The command's response (placements only when not ``per_key``) and each key's result.

    Raises:
        InvalidArgument: a rule of :func:`~paramserver.spmd.planning.check_object_transfer`
            broken (INVALID_ARGUMENT).
        TierNotRegistered: no such tier or no object store (FAILED_PRECONDITION).
        BlockNotValid: offload of a block that holds no valid data (FAILED_PRECONDITION).
        ObjectNotFound: not ``per_key``, onboard of a missing key (NOT_FOUND).
    """
    state.check_incarnation(options.incarnation_id)
    onboard = direction is Direction.ONBOARD
    tier, ids = blocks
    state.refuse(
        check_object_transfer(
            tier=tier,
            ids=ids,
            sequence_hashes=hashes,
            layouts=state.layouts,
            into_blocks=onboard,
            object_tier=state.store is not None,
        )
    )
    if not onboard:
        state.require_valid(tier, ids)
    pool = state.pools[tier]
    bpb = pool.bytes_per_block
    results: KeyResults = {}

    async def work(cancel: threading.Event) -> tuple[int, str, list[spmd_pb2.Placement]]:
        results.update(await _move_objects(state, direction, hashes, pool, ids, cancel))
        if per_key:
            moved = sum(1 for s, _ in results.values() if s == _MOVED[direction])
            return moved * bpb, "object", []
        failed = [(s, e) for s, e in results.values() if s not in _SUCCESS[direction]]
        if failed:
            cls = ObjectNotFound if failed[0][0] == "not_found" else ParamServerError
            more = f" (and {len(failed) - 1} more keys)" if len(failed) > 1 else ""
            raise cls(f"{state.prefix}: {failed[0][1]}{more}")
        if onboard:
            done = [
                spmd_pb2.Placement(sequence_hash=h, dst_block_id=b)
                for h, b in zip(hashes, ids, strict=True)
            ]
        else:
            done = [
                spmd_pb2.Placement(src_block_id=b, dst_sequence_hash=h)
                for h, b in zip(hashes, ids, strict=True)
            ]
        return len(hashes) * bpb, "object", done

    held = {tier: ids}
    # Per key, onboard: every destination block is reserved and marked invalid up front; after
    # the command completes only the blocks whose key was retrieved become valid (a failed key
    # never leaves an old block looking valid, a timed-out command marks none).
    response = await state.run_command(
        name,
        options,
        context,
        reads={} if onboard else held,
        writes=held if onboard else {},
        work=work,
        mark_valid=not (per_key and onboard),
    )
    if per_key and onboard:
        for h, block in zip(hashes, ids, strict=True):
            if results.get(h, ("", ""))[0] == "retrieved":
                pool.valid[block] = True
    return response, results


def key_response(
    state: RankState, results: Mapping[int, tuple[str, str]], moved: int
) -> spmd_pb2.ObjectBlocksResponse:
    """The ``ObjectBlocksResponse`` of per-key results."""
    return spmd_pb2.ObjectBlocksResponse(
        rank=state.rank,
        results=[
            spmd_pb2.KeyResult(sequence_hash=h, status=_KEY_STATUS[s], error=e)
            for h, (s, e) in results.items()
        ],
        bytes_moved=moved,
    )


async def has_objects(state: RankState, hashes: list[int]) -> spmd_pb2.HasObjectsResponse:
    """Which of this rank's shards are stored, with their sizes (``HasObjects``)."""
    store = state.object_store()

    def lookup() -> list[spmd_pb2.ObjectPresence]:
        out = []
        for h in hashes:
            size = store.size(object_key(state.rank, h))
            out.append(
                spmd_pb2.ObjectPresence(
                    sequence_hash=h, present=size is not None, size_bytes=size or 0
                )
            )
        return out

    objects = await asyncio.to_thread(lookup)
    return spmd_pb2.HasObjectsResponse(rank=state.rank, objects=objects)


async def put_object(
    state: RankState,
    header: spmd_pb2.PutObjectHeader,
    chunks: AsyncIterator[spmd_pb2.DataChunk],
    context: ServicerContext,
) -> spmd_pb2.PutObjectResponse:
    """Serve ``PutObject``: store one whole object from its chunk stream, or nothing.

    Raises:
        InvalidArgument: larger than ``max_object_bytes`` (INVALID_ARGUMENT).
        ResourceExhausted: the object store is full (RESOURCE_EXHAUSTED); nothing stored.
        MalformedStream: chunks out of order, too long or too short (INVALID_ARGUMENT).
        CommandTimeout: past the deadline (DEADLINE_EXCEEDED); nothing stored.
    """
    store = state.object_store()
    prefix = state.prefix
    key = object_key(state.rank, int(header.sequence_hash))
    limit = state.config.max_object_bytes
    if header.size_bytes > limit:
        raise InvalidArgument(
            f"{prefix}: object {key} of {header.size_bytes} bytes exceeds "
            f"max_object_bytes {limit} (--max-object-bytes); nothing was stored"
        )
    existing = await asyncio.to_thread(store.size, key)
    if existing is not None:
        return spmd_pb2.PutObjectResponse(
            status=spmd_pb2.KEY_STATUS_ALREADY_PRESENT, size_bytes=existing
        )
    free = await asyncio.to_thread(store.free_bytes)
    if free is not None and header.size_bytes > free:
        raise ResourceExhausted(
            f"{prefix}: object {key} needs {header.size_bytes} bytes but the object "
            f"store has {free} free; nothing was stored"
        )
    budget = state.budget_s(header.timeout_ms, context)
    writer = await asyncio.to_thread(store.begin_put, key)
    committed = False
    try:
        async with asyncio.timeout(budget):
            expected = 0
            async for chunk in chunks:
                if chunk.offset_bytes != expected:
                    raise MalformedStream(
                        f"{prefix}: chunk at {chunk.offset_bytes}, expected {expected}"
                    )
                if expected + len(chunk.data) > header.size_bytes:
                    raise MalformedStream(
                        f"{prefix}: object longer than its size_bytes {header.size_bytes}"
                    )
                try:
                    await asyncio.to_thread(writer.write, chunk.data)
                except OSError as exc:
                    if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                        raise
                    raise ResourceExhausted(
                        f"{prefix}: object store full writing {key} "
                        f"({expected} of {header.size_bytes} bytes): {exc.strerror}; "
                        "nothing was stored"
                    ) from None
                expected += len(chunk.data)
            if expected != header.size_bytes:
                raise MalformedStream(
                    f"{prefix}: object stream ended after {expected} of {header.size_bytes} bytes"
                )
            created = await asyncio.to_thread(writer.commit)
            committed = True
    except TimeoutError:
        raise CommandTimeout(
            f"{prefix}: put of {key} ran past its deadline; nothing was stored"
        ) from None
    finally:
        if not committed:
            # Synchronous on purpose: a close + unlink. When grpc drops the handler of a
            # client that died mid-stream, this finally may run while the coroutine is being
            # closed, where no await is possible.
            writer.abort()
    return spmd_pb2.PutObjectResponse(
        status=spmd_pb2.KEY_STATUS_STORED if created else spmd_pb2.KEY_STATUS_ALREADY_PRESENT,
        size_bytes=header.size_bytes,
    )


async def get_object(
    state: RankState, sequence_hash: int
) -> AsyncIterator[spmd_pb2.GetObjectResponse]:
    """Serve ``GetObject``: the object's info, then its bytes in chunks of <= 1 MiB.

    Raises:
        ObjectNotFound: no such object (NOT_FOUND).
    """
    store = state.object_store()
    key = object_key(state.rank, sequence_hash)
    size, chunks = await asyncio.to_thread(store.iter_chunks, key, MAX_CHUNK_BYTES)
    yield spmd_pb2.GetObjectResponse(
        info=spmd_pb2.ObjectInfo(sequence_hash=sequence_hash, size_bytes=size)
    )
    offset = 0
    sentinel = b""
    try:
        while True:
            data = await asyncio.to_thread(next, chunks, sentinel)
            if not data:
                break
            yield spmd_pb2.GetObjectResponse(
                chunk=spmd_pb2.DataChunk(offset_bytes=offset, data=data)
            )
            offset += len(data)
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()  # closes the file descriptor; synchronous (see put_object)
