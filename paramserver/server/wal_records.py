"""Every write-ahead-log record type: how it is built and how it replays, one registry entry each.

The log is the shard's ordered stream of mutation records: every state change (register, leave,
evict, init, push, clock, init_table, push_rows, expire_rows) is decided completely, then one
record of it is appended, then it is applied (:meth:`ServerEngine.mutate
<paramserver.server.engine.ServerEngine.mutate>`). Replaying the stream in order into a core
restored from the matching checkpoint rebuilds the state at the crash, because each record
replays through the very core method that applied it live.

A new mutation kind is one builder below and one :func:`_replays` entry; nothing else builds a
``WalRecord`` (a test checks it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

import numpy as np

from paramserver.api.v1 import tensor_pb2
from paramserver.api.v1 import wal_pb2 as wal_pb
from paramserver.core.optimizers import UpdateRule
from paramserver.errors import ParamServerError
from paramserver.protocol import tensor
from paramserver.protocol.rows_wire import spec_from_proto, spec_to_proto
from paramserver.server.wal import WalError

if TYPE_CHECKING:
    from paramserver.core.shard import ServerCore
    from paramserver.core.table_set import PreparedRowPush
    from paramserver.protocol.table_spec import TableSpec

__all__ = [
    "RECORD_TYPES",
    "clock",
    "depart",
    "expire_rows",
    "init",
    "init_table",
    "push",
    "push_rows",
    "register",
    "replay_into",
    "tensors_from_wal",
    "tensors_to_wal",
]


# ------------------------------------------------------------------------------ tensor codec
def tensors_to_wal(tensors: Mapping[str, np.ndarray]) -> list[wal_pb.WalTensor]:
    """Encode key -> array as whole WalTensor messages (little-endian C-order bytes)."""
    out = []
    for key, value in tensors.items():
        arr = tensor.normalize(value, key)
        header = tensor_pb2.TensorHeader(
            key=key,
            dtype=tensor.dtype_to_wire(arr.dtype),
            shape=list(arr.shape),
            size_bytes=arr.nbytes,
        )
        out.append(wal_pb.WalTensor(header=header, data=arr.tobytes()))
    return out


def tensors_from_wal(items: list[wal_pb.WalTensor]) -> dict[str, np.ndarray]:
    """Inverse of :func:`tensors_to_wal`; arrays are fresh and writeable."""
    out: dict[str, np.ndarray] = {}
    for item in items:
        h = item.header
        dtype = tensor.dtype_from_wire(h.dtype, h.key)
        out[h.key] = np.frombuffer(item.data, dtype=dtype).reshape(tuple(h.shape)).copy()
    return out


# ------------------------------------------------------------------------------ builders
def register(
    worker_name: str,
    replace: bool,
    nonce: str,
    worker_id: str,
    resume_worker_id: str = "",
    resume: bool = False,
) -> wal_pb.WalRecord:
    """A registration (replay checks it yields the same worker id)."""
    return wal_pb.WalRecord(
        register=wal_pb.WalRegister(
            worker_name=worker_name,
            replace=replace,
            client_nonce=nonce,
            worker_id=worker_id,
            resume_worker_id=resume_worker_id,
            resume=resume,
        )
    )


def depart(worker_id: str, why: str) -> wal_pb.WalRecord:
    """A worker left (``why="left"``) or its lease lapsed (``"evicted"``; consecutive evictions
    are one lease sweep and replay together)."""
    return wal_pb.WalRecord(depart=wal_pb.WalDepart(worker_id=worker_id, why=why))


def init(rule: UpdateRule, tensors: Mapping[str, np.ndarray]) -> wal_pb.WalRecord:
    """Keys declared with their initial values (only the keys the request created)."""
    return wal_pb.WalRecord(
        init=wal_pb.WalInit(rule=rule.to_proto(), tensors=tensors_to_wal(tensors))
    )


def push(
    worker_id: str,
    request_id: int,
    clock: int,
    num_samples: int,
    base_version: int | None,
    grads: Mapping[str, np.ndarray],
) -> wal_pb.WalRecord:
    """A dense push, as decided (its gradients decoded and checked)."""
    return wal_pb.WalRecord(
        push=wal_pb.WalPush(
            worker_id=worker_id,
            request_id=request_id,
            clock=clock,
            num_samples=num_samples,
            base_version=base_version,
            grads=tensors_to_wal(grads),
        )
    )


def clock(worker_id: str, ended: int) -> wal_pb.WalRecord:
    """A worker ended iteration ``ended``."""
    return wal_pb.WalRecord(clock=wal_pb.WalClock(worker_id=worker_id, clock=ended))


def init_table(spec: TableSpec) -> wal_pb.WalRecord:
    """A table declared."""
    return wal_pb.WalRecord(init_table=wal_pb.WalInitTable(spec=spec_to_proto(spec)))


def push_rows(prepared: PreparedRowPush, worker_id: str, now_s: float) -> wal_pb.WalRecord:
    """A row push, as prepared (ids checked), with the server time it applies at (expiry)."""
    (grads,) = tensors_to_wal({prepared.table.spec.name: np.ascontiguousarray(prepared.grads)})
    return wal_pb.WalRecord(
        push_rows=wal_pb.WalPushRows(
            table=prepared.table.spec.name,
            worker_id=worker_id,
            request_id=prepared.request_id,
            clock=prepared.clock,
            ids=prepared.ids.astype("<i8", copy=False).tobytes(),
            grads=grads,
            now_s=now_s,
        )
    )


def expire_rows(table: str, now_s: float, min_clock: int) -> wal_pb.WalRecord:
    """An expiry sweep of a table that drops rows."""
    return wal_pb.WalRecord(
        expire_rows=wal_pb.WalExpireRows(table=table, now_s=now_s, clock=min_clock)
    )


# ------------------------------------------------------------------------------ replay
@dataclass
class _Replay:
    """What replaying records share: the core, the monotonic time replayed mutations are
    stamped with, and a lease sweep's evictions still to apply together."""

    core: ServerCore
    now: float
    evictions: list[str] = field(default_factory=list)

    def flush_evictions(self) -> None:
        if not self.evictions:
            return
        ids, self.evictions = self.evictions, []
        try:
            self.core.evict(ids)
        except ParamServerError as exc:
            raise WalError(f"WAL eviction of {ids} did not re-apply: {exc}") from exc


