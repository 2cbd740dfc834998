"""Client side of the ``Session`` RPC: one persistent stream per worker client.

:class:`SessionTransport` (a :class:`~paramserver.worker_client.transport.base.Transport`)
opens the stream lazily (first push or pull), sends one request at a time and reads its
response; a broken stream is dropped (with its shared-memory segment) and the next
attempt opens a new one, so the retry funnel of :mod:`paramserver.worker_client.retry` reopens
it and retries with the same request id (dedup makes a push exactly-once). A refusal arrives as
a ``SessionError`` and is raised as the :class:`grpc.aio.AioRpcError` the ordinary path would
have raised (same status code, same error-class trailer), so the funnel maps it to the same
:mod:`paramserver.errors` class and retries exactly what it retries there.

Every request and answer carries its tensors (one key or many) as one ``SlotBatch``
(:mod:`paramserver.protocol.session_frames`), on one of two carriers:

- requests of at most :data:`SMALL_INLINE_BYTES` (slots rounded up to their 64-byte boundary):
  inline, the bytes in the batch's ``data``;
- larger ones, same host: the segment's push region (offered on first need, grown on the same
  stream when a tensor does not fit);
- larger ones, no shared memory (another host, declined, or switched off): inline up to the
  server's ``max_inline_bytes`` (~1 MiB), else the request is declined
  (:class:`~paramserver.worker_client.transport.base.Declined`, nothing sent) and the client
  sends it by the chunked Push/Pull streams.

Pulls are answered inline, in the pull region, or with ``needed_bytes`` (the client grows the
segment and asks again, or declines: the Pull stream carries it). A server without the Session
RPC declines every request for good. The stream itself runs on gRPC or, moved there after its
open, on the server's same-host local link (:class:`LocalLinkCall`, the same messages).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import TypeAlias

import grpc
import numpy as np

from paramserver.api.v1 import parameter_server_pb2 as pb
from paramserver.api.v1 import parameter_server_pb2_grpc as pb_grpc
from paramserver.api.v1 import tables_pb2 as tpb
from paramserver.errors import ERROR_CLASS_METADATA_KEY, InvalidArgument, MalformedStream
from paramserver.protocol import link, shm
from paramserver.protocol.session_frames import (
    MAX_INLINE_BYTES,
    SMALL_INLINE_BYTES,
    SlotEntry,
    batch_bytes,
    inline_region,
    pack_slot_batch,
    place_slot_batch,
    slot_batch_entries,
    slot_batch_views,
)
from paramserver.worker_client.pull_buffers import PullBuffers
from paramserver.worker_client.transport.base import (
    Declined,
    IdArray,
    PullResult,
    PullSpec,
    PushPayload,
    RowPush,
)
from paramserver.worker_client.transport.link_client import LocalLinkCall

logger = logging.getLogger(__name__)

#: The gRPC ``Session`` call.
_SessionCall: TypeAlias = "grpc.aio.StreamStreamCall[pb.SessionRequest, pb.SessionResponse]"

__all__ = ["SMALL_INLINE_BYTES", "SessionTransport"]

_STATUS_BY_VALUE = {c.value[0]: c for c in grpc.StatusCode}
#: Regions grow in steps of this many bytes (fewer renegotiations for slowly growing sizes).
_REGION_STEP_BYTES = 1 << 20
#: Seconds to connect to the local link and have its open answered.
_LINK_CONNECT_TIMEOUT_S = 2.0


#: The pull-buffer slot of many-key pulls' shared buffer (not a valid key: keys are non-empty
#: and this one holds a NUL, which no caller's key reaches through this client).
_ARENA_KEY = "\x00many-key pull"


def _rpc_error(code: grpc.StatusCode, details: str, error_class: str = "") -> grpc.aio.AioRpcError:
    trailing = grpc.aio.Metadata()
    if error_class:
        trailing.add(ERROR_CLASS_METADATA_KEY, error_class)
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details)


def _round_region(n: int) -> int:
    return (n + _REGION_STEP_BYTES - 1) // _REGION_STEP_BYTES * _REGION_STEP_BYTES


#: Compressed gradients travel as several parts per key: only the Push stream carries them.
_COMPRESSED = Declined("compressed gradients take the Push stream")


class SessionTransport:
    """One worker client's Session stream and shared-memory segment (a ``Transport``).

    Args:
        stub: Returns the client's ``ParameterServerStub`` (the channel may be reopened).
        shared_memory: Offer shared memory when a request is large enough.
        shm_dir: Directory of segments (``/dev/shm``; the server must see the same one).
        local_link: Move the stream onto the server's local link when it offers one.
        pull_buffers: Where values pulled out of shared memory are copied to.
    """

    def __init__(
        self,
        stub: Callable[[], pb_grpc.ParameterServerAsyncStub],
        *,
        shared_memory: bool = True,
        shm_dir: Path | None = None,
        local_link: bool = True,
        pull_buffers: PullBuffers | None = None,
    ) -> None:
        self._stub = stub
        #: Where pulled values out of shared memory are copied to (``copy=True``).
        self.pull_buffers = pull_buffers if pull_buffers is not None else PullBuffers()
        self.shm_dir = shm_dir or shm.SHM_DIR
        self.shared_memory = shared_memory and shm.available(self.shm_dir)
        #: Why shared memory is not used (None while it may be); set by a declined offer.
        self.shm_declined: str | None = None if self.shared_memory else "off or unavailable"
        #: Why the session stays on gRPC instead of the server's local link (None while it may
        #: move): off here, or the link could not be reached or refused the ticket once.
        self.local_declined: str | None = (
            None if shared_memory and local_link and link.available() else "off"
        )
        #: Sessions moved onto the local link so far.
        self.local_links_opened = 0
        #: The server has no Session RPC (an older server): every call uses the streams.
        self.disabled = False
        self.max_inline_bytes = MAX_INLINE_BYTES
        #: Layout memos of the inline batches this client sends and reads.
        self._packed_sent: dict[str, object] = {}
        self._packed_read: dict[str, object] = {}
        self.sessions_opened = 0
        self.offers_accepted = 0
        self._lock = asyncio.Lock()
        #: The Session call (gRPC, or the local link once the session moved there).
        self._call: _SessionCall | LocalLinkCall | None = None
        self._seq = 0
        self._segment: shm.ClientSegment | None = None
        #: Payload bytes of every key seen (pushed or pulled), to place pulls up front.
        self.known_nbytes: dict[str, int] = {}
        #: Bytes of one row per embedding table seen (sizes the pull region up front).
        self.row_bytes: dict[str, int] = {}
        # Request deadlines (see _Deadline): one lazily re-armed timer, not one per request.
        self._timer: asyncio.TimerHandle | None = None
        self._timer_loop: asyncio.AbstractEventLoop | None = None
        self._timed_task: asyncio.Task[object] | None = None  # the request in flight
        self._expiry = math.inf  # loop time its deadline passes
        self._expired = False  # the timer cancelled it

    # ------------------------------------------------------------------ state
    @property
    def busy(self) -> bool:
        """A request is in flight (a concurrent call then uses the streams)."""
        return self._lock.locked()

    @property
    def ready(self) -> bool:
        """The next request can take the session now."""
        return not self.disabled and not self._lock.locked()

    @property
    def shm_active(self) -> bool:
        """The server mapped this client's current segment."""
        return self._segment is not None

    @property
    def _shm_possible(self) -> bool:
        return self.shm_declined is None

    def close(self) -> None:
        """Drop the stream and the segment (no I/O; the server sees the stream cancelled)."""
        self._drop()
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()

    def _drop(self) -> None:
        call, self._call = self._call, None
        if call is not None:
            call.cancel()
        seg, self._segment = self._segment, None
        if seg is not None:
            seg.close()

    # ------------------------------------------------------------------ wire
    async def _roundtrip(self, req: pb.SessionRequest) -> pb.SessionResponse:
        """Send one request and read its response; a transport failure drops the stream."""
        call = self._call
        if call is None:
            raise _rpc_error(grpc.StatusCode.UNAVAILABLE, "session stream is closed")
        self._seq += 1
        req.seq = self._seq
        try:
            await call.write(req)
            resp = await call.read()
        except grpc.aio.AioRpcError:  # (a write refused by C-core is retried by the funnel)
            self._drop()
            raise
        except asyncio.CancelledError:
            self._drop()
            raise
        except Exception as exc:  # e.g. writing to a stream the server already ended
            self._drop()
            raise _rpc_error(grpc.StatusCode.UNAVAILABLE, f"session stream broke: {exc!r}") from exc
        if not isinstance(resp, pb.SessionResponse):  # grpc.aio.EOF
            self._drop()
            raise _rpc_error(grpc.StatusCode.UNAVAILABLE, "session stream ended by the server")
        if resp.seq != req.seq:
            self._drop()
            raise MalformedStream(f"session response {resp.seq} to request {req.seq}")
        if resp.WhichOneof("body") == "error":
            refusal = resp.error
            code = _STATUS_BY_VALUE.get(refusal.code, grpc.StatusCode.UNKNOWN)
            raise _rpc_error(code, refusal.message, refusal.error_class)
        return resp

    @property
    def on_local_link(self) -> bool:
        """The session runs on the server's local-link socket now (not on gRPC)."""
        return isinstance(self._call, LocalLinkCall)

    async def _ensure_open(self, worker_id: str) -> Declined | None:
        """Open the stream if it is not; declined for good when the server has no Session
        RPC."""
        if self._call is not None:
            return None
        self._call = self._stub().Session()
        want_link = self.local_declined is None
        try:
            resp = await self._roundtrip(
                pb.SessionRequest(
                    open=pb.SessionOpen(worker_id=worker_id, want_local_link=want_link)
                )
            )
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                logger.debug("server has no Session RPC: using the Push/Pull streams")
                self.disabled = True
                return Declined("server has no Session RPC", permanent=True)
            raise
        if resp.WhichOneof("body") != "opened":
            self._drop()
            raise MalformedStream("session stream did not answer open with opened")
        self.max_inline_bytes = resp.opened.max_inline_bytes or MAX_INLINE_BYTES
        self.sessions_opened += 1
        if want_link and resp.opened.HasField("local_link"):
            await self._move_to_local_link(resp.opened.local_link, worker_id)
        return None

    async def _move_to_local_link(self, offer: pb.LocalLink, worker_id: str) -> None:
        """Continue the session on the server's local-link socket; anything short of an
        ``opened`` answer there leaves it on gRPC for good (another host or namespace: the
        socket is not reachable; a refused ticket: something is off, do not insist)."""
        try:
            link = await LocalLinkCall.connect(offer.address, _LINK_CONNECT_TIMEOUT_S)
        except TimeoutError:  # a busy server: try again on the next session
            logger.debug("local link %s: no connection within the timeout", offer.address)
            return
        except OSError as exc:
            self.local_declined = f"cannot reach {offer.address!r}: {exc!r}"
            logger.debug("local link off: %s", self.local_declined)
            return
        self._seq += 1
        reason = ""
        try:
            await link.write(
                pb.SessionRequest(
                    seq=self._seq,
                    open=pb.SessionOpen(worker_id=worker_id, local_ticket=offer.ticket),
                )
            )
            answer = await asyncio.wait_for(link.read(), _LINK_CONNECT_TIMEOUT_S)
        except (TimeoutError, OSError, MalformedStream) as exc:
            answer, reason = None, repr(exc)
        except BaseException:  # cancelled (the request's deadline): no link left open
            link.cancel()
            raise
        if answer is grpc.aio.EOF:
            answer, reason = None, "the link closed before answering"
        elif isinstance(answer, pb.SessionResponse) and answer.WhichOneof("body") != "opened":
            reason = answer.error.message or "not answered with opened"
            answer = None
        if answer is None:
            link.cancel()
            self.local_declined = f"{offer.address!r} refused the session: {reason}"
            logger.debug("local link off: %s", self.local_declined)
            return
        grpc_call, self._call = self._call, link
        if grpc_call is not None:
            grpc_call.cancel()  # the gRPC Session ends; the server's handler for it returns
        self.local_links_opened += 1
        logger.debug("session moved to the local link %s", offer.address)

    async def _ensure_segment(self, push_bytes: int, pull_bytes: int) -> bool:
        """Make the mapped segment's regions at least this big (bytes); False: no shared
        memory (declined now or before)."""
        if not self._shm_possible:
            return False
        seg = self._segment
        fits = seg is not None and push_bytes <= seg.push.size_bytes
        if fits and seg is not None and pull_bytes <= seg.pull.size_bytes:
            return True
        want_push = _round_region(max(push_bytes, seg.push.size_bytes if seg else 0))
        want_pull = _round_region(max(pull_bytes, seg.pull.size_bytes if seg else 0))
        try:
            new = shm.ClientSegment.create(want_push, want_pull, self.shm_dir)
        except OSError as err:
            self.shm_declined = f"cannot create a segment in {self.shm_dir}: {err}"
            logger.debug("shared memory off: %s", self.shm_declined)
            return False
        try:
            resp = await self._roundtrip(pb.SessionRequest(shm_offer=new.offer()))
        except BaseException:
            new.close()
            raise
        finally:
            new.unlink()  # accepted or not, no file outlives the answer
        if not resp.shm.accepted:
            new.close()
            self.shm_declined = resp.shm.reason or "declined"
            logger.debug("server declined shared memory: %s", self.shm_declined)
            if seg is not None:  # the server keeps the old mapping; stop using it anyway
                self._segment = None
                seg.close()
            return False
        if seg is not None:
            seg.close()
        self._segment = new
        self.offers_accepted += 1
        return True

    # ------------------------------------------------------------------ encoding
    async def _fill_push(
        self,
        msg: pb.SessionPush,
        header: pb.PushHeader,
        arrays: Mapping[str, np.ndarray],
        pull_bytes: int,
    ) -> Declined | None:
        """Write the push into ``msg`` (the request's own field: no nested-message copies);
        declined when it is too large to go inline and shared memory is off."""
        sizes = {k: a.nbytes for k, a in arrays.items()}
        need = batch_bytes(sizes.values())
        msg.header.CopyFrom(header)
        values = list(arrays.values())
        if need > SMALL_INLINE_BYTES and await self._ensure_segment(need, pull_bytes):
            seg = self._segment
            assert seg is not None
            dsts = place_slot_batch(msg.slots, seg.push.view, arrays, values, memo=seg.layouts)
            for dst, arr in zip(dsts, values, strict=True):
                np.copyto(dst, arr)
        elif need <= self.max_inline_bytes:
            pack_slot_batch(msg.slots, list(arrays), values, memo=self._packed_sent)
        else:
            return Declined(f"push of {need} bytes without shared memory")
        self.known_nbytes.update(sizes)
        return None

    def _decode(self, pulled: pb.SessionPulled, copy: bool) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        batch = pulled.slots
        if batch.HasField("data"):
            self._decode_packed(batch, out)
        else:
            self._decode_slots(batch, copy, out)
        return out

    def _pulled_rows(self, batch: pb.SlotBatch) -> np.ndarray:
        """A fresh array of the rows of a row pull's answer (its one slot, keyed "rows").

        Raises:
            MalformedStream: not one slot keyed "rows", or a slot outside its region.
        """
        if batch.HasField("data"):
            region = inline_region(batch.data, "inline rows")
        elif self._segment is not None:
            region = self._segment.pull
        else:
            raise MalformedStream("rows in shared memory, but none is mapped")
        try:
            entries, views = slot_batch_views(batch, region)
        except InvalidArgument as exc:
            raise MalformedStream(f"pulled rows: {exc.message}") from None
        if [e[0] for e in entries] != ["rows"]:
            raise MalformedStream(f"a row pull answered with tensors {[e[0] for e in entries]}")
        return views[0].copy()

    def _decode_slots(self, batch: pb.SlotBatch, copy: bool, out: dict[str, np.ndarray]) -> None:
        """The values of a pulled :class:`SlotBatch` (pull-region slots), into ``out``."""
        seg = self._segment
        if seg is None:
            entries = slot_batch_entries(batch)
            if entries:
                raise MalformedStream(
                    f"tensor {entries[0][0]!r} in shared memory, but none is mapped"
                )
            return
        region = seg.pull
        entries, views = slot_batch_views(batch, region, seg.layouts)
        buffers = self.pull_buffers
        known = self.known_nbytes
        if copy and len(entries) > 1 and self._decode_arena(region, entries, out):
            return
        for (key, dtype, shape, _offset, nbytes), view in zip(entries, views, strict=True):
            if copy:
                arr = buffers.empty(key, dtype, shape)
                np.copyto(arr, view, casting="no")
                buffers.keep(key, arr)
            else:
                arr = view.view()  # a new array object each pull (the memo keeps the view)
            out[key] = arr
            known[key] = nbytes

    def _decode_packed(self, batch: pb.SlotBatch, out: dict[str, np.ndarray]) -> None:
        """The values of a pulled inline batch, into ``out``: copied out of the message's
        bytes (many keys in one pass, :meth:`_decode_arena`), writeable whatever ``copy``.

        Raises:
            MalformedStream: a slot outside the batch's bytes, or arrays that disagree.
        """
        region = inline_region(batch.data, "inline pull")
        try:
            entries = slot_batch_entries(batch, self._packed_read)
            if len(entries) > 1 and self._decode_arena(region, entries, out):
                return
        except InvalidArgument as exc:
            raise MalformedStream(f"inline pull: {exc.message}") from None
        known = self.known_nbytes
        for key, dtype, shape, offset, nbytes in entries:
            try:
                view = region.view(offset, nbytes, dtype, shape)
            except InvalidArgument as exc:
                raise MalformedStream(f"tensor {key!r}: {exc.message}") from None
            out[key] = view.copy()
            known[key] = nbytes

    def _decode_arena(
        self, region: shm.Region, entries: list[SlotEntry], out: dict[str, np.ndarray]
    ) -> bool:
        """Copy the values of many keys out of the pull region in one pass into one private
        buffer (reused once nothing refers to any of its values) and return views of it.

        One contiguous copy instead of one per key: separately allocated destinations cost
        up to ~1.7x the copy of the same bytes (measured with ResNet-50's 161 tensors), and
        small ones fresh pages each pull. A value the caller keeps keeps the whole buffer.
        False (nothing done) when the slots are not laid out in order without overlap.
        """
        start = prev_end = entries[0][3]
        payload = 0
        for _key, _dtype, _shape, offset, nbytes in entries:
            if offset < prev_end:
                return False
            prev_end = offset + nbytes
            payload += nbytes
        span = prev_end - start
        if span > 2 * payload + (len(entries) << 16):  # (padding only: else per key)
            return False
        arena = self.pull_buffers.empty(_ARENA_KEY, np.dtype(np.uint8), (span,))
        np.copyto(arena, region.view(start, span, np.dtype(np.uint8), (span,)), casting="no")
        self.pull_buffers.keep(_ARENA_KEY, arena)
        known = self.known_nbytes
        for key, dtype, shape, offset, nbytes in entries:
            rel = offset - start
            out[key] = arena[rel : rel + nbytes].view(dtype).reshape(shape)
            known[key] = nbytes
        return True

    def _pull_bytes(self, keys: list[str]) -> int | None:
        """Bytes the pull of ``keys`` needs in the pull region, when every size is known."""
        if not keys:
            return None
        known = self.known_nbytes
        total = 0
        for key in keys:  # (one pass: this runs on every request)
            nbytes = known.get(key)
            if nbytes is None:
                return None
            total += shm.align_up(nbytes)
        return total

    async def _prepare_pull(self, keys: list[str]) -> Declined | None:
        """Grow the pull region up front when the sizes are known; declined when the values
        cannot come over the session."""
        need = self._pull_bytes(keys)
        if need is None:
            return None
        if need > SMALL_INLINE_BYTES and not await self._ensure_segment(0, need):
            if need > self.max_inline_bytes:
                return Declined(f"pull of {need} bytes without shared memory")
        return None

    async def _finish_pull(
        self, req: pb.PullRequest, pulled: pb.SessionPulled, copy: bool
    ) -> PullResult | Declined:
        if pulled.needed_bytes:
            if not await self._ensure_segment(0, pulled.needed_bytes):
                return Declined(f"pull of {pulled.needed_bytes} bytes without shared memory")
            pulled = (await self._roundtrip(pb.SessionRequest(pull=req))).pull
            if pulled.needed_bytes:
                return Declined(f"pull of {pulled.needed_bytes} bytes still does not fit")
        return pulled.info, self._decode(pulled, copy)

    # ------------------------------------------------------------------ requests
    async def push(self, push: PushPayload) -> pb.PushResponse | Declined:
        """One push over the session (declined, nothing sent: compressed gradients, too large
        without shared memory, or no Session RPC).

        Raises:
            grpc.aio.AioRpcError: a refusal (its status code) or a broken stream.
        """
        arrays = push.dense
        if arrays is None:
            return _COMPRESSED
        async with self._lock, self._deadline(push.deadline_s):
            header = push.header()
            declined = await self._ensure_open(header.worker_id)
            if declined is not None:
                return declined
            request = pb.SessionRequest()
            declined = await self._fill_push(request.push, header, arrays, 0)
            if declined is not None:
                return declined
            return (await self._roundtrip(request)).push

    async def pull(self, pull: PullSpec) -> PullResult | Declined:
        """One pull over the session; values are fresh arrays unless ``pull.copy`` is False
        (then shared-memory values are views of the pull region, valid until the next request).

        Raises:
            grpc.aio.AioRpcError: as :meth:`push`.
        """
        request = pull.request
        async with self._lock, self._deadline(pull.deadline_s):
            declined = await self._ensure_open(request.worker_id)
            if declined is None:
                declined = await self._prepare_pull(list(request.keys))
            if declined is not None:
                return declined
            pulled = (await self._roundtrip(pb.SessionRequest(pull=request))).pull
            return await self._finish_pull(request, pulled, pull.copy)

    async def pull_rows(
        self, header: tpb.RowsHeader, ids: IdArray, deadline_s: float
    ) -> np.ndarray | Declined:
        """One embedding-table row pull: a fresh (n, dim) array (the pull region is sized up
        front once a row's size is known)."""
        got = await self._rows(header, ids, None, deadline_s)
        if isinstance(got, Declined):
            return got
        done, rows = got
        self.row_bytes[header.table] = int(done.info.dim) * rows.dtype.itemsize
        return rows

    async def push_rows(
        self, header: tpb.RowsHeader, rows: RowPush, deadline_s: float
    ) -> tpb.PushRowsResponse | Declined:
        """One embedding-table row push: the server's response."""
        got = await self._rows(header, rows.ids, rows.grads, deadline_s)
        if isinstance(got, Declined):
            return got
        return got[0].pushed

    async def push_pull_rows(
        self, header: tpb.RowsHeader, rows: RowPush, pull_ids: IdArray, deadline_s: float
    ) -> tuple[tpb.PushRowsResponse, np.ndarray] | Declined:
        """A row push, then a row pull of the same table, in one request (tensors "ids",
        "grads", "pull_ids"): the push's response and a fresh (m, dim) array of the rows."""
        got = await self._rows(header, rows.ids, rows.grads, deadline_s, pull_ids)
        if isinstance(got, Declined):
            return got
        done, pulled = got
        self.row_bytes[header.table] = int(done.info.dim) * pulled.dtype.itemsize
        return done.pushed, pulled

    async def _rows(
        self,
        header: tpb.RowsHeader,
        ids: np.ndarray,
        grads: np.ndarray | None,
        deadline_s: float,
        pull_ids: np.ndarray | None = None,
    ) -> tuple[pb.SessionRowsDone, np.ndarray] | Declined:
        """One row pull (``grads`` None), push, or push-then-pull (``grads`` and
        ``pull_ids``): ``header`` is the ``RowsHeader`` (table, worker id, request id, clock,
        timeout), ``ids`` int64 (n,), ``grads`` (n, dim), ``pull_ids`` int64 (m,). Returns
        the ``SessionRowsDone`` and, for a pull, its rows decoded into a fresh array (for a
        push, ``ids``). A push-then-pull whose rows fit neither inline nor the pull region
        has its push applied; its rows are then pulled by a plain row pull."""
        async with self._lock, self._deadline(deadline_s):
            declined = await self._ensure_open(header.worker_id)
            if declined is not None:
                return declined
            request = pb.SessionRequest()
            msg = request.rows
            msg.header.CopyFrom(header)
            msg.push = grads is not None
            arrays = {"ids": ids} if grads is None else {"ids": ids, "grads": grads}
            if grads is not None and pull_ids is not None:
                arrays["pull_ids"] = pull_ids
            pulled_ids = ids if grads is None else pull_ids
            keys, values = list(arrays), list(arrays.values())
            need = batch_bytes(a.nbytes for a in values)
            row_bytes = self.row_bytes.get(header.table)
            pull_bytes = (
                0 if pulled_ids is None or row_bytes is None else pulled_ids.shape[0] * row_bytes
            )
            big = need > SMALL_INLINE_BYTES or pull_bytes > SMALL_INLINE_BYTES
            if big and await self._ensure_segment(need, pull_bytes):
                self._place_in_segment(msg.tensors, keys, values)
            elif need <= self.max_inline_bytes and pull_bytes <= self.max_inline_bytes:
                pack_slot_batch(msg.tensors, keys, values)
            else:
                return Declined(
                    f"row request of {max(need, pull_bytes)} bytes without shared memory"
                )
            done = (await self._roundtrip(request)).rows
            if pulled_ids is None:
                return done, ids
            if done.needed_bytes:  # a pull changes nothing: ask again with a bigger region
                if not await self._ensure_segment(need, done.needed_bytes):
                    # (a push-then-pull's push was applied: the streams pull the rows)
                    return Declined(f"row pull of {done.needed_bytes} bytes without shared memory")
                if grads is not None:  # a push-then-pull: its push stands; pull the rows alone
                    pushed = done.pushed
                    msg.push = False
                    msg.ClearField("tensors")
                    keys, values = ["ids"], [pulled_ids]
                    pack_slot_batch(msg.tensors, keys, values)
                    if pulled_ids.nbytes > SMALL_INLINE_BYTES:
                        msg.ClearField("tensors")
                        self._place_in_segment(msg.tensors, keys, values)
                elif not msg.tensors.HasField("data"):  # the ids again: the segment may be new
                    msg.ClearField("tensors")
                    self._place_in_segment(msg.tensors, keys, values)
                done = (await self._roundtrip(request)).rows
                if done.needed_bytes:
                    return Declined(f"row pull of {done.needed_bytes} bytes still does not fit")
                if grads is not None:
                    done.pushed.CopyFrom(pushed)
            return done, self._pulled_rows(done.tensors)

    def _place_in_segment(
        self, batch: pb.SlotBatch, keys: list[str], values: list[np.ndarray]
    ) -> None:
        """Copy ``values`` into the current segment's push region, described in ``batch``."""
        seg = self._segment
        assert seg is not None
        dsts = place_slot_batch(batch, seg.push.view, keys, values)
        for dst, arr in zip(dsts, values, strict=True):
            np.copyto(dst, arr)

    async def push_pull(
        self, push: PushPayload, pull: PullSpec
    ) -> tuple[pb.PushResponse, PullResult | None] | Declined:
        """Push, then pull, in one round trip (both within ``pull.deadline_s``).

        Returns:
            The push's response, and the pull's info and values — None when the values could
            not come over the session (the push was applied; pull them over the stream);
            declined (nothing sent) when the push cannot go over the session.

        Raises:
            grpc.aio.AioRpcError: as :meth:`push`.
        """
        arrays = push.dense
        if arrays is None:
            return _COMPRESSED
        request = pull.request
        async with self._lock, self._deadline(pull.deadline_s):
            header = push.header()
            declined = await self._ensure_open(header.worker_id)
            if declined is not None:
                return declined
            keys = list(request.keys)
            pull_bytes = self._pull_bytes(keys)
            if pull_bytes is None:
                pull_bytes = batch_bytes(a.nbytes for k, a in arrays.items() if k in keys)
            req = pb.SessionRequest()
            both = req.push_pull
            declined = await self._fill_push(both.push, header, arrays, pull_bytes)
            if declined is not None:
                return declined
            both.pull.CopyFrom(request)
            resp = await self._roundtrip(req)
            pushed = resp.push_pull.push
            pulled = await self._finish_pull(request, resp.push_pull.pull, pull.copy)
            return pushed, None if isinstance(pulled, Declined) else pulled

    def _deadline(self, deadline_s: float) -> _Deadline:
        return _Deadline(self, deadline_s)

    def _arm(self, loop: asyncio.AbstractEventLoop, at: float) -> None:
        """Make the deadline timer fire no later than loop time ``at``."""
        timer = self._timer
        if timer is not None and self._timer_loop is loop and timer.when() <= at:
            return  # fires earlier; it re-arms itself for the request then in flight
        if timer is not None:
            timer.cancel()
        self._timer = loop.call_at(at, self._on_timer)
        self._timer_loop = loop

    def _on_timer(self) -> None:
        self._timer = None
        task = self._timed_task
        if task is None or self._expired:
            return  # no request in flight: re-armed by the next one
        loop = self._timer_loop
        assert loop is not None
        if self._expiry - loop.time() > _TIMER_SLACK_S:
            self._arm(loop, self._expiry)  # a later request's deadline
            return
        self._expired = True
        task.cancel()


