"""``paramserver serve --read-only --from-export DIR``: a trained cluster's tables exported
and served answer pulls bit for bit as the live cluster did (stored ids and never-stored ids
alike, one read-only shard or two), and every mutation is refused with ReadOnly
(FAILED_PRECONDITION) with nothing changed."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import numpy as np
import pytest

from paramserver.api.v1 import parameter_server_pb2 as pb
from paramserver.api.v1 import parameter_server_pb2_grpc as pb_grpc
from paramserver.api.v1 import tables_pb2 as tpb
from paramserver.api.v1 import tensor_pb2
from paramserver.core.tables import Initializer, TableRule, TableSpec
from paramserver.errors import ERROR_CLASS_METADATA_KEY, InvalidArgument, ReadOnly
from paramserver.protocol.rows_wire import spec_to_proto
from paramserver.server.config import ServerConfig
from paramserver.server.table_export import ExportedTables, export_tables
from paramserver.worker_client import connect
from tests.harness import ServerProcess, running_cluster, wait_serving
from tests.harness.raw_stubs import frames

pytestmark = pytest.mark.timeout(120)

SPECS = [
    TableSpec(
        "users", 8, rule=TableRule("adagrad", lr=0.1), initializer=Initializer("normal", 0.1)
    ),
    TableSpec("items", 4, rule=TableRule("adam", lr=0.05), dtype="bfloat16", seed=4),
    TableSpec(
        "tags",
        3,
        rule=TableRule("sgd", lr=0.5),
        dtype="float16",
        seed=2,
        min_pushes=2,
        consistency="ssp",
        staleness=1,
    ),
]
#: Stored ids (Zipf over [0, 1000)) and many never touched, some far beyond.
PROBE = np.concatenate([np.arange(3000), [10**12, 2**62, 7]]).astype(np.int64)


async def _train_and_export(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    """A 2-shard cluster trained a few steps; its pulls of PROBE and its export."""
    dirs = [tmp_path / f"shard-{i}" for i in range(2)]
    per_shard = [{"checkpoint_dir": str(d)} for d in dirs]
    rng = np.random.default_rng(5)
    async with running_cluster(2, consistency="asp", per_shard=per_shard) as daemons:
        async with connect(daemons[0].address, "trainer") as w:
            for s in SPECS:
                await w.init_table(s)
            for _ in range(4):
                ids = {s.name: (rng.zipf(1.3, 300) % 1000).astype(np.int64) for s in SPECS}
                grads = {
                    s.name: rng.normal(size=(300, s.dim)).astype(np.float32) * np.float32(0.1)
                    for s in SPECS
                }
                await w.push_rows_many(ids, grads)
                await w.clock()
            live = await w.pull_rows_many({s.name: PROBE for s in SPECS})
        for d in daemons:
            await d.request_checkpoint()
    out = tmp_path / "export"
    written = await asyncio.to_thread(export_tables, dirs, out)
    assert all(written[s.name] > 0 for s in SPECS)
    return out, live


async def _refusals(address: str) -> list[tuple[str, grpc.StatusCode, str]]:
    """Every mutation RPC sent raw; (rpc, code, error-class trailer) of each refusal."""
    got = []

    async def refused(name: str, call: object) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call  # type: ignore[misc]
        err = info.value
        trailer = dict(err.trailing_metadata() or ()).get(ERROR_CLASS_METADATA_KEY, "")
        got.append((name, err.code(), str(trailer)))

    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.ParameterServerStub(channel)
        await refused("Register", stub.Register(pb.RegisterRequest(worker_name="w")))
        await refused("Clock", stub.Clock(pb.ClockRequest(worker_id="w-1", clock=1)))
        await refused("Leave", stub.Leave(pb.LeaveRequest(worker_id="w-1")))
        same = spec_to_proto(SPECS[0])  # the stored declaration again: still refused
        await refused("InitTable", stub.InitTable(tpb.InitTableRequest(spec=same)))
        other = spec_to_proto(TableSpec("new", 2))
        await refused("InitTable(new)", stub.InitTable(tpb.InitTableRequest(spec=other)))
        ids = np.array([1, 2, 3], np.int64)
        header = tpb.RowsHeader(
            table="users",
            worker_id="w-1",
            request_id=1,
            num_ids=3,
            dtype=tensor_pb2.DTYPE_FLOAT32,
            dim=8,
        )
        chunk = tpb.RowsChunk(ids=ids.tobytes(), rows=np.ones((3, 8), np.float32).tobytes())
        await refused(
            "PushRows",
            stub.PushRows(
                iter([tpb.PushRowsRequest(header=header), tpb.PushRowsRequest(chunk=chunk)])
            ),
        )
        value = np.ones(4, np.float32)
        init = [pb.InitRequest(header=pb.InitHeader())] + [
            pb.InitRequest(frame=f) for f in frames("k", value)
        ]
        await refused("Init", stub.Init(iter(init)))
        push = [pb.PushRequest(header=pb.PushHeader(worker_id="w-1", request_id=2))] + [
            pb.PushRequest(frame=f) for f in frames("k", value)
        ]
        await refused("Push", stub.Push(iter(push)))
    return got


async def _pull_all(address: str) -> dict[str, np.ndarray]:
    async with connect(address, "reader", register=False) as r:
        many = await r.pull_rows_many({s.name: PROBE for s in SPECS})
        one = await r.pull_rows("users", PROBE[::-1])
        assert one.tobytes() == many["users"][::-1].tobytes()
        return many


def _same(got: dict[str, np.ndarray], live: dict[str, np.ndarray]) -> None:
    for s in SPECS:
        assert got[s.name].dtype == live[s.name].dtype, s.name
        assert got[s.name].tobytes() == live[s.name].tobytes(), s.name


async def test_read_only_server_answers_as_the_cluster_and_refuses_changes(
    tmp_path: Path,
) -> None:
    export, live = await _train_and_export(tmp_path)
    server = ServerProcess(tmp_path, "--read-only", "--from-export", str(export), start=False)
    with server:
        await asyncio.to_thread(server.start)
        await wait_serving(server.address)
        _same(await _pull_all(server.address), live)
        refusals = await _refusals(server.address)
        assert [name for name, _, _ in refusals] == [
            "Register",
            "Clock",
            "Leave",
            "InitTable",
            "InitTable(new)",
            "PushRows",
            "Init",
            "Push",
        ]
        for name, code, trailer in refusals[:-1]:
            assert (code, trailer) == (grpc.StatusCode.FAILED_PRECONDITION, "ReadOnly"), name
        # An export holds no dense keys: a dense push names an unknown key, refused as such
        # while its frames are decoded, before it reaches the funnel.
        assert refusals[-1][1:] == (grpc.StatusCode.NOT_FOUND, "KeyNotFound")
        with pytest.raises(ReadOnly, match="read-only"):  # a client that registers
            async with connect(server.address, "trainer"):
                pass
        _same(await _pull_all(server.address), live)  # nothing changed
        async with grpc.aio.insecure_channel(server.address) as channel:
            st = await pb_grpc.ParameterServerStub(channel).Status(pb.StatusRequest())
        assert sorted(t.spec.name for t in st.tables) == sorted(s.name for s in SPECS)
        assert len(st.workers) == 0


async def test_sharded_read_only_servers_load_their_own_ids(tmp_path: Path) -> None:
    export, live = await _train_and_export(tmp_path)
    async with running_cluster(2, read_only=True, from_export=str(export)) as daemons:
        _same(await _pull_all(daemons[0].address), live)
        stored = [sum(d.engine.core.tables.get(s.name).n for d in daemons) for s in SPECS]
    loaded = ExportedTables(export)
    assert stored == [loaded.tables[s.name].n for s in SPECS]  # a disjoint split


@pytest.mark.parametrize(
    "fields",
    [
        {"read_only": True},
        {"from_export": "x"},
        {"read_only": True, "from_export": "x", "wal": True, "wal_dir": "w"},
        {"read_only": True, "from_export": "x", "checkpoint_dir": "c"},
    ],
)
def test_read_only_config_refuses_writes(fields: dict[str, object]) -> None:
    with pytest.raises(InvalidArgument):
        ServerConfig(**fields)  # type: ignore[arg-type]
