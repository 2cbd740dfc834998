"""Server side of the ``Session`` RPC: one persistent bidirectional stream per worker client.

The stream opens with ``SessionOpen`` (answered by ``SessionOpened``); then every request —
push, pull, push_pull, or a shared-memory offer that attaches or grows the segment — is answered
by one response carrying the request's ``seq``, in order. Requests are decoded here and handed to
the funnel every push and pull path shares (:class:`~paramserver.server.shard_service.ShardService`:
``apply_push``, ``admit_pull``, ``pull_snapshots_bytes``, ``pull_snapshots_into``), inside the same
back-pressure ticket as the
Push stream, so dedup, the WAL commit and every error code are those of the ordinary path. A
refused request is answered with a ``SessionError`` (status code, message, exact error class)
and the stream keeps serving; only a protocol violation (no open first, a second open) ends it.

Every request and answer carries its tensors as one ``SlotBatch``
(:mod:`paramserver.protocol.session_frames`), on one of two carriers: inline (the batch's
``data``: small requests, or any that fits one message when no segment is mapped) or the client's
shared-memory segment (:mod:`paramserver.protocol.shm`): gradients are read from the push region
in place, pulled values are copied once into the pull region. Compressed gradients take the Push
stream.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

import grpc
import numpy as np

from paramserver.api.v1 import parameter_server_pb2 as pb
from paramserver.api.v1 import tables_pb2 as tpb
from paramserver.core.store import count_non_finite
from paramserver.errors import InvalidArgument, MalformedStream, ParamServerError
from paramserver.protocol import shm
from paramserver.protocol.session_frames import (
    MAX_INLINE_BYTES,
    SMALL_INLINE_BYTES,
    batch_bytes,
    inline_region,
    pack_slot_batch,
    place_slot_batch,
    slot_batch_views,
    slot_span,
)
from paramserver.security.tokens import check_worker_identity
from paramserver.server.engine import InflightTicket

if TYPE_CHECKING:
    from paramserver.server.shard_service import ShardService
    from paramserver.server.transports.table_service import TableRpcs

logger = logging.getLogger(__name__)


class LinkTickets(Protocol):
    """What a Session needs of the shard's local-link server
    (:class:`~paramserver.server.transports.link_service.LocalLinkServer`, which imports this
    module): a ticket for a client that asks to move its session onto the link."""

    def issue_ticket(self, worker_id: str) -> pb.LocalLink:
        """A fresh single-use ticket for ``worker_id``."""
        ...


_SHUTDOWN = "paramserver: server shutting down"


def error_response(seq: int, exc: ParamServerError) -> pb.SessionResponse:
    """A ``SessionError`` answer to request ``seq`` (status code, message, error class)."""
    return pb.SessionResponse(
        seq=seq,
        error=pb.SessionError(
            code=exc.code.value[0], message=exc.message, error_class=type(exc).__name__
        ),
    )


class _Session:
    """State of one stream: its worker and its mapped segment (if any)."""

    def __init__(self) -> None:
        self.worker_id = ""
        self.mapping: shm.ServerMapping | None = None
        #: Where a pushed inline batch is copied to (writeable, reused while its size repeats),
        #: and the layout memo of that region and of the inline pulls.
        self._received: shm.Region | None = None
        self._received_bytes = bytearray()
        self.received_layouts: dict[str, object] = {}
        self.packed_layouts: dict[str, object] = {}

    def receive(self, data: bytes) -> shm.Region:
        """The session's region holding a copy of an inline batch's ``data``: one
        writeable buffer per size, so a model's every round reuses its views (as a mapped
        push region's), and the gradients handed on never alias the message."""
        region = self._received
        if region is None or region.size_bytes != len(data):
            self._received_bytes = bytearray(len(data))
            region = self._received = inline_region(self._received_bytes, "inline push")
            self.received_layouts = {}
        self._received_bytes[:] = data  # (same length: one copy, the views stay valid)
        return region

    def close(self) -> None:
        if self.mapping is not None:
            self.mapping.close()
            self.mapping = None


