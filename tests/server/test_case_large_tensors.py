"""Case large-tensor-default-limits.md: tensors past gRPC's 4 MiB message limit stream in chunks.

The product client is used with default options (no message-size overrides); the key's rule is
``assign`` so the pulled value must be the pushed gradient bit for bit, compared by SHA-256 of
the raw bytes. Malformed streams are hand-built frames sent through the raw stub.
"""

from __future__ import annotations

import asyncio
import hashlib
import signal
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import pytest

from paramserver.api.v1 import parameter_server_pb2 as pb
from paramserver.api.v1 import parameter_server_pb2_grpc as pb_grpc
from paramserver.api.v1 import tensor_pb2
from paramserver.worker_client import UpdateRule, connect
from tests.harness import ServerProcess, running_server
from tests.harness import raw_stubs as raw

ASSIGN = UpdateRule("assign")
MIB = 1 << 20


def _sha256(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).view(np.uint8).data).hexdigest()


def _gradient(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n, dtype=np.float32)


async def _push_pull_hash(address: str, n: int, seed: int, key: str = "w") -> None:
    """Init ``key`` = zeros(n) float32 (assign), push a random gradient, pull it, compare hashes."""
    grad = _gradient(n, seed)
    sent = _sha256(grad)
    async with connect(address, f"big-{key}", rpc_timeout_s=120.0) as ps:
        await ps.init({key: np.zeros(n, np.float32)}, rule=ASSIGN)
        applied_before = (await ps.status()).applied_updates
        ack = await ps.push({key: grad})
        assert not ack.duplicate
        got = (await ps.pull([key]))[key]
        status = await ps.status()
    assert got.dtype == np.float32
    assert got.shape == (n,)
    assert _sha256(got) == sent
    assert status.applied_updates == applied_before + 1
    assert status.rejected_pushes == 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("receive_limit", [None, MIB], ids=["default-limit", "server-limit-1MiB"])