@dataclass(frozen=True)
class RecordType:
    """One record type: the ``WalRecord`` body field it uses and how it replays.

    Attributes:
        body: The ``WalRecord`` oneof field.
        replay: Re-applies one record (its ``body`` field) through the core method that
            applied it live.
        batched: Consecutive records of this type are applied together by ``replay`` itself
            (a lease sweep's evictions); every other type first flushes them.
    """

    body: str
    replay: Callable[[_Replay, wal_pb.WalRecord], None]
    batched: bool = False


def _replay_register(r: _Replay, record: wal_pb.WalRecord) -> None:
    body = record.register
    rec = r.core.register(
        body.worker_name,
        r.now,
        replace=body.replace,
        client_nonce=body.client_nonce,
        resume_worker_id=body.resume_worker_id,
        resume=body.resume,
    )
    if body.worker_id and rec.worker_id != body.worker_id:
        raise WalError(
            f"replayed registration of {body.worker_name!r} gave {rec.worker_id!r}, "
            f"log says {body.worker_id!r}"
        )


def _replay_depart(r: _Replay, record: wal_pb.WalRecord) -> None:
    body = record.depart
    if body.why == "evicted":
        r.evictions.append(body.worker_id)
    else:
        r.flush_evictions()
        r.core.leave(body.worker_id)


