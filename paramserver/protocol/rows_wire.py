"""Wire codec of embedding-table requests, shared by the server and the worker client.

Ids travel as raw little-endian int64 bytes and rows as raw little-endian C-order bytes, in
:class:`RowsChunk` messages of ``k`` whole ids (and their ``k`` rows) chosen so that a chunk
stays near :data:`~paramserver.protocol.tensor.DEFAULT_CHUNK_BYTES` (``tables.proto`` documents
every field). Sending writes each chunk message's wire bytes straight from the arrays (one copy,
:func:`~paramserver.protocol.wire.row_chunk_message`); receiving is ``numpy.frombuffer`` per
chunk (of the message itself when :func:`~paramserver.protocol.wire.rows_deserializer` read
it) and one concatenation: no per-id work.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from paramserver.api.v1 import tables_pb2 as tpb
from paramserver.errors import MalformedStream
from paramserver.protocol import tensor, wire
from paramserver.protocol.table_spec import Initializer, TableRule, TableSpec

__all__ = [
    "RowsChunkLike",
    "RowsReceiver",
    "SegmentsReceiver",
    "chunk_messages",
    "rows_per_chunk",
    "spec_from_proto",
    "spec_to_proto",
]

_RULES = {
    tpb.TABLE_RULE_KIND_UNSPECIFIED: "sgd",
    tpb.TABLE_RULE_KIND_SGD: "sgd",
    tpb.TABLE_RULE_KIND_ADAGRAD: "adagrad",
    tpb.TABLE_RULE_KIND_ROWWISE_ADAGRAD: "rowwise_adagrad",
    tpb.TABLE_RULE_KIND_ADAM: "adam",
}
_INITS = {
    tpb.TABLE_INITIALIZER_UNSPECIFIED: "uniform",
    tpb.TABLE_INITIALIZER_UNIFORM: "uniform",
    tpb.TABLE_INITIALIZER_NORMAL: "normal",
    tpb.TABLE_INITIALIZER_ZEROS: "zeros",
}
_CONS = {
    tpb.TABLE_CONSISTENCY_UNSPECIFIED: "asp",
    tpb.TABLE_CONSISTENCY_ASP: "asp",
    tpb.TABLE_CONSISTENCY_SSP: "ssp",
    tpb.TABLE_CONSISTENCY_BSP: "bsp",
}


_Code = TypeVar("_Code", bound=int)

#: The optional ``TableRule`` fields (unset: the rule's default).
_RULE_FLOATS: tuple[Literal["lr", "eps", "beta1", "beta2", "initial_accumulator"], ...] = (
    "lr",
    "eps",
    "beta1",
    "beta2",
    "initial_accumulator",
)


def _to_wire(names: dict[_Code, str]) -> dict[str, _Code]:
    """The inverse of a wire enum -> name table (UNSPECIFIED, value 0, is never written)."""
    return {name: code for code, name in names.items() if code != 0}


_RULES_PB = _to_wire(_RULES)
_INITS_PB = _to_wire(_INITS)
_CONS_PB = _to_wire(_CONS)


def spec_to_proto(spec: TableSpec) -> tpb.TableSpec:
    """A :class:`TableSpec` as a ``tables_pb2.TableSpec`` (every value explicit)."""
    r = spec.rule
    msg = tpb.TableSpec(
        name=spec.name,
        dim=spec.dim,
        dtype=tensor.dtype_to_wire(spec.np_dtype),
        rule=tpb.TableRule(
            kind=_RULES_PB[r.kind],
            lr=r.lr,
            eps=r.eps,
            beta1=r.beta1,
            beta2=r.beta2,
            initial_accumulator=r.initial_accumulator,
        ),
        initializer=_INITS_PB[spec.initializer.kind],
        init_scale=spec.initializer.scale,
        seed=spec.seed,
        consistency=_CONS_PB[spec.consistency],
        staleness=spec.staleness,
        expiry_clocks=spec.expiry_clocks,
        expiry_s=spec.expiry_s,
        min_pushes=spec.min_pushes,
    )
    if spec.num_embeddings is not None:
        msg.num_embeddings = spec.num_embeddings
    return msg


def spec_from_proto(msg: tpb.TableSpec) -> TableSpec:
    """A ``tables_pb2.TableSpec`` as a validated :class:`TableSpec`.

    Raises:
        InvalidArgument: an unknown enum value or a value out of range (INVALID_ARGUMENT).
    """
    name = msg.name
    dtype = (
        "float32" if msg.dtype == 0 else str(tensor.dtype_from_wire(msg.dtype, f"table {name!r}"))
    )
    r = msg.rule
    if r.kind not in _RULES or msg.initializer not in _INITS or msg.consistency not in _CONS:
        raise MalformedStream(f"table {name!r}: unknown rule, initializer or consistency value")
    rule_kw = {f: float(getattr(r, f)) for f in _RULE_FLOATS if r.HasField(f)}
    init = Initializer(
        _INITS[msg.initializer], msg.init_scale if msg.HasField("init_scale") else 0.01
    )
    return TableSpec(
        name=name,
        dim=int(msg.dim),
        dtype=dtype,
        rule=TableRule(_RULES[r.kind], **rule_kw),
        initializer=init,
        seed=int(msg.seed),
        num_embeddings=int(msg.num_embeddings) if msg.HasField("num_embeddings") else None,
        consistency=_CONS[msg.consistency],
        staleness=int(msg.staleness),
        expiry_clocks=int(msg.expiry_clocks),
        expiry_s=float(msg.expiry_s),
        min_pushes=max(1, int(msg.min_pushes)),
    )


def rows_per_chunk(row_bytes: int, chunk_bytes: int = tensor.DEFAULT_CHUNK_BYTES) -> int:
    """Ids per chunk: k with ``k * (8 + row_bytes)`` near ``chunk_bytes`` (at least 1)."""
    return max(1, chunk_bytes // (8 + row_bytes))


class RowsChunkLike(Protocol):
    """A received ``RowsChunk``: the generated message, or
    :class:`~paramserver.protocol.wire.RawRowsChunk` (its fields read in place)."""

    @property
    def ids(self) -> bytes | memoryview: ...

    @property
    def rows(self) -> bytes | memoryview: ...

    @property
    def versions(self) -> bytes | memoryview: ...


def chunk_messages(
    ids: npt.NDArray[np.int64] | None,
    rows: np.ndarray | None,
    *,
    chunk_bytes: int = tensor.DEFAULT_CHUNK_BYTES,
    versions: npt.NDArray[np.int64] | None = None,
) -> Iterator[bytes]:
    """The wire bytes of the row stream messages (``body`` = ``RowsChunk``) carrying ids
    and/or rows (little-endian), in order: what a ``chunk=RowsChunk(...)`` message of any row
    stream (requests and replies alike) serializes to.

    Args:
        ids: int64 (n,) or None (row-only chunks: pull replies).
        rows: (n, dim) rows or None (id-only chunks: pull requests).
        versions: int64 (n,) row versions, one per id or row (``RowsChunk.versions``), or
            None (no versions).
    """
    n = ids.shape[0] if ids is not None else rows.shape[0] if rows is not None else 0
    per_row = 0 if rows is None else rows.dtype.itemsize * (rows.shape[1] if rows.ndim > 1 else 1)
    k = rows_per_chunk(per_row + (8 if versions is not None else 0), chunk_bytes)
    versions_le = None if versions is None else _bytes_of(versions.astype("<i8", copy=False))
    ids_le = None if ids is None else _bytes_of(ids.astype("<i8", copy=False))
    rows_le = None
    if rows is not None:
        native = (
            rows if rows.dtype.byteorder in "=|<" else rows.astype(rows.dtype.newbyteorder("<"))
        )
        rows_le = _bytes_of(native)
    for start in range(0, n, k):
        stop = min(n, start + k)
        yield wire.row_chunk_message(
            None if ids_le is None else ids_le[8 * start : 8 * stop],
            None if rows_le is None else rows_le[per_row * start : per_row * stop],
            None if versions_le is None else versions_le[8 * start : 8 * stop],
        )


def _bytes_of(array: np.ndarray) -> memoryview:
    """A flat byte view of ``array`` (copied first when it is not C-contiguous; through
    uint8, since numpy exports no buffer of extension dtypes such as bfloat16)."""
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8).data


class RowsReceiver:
    """Collects ``RowsChunk`` messages of a stream into one ids array and one rows array.

    Args:
        what: Names the stream in errors (e.g. ``"table 'emb'"``).
        num_ids: Ids the header announced.
        dim: Row width (0: chunks carry no rows).
        dtype: Row dtype (ignored when ``dim`` is 0).
        with_ids: Chunks carry ids.
        with_versions: Chunks carry one int64 version per id or row (``RowsChunk.versions``),
            collected into :attr:`versions` by :meth:`finish`.

    Raises (from :meth:`feed` / :meth:`finish`):
        MalformedStream: a chunk's ids and rows disagree, a chunk carries what its stream does
            not (rows in a pull request, ids in a pull reply, versions where none were asked
            for or a count of them other than the chunk's ids), or more or fewer ids than
            announced (INVALID_ARGUMENT).
    """

    def __init__(
        self,
        what: str,
        num_ids: int,
        dim: int,
        dtype: np.dtype[np.generic],
        *,
        with_ids: bool = True,
        with_versions: bool = False,
    ) -> None:
        self.what = what
        self.num_ids = num_ids
        self.dim = dim
        self.dtype = dtype
        self.with_ids = with_ids
        self._ids: list[np.ndarray] = []
        self._rows: list[np.ndarray] = []
        self.with_versions = with_versions
        self._versions: list[np.ndarray] = []
        #: The versions received (int64 (n,); empty unless ``with_versions``), set by
        #: :meth:`finish`.
        self.versions: npt.NDArray[np.int64] = np.zeros(0, np.int64)
        self.received = 0

    def feed(self, chunk: RowsChunkLike) -> None:
        if self.with_ids and not self.dim and chunk.rows:
            raise MalformedStream(
                f"{self.what}: a chunk of a PullRows request carries {len(chunk.rows)} row "
                "bytes; such chunks carry ids only"
            )
        if not self.with_ids and chunk.ids:
            raise MalformedStream(
                f"{self.what}: a chunk of a PullRows reply carries ids; such chunks carry rows only"
            )
        if self.with_ids:
            if len(chunk.ids) % 8:
                raise MalformedStream(f"{self.what}: a chunk's ids are not whole int64s")
            k = len(chunk.ids) // 8
        else:
            if self.dim == 0:
                raise MalformedStream(f"{self.what}: chunk with neither ids nor rows")
            row_bytes = self.dim * self.dtype.itemsize
            if len(chunk.rows) % row_bytes:
                raise MalformedStream(f"{self.what}: a chunk's rows are not whole rows")
            k = len(chunk.rows) // row_bytes
        if k == 0:
            raise MalformedStream(f"{self.what}: empty chunk")
        if self.received + k > self.num_ids:
            raise MalformedStream(
                f"{self.what}: more than the {self.num_ids} ids the header announced"
            )
        if len(chunk.versions) != (8 * k if self.with_versions else 0):
            raise MalformedStream(
                f"{self.what}: a chunk of {k} ids carries {len(chunk.versions)} version bytes, "
                f"expected {8 * k if self.with_versions else 0}"
            )
        if self.with_versions:
            self._versions.append(np.frombuffer(chunk.versions, "<i8"))
        if self.with_ids:
            self._ids.append(np.frombuffer(chunk.ids, "<i8"))
        if self.dim:
            want = k * self.dim * self.dtype.itemsize
            if len(chunk.rows) != want:
                raise MalformedStream(
                    f"{self.what}: a chunk of {k} ids carries {len(chunk.rows)} row bytes, "
                    f"expected {want} ({self.dim} x {self.dtype})"
                )
            self._rows.append(
                np.frombuffer(chunk.rows, self.dtype.newbyteorder("<")).reshape(k, self.dim)
            )
        self.received += k

    def finish(self) -> tuple[npt.NDArray[np.int64], np.ndarray]:
        """The ids (native int64 (n,)) and rows ((n, dim) native, or (n, 0))."""
        if self.received != self.num_ids:
            raise MalformedStream(
                f"{self.what}: {self.received} ids received, the header announced {self.num_ids}"
            )
        ids = (
            np.concatenate(self._ids).astype(np.int64, copy=False)
            if self._ids
            else np.zeros(0, np.int64)
        )
        if self.dim:
            rows = (
                np.concatenate(self._rows).astype(self.dtype, copy=False)
                if self._rows
                else np.zeros((0, self.dim), self.dtype)
            )
        else:
            rows = np.zeros((self.received, 0), np.float32)
        if self._versions:
            self.versions = np.concatenate(self._versions).astype(np.int64, copy=False)
        return ids, rows


class SegmentsReceiver:
    """Collects the ``RowsChunk`` messages of a several-table stream (``RowsManyHeader``):
    segment 0's chunks, then segment 1's, and so on, each into its own :class:`RowsReceiver`.

    Args:
        receivers: One receiver per segment, in segment order.

    Raises (from :meth:`feed` / :meth:`finish`):
        MalformedStream: a chunk past the last segment, or any :class:`RowsReceiver` refusal
            (a chunk crossing a segment's end counts as more ids than it announced).
    """

    def __init__(self, receivers: list[RowsReceiver]) -> None:
        self.receivers = receivers
        self._at = 0

    def _current(self) -> RowsReceiver:
        while self._at < len(self.receivers):
            r = self.receivers[self._at]
            if r.received < r.num_ids:
                return r
            self._at += 1
        raise MalformedStream("a chunk after every segment's announced ids")

    def feed(self, chunk: RowsChunkLike) -> None:
        self._current().feed(chunk)

    def finish(self) -> list[tuple[npt.NDArray[np.int64], np.ndarray]]:
        """Every segment's (ids, rows), in segment order (see :meth:`RowsReceiver.finish`)."""
        return [r.finish() for r in self.receivers]
