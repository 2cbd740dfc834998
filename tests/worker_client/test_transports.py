"""The worker client's transports: one ``Transport`` interface, the choice between the preferred
transport and the streams returned as a value (``Declined``), never raised; the Session's slot
layout shared with the server (``protocol.session_frames``); the typed keyword signature of
``connect`` and friends kept equal to ``WorkerClient``'s."""

from __future__ import annotations

import inspect
import typing
from typing import Any

import numpy as np
import pytest

from paramserver.api.v1 import parameter_server_pb2 as pb
from paramserver.errors import InvalidArgument, MalformedStream
from paramserver.protocol import shm
from paramserver.protocol.session_frames import (
    place_slot_batch,
    slot_batch_entries,
    slot_batch_views,
)
from paramserver.worker_client import options as options_module
from paramserver.worker_client.client import WorkerClient
from paramserver.worker_client.cluster import ClusterWorkerClient
from paramserver.worker_client.compression import WirePart
from paramserver.worker_client.options import ClientOptions
from paramserver.worker_client.transport.base import (
    Declined,
    PullSpec,
    PushPayload,
    Transport,
    Transports,
)
from paramserver.worker_client.transport.session_stream import SessionTransport
from paramserver.worker_client.transport.streams import StreamTransport

pytestmark = pytest.mark.timeout(30)


class FakeTransport:
    """Answers every push with ``answer`` (a response or a Declined) and counts the calls."""

    def __init__(self, answer: Any, ready: bool = True) -> None:
        self.answer = answer
        self._ready = ready
        self.calls = 0

    @property
    def ready(self) -> bool:
        return self._ready

    def close(self) -> None:
        pass

    async def push(self, push: PushPayload) -> Any:
        self.calls += 1
        return self.answer


def _payload() -> PushPayload:
    grads = {"w": [WirePart(np.ones(3, np.float32))]}
    return PushPayload.of(7, lambda: pb.PushHeader(request_id=7), grads, 5.0)


async def _send(transports: Transports) -> Any:
    payload = _payload()
    return await transports.send(lambda t: t.push(payload))  # type: ignore[attr-defined]


async def test_preferred_transport_carries_what_it_can() -> None:
    preferred, streams = FakeTransport(pb.PushResponse(applied_updates=1)), FakeTransport(None)
    transports = Transports(streams, preferred)  # type: ignore[arg-type]
    assert (await _send(transports)).applied_updates == 1
    assert (preferred.calls, streams.calls) == (1, 0)


async def test_a_decline_goes_to_the_streams_and_the_preferred_stays() -> None:
    preferred = FakeTransport(Declined("too large"))
    streams = FakeTransport(pb.PushResponse(applied_updates=2))
    transports = Transports(streams, preferred)  # type: ignore[arg-type]
    for _ in range(2):
        assert (await _send(transports)).applied_updates == 2
    assert (preferred.calls, streams.calls) == (2, 2)
    assert transports.preferred is preferred


async def test_a_permanent_decline_replaces_the_preferred_transport() -> None:
    preferred = FakeTransport(Declined("no Session RPC", permanent=True))
    streams = FakeTransport(pb.PushResponse(applied_updates=3))
    transports = Transports(streams, preferred)  # type: ignore[arg-type]
    for _ in range(3):
        assert (await _send(transports)).applied_updates == 3
    assert (preferred.calls, streams.calls) == (1, 3)
    assert transports.preferred is None


async def test_a_busy_preferred_transport_is_passed_over() -> None:
    preferred = FakeTransport(pb.PushResponse(applied_updates=1), ready=False)
    streams = FakeTransport(pb.PushResponse(applied_updates=4))
    transports = Transports(streams, preferred)  # type: ignore[arg-type]
    assert (await _send(transports)).applied_updates == 4
    assert preferred.calls == 0


async def test_the_session_declines_compressed_gradients_without_sending() -> None:
    session = SessionTransport(lambda: None, shared_memory=False)
    parts = {"w": [WirePart(np.ones(2, np.float32), role=1)]}
    payload = PushPayload.of(1, pb.PushHeader, parts, 1.0)
    assert payload.dense is None
    got = await session.push(payload)
    assert isinstance(got, Declined) and not got.permanent
    assert session._call is None  # nothing opened
    got = await session.push_pull(payload, PullSpec(pb.PullRequest(keys=["w"]), 1.0))
    assert isinstance(got, Declined)


