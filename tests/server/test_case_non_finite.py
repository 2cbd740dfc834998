"""Case non-finite-gradient.md: one NaN/Inf gradient must not poison the parameters.

BSP, three workers, ``w`` = ones(1000), SGD lr 0.5, mean aggregation. Gradients are dyadic
rationals, so the oracle ``1 - lr * (g1 + g3) / 2`` (computed here in float64) is exact in
float32, float16 and bfloat16 alike and the comparison is bit-exact.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file

from paramserver.errors import NonFiniteGradient
from paramserver.worker_client import UpdateRule, WorkerClient, connect
from tests.harness import eventually, running_server

pytestmark = pytest.mark.timeout(60)

N = 1000
LR = 0.5
DTYPES = [np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)]


def _finite_gradients(dtype: np.dtype[Any]) -> tuple[np.ndarray, np.ndarray]:
    i = np.arange(N)
    g1 = ((i % 4) * 0.25).astype(dtype)  # 0, 0.25, 0.5, 0.75, ...
    g3 = ((i % 8) * 0.125 - 0.5).astype(dtype)  # -0.5 .. 0.375
    return g1, g3


def _poisoned(dtype: np.dtype[Any]) -> np.ndarray:
    g2 = np.full(N, 0.5, dtype)
    g2[17] = np.nan
    g2[18] = np.inf
    return g2


def _committed(ckpt: Path) -> list[Path]:
    return sorted(p for p in ckpt.iterdir() if p.is_dir() and p.name.startswith("ckpt-"))


def _checkpoint_params(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint, read with safetensors directly (bfloat16 is stored as its
    uint16 bit pattern with the true dtype in the manifest)."""
    manifest = json.loads((path / "manifest.json").read_text())
    tensors = load_file(str(path / "tensors.safetensors"))
    out = {}
    for name, array in tensors.items():
        if manifest["tensors"][name]["dtype"] == "bfloat16":
            array = array.view(ml_dtypes.bfloat16)
        out[name] = array
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
async def test_bsp_non_finite_push_refused_step_completes(
    dtype: np.dtype[Any], tmp_path: Path
) -> None:
    """Case non-finite-gradient.md: W2's gradient has element 17 = NaN and 18 = +Inf: its push
    is refused with INVALID_ARGUMENT naming key 'w', the worker and the count (2); the step
    completes with the two finite gradients (w == 1 - lr * (g1 + g3) / 2, finite); the periodic
    checkpoint after the step and the final one hold only finite values. Same for float16 and
    bfloat16."""
    ckpt = tmp_path / "ckpt"
    g1, g3 = _finite_gradients(dtype)
    expected = (1.0 - LR * (g1.astype(np.float64) + g3.astype(np.float64)) / 2).astype(dtype)
    async with running_server(
        consistency="bsp", aggregation="mean", checkpoint_dir=str(ckpt), checkpoint_every_steps=1
    ) as srv:
        clients = [connect(srv.address, f"W{i}") for i in (1, 2, 3)]
        for c in clients:
            await c.open()
        w1, w2, w3 = clients
        try:
            await w1.init({"w": np.ones(N, dtype)}, rule=UpdateRule("sgd", lr=LR))
            await w1.push({"w": g1})
            with pytest.raises(NonFiniteGradient) as info:
                await w2.push({"w": _poisoned(dtype)})
            cause = info.value.__cause__
            assert isinstance(cause, grpc.aio.AioRpcError)
            assert cause.code() == grpc.StatusCode.INVALID_ARGUMENT
            message = info.value.message
            assert "'w'" in message, message
            assert w2.worker_id in message, message
            assert "2 non-finite" in message, message
            await w3.push({"w": g3})
            for c in clients:
                await c.clock()
            got = (await w1.pull(["w"]))["w"]
            status = await w1.status()
            await eventually(lambda: bool(_committed(ckpt)), what="periodic checkpoint")
        finally:
            for c in clients:
                await c.close()
    assert got.dtype == dtype
    assert np.isfinite(got.astype(np.float64)).all()
    assert got.tobytes() == expected.tobytes()
    assert (status.bsp_step, status.applied_updates, status.rejected_pushes) == (1, 2, 1)
    checkpoints = _committed(ckpt)
    assert len(checkpoints) >= 2  # the periodic one after step 1 and the final one
    for path in checkpoints:
        params = _checkpoint_params(path)
        assert params["param/w"].tobytes() == expected.tobytes()
        for name, array in params.items():
            assert np.isfinite(array.astype(np.float64)).all(), (path.name, name)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
async def test_negative_zero_and_subnormals_are_accepted(dtype: np.dtype[Any]) -> None:
    """Case non-finite-gradient.md: a gradient holding -0.0 and the dtype's smallest and largest
    subnormals is accepted (BSP, with two all-zero gradients beside it); the step closes and w
    stays 1 (the subnormal contribution is far below half an ulp of 1)."""
    info = ml_dtypes.finfo(dtype)  # numpy's finfo does not know bfloat16
    tiny = info.smallest_subnormal
    g2 = np.zeros(N, dtype)
    g2[0] = -0.0
    g2[1] = tiny
    g2[2] = -tiny
    g2[3] = info.smallest_normal - tiny  # the largest subnormal
    assert np.signbit(g2[0]) and g2[1] != 0 and 0 < g2[3] < info.smallest_normal
    async with running_server(consistency="bsp", aggregation="mean") as srv:
        clients = [connect(srv.address, f"W{i}") for i in (1, 2, 3)]
        for c in clients:
            await c.open()
        try:
            await clients[0].init({"w": np.ones(N, dtype)}, rule=UpdateRule("sgd", lr=LR))
            await clients[0].push({"w": np.zeros(N, dtype)})
            await clients[1].push({"w": g2})
            await clients[2].push({"w": np.zeros(N, dtype)})
            for c in clients:
                await c.clock()
            got = (await clients[0].pull(["w"]))["w"]
            status = await clients[0].status()
        finally:
            for c in clients:
                await c.close()
    assert status.rejected_pushes == 0
    assert status.applied_updates == 3
    assert got.tobytes() == np.ones(N, dtype).tobytes()


@pytest.mark.parametrize("consistency", ["asp", "ssp"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
async def test_non_finite_refused_under_asp_and_ssp(consistency: str, dtype: np.dtype[Any]) -> None:
    """Case non-finite-gradient.md, whole kind of fault: under ASP and SSP too the NaN/Inf push
    is refused (INVALID_ARGUMENT, key, worker, count 2) and w stays bit-for-bit ones; a finite
    push after it is applied (w == 1 - lr * 0.5 == 0.75)."""
    async with running_server(consistency=consistency, staleness=2) as srv:
        ps: WorkerClient
        async with connect(srv.address, "W2") as ps:
            await ps.init({"w": np.ones(N, dtype)}, rule=UpdateRule("sgd", lr=LR))
            with pytest.raises(NonFiniteGradient) as info:
                await ps.push({"w": _poisoned(dtype)})
            for part in ("'w'", ps.worker_id, "2 non-finite"):
                assert part in info.value.message
            assert (await ps.pull(["w"]))["w"].tobytes() == np.ones(N, dtype).tobytes()
            await ps.push({"w": np.full(N, 0.5, dtype)})
            got = (await ps.pull(["w"]))["w"]
    assert got.tobytes() == np.full(N, 0.75, dtype).tobytes()
