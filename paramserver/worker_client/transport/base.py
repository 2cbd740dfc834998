"""The one interface every way of reaching a shard implements, and the choice between them.

A worker client's data-plane requests (push, pull, push_pull, row pull, row push, row
push-then-pull) travel by a :class:`Transport`:

- :class:`~paramserver.worker_client.transport.streams.StreamTransport`: one chunked gRPC
  ``Push`` / ``Pull`` / ``PushRows`` / ``PullRows`` stream per request; carries every request
  of any size, compressed gradients too.
- :class:`~paramserver.worker_client.transport.session_stream.SessionTransport`: one persistent
  ``Session`` stream, on gRPC or moved onto the server's same-host local link
  (:mod:`paramserver.worker_client.transport.link_client`), with tensor bytes inline or in
  shared-memory slots. It declines what it cannot carry (too large without shared memory,
  compressed gradients, a server without the Session RPC).

A transport that cannot carry a request says so by returning :class:`Declined` (nothing was
sent), never by raising; :class:`Transports` then sends the request by the streams. The
preferred transport is chosen once, when the client is built, and replaced explicitly (by the
streams, for good) when it declines permanently.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from paramserver.api.v1 import parameter_server_pb2 as pb
from paramserver.api.v1 import tables_pb2 as tpb
from paramserver.api.v1 import tensor_pb2
from paramserver.errors import ParamServerError
from paramserver.protocol import rows_wire, tensor
from paramserver.worker_client.compression import DenseParts, WirePart

__all__ = [
    "Declined",
    "IdArray",
    "PullResult",
    "PullSpec",
    "PushPayload",
    "RowPush",
    "Transport",
    "Transports",
]

logger = logging.getLogger(__name__)

R = TypeVar("R")

#: A pull's outcome: the server's info and key -> value.
PullResult = tuple[pb.PullInfo, dict[str, np.ndarray]]
#: Row ids as the transports take them: int64 (n,).
IdArray = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class Declined:
    """A transport's answer to a request it cannot carry; nothing was sent (for push_pull:
    nothing of the push).

    Attributes:
        reason: Why, for the debug log.
        permanent: Every later request would be declined too (the server has no such RPC).
    """

    reason: str
    permanent: bool = False


@dataclass(frozen=True, slots=True)
class PushPayload:
    """One push as every transport takes it (built once per push, sent per attempt).

    Attributes:
        request_id: The push's request id (the same at every attempt: applied once).
        header: Builds the push header at each attempt (clock and version read then).
        parts: key -> the parts the Push stream sends (compressed gradients: several).
        dense: key -> the array when every key is one uncompressed part, else None.
        deadline_s: Deadline of the push's own call, seconds.
    """

    request_id: int
    header: Callable[[], pb.PushHeader]
    parts: Mapping[str, list[WirePart]]
    dense: Mapping[str, np.ndarray] | None
    deadline_s: float

    @classmethod
    def of(
        cls,
        request_id: int,
        header: Callable[[], pb.PushHeader],
        parts: Mapping[str, list[WirePart]],
        deadline_s: float,
    ) -> PushPayload:
        """The payload of ``parts`` (``dense`` worked out from them)."""
        if isinstance(parts, DenseParts):
            return cls(request_id, header, parts, parts.arrays, deadline_s)
        dense: dict[str, np.ndarray] = {}
        for key, key_parts in parts.items():
            if len(key_parts) != 1 or key_parts[0].role != tensor_pb2.TENSOR_ROLE_UNSPECIFIED:
                return cls(request_id, header, parts, None, deadline_s)
            dense[key] = key_parts[0].array
        return cls(request_id, header, parts, dense, deadline_s)


@dataclass(frozen=True, slots=True)
class PullSpec:
    """One attempt of a pull as every transport takes it.

    Attributes:
        request: The ``PullRequest`` (worker id, keys, the server's wait in ms).
        deadline_s: Deadline of the whole call (wait and transfer), seconds.
        copy: False: shared-memory values may be views of the pull region, valid until the
            next request (the streams always return fresh arrays).
    """

    request: pb.PullRequest
    deadline_s: float
    copy: bool = True


@dataclass(slots=True)
class RowPush:
    """One row push: int64 (n,) ids and (n, dim) gradient rows; the stream's chunks are encoded
    once, on first need, and re-sent on retry."""

    ids: IdArray
    grads: np.ndarray
    _chunks: list[bytes] | None = field(default=None, repr=False)

    def header(self, header: tpb.RowsHeader) -> tpb.RowsHeader:
        """``header`` (left as it is) with this push's id count, dtype and dim filled in."""
        full = tpb.RowsHeader()
        full.CopyFrom(header)
        full.num_ids = int(self.ids.shape[0])
        full.dtype = tensor.dtype_to_wire(self.grads.dtype)
        full.dim = int(self.grads.shape[1])
        return full

    @property
    def chunks(self) -> list[bytes]:
        """The chunk messages of the PushRows stream (their wire bytes: the same for every
        row request stream)."""
        if self._chunks is None:
            self._chunks = list(rows_wire.chunk_messages(self.ids, self.grads))
        return self._chunks


class Transport(Protocol):
    """A way of carrying a worker client's data-plane requests to one shard.

    Each method either carries the request (returning the server's answer, or raising the
    :class:`grpc.aio.AioRpcError` a refusal or a broken link is, for the retry funnel of
    :mod:`paramserver.worker_client.retry`) or returns :class:`Declined` having sent nothing.
    """

    @property
    def ready(self) -> bool:
        """The transport can take a request now (False: busy, or off for good)."""

    def close(self) -> None:
        """Release the transport's streams and memory (no I/O)."""

    async def push(self, push: PushPayload) -> pb.PushResponse | Declined:
        """Push gradients; the server's response."""

    async def pull(self, pull: PullSpec) -> PullResult | Declined:
        """Pull values: the server's info and key -> value."""

    async def push_pull(
        self, push: PushPayload, pull: PullSpec
    ) -> tuple[pb.PushResponse, PullResult | None] | Declined:
        """Push, then pull the values after it; the pull's result None: pull them separately
        (the push was applied)."""

    async def pull_rows(
        self, header: tpb.RowsHeader, ids: IdArray, deadline_s: float
    ) -> np.ndarray | Declined:
        """Rows of ``ids`` (int64 (n,)) of ``header.table``: a (n, dim) array."""

    async def push_rows(
        self, header: tpb.RowsHeader, rows: RowPush, deadline_s: float
    ) -> tpb.PushRowsResponse | Declined:
        """Push gradient rows; the server's response."""

    async def push_pull_rows(
        self, header: tpb.RowsHeader, rows: RowPush, pull_ids: IdArray, deadline_s: float
    ) -> tuple[tpb.PushRowsResponse, np.ndarray] | Declined:
        """Push gradient rows, then pull the rows of ``pull_ids`` (int64 (m,)) of the same
        table after the push (``header.timeout_ms``: the pull's wait); the push's response
        and a (m, dim) array. Declined: nothing of the push was sent, or (the rows found
        too large for this transport only once the push was applied) the push was applied
        and carrying the request again with its request id is answered as a duplicate."""


class Transports:
    """The transports of one worker client: the preferred one (chosen when the client is
    built: the Session, unless switched off), and the streams, which carry every request.

    Args:
        streams: The transport of last resort (never declines).
        preferred: Tried first while it is ready; None: the streams only.
    """

    def __init__(self, streams: Transport, preferred: Transport | None = None) -> None:
        self.streams = streams
        self.preferred = preferred

    async def send(self, request: Callable[[Transport], Awaitable[R | Declined]]) -> R:
        """Send ``request`` by the preferred transport when it is ready and carries it, else by
        the streams. A permanent decline replaces the preferred transport by the streams.

        Raises:
            The errors of the transport that carried the request.
        """
        preferred = self.preferred
        if preferred is not None and preferred.ready:
            got = await request(preferred)
            if not isinstance(got, Declined):
                return got
            if got.permanent:
                logger.debug("%s off for good: %s", type(preferred).__name__, got.reason)
                self.preferred = None
        got = await request(self.streams)
        if isinstance(got, Declined):  # pragma: no cover - the streams carry every request
            raise ParamServerError(f"no transport carries this request: {got.reason}")
        return got