@pytest.mark.parametrize("n", [5_000_000, 4_194_304 // 4], ids=["20MB", "exactly-4194304-bytes"])
async def test_large_push_pull_hash_equal(n: int, receive_limit: int | None) -> None:
    """Case large-tensor-default-limits.md: with default client options a 5,000,000-element
    float32 gradient (20 MB) and one of exactly 4,194,304 bytes push and pull intact (SHA-256 of
    the pulled bytes equals the sent one), with the server's receive limit at its default and at
    1 MiB."""
    config = {} if receive_limit is None else {"max_receive_message_bytes": receive_limit}
    async with running_server(consistency="asp", **config) as srv:
        await _push_pull_hash(srv.address, n, seed=n)


@pytest.mark.timeout(240)
async def test_300mb_push_pull_hash_equal() -> None:
    """Case large-tensor-default-limits.md: one push and one pull of a 300 MB float32 gradient
    (75,000,000 elements) with default client options; the hashes agree."""
    async with running_server(consistency="asp") as srv:
        await _push_pull_hash(srv.address, 75_000_000, seed=300)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_cli_receive_limit_1mib(tmp_path: Path) -> None:
    """Case large-tensor-default-limits.md: `paramserver serve --max-receive-message-bytes
    1048576` (a real subprocess) still takes a 20 MB and an exactly-4-MiB push and serves them
    back intact."""
    server = ServerProcess(
        tmp_path, "--consistency", "asp", "--max-receive-message-bytes", str(MIB)
    )
    try:

        async def main() -> None:
            await _push_pull_hash(server.address, 5_000_000, seed=1, key="w20MB")
            await _push_pull_hash(server.address, 4_194_304 // 4, seed=2, key="w4MiB")

        asyncio.run(main())
    finally:
        assert server.stop(signal.SIGTERM) == 0, server.log()
    assert "Traceback" not in server.log()


KEY = "layer0.weight"
N = 4096  # float32: 16 KiB in 16 frames of 1 KiB
CHUNK = 1024


def _well_formed() -> list[tensor_pb2.TensorFrame]:
    return raw.frames(KEY, _gradient(N, 9), CHUNK)


def _out_of_order(f: list[tensor_pb2.TensorFrame]) -> list[tensor_pb2.TensorFrame]:
    f[2], f[3] = f[3], f[2]
    return f


def _missing_middle(f: list[tensor_pb2.TensorFrame]) -> list[tensor_pb2.TensorFrame]:
    del f[5]
    return f


def _missing_last(f: list[tensor_pb2.TensorFrame]) -> list[tensor_pb2.TensorFrame]:
    return f[:-1]


def _duplicated(f: list[tensor_pb2.TensorFrame]) -> list[tensor_pb2.TensorFrame]:
    return [*f[:5], f[4], *f[5:]]


def _wrong_offset(f: list[tensor_pb2.TensorFrame]) -> list[tensor_pb2.TensorFrame]:
    f[3].offset_bytes += 4
    return f


def _declared_size_disagrees(f: list[tensor_pb2.TensorFrame]) -> list[tensor_pb2.TensorFrame]:
    f[0].header.size_bytes = N * 4 + 4  # shape says N * 4 bytes
    return f


def _short_total(f: list[tensor_pb2.TensorFrame]) -> list[tensor_pb2.TensorFrame]:
    f[-1].data = f[-1].data[:-4]
    return f


def _long_total(f: list[tensor_pb2.TensorFrame]) -> list[tensor_pb2.TensorFrame]:
    f[-1].data = f[-1].data + b"\0\0\0\0"
    return f


def _last_too_early(f: list[tensor_pb2.TensorFrame]) -> list[tensor_pb2.TensorFrame]:
    f[7].last = True
    return f[:8]


MALFORMED: dict[str, Callable[[list[tensor_pb2.TensorFrame]], list[tensor_pb2.TensorFrame]]] = {
    "out-of-order": _out_of_order,
    "missing-middle": _missing_middle,
    "missing-last": _missing_last,
    "duplicated": _duplicated,
    "wrong-offset": _wrong_offset,
    "size-disagrees-with-shape": _declared_size_disagrees,
    "total-short-of-declared": _short_total,
    "total-past-declared": _long_total,
    "last-before-declared-total": _last_too_early,
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", list(MALFORMED))
async def test_malformed_push_frames_invalid_argument_value_unchanged(kind: str) -> None:
    """Case large-tensor-default-limits.md: a push whose frames are out of order, missing,
    duplicated, or whose total disagrees with the declared size is refused with
    INVALID_ARGUMENT naming the key; a well-formed tensor sent before it in the same push is
    not applied either; the stored values are unchanged (pulled and compared); a well-formed
    push afterwards is applied."""
    init_w = np.arange(N, dtype=np.float32)
    init_b = np.zeros(8, np.float32)
    async with running_server(consistency="asp") as srv, raw.channel(srv.address) as ch:
        stub = pb_grpc.ParameterServerStub(ch)
        wid = await raw.register(stub, "worker")
        await raw.init(stub, {KEY: init_w, "bias": init_b}, ASSIGN)
        bad = raw.frames("bias", np.ones(8, np.float32)) + MALFORMED[kind](_well_formed())
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Push(iter(raw.push_messages(wid, 1, bad)), timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        assert KEY in (info.value.details() or "")

        got = await raw.pull(stub, [KEY, "bias"])
        assert _sha256(got[KEY]) == _sha256(init_w)
        np.testing.assert_array_equal(got["bias"], init_b)
        st = await raw.status(stub)
        assert st.applied_updates == 0
        assert all(k.updates == 0 for k in st.keys)

        good = _gradient(N, 9)
        resp = await stub.Push(
            iter(raw.push_messages(wid, 2, raw.frames(KEY, good, CHUNK))), timeout=10
        )
        assert not resp.duplicate
        assert _sha256((await raw.pull(stub, [KEY]))[KEY]) == _sha256(good)


@pytest.mark.timeout(120)
async def test_malformed_large_push_refused_while_client_still_sends() -> None:
    """Case large-tensor-default-limits.md: the declared size of a 16 MB push (256 frames of
    64 KiB) disagrees with its shape, so the server refuses it at the first frame while the
    client is still sending; 20 times in a row the client gets INVALID_ARGUMENT naming the key
    (not INTERNAL "Internal error from Core", grpc/grpc#36066) and the value is unchanged."""
    n = 4_000_000
    init_w = np.zeros(n, np.float32)
    bad = raw.frames(KEY, np.ones(n, np.float32), 1 << 16)
    bad[0].header.size_bytes += 4
    async with running_server(consistency="asp") as srv, raw.channel(srv.address) as ch:
        stub = pb_grpc.ParameterServerStub(ch)
        wid = await raw.register(stub, "worker")
        await raw.init(stub, {KEY: init_w}, ASSIGN)
        outcomes = []
        for rid in range(1, 21):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Push(iter(raw.push_messages(wid, rid, bad)), timeout=30)
            outcomes.append((info.value.code(), KEY in (info.value.details() or "")))
        assert outcomes == [(grpc.StatusCode.INVALID_ARGUMENT, True)] * 20
        assert _sha256((await raw.pull(stub, [KEY]))[KEY]) == _sha256(init_w)
        assert (await raw.status(stub)).applied_updates == 0


@pytest.mark.timeout(60)
async def test_push_without_header_frame_is_invalid_argument() -> None:
    """Case large-tensor-default-limits.md: a tensor whose first frame (the one carrying key,
    dtype and shape) is missing is refused with INVALID_ARGUMENT; nothing changes. (The key
    travels only in that frame, so here the message names the missing header instead.)"""
    init_w = np.arange(N, dtype=np.float32)
    async with running_server(consistency="asp") as srv, raw.channel(srv.address) as ch:
        stub = pb_grpc.ParameterServerStub(ch)
        wid = await raw.register(stub, "worker")
        await raw.init(stub, {KEY: init_w}, ASSIGN)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Push(iter(raw.push_messages(wid, 1, _well_formed()[1:])), timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        assert "header" in (info.value.details() or "")
        assert _sha256((await raw.pull(stub, [KEY]))[KEY]) == _sha256(init_w)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["out-of-order", "duplicated", "total-short-of-declared"])
async def test_malformed_init_frames_create_nothing(kind: str) -> None:
    """Case large-tensor-default-limits.md, for Init streams: malformed frames are refused with
    INVALID_ARGUMENT naming the key, and the key is not created."""
    async with running_server(consistency="asp") as srv, raw.channel(srv.address) as ch:
        stub = pb_grpc.ParameterServerStub(ch)
        msgs = [pb.InitRequest(header=pb.InitHeader(rule=ASSIGN.to_proto()))]
        msgs += [pb.InitRequest(frame=f) for f in MALFORMED[kind](_well_formed())]
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Init(iter(msgs), timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        assert KEY in (info.value.details() or "")
        assert [k.key for k in (await raw.status(stub)).keys] == []
