"""Conformance of embedding tables: what a client written from tables.proto and
docs/wire-contract.md alone can rely on.

The id -> shard and initial-row functions are re-implemented from the document
(:mod:`conformance.contract_functions`, nothing from paramserver) and checked three ways: against
the test vectors the document lists, against the rows a live server returns for ids it never
stored, and against which ids a shard of a cluster accepts. The refusals of table requests and
the rule for empty requests are checked through plain stubs.
"""

from __future__ import annotations

import asyncio
import re
import secrets
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from paramserver.api.v1 import parameter_server_pb2 as pb
from paramserver.api.v1 import tables_pb2 as tbl
from paramserver.api.v1 import tensor_pb2 as tpb

from . import contract_functions as cf
from .conftest import ServerUnderTest, serve
from .protowire import ProtoTables, ProtoWorker, row_chunks, trailer_class

pytestmark = pytest.mark.timeout(120)

WIRE_CONTRACT = Path(__file__).resolve().parents[2] / "docs" / "wire-contract.md"

_DTYPES = {
    "float32": tpb.DTYPE_FLOAT32,
    "float16": tpb.DTYPE_FLOAT16,
    "bfloat16": tpb.DTYPE_BFLOAT16,
}
_INITS = {
    "uniform": tbl.TABLE_INITIALIZER_UNIFORM,
    "normal": tbl.TABLE_INITIALIZER_NORMAL,
    "zeros": tbl.TABLE_INITIALIZER_ZEROS,
}
_SHARD_ROW = re.compile(
    r"^\| `(?P<table>[^`]+)` \| (?P<id>\d+) \| `(?P<hash>[0-9a-f]{16})` \| "
    r"(?P<shards>\d \| \d \| \d \| \d \| \d) \|$"
)
_INIT_ROW = re.compile(
    r"^\| (?P<kind>uniform|normal) \| (?P<scale>[0-9.]+) \| (?P<seed>\d+) \| (?P<id>\d+) \| "
    r"(?P<column>\d+) \| (?P<words>[`0-9a-f, ]+) \| `(?P<value>[^`]+)` \| `(?P<f32>[0-9a-f]{8})` "
    r"\| `(?P<f16>[0-9a-f]{4})` \| `(?P<bf16>[0-9a-f]{4})` \|$"
)


def _shard_vectors() -> list[dict[str, Any]]:
    out = []
    for line in WIRE_CONTRACT.read_text().splitlines():
        m = _SHARD_ROW.match(line)
        if m:
            shards = [int(s) for s in m["shards"].split(" | ")]
            out.append(
                {
                    "table": m["table"],
                    "id": int(m["id"]),
                    "hash": int(m["hash"], 16),
                    "shards": shards,
                }
            )
    return out


def _init_vectors() -> list[dict[str, Any]]:
    out = []
    for line in WIRE_CONTRACT.read_text().splitlines():
        m = _INIT_ROW.match(line)
        if m:
            out.append(
                {
                    "kind": m["kind"],
                    "scale": float(m["scale"]),
                    "seed": int(m["seed"]),
                    "id": int(m["id"]),
                    "column": int(m["column"]),
                    "words": [int(w.strip("` "), 16) for w in m["words"].split(",")],
                    "value": float(m["value"]),
                    "bits": {
                        "float32": int(m["f32"], 16),
                        "float16": int(m["f16"], 16),
                        "bfloat16": int(m["bf16"], 16),
                    },
                }
            )
    return out


def _name(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(4)}"


