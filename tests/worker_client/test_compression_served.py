"""Wire compression through the real server, and the digits job reaching its bar with each."""

from __future__ import annotations

import re
import subprocess
import sys
from typing import Any

import grpc
import ml_dtypes
import numpy as np
import pytest

from paramserver.api.v1 import parameter_server_pb2 as pb
from paramserver.api.v1 import parameter_server_pb2_grpc as pb_grpc
from paramserver.api.v1 import tensor_pb2
from paramserver.errors import InvalidArgument
from paramserver.protocol import tensor
from paramserver.server.shard_service import ShardService
from paramserver.worker_client import UpdateRule, connect
from paramserver.worker_client.compression import Cast, TopK
from tests.harness import running_server

pytestmark = pytest.mark.timeout(60)


async def test_cast_and_top_k_pushes_apply_the_decoded_gradients() -> None:
    rng = np.random.default_rng(5)
    g_cast = rng.normal(size=(3, 4)).astype(np.float32)
    g_topk = rng.normal(size=(50,)).astype(np.float32)
    schemes = {"a": Cast("bfloat16"), "b": TopK(0.1)}
    async with running_server(consistency="asp") as srv:
        async with connect(srv.address, "w0", compression=schemes) as ps:
            await ps.init({"a": np.zeros((3, 4), np.float32)}, UpdateRule("add"))
            await ps.init({"b": np.zeros(50, np.float32)}, UpdateRule("add"))
            await ps.push({"a": g_cast, "b": g_topk})
            await ps.push({"b": g_topk})
            got = await ps.pull()
            ratio = ps.compressor.ratio
    np.testing.assert_array_equal(got["a"], g_cast.astype(ml_dtypes.bfloat16).astype(np.float32))
    # Oracle for top-k with error feedback, written out: 5 of 50 entries per push.
    first = np.argsort(-np.abs(g_topk), kind="stable")[:5]
    sent1 = np.zeros(50, np.float32)
    sent1[first] = g_topk[first]
    carried = g_topk - sent1 + g_topk
    second = np.argsort(-np.abs(carried), kind="stable")[:5]
    sent2 = np.zeros(50, np.float32)
    sent2[second] = carried[second]
    np.testing.assert_allclose(got["b"], sent1 + sent2, rtol=0, atol=1e-6)
    assert ratio < 0.5


async def test_the_transport_hands_compressed_gradients_on_and_the_shard_decodes_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The Push stream passes a compressed gradient on as it came (its wire dtype, its indices);
    # the shard's push path decodes it against the key, one place for every transport.
    seen: list[tuple[list[str], dict[str, Any]]] = []
    real = ShardService.apply_push_header

    async def recording(self: ShardService, header: Any, grads: Any, **kwargs: Any) -> Any:
        seen.append((list(grads), dict(kwargs.get("encoded") or {})))
        return await real(self, header, grads, **kwargs)

    monkeypatch.setattr(ShardService, "apply_push_header", recording)
    g = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    dense = np.arange(5, dtype=np.float32)
    schemes = {"a": Cast("float16"), "b": TopK(0.25)}
    async with running_server(consistency="asp") as srv:
        async with connect(srv.address, "w0", compression=schemes) as ps:
            await ps.init({"a": np.zeros((3, 4), np.float32)}, UpdateRule("add"))
            await ps.init({"b": np.zeros(8, np.float32)}, UpdateRule("add"))
            await ps.init({"c": np.zeros(5, np.float32)}, UpdateRule("add"))
            b = np.array([0, 3, 0, 0, -4, 0, 0, 1], np.float32)  # top 2 of 8: 3 and -4
            await ps.push({"a": g, "b": b, "c": dense})
            got = await ps.pull(["a", "b", "c"])
    (dense_keys, encoded) = seen[-1]
    assert dense_keys == ["c"] and sorted(encoded) == ["a", "b"]
    assert encoded["a"].values.dtype == np.float16 and encoded["a"].indices is None
    assert encoded["b"].dense_shape == (8,)
    np.testing.assert_array_equal(np.sort(encoded["b"].indices), [1, 4])
    np.testing.assert_array_equal(got["a"], g.astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(got["b"], [0, 3, 0, 0, -4, 0, 0, 0])
    np.testing.assert_array_equal(got["c"], dense)


async def test_malformed_sparse_push_is_refused_and_changes_nothing() -> None:
    async with running_server(consistency="asp") as srv:
        async with connect(srv.address, "w0") as ps:
            await ps.init({"w": np.ones(8, np.float32)}, UpdateRule("add"))
            async with grpc.aio.insecure_channel(srv.address) as ch:
                stub = pb_grpc.ParameterServerStub(ch)
                idx = tensor.encode_frames(
                    "w",
                    np.array([1, 99], np.int64),
                    role=tensor_pb2.TENSOR_ROLE_SPARSE_INDICES,
                    dense_shape=(8,),
                )
                vals = tensor.encode_frames(
                    "w", np.ones(2, np.float32), role=tensor_pb2.TENSOR_ROLE_SPARSE_VALUES
                )
                msgs = [pb.PushRequest(header=pb.PushHeader(worker_id=ps.worker_id, request_id=7))]
                msgs += [pb.PushRequest(frame=f) for f in [*idx, *vals]]
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.Push(iter(msgs), timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "'w'" in (info.value.details() or "")
            got = (await ps.pull(["w"]))["w"]
    np.testing.assert_array_equal(got, np.ones(8, np.float32))


async def test_compressing_an_integer_key_is_refused_by_the_client() -> None:
    async with running_server(consistency="asp") as srv:
        async with connect(srv.address, "w0", compression={"c": Cast()}) as ps:
            await ps.init({"c": np.zeros(3, np.int64)}, UpdateRule("add"))
            with pytest.raises(InvalidArgument, match="float"):
                await ps.push({"c": np.ones(3, np.int64)})


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("compression", ["fp16", "bf16", "topk"])
def test_digits_job_reaches_its_bar_with_compression(compression: str) -> None:
    """Issue 7: the digits job still reaches its accuracy bar with each compression."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "paramserver",
            "demo",
            "--workers",
            "4",
            "--consistency",
            "ssp",
            "--staleness",
            "2",
            "--epochs",
            "6",
            "--compression",
            compression,
            "--topk-ratio",
            "0.05",
            "--min-accuracy",
            "0.93",
            "--timeout-s",
            "120",
        ],
        capture_output=True,
        text=True,
        timeout=140,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    final = float(re.search(r"final test accuracy (\S+)", proc.stdout).group(1))  # type: ignore[union-attr]
    assert final >= 0.93