#: A deadline timer firing this close (seconds) before its request's deadline expires it.
_TIMER_SLACK_S = 1e-3


class _Deadline:
    """``async with``: the request's deadline; past it the stream is dropped (its response
    may still arrive: it must never be read as the next request's) and DEADLINE_EXCEEDED is
    raised as the ordinary path's call would raise it.

    Same semantics as :func:`asyncio.timeout` (the request's task is cancelled at the deadline
    and the cancellation turned into the error), but with one timer per :class:`SessionTransport`,
    re-armed lazily: a request only moves it earlier, and when it fires for a request that has
    finished it re-arms for the one in flight. Small requests take microseconds and deadlines
    are seconds, so the timer rarely moves (a timer per request cost a tenth of the client's
    Python time per round). Requests of one SessionTransport never overlap (its lock).
    """

    __slots__ = ("_cancelling", "_fp", "_s", "_task")

    def __init__(self, fp: SessionTransport, deadline_s: float) -> None:
        self._fp = fp
        self._s = deadline_s
        self._task: asyncio.Task[object] | None = None
        self._cancelling = 0

    async def __aenter__(self) -> None:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("a session request must run in a task")
        loop = asyncio.get_running_loop()
        fp = self._fp
        self._task = task
        self._cancelling = task.cancelling()
        fp._timed_task = task
        fp._expired = False
        fp._expiry = at = loop.time() + self._s
        fp._arm(loop, at)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        fp = self._fp
        fp._timed_task = None
        fp._expiry = math.inf
        if not fp._expired:
            return
        fp._expired = False
        task = self._task
        assert task is not None
        # As asyncio.timeout: our cancellation (and no one else's) becomes the deadline error.
        if task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
            fp._drop()
            raise _rpc_error(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"no session response within {self._s:.3f} s"
            ) from None
