"""Case empty-and-scalar-tensors.md: zero-size and zero-dimensional tensors keep shape and dtype.

Four float32 keys: zeros((0,)), zeros((3, 0, 5)), the scalar 7.5 of shape () and zeros((1,)).
Expected values are closed forms of the ``add`` rule (w + g) and of the BSP mean.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from paramserver.api.v1 import parameter_server_pb2 as pb
from paramserver.api.v1 import parameter_server_pb2_grpc as pb_grpc
from paramserver.worker_client import UpdateRule, connect
from tests.harness import raw_stubs as raw
from tests.harness import running_server

pytestmark = pytest.mark.timeout(60)

ADD = UpdateRule("add")


def _initial() -> dict[str, Any]:
    return {
        "empty1": np.zeros((0,), np.float32),
        "empty3": np.zeros((3, 0, 5), np.float32),
        "scalar": np.float32(7.5),  # a numpy scalar: shape ()
        "one": np.zeros((1,), np.float32),
    }


def _gradients(scalar: float, one: float) -> dict[str, np.ndarray]:
    return {
        "empty1": np.zeros((0,), np.float32),
        "empty3": np.zeros((3, 0, 5), np.float32),
        "scalar": np.array(scalar, np.float32),
        "one": np.array([one], np.float32),
    }


SHAPES = {"empty1": (0,), "empty3": (3, 0, 5), "scalar": (), "one": (1,)}


def _check(got: dict[str, np.ndarray], scalar: float, one: float) -> None:
    assert set(got) == set(SHAPES)
    for key, shape in SHAPES.items():
        assert got[key].shape == shape, key
        assert got[key].dtype == np.float32, key
    assert got["scalar"].ndim == 0
    assert float(got["scalar"]) == scalar
    np.testing.assert_array_equal(got["one"], np.array([one], np.float32))


async def test_push_pull_keep_shapes_and_dtypes() -> None:
    """Case empty-and-scalar-tensors.md: init, push (add rule) and pull the four tensors: shapes
    and dtypes come back exactly ((3, 0, 5) stays (3, 0, 5), () stays () not (1,)); scalar
    7.5 + 1.25 == 8.75, [0] + [3] == [3]; Status reports the same shapes."""
    async with running_server(consistency="asp") as srv:
        async with connect(srv.address, "w0") as ps:
            created = await ps.init(_initial(), rule=ADD)
            _check(created, 7.5, 0.0)
            await ps.push(_gradients(1.25, 3.0))
            _check(await ps.pull(), 8.75, 3.0)
            status = await ps.status()
        async with raw.channel(srv.address) as ch:  # independent decoder of the wire bytes
            _check(await raw.pull(pb_grpc.ParameterServerStub(ch)), 8.75, 3.0)
    shapes = {k.key: tuple(k.shape) for k in status.keys}
    assert shapes == SHAPES
    assert all(k.updates == 1 for k in status.keys)


async def test_push_stream_without_data_bytes_is_accepted_for_empty_tensors() -> None:
    """Case empty-and-scalar-tensors.md: a push whose frames for the empty tensors carry no data
    bytes at all (one frame each: header, empty data, last) is accepted and counted."""
    async with running_server(consistency="asp") as srv, raw.channel(srv.address) as ch:
        stub = pb_grpc.ParameterServerStub(ch)
        wid = await raw.register(stub, "w0")
        await raw.init(stub, {k: np.asarray(v) for k, v in _initial().items()}, ADD)
        frames = raw.frames("empty1", np.zeros((0,), np.float32)) + raw.frames(
            "empty3", np.zeros((3, 0, 5), np.float32)
        )
        assert len(frames) == 2
        assert all(f.data == b"" and f.last for f in frames)
        resp = await stub.Push(iter(raw.push_messages(wid, 1, frames)), timeout=10)
        assert not resp.duplicate
        assert resp.applied_updates == 1
        updates = {k.key: k.updates for k in (await raw.status(stub)).keys}
        assert updates == {"empty1": 1, "empty3": 1, "scalar": 0, "one": 0}
        got = await raw.pull(stub, ["empty1", "empty3"])
        assert got["empty1"].shape == (0,)
        assert got["empty3"].shape == (3, 0, 5)


async def test_bsp_mean_over_empty_gradients_is_empty_without_warnings() -> None:
    """Case empty-and-scalar-tensors.md: BSP with two workers pushing the four gradients; the
    step's mean over the empty gradients is empty (shapes kept) and nothing warns (numpy's
    "mean of empty slice" / invalid-value warnings would be recorded here: the server runs in
    this process). Scalar: 7.5 + mean(1, 2) == 9.0; one: 0 + mean(3, 5) == 4."""
    async with running_server(consistency="bsp", aggregation="mean") as srv:
        async with connect(srv.address, "a") as a, connect(srv.address, "b") as b:
            await a.init(_initial(), rule=ADD)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                await a.push(_gradients(1.0, 3.0))
                await b.push(_gradients(2.0, 5.0))
                await a.clock()
                await b.clock()
                got = await a.pull()
                status = await a.status()
    assert [str(w.message) for w in caught] == []
    _check(got, 9.0, 4.0)
    assert status.bsp_step == 1
    assert status.applied_updates == 2


@pytest.mark.parametrize("consistency", ["asp", "bsp"])
async def test_shape_mismatch_names_key_and_both_shapes(consistency: str) -> None:
    """Case empty-and-scalar-tensors.md: a gradient of shape (3, 0, 5) for a key of shape
    (3, 0, 4) is refused with INVALID_ARGUMENT naming the key and both shapes; the key keeps its
    shape and dtype and no update is counted."""
    async with running_server(consistency=consistency) as srv, raw.channel(srv.address) as ch:
        stub = pb_grpc.ParameterServerStub(ch)
        wid = await raw.register(stub, "w0")
        await raw.init(stub, {"k304": np.zeros((3, 0, 4), np.float32)}, ADD)
        msgs = raw.push_arrays(wid, 1, {"k304": np.zeros((3, 0, 5), np.float32)})
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Push(iter(msgs), timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = info.value.details() or ""
        for part in ("k304", "(3, 0, 5)", "(3, 0, 4)"):
            assert part in details, details
        got = (await raw.pull(stub, ["k304"]))["k304"]
        assert (got.shape, got.dtype) == ((3, 0, 4), np.float32)
        st = await raw.status(stub)
        assert [tuple(k.shape) for k in st.keys] == [(3, 0, 4)]
        assert (st.keys[0].updates, st.applied_updates, st.rejected_pushes) == (0, 0, 1)


async def test_checkpoint_and_restore_keep_all_four(tmp_path: Path) -> None:
    """Case empty-and-scalar-tensors.md: after a push the server stops (final checkpoint); a new
    server restores from the same directory and serves the four tensors with the same shapes,
    dtypes and values (scalar 8.75 of shape (), [3.0])."""
    ckpt = str(tmp_path / "ckpt")
    async with running_server(consistency="asp", checkpoint_dir=ckpt) as srv:
        async with connect(srv.address, "w0") as ps:
            await ps.init(_initial(), rule=ADD)
            await ps.push(_gradients(1.25, 3.0))
    async with running_server(consistency="asp", checkpoint_dir=ckpt) as srv:
        async with raw.channel(srv.address) as ch:
            stub = pb_grpc.ParameterServerStub(ch)
            _check(await raw.pull(stub), 8.75, 3.0)
            st = await stub.Status(pb.StatusRequest(), timeout=10)
    assert {k.key: tuple(k.shape) for k in st.keys} == SHAPES
    assert {k.key: k.updates for k in st.keys} == dict.fromkeys(SHAPES, 1)
