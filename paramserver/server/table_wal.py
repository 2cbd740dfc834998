"""Write-ahead-log records of embedding tables: built before a mutation is applied, replayed
in order after a restart (the table core is deterministic given them).

Records: ``init_table`` (a declaration that created a table), ``push_rows`` (one row push,
with the server time it was applied at) and ``expire_rows`` (an expiry sweep that dropped
rows, with its time and clock), so a replay reproduces rows, optimizer state, frequency-filter
counts and expiries bit for bit.
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np

from paramserver.api.v1 import wal_pb2 as wal_pb
from paramserver.core.table_set import PreparedRowPush
from paramserver.core.tables import TableSpec
from paramserver.protocol.rows_wire import spec_from_proto, spec_to_proto

__all__ = [
    "TABLE_RECORDS",
    "record_expire_rows",
    "record_init_table",
    "record_push_rows",
    "replay_table_record",
]

TABLE_RECORDS: Final = frozenset({"init_table", "push_rows", "expire_rows"})


def record_init_table(spec: TableSpec) -> Any:
    return wal_pb.WalRecord(init_table=wal_pb.WalInitTable(spec=spec_to_proto(spec)))


def record_push_rows(push: PreparedRowPush, worker_id: str, now_s: float) -> Any:
    from paramserver.server.wal import tensors_to_wal

    (grads,) = tensors_to_wal({push.table.spec.name: np.ascontiguousarray(push.grads)})
    return wal_pb.WalRecord(
        push_rows=wal_pb.WalPushRows(
            table=push.table.spec.name,
            worker_id=worker_id,
            request_id=push.request_id,
            clock=push.clock,
            ids=push.ids.astype("<i8", copy=False).tobytes(),
            grads=grads,
            now_s=now_s,
        )
    )


def record_expire_rows(table: str, now_s: float, clock: int) -> Any:
    return wal_pb.WalRecord(expire_rows=wal_pb.WalExpireRows(table=table, now_s=now_s, clock=clock))


def replay_table_record(core: Any, record: Any) -> None:
    """Re-apply one table record to ``core`` (a :class:`~paramserver.core.shard.ServerCore`).

    Raises:
        ParamServerError: the record does not re-apply (the caller wraps it in a WalError).
    """
    from paramserver.server.wal import tensors_from_wal

    which = record.WhichOneof("body")
    tables = core.tables
    if which == "init_table":
        tables.init(spec_from_proto(record.init_table.spec))
    elif which == "push_rows":
        p = record.push_rows
        (grads,) = tensors_from_wal([p.grads]).values()
        ids = np.frombuffer(p.ids, "<i8").astype(np.int64)
        prepared = tables.prepare(
            core.cluster, p.worker_id, p.request_id, p.clock, p.table, ids, grads
        )
        tables.commit(prepared, now_s=p.now_s)
    elif which == "expire_rows":
        e = record.expire_rows
        tables.get(e.table).expire(now_s=e.now_s, clock=int(e.clock))
