"""Table limits are checked before anything is logged or changed: name length, dim, tables
per shard, the shard's table memory budget, and memory the process cannot get."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from paramserver.api.v1 import parameter_server_pb2_grpc as pb_grpc
from paramserver.api.v1 import tables_pb2 as tpb
from paramserver.core import table_set as table_set_module
from paramserver.core.consistency import ClusterState, Consistency
from paramserver.core.table_set import TableSet
from paramserver.core.tables import TableLimits
from paramserver.errors import CapacityExceeded, InvalidArgument
from paramserver.protocol.table_spec import TableRule, TableSpec
from paramserver.serving.error_status import abort_with
from tests.harness import running_server

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("name", "ok"),
    [("t" * 1024, True), ("t" * 1025, False), ("é" * 512, True), ("é" * 513, False)],
)
def test_table_names_are_1_to_1024_bytes_of_utf8(name: str, ok: bool) -> None:
    if ok:
        assert TableSpec(name, 4).name == name
    else:
        with pytest.raises(InvalidArgument, match="1024 bytes"):
            TableSpec(name, 4)


@pytest.mark.parametrize("dim", [0, 65537, 2**22, 2**32 - 1])
def test_dims_past_the_limit_are_refused(dim: int) -> None:
    with pytest.raises(InvalidArgument, match="65536"):
        TableSpec("t", dim)


def cluster_with(worker: str) -> tuple[ClusterState, str]:
    cluster = ClusterState(Consistency.ASP, staleness=0, lease_s=600.0)
    rec, _ = cluster.register(worker, 0.0)
    return cluster, rec.worker_id


def test_the_table_count_limit_refuses_before_logging() -> None:
    tables = TableSet(TableLimits(max_tables=2))
    logged: list[str] = []
    for name in ("a", "b"):
        tables.init(TableSpec(name, 2), log=lambda n=name: logged.append(n))
    with pytest.raises(CapacityExceeded, match="2 tables"):
        tables.init(TableSpec("c", 2), log=lambda: logged.append("c"))
    assert logged == ["a", "b"] and set(tables.tables) == {"a", "b"}
    assert tables.init(TableSpec("a", 2)) == (False, TableSpec("a", 2))  # a no-op still works


def test_a_table_the_process_cannot_allocate_is_refused_before_logging(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_memory(*args: Any, **kwargs: Any) -> None:
        raise MemoryError

    monkeypatch.setattr(table_set_module, "EmbeddingTable", no_memory)
    tables = TableSet()
    logged: list[str] = []
    with pytest.raises(CapacityExceeded, match="could not allocate"):
        tables.init(TableSpec("big", 65536, rule=TableRule("adam")), log=lambda: logged.append("x"))
    assert logged == [] and tables.tables == {}


def test_the_memory_budget_refuses_a_push_of_new_rows_and_changes_nothing() -> None:
    spec = TableSpec("emb", 8, rule=TableRule("sgd", lr=1.0))
    probe = TableSet()
    probe.init(spec)
    row_bytes = probe.get("emb").row_bytes  # 8 float32 and a version (no expiry bookkeeping)
    assert row_bytes == 8 * 4 + 8
    tables = TableSet(TableLimits(memory_bytes=10 * row_bytes))
    tables.init(spec)
    cluster, worker = cluster_with("w0")

    def push(request_id: int, ids: list[int]) -> Any:
        arr = np.array(ids, np.int64)
        grads = np.ones((len(ids), 8), np.float32)
        prepared = tables.prepare(cluster, worker, request_id, 0, "emb", arr, grads)
        return tables.commit(prepared, now_s=0.0)

    push(1, list(range(8)))  # 8 rows stored: 80% of the budget
    table = tables.get("emb")
    before = table.pull(np.arange(8, dtype=np.int64)).copy()
    with pytest.raises(CapacityExceeded, match="budget"):
        push(2, [100, 101, 102])  # 3 new rows: 110%
    assert table.n == 8
    np.testing.assert_array_equal(table.pull(np.arange(8, dtype=np.int64)), before)
    assert tables.dedup.get("push_rows", worker, 2) is None  # refused: not remembered
    push(3, [0, 1, 2, 3, 4, 5, 6, 7, 100, 101])  # stored rows and 2 new: exactly the budget
    assert table.n == 10


class _Context:
    def __init__(self) -> None:
        self.code: grpc.StatusCode | None = None
        self.trailer: Any = None

    def set_trailing_metadata(self, md: Any) -> None:
        self.trailer = md

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code = code
        raise grpc.aio.AbortError


async def test_a_memory_error_anywhere_answers_resource_exhausted() -> None:
    ctx = _Context()
    with pytest.raises(grpc.aio.AbortError):
        await abort_with(ctx, MemoryError(), "InitTable")  # type: ignore[arg-type]
    assert ctx.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert ("paramserver-error-class", "CapacityExceeded") in ctx.trailer


@pytest.mark.parametrize("dim", [2**22, 2**32 - 1])
async def test_a_huge_table_is_refused_over_the_wire_and_not_logged(
    tmp_path: Path, dim: int
) -> None:
    async with running_server(
        consistency="asp", wal=True, wal_dir=str(tmp_path / "wal"), lease_ms=600_000
    ) as daemon:
        wal = daemon.engine.wal
        before = wal.next_sequence
        spec = tpb.TableSpec(name="huge", dim=dim)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{daemon.port}") as channel:
            stub = pb_grpc.ParameterServerStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.InitTable(tpb.InitTableRequest(spec=spec), timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "65536" in (err.value.details() or "")
        assert wal.next_sequence == before
        assert daemon.engine.core.tables.tables == {}