class SessionService:
    """Serves ``ParameterServer.Session`` streams of one shard.

    Args:
        shard: The funnel every dense-key request goes through.
        table_rpcs: The embedding-table calls (row pulls and pushes on the stream).
        shared_memory: Accept shared-memory offers (False: network only, ``--no-shared-memory``).
        max_inline_bytes: Largest inline payload (bytes) of one message.
    """

    def __init__(
        self,
        shard: ShardService,
        table_rpcs: TableRpcs,
        *,
        shared_memory: bool = True,
        max_inline_bytes: int = MAX_INLINE_BYTES,
    ) -> None:
        self.shard = shard
        self.table_rpcs = table_rpcs
        self.shared_memory = shared_memory
        self.max_inline_bytes = max_inline_bytes
        #: Streams open now, and shared-memory segments mapped now (for tests and status).
        self.open_sessions = 0
        self.mapped_segments = 0
        self._closing = False
        #: Tasks of the streams waiting for their next request (ended by begin_shutdown).
        self._idle: set[asyncio.Task[object]] = set()
        #: The same-host local link, when the daemon runs one (its tickets go out on open).
        self.local_link: LinkTickets | None = None

    def begin_shutdown(self) -> None:
        """End every stream once it has no request in hand (idle ones at once), so a graceful
        stop does not wait its whole grace for them; their clients reconnect (to a successor)
        and retry."""
        self._closing = True
        for task in list(self._idle):
            task.cancel(msg=_SHUTDOWN)

    async def serve(
        self,
        read: Callable[[], Awaitable[Any]],
        write: Callable[[pb.SessionResponse], Awaitable[None]],
    ) -> None:
        """Answer the requests of one stream, in order, until the client ends it.

        Reader/writer style (``context.read()`` / ``context.write()``), not an async
        generator: one coroutine per stream and no generator layers per message.

        Args:
            read: Returns the next request, or ``grpc.aio.EOF`` when the client is done.
            write: Sends one response.

        Raises:
            MalformedStream: the stream does not start with ``open`` or opens twice
                (INVALID_ARGUMENT; ends the stream).
        """
        session = _Session()
        self.open_sessions += 1
        task = asyncio.current_task()
        idle = self._idle
        try:
            first = True
            while not self._closing:
                if task is not None:
                    idle.add(task)
                try:
                    req = await read()
                except asyncio.CancelledError:
                    if not self._closing or task is None:
                        raise
                    task.uncancel()  # our own shutdown request: end the stream with OK
                    return
                finally:
                    if task is not None:
                        idle.discard(task)
                if req is grpc.aio.EOF:
                    return
                which = req.WhichOneof("body")
                if first:
                    if which != "open":
                        raise MalformedStream("a Session stream must start with an open message")
                    first = False
                    await write(self._open(session, req))
                    continue
                if which == "open":
                    raise MalformedStream("second open message in one Session stream")
                await write(await self._answer(session, req, which))
        finally:
            self._unmap(session)
            self.open_sessions -= 1

    # ------------------------------------------------------------------ open
    def _open(self, session: _Session, req: pb.SessionRequest) -> pb.SessionResponse:
        check_worker_identity(req.open.worker_id)
        session.worker_id = req.open.worker_id
        opened = pb.SessionOpened(max_inline_bytes=self.max_inline_bytes)
        if req.open.HasField("shm"):
            opened.shm.CopyFrom(self._attach(session, req.open.shm))
        link = self.local_link
        if req.open.want_local_link and link is not None and not self._closing:
            opened.local_link.CopyFrom(link.issue_ticket(session.worker_id))
        return pb.SessionResponse(seq=req.seq, opened=opened)

    def _attach(self, session: _Session, offer: pb.ShmOffer) -> pb.ShmAnswer:
        if not self.shared_memory:
            return pb.ShmAnswer(accepted=False, reason="shared memory is off on this server")
        try:
            mapping = shm.ServerMapping.attach(offer, shm.SHM_DIR)
        except shm.ShmDeclined as exc:
            logger.debug("shared-memory offer %s declined: %s", offer.name, exc)
            return pb.ShmAnswer(accepted=False, reason=str(exc))
        self._unmap(session)
        session.mapping = mapping
        self.mapped_segments += 1
        logger.debug("mapped shared-memory segment %s (%d bytes)", offer.name, offer.size_bytes)
        return pb.ShmAnswer(accepted=True)

    def _unmap(self, session: _Session) -> None:
        if session.mapping is not None:
            session.close()
            self.mapped_segments -= 1

    # ------------------------------------------------------------------ requests
    async def _answer(
        self, session: _Session, req: pb.SessionRequest, which: str | None
    ) -> pb.SessionResponse:
        # Responses are filled in place (pulled tensors written straight into the response's
        # own fields): no nested-message copies.
        try:
            if which == "push_pull":
                resp = pb.SessionResponse(seq=req.seq)
                both = resp.push_pull
                # Unknown pull keys are refused before the push is applied: all or nothing.
                self.shard.core.require_keys(req.push_pull.pull.keys)
                pushed = await self._push(session, req.push_pull.push)
                both.push.CopyFrom(pushed)
                await self._pull(session, req.push_pull.pull, both.pull)
                return resp
            if which == "push":
                return pb.SessionResponse(seq=req.seq, push=await self._push(session, req.push))
            if which == "pull":
                resp = pb.SessionResponse(seq=req.seq)
                await self._pull(session, req.pull, resp.pull)
                return resp
            if which == "shm_offer":
                return pb.SessionResponse(seq=req.seq, shm=self._attach(session, req.shm_offer))
            if which == "rows":
                resp = pb.SessionResponse(seq=req.seq)
                await self._rows(session, req.rows, resp.rows)
                return resp
            raise MalformedStream(f"Session request {req.seq} has no body")
        except ParamServerError as exc:
            logger.debug("Session request %d refused: %s", req.seq, exc)
            return error_response(req.seq, exc)
        except Exception as exc:  # never kill the stream for one request
            logger.error("Session request %d failed unexpectedly", req.seq, exc_info=exc)
            err = ParamServerError(f"internal error in Session: {exc!r}")
            return error_response(req.seq, err)

    def _decode(
        self,
        session: _Session,
        batch: pb.SlotBatch,
        ticket: InflightTicket,
        out: dict[str, np.ndarray],
        *,
        reuse: bool = True,
    ) -> bool:
        """The tensors of a request's :class:`SlotBatch`, added to ``out``: views of the push
        region, or of a copy of an inline batch's bytes (the session's buffer when ``reuse``,
        else a fresh one), copies when BSP queues them; each checked (key, size limit, slot
        inside its region) and reserved on ``ticket`` before anything is handed on.

        Returns:
            True when one scan of the bytes the slots span found no NaN/Inf (so none of the
            tensors holds any); False when that was not tried or found some (padding
            between slots may hold anything: then the core scans each gradient).

        Raises:
            MalformedStream: an empty or repeated key, arrays that disagree (INVALID_ARGUMENT).
            InvalidArgument: a slot outside its region, of a shape no array can have, over
                ``max_tensor_bytes``, in shared memory with no segment mapped, or an inline
                batch with bytes after its last slot (INVALID_ARGUMENT), naming the key.
        """
        mapping = session.mapping
        inline = batch.HasField("data")
        layouts: dict[str, object] | None
        if inline:
            data = batch.data
            if reuse:
                region, layouts = session.receive(data), session.received_layouts
            else:
                region, layouts = inline_region(bytearray(data), "inline request"), None
        elif mapping is None:
            if batch.keys:
                raise InvalidArgument(
                    f"tensor {batch.keys[0]!r}: shared-memory slot but no segment is mapped"
                )
            return False
        else:
            region, layouts = mapping.push, mapping.layouts
        limit = self.shard.engine.config.max_tensor_bytes
        keep_copies = self.shard.core.aggregator is not None  # BSP queues the arrays
        entries, views = slot_batch_views(batch, region, layouts)
        if inline:
            end = shm.align_up(max(e[3] + e[4] for e in entries)) if entries else 0
            if region.size_bytes > end:
                raise InvalidArgument(
                    f"inline batch carries {region.size_bytes} bytes, but its slots end at {end}"
                )
        for (key, _dtype, _shape, _offset, nbytes), view in zip(entries, views, strict=True):
            if not key:
                raise MalformedStream("Session tensor with an empty key")
            if key in out:
                raise MalformedStream(f"key {key!r} appears twice in one push")
            if limit is not None and nbytes > limit:
                raise InvalidArgument(
                    f"tensor {key!r}: size_bytes {nbytes} exceeds max_tensor_bytes {limit}"
                )
            ticket.reserve(nbytes)
            out[key] = view.copy() if keep_copies else view
        if len(entries) < 2 or keep_copies or self.shard.engine.config.allow_non_finite:
            # (BSP queues copies: the bytes checked must be the bytes kept, so the core scans
            # the copies themselves)
            return False
        span = slot_span(entries, layouts)
        if span is None:
            return False
        start, end, dtype = span
        whole = region.view(start, end - start, dtype, ((end - start) // dtype.itemsize,))
        return count_non_finite(whole) == 0

    async def _push(self, session: _Session, push: pb.SessionPush) -> pb.PushResponse:
        header = push.header
        # Backpressure.ticket() without its generator-based context manager (per request).
        ticket = InflightTicket(self.shard.engine.backpressure)
        try:
            ticket.enter(header.worker_id)
            grads: dict[str, np.ndarray] = {}
            finite = self._decode(session, push.slots, ticket, grads)
            return await self.shard.apply_push_header(header, grads, finite=finite)
        finally:
            ticket.release()

    async def _pull(self, session: _Session, req: pb.PullRequest, out: pb.SessionPulled) -> None:
        """Admit the pull and write its info and values into ``out`` (a response's field)."""
        shard = self.shard
        keys = await shard.admit_pull(req.worker_id, req.keys, req.timeout_ms)
        out.SetInParent()  # present even when it stays empty
        info = out.info
        shard.view_into(info.view)
        info.version = shard.core.version
        store = shard.core.store
        values = [store.get(key).value for key in keys]
        needed = batch_bytes(v.nbytes for v in values)
        mapping = session.mapping
        if needed <= SMALL_INLINE_BYTES or (mapping is None and needed <= self.max_inline_bytes):
            # dtype and shape are fixed per key; the bytes are a consistent snapshot of each.
            datas = await shard.pull_snapshots_bytes(keys)
            pack_slot_batch(out.slots, keys, values, datas=datas, memo=session.packed_layouts)
            return
        if mapping is None or needed > mapping.pull.size_bytes:
            out.needed_bytes = needed
            return
        # One pass for the whole request: the destinations, then one consistent copy of every
        # key (inline when all are small and idle, else one reservation and one worker-thread
        # hop for the big ones), then the response's slots (no per-key message objects).
        dsts = place_slot_batch(out.slots, mapping.pull.view, keys, values, memo=mapping.layouts)
        await shard.pull_snapshots_into(keys, dsts)

    async def _rows(self, session: _Session, req: pb.SessionRows, out: pb.SessionRowsDone) -> None:
        """An embedding-table row pull, push, or push-then-pull (a push carrying "pull_ids";
        the servicer's table handlers decide)."""
        rpcs = self.table_rpcs
        header = req.header
        keys = list(req.tensors.keys)
        if not req.push and keys[1:2] == ["grads"]:
            raise MalformedStream(
                f"table {header.table!r}: a row pull (SessionRows with push = false) carries "
                "no grads"
            )
        allowed = (["ids", "grads"], ["ids", "grads", "pull_ids"]) if req.push else (["ids"],)
        if keys not in allowed:
            raise MalformedStream(
                "SessionRows tensors must be keyed 'ids' (and, on a push, 'grads', then "
                "optionally 'pull_ids'), in order"
            )
        ticket = InflightTicket(self.shard.engine.backpressure)
        pull = None
        try:
            if req.push:
                ticket.enter(header.worker_id)
            arrays: dict[str, np.ndarray] = {}
            # (a fresh copy of inline bytes: a table may keep the arrays past this request)
            self._decode(session, req.tensors, ticket, arrays, reuse=False)
            for key in ("ids", "pull_ids"):
                got = arrays.get(key)
                if got is not None and (got.dtype != np.int64 or got.ndim != 1):
                    raise InvalidArgument(
                        f"table {header.table!r}: {key} must be int64 (n,), got {got.dtype} "
                        f"{tuple(got.shape)}"
                    )
            ids = arrays["ids"]
            if req.push:
                if "pull_ids" in arrays:  # a push-then-pull: its pull checked before the push
                    pull = rpcs.check_pull(rpcs.pull_header(header), arrays["pull_ids"])
                grads = arrays["grads"]
                h = tpb.RowsHeader()
                h.CopyFrom(header)
                h.num_ids = ids.shape[0]
                h.dim = grads.shape[1] if grads.ndim == 2 else 0
                out.pushed.CopyFrom(await rpcs.push_decoded(h, ids, grads))
                if pull is None:
                    return
        finally:
            ticket.release()
        if pull is not None:
            info, rows = await rpcs.pull_checked(pull)
        else:
            info, rows = await rpcs.pull_decoded(header, ids)
        out.info.CopyFrom(info)
        needed = shm.align_up(int(rows.nbytes))
        mapping = session.mapping
        if needed <= SMALL_INLINE_BYTES or (mapping is None and needed <= self.max_inline_bytes):
            pack_slot_batch(out.tensors, ["rows"], [rows])
            return
        if mapping is None or needed > mapping.pull.size_bytes:
            out.needed_bytes = needed
            return
        (dst,) = place_slot_batch(out.tensors, mapping.pull.view, ["rows"], [rows])
        np.copyto(dst, rows)