def test_both_transports_implement_the_interface() -> None:
    names = {"ready", "close", "push", "pull", "push_pull", "pull_rows", "push_rows"}
    protocol = {n for n in vars(Transport) if not n.startswith("_")}
    assert names <= protocol
    for cls in (SessionTransport, StreamTransport):
        for name in names:
            assert hasattr(cls, name), (cls, name)
        for name in names - {"ready", "close"}:
            ours = list(inspect.signature(getattr(Transport, name)).parameters)
            theirs = list(inspect.signature(getattr(cls, name)).parameters)
            assert theirs[: len(ours)] == ours, (cls, name)


# ------------------------------------------------------------------ slot layout
def _region(nbytes: int) -> tuple[np.ndarray, Any]:
    buf = np.zeros(nbytes, np.uint8)

    def view(offset: int, size: int, dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
        return buf[offset : offset + size].view(dtype).reshape(shape)

    return buf, view


VALUES = {
    "a": np.arange(5, dtype=np.float32),
    "b": np.arange(12, dtype=np.int64).reshape(3, 4),
    "c": np.array(2.5, np.float64),
}


def test_slot_batch_round_trip_at_aligned_offsets() -> None:
    _, view = _region(1 << 16)
    batch = pb.SlotBatch()
    dsts = place_slot_batch(batch, view, VALUES, list(VALUES.values()))
    for dst, value in zip(dsts, VALUES.values(), strict=True):
        np.copyto(dst, value)
    # Offsets: each slot starts at the aligned end of the previous one, from 0.
    expected, offset = [], 0
    for value in VALUES.values():
        expected.append(offset)
        offset = shm.align_up(offset + value.nbytes)
    assert list(batch.offsets) == expected
    entries = slot_batch_entries(batch)
    assert [e[0] for e in entries] == list(VALUES)
    for (_, dtype, shape, off, nbytes), value in zip(entries, VALUES.values(), strict=True):
        assert (dtype, shape, nbytes) == (value.dtype, value.shape, value.nbytes)
        np.testing.assert_array_equal(view(off, nbytes, dtype, shape), value)


def test_a_slot_batch_whose_arrays_disagree_is_malformed() -> None:
    _, view = _region(1 << 16)
    batch = pb.SlotBatch()
    place_slot_batch(batch, view, VALUES, list(VALUES.values()))
    batch.dims.append(3)  # one dim too many for the ranks
    with pytest.raises(MalformedStream, match="SlotBatch arrays disagree"):
        slot_batch_entries(batch)


def _fields(batch: pb.SlotBatch) -> tuple[list[Any], ...]:
    return (
        list(batch.keys),
        list(batch.dtypes),
        list(batch.ndims),
        list(batch.dims),
        list(batch.offsets),
    )


def test_a_repeated_layout_reuses_its_views_and_a_changed_one_is_laid_out_anew() -> None:
    _, view = _region(1 << 16)
    memo: dict[str, Any] = {}
    values = list(VALUES.values())
    oracle = pb.SlotBatch()
    place_slot_batch(oracle, view, VALUES, values)  # no memo: laid out from scratch
    first, second = pb.SlotBatch(), pb.SlotBatch()
    dsts1 = place_slot_batch(first, view, VALUES, values, memo=memo)
    dsts2 = place_slot_batch(second, view, VALUES, values, memo=memo)
    assert _fields(first) == _fields(second) == _fields(oracle)
    assert all(a is b for a, b in zip(dsts1, dsts2, strict=True))  # reused
    # Another shape for "b": a new layout, the same as one made without the memo.
    changed = dict(VALUES, b=np.arange(20, dtype=np.int64).reshape(4, 5))
    fresh, again = pb.SlotBatch(), pb.SlotBatch()
    place_slot_batch(fresh, view, changed, list(changed.values()))
    dsts3 = place_slot_batch(again, view, changed, list(changed.values()), memo=memo)
    assert _fields(again) == _fields(fresh) != _fields(first)
    assert [d.shape for d in dsts3] == [v.shape for v in changed.values()]
    # Other keys with the same dtypes and shapes: new keys in the batch.
    renamed = {f"x{k}": v for k, v in VALUES.items()}
    third = pb.SlotBatch()
    place_slot_batch(third, view, renamed, values, memo=memo)
    assert list(third.keys) == list(renamed)


def test_slot_batch_views_reuse_a_repeated_batch_and_check_a_new_one(tmp_path: Any) -> None:
    seg = shm.ClientSegment.create(1 << 14, 1 << 14, tmp_path)
    try:
        batch = pb.SlotBatch()
        dsts = place_slot_batch(batch, seg.push.view, VALUES, list(VALUES.values()))
        for dst, value in zip(dsts, VALUES.values(), strict=True):
            np.copyto(dst, value)
        entries, views = slot_batch_views(batch, seg.push, seg.layouts)
        assert entries == slot_batch_entries(batch)
        for got, value in zip(views, VALUES.values(), strict=True):
            np.testing.assert_array_equal(got, value)
        copy = pb.SlotBatch()
        copy.CopyFrom(batch)
        entries2, views2 = slot_batch_views(copy, seg.push, seg.layouts)
        assert entries2 is entries and all(a is b for a, b in zip(views, views2, strict=True))
        # A slot moved past the region's end: checked again (not served from the memo).
        copy.offsets[-1] = seg.push.size_bytes
        with pytest.raises(InvalidArgument, match=r"tensor 'c'.*outside"):
            slot_batch_views(copy, seg.push, seg.layouts)
        assert seg.layouts
    finally:
        seg.close()
    assert seg.layouts == {}  # no view of the closed mapping is kept by the memo


# ------------------------------------------------------------------ typed signature
def test_client_options_are_the_worker_client_keywords() -> None:
    params = {
        name: p
        for name, p in inspect.signature(WorkerClient.__init__).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    }
    hints = typing.get_type_hints(ClientOptions, vars(options_module))
    assert list(hints) == list(params)
    client_hints = typing.get_type_hints(WorkerClient.__init__)
    for name in params:
        assert hints[name] == client_hints[name], name


def test_cluster_client_checks_its_options_when_built() -> None:
    from paramserver.errors import InvalidArgument

    with pytest.raises(InvalidArgument):
        ClusterWorkerClient("127.0.0.1:1", "w", pull_buffer_max_bytes=-1)
    with pytest.raises(TypeError, match="rpc_timeout"):
        ClusterWorkerClient("127.0.0.1:1", "w", rpc_timeout=1.0)  # type: ignore[call-arg]


def test_a_single_shard_cluster_is_one_worker_client() -> None:
    ps = ClusterWorkerClient("127.0.0.1:1", "w", rpc_timeout_s=3.0)
    assert isinstance(ps.client, WorkerClient) and not isinstance(ps, WorkerClient)
    assert not ps.sharded and ps.client.rpc_timeout_s == 3.0
    ps.clock_value = 4  # the facade's state is its client's
    assert ps.client.clock_value == 4 and ps.clock_value == 4
    assert ps.fastpath is ps.client.fastpath


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_mypy_checks_the_callers_of_connect(tmp_path: Any) -> None:
    """``connect``, ``connect_sync``, ``connect_cluster`` and ``ClusterWorkerClient`` have the
    full typed keyword signature: mypy --strict refuses a misspelt or mistyped keyword."""
    import subprocess
    import sys
    from pathlib import Path

    snippet = tmp_path / "caller.py"
    snippet.write_text(
        "import paramserver\n"
        "from paramserver.worker_client import connect_cluster\n"
        'paramserver.connect("a:1", "w", rpc_timeout=1.0)\n'
        'paramserver.connect_sync("a:1", "w", heartbeat="yes")\n'
        'connect_cluster("a:1", "w", discover=True, session=False, rpc_timeout_s=2.0)\n'
        'paramserver.ClusterWorkerClient("a:1", "w", cast_gradients=1.5)\n'
    )
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(tmp_path / "cache"),
         str(snippet)],
        capture_output=True, text=True, cwd=root, timeout=500, check=False,
        env={**__import__("os").environ, "PYTHONPATH": str(root)},
    )  # fmt: skip
    errors = [line for line in run.stdout.splitlines() if ": error:" in line]
    assert [int(line.split(":")[1]) for line in errors] == [3, 4, 6], run.stdout
    assert 'Unexpected keyword argument "rpc_timeout"' in errors[0]
    assert '"heartbeat"' in errors[1] and '"cast_gradients"' in errors[2]
