"""The PyTorch adapter against a real server: bit-exact round trips for every float dtype,
bfloat16 stored and sent as 2 bytes, pushed gradients equal a closed-form oracle, in-place
loads that keep dtype, device and identity; the blocking client; the 2-worker torch demo."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from paramserver.api.v1 import parameter_server_pb2 as pb  # noqa: E402
from paramserver.api.v1 import parameter_server_pb2_grpc as pb_grpc  # noqa: E402
from paramserver.api.v1 import tensor_pb2  # noqa: E402
from paramserver.errors import InvalidArgument  # noqa: E402
from paramserver.integrations.torch import (  # noqa: E402
    TorchWorker,
    init_from_module,
    load_parameters,
    module_parameters,
    parameter_keys,
    pull_parameters,
    push_gradients,
)
from paramserver.worker_client import UpdateRule, connect, connect_sync  # noqa: E402
from tests.harness import ServerProcess, running_server  # noqa: E402

pytestmark = pytest.mark.timeout(60)

FLOAT_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
_BITS = {
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}
_SPECIALS = {  # NaN with a payload, -0.0, +inf, the smallest subnormal, as raw bit patterns
    torch.float16: [0x7E01, 0x8000, 0x7C00, 0x0001],
    torch.bfloat16: [0x7FC1, 0x8000, 0x7F80, 0x0001],
    torch.float32: [0x7FC00001, 0x80000000, 0x7F800000, 0x00000001],
    torch.float64: [0x7FF8000000000001, 0x8000000000000000, 0x7FF0000000000000, 0x1],
}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view(_BITS[t.dtype]).clone()


def _random_module(seed: int) -> torch.nn.Module:
    """One parameter of each float dtype (odd shapes, a scalar, special values) and an int64
    buffer; values are random bit patterns drawn by torch, so nothing here uses the adapter."""
    gen = torch.Generator().manual_seed(seed)
    m = torch.nn.Module()
    for i, dtype in enumerate(FLOAT_DTYPES):
        itype = _BITS[dtype]
        info = torch.iinfo(itype)
        raw = torch.randint(
            info.min, info.max, (3, 5 + i), dtype=itype, generator=gen
        )  # any bits: NaNs with payloads included
        width = info.bits
        signed = [v - (1 << width) if v >= 1 << (width - 1) else v for v in _SPECIALS[dtype]]
        raw.view(-1)[:4] = torch.tensor(signed, dtype=itype)
        name = str(dtype).removeprefix("torch.")
        m.register_parameter(f"w_{name}", torch.nn.Parameter(raw.view(dtype)))
        scalar = torch.randint(info.min, info.max, (), dtype=itype, generator=gen)
        m.register_parameter(f"s_{name}", torch.nn.Parameter(scalar.view(dtype)))
    m.register_buffer("steps", torch.randint(0, 2**40, (4,), generator=gen))
    return m


def _zeros_like_module(src: torch.nn.Module) -> torch.nn.Module:
    m = torch.nn.Module()
    for name, p in src.named_parameters():
        m.register_parameter(name, torch.nn.Parameter(torch.zeros_like(p)))
    for name, b in src.named_buffers():
        m.register_buffer(name, torch.zeros_like(b))
    return m


async def test_round_trip_is_bit_exact_and_in_place() -> None:
    """A module of float32/64/16 and bfloat16 parameters (random bits, NaN payloads, -0.0,
    inf, subnormals) and an int64 buffer, declared by one worker and pulled by another into
    zeros: every bit arrives, each tensor keeps its dtype, device and storage."""
    src = _random_module(1)
    dst = _zeros_like_module(src)
    before = {n: (t.dtype, t.device, t.data_ptr()) for n, t in dst.state_dict().items()}
    async with running_server(consistency="asp") as srv:
        async with connect(srv.address, worker_name="a") as a, connect(srv.address, "b") as b:
            keys = await init_from_module(a, src, prefix="net/", buffers=True)
            await pull_parameters(b, dst, prefix="net/", buffers=True)
    assert keys == ["net/" + n for n, _ in src.named_parameters()] + ["net/steps"]
    for (name, want), (_, got) in zip(src.named_parameters(), dst.named_parameters(), strict=True):
        assert torch.equal(_bits(got), _bits(want)), name
    assert torch.equal(dst.steps, src.steps)
    after = {n: (t.dtype, t.device, t.data_ptr()) for n, t in dst.state_dict().items()}
    assert after == before


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
async def test_server_stores_the_torch_dtype_bfloat16_in_two_bytes(dtype: torch.dtype) -> None:
    """The server stores each parameter in the module's own dtype; bfloat16 travels as
    2 bytes per element (the pull stream's header says so) and is stored as BFLOAT16."""
    numel = 7 * 9
    module = torch.nn.Linear(9, 7, bias=False).to(dtype)
    wire = {
        torch.float16: (tensor_pb2.DTYPE_FLOAT16, 2),
        torch.bfloat16: (tensor_pb2.DTYPE_BFLOAT16, 2),
        torch.float32: (tensor_pb2.DTYPE_FLOAT32, 4),
        torch.float64: (tensor_pb2.DTYPE_FLOAT64, 8),
    }[dtype]
    async with running_server(consistency="asp") as srv:
        async with connect(srv.address, worker_name="a") as ps:
            await init_from_module(ps, module)
            status = await ps.status()
        async with grpc.aio.insecure_channel(srv.address) as channel:
            stub = pb_grpc.ParameterServerStub(channel)
            headers = [
                resp.frame.header
                async for resp in stub.Pull(pb.PullRequest(keys=["weight"]), timeout=10)
                if resp.WhichOneof("body") == "frame" and resp.frame.chunk_index == 0
            ]
    (info,) = [k for k in status.keys if k.key == "weight"]
    assert (info.dtype, list(info.shape)) == (wire[0], [7, 9])
    (header,) = headers
    assert header.dtype == wire[0]
    assert header.size_bytes == wire[1] * numel


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
async def test_pushed_gradient_matches_closed_form_sgd(dtype: torch.dtype) -> None:
    """Linear(5 -> 3) under 0.5 * sum of squared residuals: the server's SGD result equals
    W - lr * r^T x and b - lr * sum(r) computed here in float64 from the same inputs."""
    lr = 0.25
    torch.manual_seed(3)
    model = torch.nn.Linear(5, 3).to(dtype)
    x = torch.randn(8, 5, dtype=dtype)
    y = torch.randn(8, 3, dtype=dtype)
    w0 = model.weight.detach().numpy().astype(np.float64)
    b0 = model.bias.detach().numpy().astype(np.float64)
    xs, ys = x.numpy().astype(np.float64), y.numpy().astype(np.float64)
    r = xs @ w0.T + b0 - ys
    want_w, want_b = w0 - lr * (r.T @ xs), b0 - lr * r.sum(axis=0)

    async with running_server(consistency="bsp") as srv:
        async with connect(srv.address, worker_name="a") as ps:
            worker = TorchWorker(ps, model)
            assert await worker.init(UpdateRule("sgd", lr=lr)) == ["weight", "bias"]
            await worker.pull()
            (0.5 * ((model(x) - y) ** 2).sum()).backward()
            await worker.push(num_samples=8)
            await worker.clock()
            await worker.pull()
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    np.testing.assert_allclose(model.weight.detach().numpy(), want_w, rtol=tol, atol=tol)
    np.testing.assert_allclose(model.bias.detach().numpy(), want_b, rtol=tol, atol=tol)
    assert model.weight.dtype == dtype


async def test_bfloat16_gradient_applied_in_bfloat16() -> None:
    """bfloat16 end to end: dyadic values, so ``w - 0.5 * g`` is exact and compared bit for bit
    against torch's own bfloat16 arithmetic on the same tensors."""
    w = torch.arange(-8, 8, dtype=torch.float32).reshape(4, 4).to(torch.bfloat16) / 4
    g = torch.arange(16, dtype=torch.float32).reshape(4, 4).to(torch.bfloat16) / 8
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(w.clone())
    async with running_server(consistency="asp") as srv:
        async with connect(srv.address, worker_name="a") as ps:
            await init_from_module(ps, model, UpdateRule("sgd", lr=0.5))
            model.w.grad = g.clone()
            await push_gradients(ps, model)
            await pull_parameters(ps, model)
    assert model.w.dtype == torch.bfloat16
    assert torch.equal(_bits(model.w), _bits(w - 0.5 * g))


async def test_missing_gradient_refused_zeros_or_skipped() -> None:
    """A trainable parameter without .grad: InvalidArgument naming it (nothing pushed);
    ``missing_grad="zeros"`` pushes zeros, ``"skip"`` leaves it out; frozen ones never go."""
    model = torch.nn.Module()
    model.used = torch.nn.Parameter(torch.ones(3))
    model.unused = torch.nn.Parameter(torch.ones(3))
    model.frozen = torch.nn.Parameter(torch.ones(3), requires_grad=False)
    async with running_server(consistency="asp") as srv:
        async with connect(srv.address, worker_name="a") as ps:
            await init_from_module(ps, model, UpdateRule("sgd", lr=1.0))
            (model.used * 2).sum().backward()
            with pytest.raises(InvalidArgument, match="'unused' has no gradient"):
                await push_gradients(ps, model)
            assert (await ps.status()).applied_updates == 0
            await push_gradients(ps, model, missing_grad="zeros")
            await push_gradients(ps, model, missing_grad="skip")
            values = await ps.pull(parameter_keys(model))
    np.testing.assert_array_equal(values["used"], np.full(3, -3.0, np.float32))  # 1 - 2 - 2
    np.testing.assert_array_equal(values["unused"], np.ones(3, np.float32))
    np.testing.assert_array_equal(values["frozen"], np.ones(3, np.float32))


async def test_dtype_mismatch_refused_before_any_copy() -> None:
    """Pulling float32 server values into a module whose second parameter is float64 is refused
    with InvalidArgument naming it, and the first parameter is left untouched."""
    declared = torch.nn.Sequential(torch.nn.Linear(2, 2))
    local = torch.nn.Sequential(torch.nn.Linear(2, 2))
    torch.nn.init.zeros_(local[0].weight)
    local[0].bias.data = local[0].bias.data.double()
    async with running_server(consistency="asp") as srv:
        async with connect(srv.address, worker_name="a") as ps:
            await init_from_module(ps, declared)
            with pytest.raises(InvalidArgument, match=r"'0\.bias' is torch\.float64"):
                await pull_parameters(ps, local)
    assert torch.count_nonzero(local[0].weight) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_cuda_module_round_trip() -> None:
    """A CUDA module: bits round-trip and parameters stay on their device."""
    src = torch.nn.Linear(4, 3).to(torch.bfloat16).cuda()
    dst = torch.nn.Linear(4, 3).to(torch.bfloat16).cuda()
    async with running_server(consistency="asp") as srv:
        async with connect(srv.address, worker_name="a") as ps:
            await init_from_module(ps, src, load=False)
            await pull_parameters(ps, dst)
    assert dst.weight.device.type == "cuda"
    assert torch.equal(_bits(dst.weight), _bits(src.weight))


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_blocking_client_with_the_pure_helpers(tmp_path: Path) -> None:
    """``connect_sync`` + module_parameters / load_parameters against a server process."""
    src = _random_module(5)
    dst = _zeros_like_module(src)
    server = ServerProcess(tmp_path, "--consistency", "asp")
    try:
        with connect_sync(server.address, worker_name="sync") as ps:
            ps.init(module_parameters(src))
            load_parameters(dst, ps.pull(parameter_keys(dst)))
    finally:
        assert server.stop() == 0, server.log()
    for (name, want), (_, got) in zip(src.named_parameters(), dst.named_parameters(), strict=True):
        assert torch.equal(_bits(got), _bits(want)), name


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_torch_demo_two_workers_reaches_the_bar() -> None:
    """``paramserver torch-demo``: a server and 2 torch worker processes (SSP, 3 epochs) reach
    the numpy demo's test bar of 0.9 on digits; loss falls."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "paramserver",
            "torch-demo",
            "--workers",
            "2",
            "--epochs",
            "3",
            "--min-accuracy",
            "0.9",
            "--timeout-s",
            "500",
        ],
        capture_output=True,
        text=True,
        timeout=560,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 torch workers" in proc.stdout
    epochs = re.findall(r"epoch\s+(\d+)/3\s+loss (\S+)", proc.stdout)
    assert [int(e) for e, _ in epochs] == [1, 2, 3]
    assert float(epochs[-1][1]) < float(epochs[0][1])
    final = float(re.search(r"final test accuracy (\S+)", proc.stdout).group(1))  # type: ignore[union-attr]
    assert final >= 0.9