async def _refused(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value


def _expect(err: grpc.aio.AioRpcError, code: grpc.StatusCode, cls: str, *needles: str) -> None:
    details = err.details() or ""
    assert err.code() == code, (err.code(), details)
    assert trailer_class(err) == cls, (trailer_class(err), details)
    for needle in needles:
        assert needle in details, (needle, details)


def _spec(name: str, **fields: Any) -> tbl.TableSpec:
    base: dict[str, Any] = {"name": name, "dim": 4}
    base.update(fields)
    return tbl.TableSpec(**base)


@pytest.fixture
async def channel(asp_server: ServerUnderTest) -> Any:
    async with grpc.aio.insecure_channel(asp_server.address) as ch:
        yield ch


# ----------------------------------------------------------------------------- the document
def test_the_documented_vectors_follow_the_documented_algorithms() -> None:
    """Every vector in docs/wire-contract.md, recomputed from its step-by-step text."""
    text = WIRE_CONTRACT.read_text()
    for name in ("emb", "users"):
        stated = re.search(rf'`table_hash\("{name}"\) = 0x([0-9a-f]{{16}})`', text)
        assert stated is not None and int(stated[1], 16) == cf.table_hash(name)
    stated = re.search(r"`splitmix64\(0\) = 0x([0-9a-f]{16})`", text)
    assert stated is not None and int(stated[1], 16) == cf.splitmix64(0) == 0xE220A8397B1DCDAF
    shard_rows = _shard_vectors()
    assert len(shard_rows) == 24, "the placement vectors were not found (format changed?)"
    assert {r["id"] for r in shard_rows} >= {0, 2**63 - 1}
    for row in shard_rows:
        assert cf.hash64(row["table"], row["id"]) == row["hash"], row
        assert [cf.shard_of(row["table"], row["id"], s) for s in range(1, 6)] == row["shards"]
    init_rows = _init_vectors()
    assert len(init_rows) == 12, "the initial-row vectors were not found (format changed?)"
    for v in init_rows:
        k0 = v["column"] if v["kind"] == "uniform" else 2 * v["column"]
        words = [cf.word(v["seed"], v["id"], k0 + j) for j in range(len(v["words"]))]
        assert words == v["words"], v
        value = cf.initial_float64(v["kind"], v["scale"], v["seed"], v["id"], v["column"])
        assert value == v["value"], v
        for dtype, bits in v["bits"].items():
            assert cf.storage_bits(value, dtype) == bits, (dtype, v)


# ----------------------------------------------------------------------------- initial rows
def _within_one_unit(got: np.ndarray, want: np.ndarray) -> bool:
    """Bit patterns of the same sign, at most one unit in the last place apart."""
    g, w = got.astype(np.int64), want.astype(np.int64)
    return bool(np.all(np.abs(g - w) <= 1))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
async def test_rows_of_unstored_ids_are_the_documented_initial_rows(
    channel: Any, dtype: str
) -> None:
    tables = ProtoTables(channel)
    vectors = _init_vectors()
    rng = np.random.default_rng(7)
    extra = [int(i) for i in rng.integers(0, 2**63 - 1, 96, dtype=np.int64)]
    groups = {(v["kind"], v["scale"], v["seed"]) for v in vectors} | {("zeros", 1.0, 5)}
    for kind, scale, seed in sorted(groups):
        name = _name(f"init-{kind}")
        await tables.init_table(
            _spec(
                name,
                dim=8,
                dtype=_DTYPES[dtype],
                initializer=_INITS[kind],
                init_scale=scale,
                seed=seed,
            )
        )
        mine = [v for v in vectors if (v["kind"], v["scale"], v["seed"]) == (kind, scale, seed)]
        ids = [v["id"] for v in mine] + extra
        info, bits = await tables.pull_rows(
            tbl.RowsHeader(table=name, num_ids=len(ids)), row_chunks(ids)
        )
        assert info.dtype == _DTYPES[dtype] and info.dim == 8 and info.num_ids == len(ids)
        for row, v in enumerate(mine):  # the document's vectors, exactly
            assert int(bits[row, v["column"]]) == v["bits"][dtype], (dtype, v)
        want = np.array(
            [[cf.initial_bits(kind, scale, seed, i, c, dtype) for c in range(8)] for i in ids],
            bits.dtype,
        )
        differ = int(np.count_nonzero(bits != want))
        if kind == "normal":  # log1p/cos may differ in the last float64 bit (the document)
            assert differ <= 1 and _within_one_unit(bits, want), (kind, dtype, differ)
        else:
            assert differ == 0, (kind, dtype, differ)
        # a pull stores nothing: the table still has no rows
        status = await tables.stub.Status(pb.StatusRequest(), timeout=10)
        (info_row,) = [t for t in status.tables if t.spec.name == name]
        assert info_row.rows == 0


# ----------------------------------------------------------------------------- placement
@pytest.mark.parametrize(("num_shards", "index"), [(2, 1), (3, 0), (4, 3), (5, 2)])
def test_a_shard_serves_exactly_the_ids_it_owns(
    tmp_path: Path, num_shards: int, index: int
) -> None:
    """One shard of a cluster (the others need not run): every id the documented placement
    gives another shard is refused (FAILED_PRECONDITION, WrongShard, naming the shard's index,
    the shard count and the id), on pull and push, and nothing of a refused push is applied."""
    vector_ids = sorted({r["id"] for r in _shard_vectors()})
    rng = np.random.default_rng(num_shards)
    ids = vector_ids + [int(i) for i in rng.integers(0, 2**63 - 1, 24, dtype=np.int64)]
    owned = [i for i in ids if cf.shard_of("emb", i, num_shards) == index]
    foreign = [i for i in ids if cf.shard_of("emb", i, num_shards) != index]
    assert owned and foreign
    for row in _shard_vectors():  # the document's column for this shard count
        if row["table"] == "emb":
            assert (row["id"] in owned) == (row["shards"][num_shards - 1] == index)

    async def check(address: str) -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            tables = ProtoTables(channel)
            await tables.init_table(_spec("emb", initializer=tbl.TABLE_INITIALIZER_UNIFORM))
            for i in ids:
                header = tbl.RowsHeader(table="emb", num_ids=1)
                if i in owned:
                    _, bits = await tables.pull_rows(header, row_chunks([i]))
                    want = [cf.initial_bits("uniform", 0.01, 0, i, c, "float32") for c in range(4)]
                    assert bits[0].tolist() == want
                else:
                    err = await _refused(tables.pull_rows(header, row_chunks([i])))
                    _expect(
                        err,
                        grpc.StatusCode.FAILED_PRECONDITION,
                        "WrongShard",
                        f"id {i} ",
                        f"index {index} of {num_shards}",
                        "'emb'",
                    )
            w = ProtoWorker(channel)
            await w.register()
            grads = np.ones((len(owned) + 1, 4), np.float32)
            header = tbl.RowsHeader(
                table="emb",
                worker_id=w.worker_id,
                request_id=1,
                num_ids=len(owned) + 1,
                dtype=tpb.DTYPE_FLOAT32,
                dim=4,
            )
            err = await _refused(tables.push_rows(header, row_chunks([*owned, foreign[0]], grads)))
            _expect(err, grpc.StatusCode.FAILED_PRECONDITION, "WrongShard", f"id {foreign[0]} ")
            status = await tables.stub.Status(pb.StatusRequest(), timeout=10)
            assert status.tables[0].rows == 0 and status.tables[0].pushes == 0  # nothing applied
            header.num_ids, header.request_id = len(owned), 2
            ack = await tables.push_rows(header, row_chunks(owned, grads[:-1]))
            assert ack.applied == ack.distinct == len(owned)

    with serve(tmp_path, "asp", shard=(index, num_shards)) as server:
        asyncio.run(check(server.address))


# ----------------------------------------------------------------------------- refusals
async def test_table_refusals_have_their_codes_and_classes(channel: Any) -> None:
    tables = ProtoTables(channel)
    w = ProtoWorker(channel)
    await w.register()
    name = _name("refusals")
    await tables.init_table(_spec(name, initializer=tbl.TABLE_INITIALIZER_ZEROS))

    def push_header(table: str, n: int, dtype: int, request_id: int) -> tbl.RowsHeader:
        return tbl.RowsHeader(
            table=table,
            worker_id=w.worker_id,
            request_id=request_id,
            num_ids=n,
            dtype=dtype,
            dim=4,
        )

    missing = _name("missing")
    err = await _refused(
        tables.pull_rows(tbl.RowsHeader(table=missing, num_ids=1), row_chunks([1]))
    )
    _expect(err, grpc.StatusCode.NOT_FOUND, "TableNotFound", repr(missing))
    ones = np.ones((1, 4), np.float32)
    err = await _refused(
        tables.push_rows(push_header(missing, 1, tpb.DTYPE_FLOAT32, 1), row_chunks([1], ones))
    )
    _expect(err, grpc.StatusCode.NOT_FOUND, "TableNotFound", repr(missing))

    err = await _refused(tables.init_table(_spec(name, dim=5)))
    _expect(err, grpc.StatusCode.ALREADY_EXISTS, "TableConflict", repr(name))

    # gradient rows of another dtype: DTypeMismatch naming the table and both dtypes
    for wire, array in (
        (tpb.DTYPE_FLOAT64, np.ones((1, 4))),
        (tpb.DTYPE_FLOAT16, ones.astype("<f2")),
    ):
        err = await _refused(
            tables.push_rows(push_header(name, 1, wire, 2), row_chunks([1], array))
        )
        _expect(
            err,
            grpc.StatusCode.INVALID_ARGUMENT,
            "DTypeMismatch",
            repr(name),
            str(array.dtype.name),
            "float32",
        )
    # a push header must name the rows' dtype: DTYPE_UNSPECIFIED is not read as float32
    err = await _refused(
        tables.push_rows(push_header(name, 1, tpb.DTYPE_UNSPECIFIED, 3), row_chunks([1], ones))
    )
    _expect(err, grpc.StatusCode.INVALID_ARGUMENT, "InvalidArgument", "DTYPE_UNSPECIFIED")
    # rows inside a pull request
    bad = row_chunks([1], ones)
    err = await _refused(tables.pull_rows(tbl.RowsHeader(table=name, num_ids=1), bad))
    _expect(err, grpc.StatusCode.INVALID_ARGUMENT, "MalformedStream", "ids only")
    # a negative id (top bit set: what a uint64 id >= 2**63 would be) is named as sent
    err = await _refused(
        tables.pull_rows(tbl.RowsHeader(table=name, num_ids=1), row_chunks([-(2**63)]))
    )
    _expect(err, grpc.StatusCode.INVALID_ARGUMENT, "InvalidArgument", str(-(2**63)))

    _, bits = await tables.pull_rows(tbl.RowsHeader(table=name, num_ids=1), row_chunks([1]))
    assert bits.tolist() == [[0, 0, 0, 0]]  # nothing of the refused pushes applied
    status = await tables.stub.Status(pb.StatusRequest(), timeout=10)
    (info,) = [t for t in status.tables if t.spec.name == name]
    assert info.rows == 0 and info.pushes == 0


async def test_declarations_are_taken_as_given_or_refused(channel: Any) -> None:
    tables = ProtoTables(channel)
    rule = tbl.TableRule(kind=tbl.TABLE_RULE_KIND_ADAGRAD, eps=0.0)
    assert rule.HasField("eps")  # set, to 0: not the same as unset
    err = await _refused(tables.init_table(_spec(_name("eps0"), rule=rule)))
    _expect(err, grpc.StatusCode.INVALID_ARGUMENT, "InvalidArgument", "eps")
    unset = await tables.init_table(
        _spec(_name("eps"), rule=tbl.TableRule(kind=tbl.TABLE_RULE_KIND_ADAGRAD))
    )
    assert unset.spec.rule.eps == 1e-10
    tiny = await tables.init_table(
        _spec(_name("eps"), rule=tbl.TableRule(kind=tbl.TABLE_RULE_KIND_ADAM, eps=1e-30))
    )
    assert tiny.spec.rule.eps == 1e-30

    bsp = tbl.TABLE_CONSISTENCY_BSP
    err = await _refused(tables.init_table(_spec(_name("bsp"), consistency=bsp, staleness=2)))
    _expect(err, grpc.StatusCode.INVALID_ARGUMENT, "InvalidArgument", "staleness")
    assert (await tables.init_table(_spec(_name("bsp"), consistency=bsp))).created


async def test_empty_requests_and_queued_pushes_answer_per_the_contract(channel: Any) -> None:
    tables = ProtoTables(channel)
    w = ProtoWorker(channel)
    await w.register()
    for consistency in (tbl.TABLE_CONSISTENCY_ASP, tbl.TABLE_CONSISTENCY_BSP):
        name = _name("empty")
        await tables.init_table(
            _spec(name, dim=3, dtype=tpb.DTYPE_BFLOAT16, consistency=consistency)
        )
        info, bits = await tables.pull_rows(tbl.RowsHeader(table=name), [])
        assert (info.dtype, info.dim, info.num_ids) == (tpb.DTYPE_BFLOAT16, 3, 0)
        assert bits.shape == (0, 3)
        header = tbl.RowsHeader(
            table=name, worker_id=w.worker_id, request_id=1, dtype=tpb.DTYPE_FLOAT32, dim=3
        )
        ack = await tables.push_rows(header, [])
        assert not (ack.duplicate or ack.queued)
        assert (ack.distinct, ack.applied, ack.filtered) == (0, 0, 0)
        status = await tables.stub.Status(pb.StatusRequest(), timeout=10)
        (row,) = [t for t in status.tables if t.spec.name == name]
        assert row.pushes == 0 and row.queued_pushes == 0 and row.rows == 0
        # an empty push is still checked: another dim is refused
        header.dim, header.request_id = 4, 2
        err = await _refused(tables.push_rows(header, []))
        _expect(err, grpc.StatusCode.INVALID_ARGUMENT, "DimensionMismatch", repr(name))

    name = _name("queued")
    await tables.init_table(_spec(name, consistency=tbl.TABLE_CONSISTENCY_BSP))
    ids = [5, 1, 5, 9, 1]
    header = tbl.RowsHeader(
        table=name,
        worker_id=w.worker_id,
        request_id=3,
        num_ids=len(ids),
        dtype=tpb.DTYPE_FLOAT32,
        dim=4,
    )
    ack = await tables.push_rows(header, row_chunks(ids, np.ones((5, 4), np.float32)))
    assert ack.queued and (ack.distinct, ack.applied, ack.filtered) == (3, 0, 0)


async def test_push_pull_rows_is_a_push_then_a_pull(channel: Any) -> None:
    """PushPullRows (tables.proto): the push's chunks, then the pull's ids; the rows read
    after the push; a refused push answers no rows and changes nothing."""
    tables = ProtoTables(channel)
    w = ProtoWorker(channel)
    await w.register()
    name = _name("fused")
    lr = 0.5
    await tables.init_table(
        _spec(name, rule=tbl.TableRule(kind=tbl.TABLE_RULE_KIND_SGD, lr=lr), seed=4)
    )
    push_ids = np.array([7, 3, 7, 11, 3, 3], np.int64)
    grads = (np.arange(24, dtype=np.float32).reshape(6, 4) - 12) / np.float32(16)
    pull_ids = np.array([3, 5, 7, 11, 3], np.int64)
    _, before = await tables.pull_rows(
        tbl.RowsHeader(table=name, num_ids=12), row_chunks(range(12))
    )
    want = before.view(np.float32).copy()
    sums = np.zeros((12, 4), np.float32)  # duplicates summed (exact: sixteenths), rule once
    np.add.at(sums, push_ids, grads)
    for i in np.unique(push_ids):
        want[i] = want[i] - np.float32(lr) * sums[i]
    header = tbl.PushPullRowsHeader(
        push=tbl.RowsHeader(
            table=name,
            worker_id=w.worker_id,
            request_id=1,
            num_ids=push_ids.shape[0],
            dtype=tpb.DTYPE_FLOAT32,
            dim=4,
        ),
        pull_num_ids=pull_ids.shape[0],
    )
    info, bits = await tables.push_pull_rows(
        header, row_chunks(push_ids, grads, per_chunk=4), row_chunks(pull_ids, per_chunk=2)
    )
    assert not info.pushed.duplicate and info.pushed.distinct == 3 and info.pushed.applied == 3
    assert (info.pulled.dtype, info.pulled.dim, info.pulled.num_ids) == (tpb.DTYPE_FLOAT32, 4, 5)
    assert bits.view(np.float32).tobytes() == want[pull_ids].tobytes()
    # the same request again: a duplicate, applied once, the same rows
    info, again = await tables.push_pull_rows(
        header, row_chunks(push_ids, grads), row_chunks(pull_ids)
    )
    assert info.pushed.duplicate and again.tobytes() == bits.tobytes()
    # a refused push: no rows, nothing applied
    header.push.request_id, header.push.dim = 2, 8
    err = await _refused(
        tables.push_pull_rows(
            header, row_chunks(push_ids, np.ones((6, 8), np.float32)), row_chunks(pull_ids)
        )
    )
    _expect(err, grpc.StatusCode.INVALID_ARGUMENT, "DimensionMismatch", repr(name))
    _, after = await tables.pull_rows(tbl.RowsHeader(table=name, num_ids=12), row_chunks(range(12)))
    assert after.view(np.float32).tobytes() == want.tobytes()