def _replay_init(r: _Replay, record: wal_pb.WalRecord) -> None:
    body = record.init
    r.core.init(tensors_from_wal(list(body.tensors)), UpdateRule.from_proto(body.rule))


def _replay_push(r: _Replay, record: wal_pb.WalRecord) -> None:
    body = record.push
    r.core.push(
        body.worker_id,
        body.request_id,
        body.clock,
        tensors_from_wal(list(body.grads)),
        r.now,
        num_samples=body.num_samples,
        base_version=body.base_version if body.HasField("base_version") else None,
    )


def _replay_clock(r: _Replay, record: wal_pb.WalRecord) -> None:
    body = record.clock
    r.core.clock(body.worker_id, body.clock)


def _replay_init_table(r: _Replay, record: wal_pb.WalRecord) -> None:
    body = record.init_table
    r.core.tables.init(spec_from_proto(body.spec))


def _replay_push_rows(r: _Replay, record: wal_pb.WalRecord) -> None:
    body = record.push_rows
    (grads,) = tensors_from_wal([body.grads]).values()
    ids = np.frombuffer(body.ids, "<i8").astype(np.int64)
    tables = r.core.tables
    prepared = tables.prepare(
        r.core.cluster, body.worker_id, body.request_id, body.clock, body.table, ids, grads
    )
    tables.commit(prepared, now_s=body.now_s)


def _replay_expire_rows(r: _Replay, record: wal_pb.WalRecord) -> None:
    body = record.expire_rows
    r.core.tables.get(body.table).expire(now_s=body.now_s, clock=int(body.clock))


#: Every record type, by its ``WalRecord`` body field.
RECORD_TYPES: Final[dict[str, RecordType]] = {
    t.body: t
    for t in (
        RecordType("register", _replay_register),
        RecordType("depart", _replay_depart, batched=True),
        RecordType("init", _replay_init),
        RecordType("push", _replay_push),
        RecordType("clock", _replay_clock),
        RecordType("init_table", _replay_init_table),
        RecordType("push_rows", _replay_push_rows),
        RecordType("expire_rows", _replay_expire_rows),
    )
}


def replay_into(
    core: ServerCore, records: Iterator[wal_pb.WalRecord], *, now: float | None = None
) -> int:
    """Re-apply logged mutations to a core restored from the matching checkpoint.

    The core is deterministic given the sequence of mutations, so replaying them in order
    reproduces the state at the crash: parameters, optimizer state, clocks, BSP queues, worker
    ids (incarnations), dedup windows (a client retry after the crash is a duplicate), tables
    and the applied counts per registration, each counted where the live mutation counted it.
    The core's observer is told each record's write time (``CoreObserver.replaying_at``), so
    the BSP barrier waits of replayed steps are those measured live (records without a time,
    written before it was logged, replay at the time the replay started: waits of 0).

    Args:
        core: A core restored from the checkpoint the records follow.
        records: The records after that checkpoint's sequence, in order.
        now: Monotonic seconds to stamp replayed mutations with (default: now).

    Returns:
        The number of records replayed.

    Raises:
        WalError: a record that does not re-apply (the log and the checkpoint disagree), or one
            of no known type.
    """
    state = _Replay(core, time.monotonic() if now is None else now)
    started_unix_s = time.time()
    observer = core.observer
    count = 0
    try:
        for record in records:
            which = record.WhichOneof("body")
            kind = RECORD_TYPES.get(which or "")
            if kind is None:
                raise WalError(f"WAL record {record.sequence} has no known body ({which!r})")
            if not kind.batched:
                state.flush_evictions()
            observer.replaying_at(record.unix_s or started_unix_s)
            try:
                kind.replay(state, record)
            except WalError:
                raise
            except ParamServerError as exc:
                raise WalError(
                    f"WAL record {record.sequence} ({which}) did not re-apply: {exc}"
                ) from exc
            count += 1
        state.flush_evictions()
    finally:
        observer.replaying_at(None)
    return count
