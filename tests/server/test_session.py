"""The Session fast path: inline small tensors, same-host shared memory, and the fallback to the
Push/Pull streams, against real servers on 127.0.0.1.

Expected values come from a numpy oracle: every key uses the ``add`` rule (w += g), so after
pushing g1 then g2 the value is ``init + g1 + g2`` computed by numpy in the key's dtype (the
server performs the same single rounding per element, so equality is exact).
"""

from __future__ import annotations

import asyncio
import os
import signal
import textwrap
from pathlib import Path
from typing import Any

import grpc
import ml_dtypes
import numpy as np
import pytest

from paramserver.api.v1 import parameter_server_pb2 as pb
from paramserver.api.v1 import parameter_server_pb2_grpc as pb_grpc
from paramserver.errors import (
    DimensionMismatch,
    InvalidArgument,
    KeyNotFound,
    ParamServerError,
    StaleUpdate,
)
from paramserver.protocol import shm
from paramserver.protocol.session_frames import SMALL_INLINE_BYTES
from paramserver.server.shard_daemon import ParameterServerDaemon
from paramserver.worker_client import UpdateRule, WorkerClient
from tests.harness import ScriptProcess, ServerProcess, address_of, eventually, running_server
from tests.harness.raw_stubs import random_values, slot_batch

pytestmark = pytest.mark.timeout(60)

ADD = UpdateRule("add")
DTYPES = [
    np.dtype(np.float16),
    np.dtype(ml_dtypes.bfloat16),
    np.dtype(np.float32),
    np.dtype(np.float64),
    np.dtype(np.int32),
    np.dtype(np.int64),
]
#: Above 1 MiB for every dtype: shared memory, or the Push/Pull streams without it.
BIG = 600_000
#: Above the small-inline bound, below the inline limit (for 2-byte dtypes).
MID = 100_000
SHAPES = [(), (0,), (3, 0, 5), (5, 3), (MID,), (BIG,)]


def _segments_of(pid: int, directory: Path = shm.SHM_DIR) -> list[str]:
    return [n for n in os.listdir(directory) if n.startswith(f"paramserver-{pid}-")]


def _client(daemon: ParameterServerDaemon, name: str, **kwargs: Any) -> WorkerClient:
    kwargs.setdefault("heartbeat", False)
    return WorkerClient(address_of(daemon), name, **kwargs)


async def _roundtrips(ps: WorkerClient, seed: int) -> None:
    """init + push + pull + push_pull of every dtype and shape, checked against numpy."""
    rng = np.random.default_rng(seed)
    for dtype in DTYPES:
        for shape in SHAPES:
            key = f"{dtype.name}-{'x'.join(map(str, shape))}"
            init = random_values(rng, dtype, shape)
            g1, g2 = random_values(rng, dtype, shape), random_values(rng, dtype, shape)
            await ps.init({key: init}, rule=ADD)
            await ps.push({key: g1})
            want1 = init + g1
            got = await ps.pull([key])
            assert got[key].dtype == dtype and got[key].shape == shape, key
            np.testing.assert_array_equal(got[key], want1, err_msg=key)
            assert got[key].flags.writeable
            got = await ps.push_pull({key: g2})
            np.testing.assert_array_equal(got[key], want1 + g2, err_msg=key)
            assert got[key].dtype == dtype and got[key].flags.writeable


@pytest.mark.parametrize(
    ("server_shm", "client_shm", "link", "expect_shm"),
    [
        (True, True, True, True),
        (True, True, False, True),
        (True, False, True, False),
        (False, True, True, False),
    ],
    ids=["shm+local-link", "shm+grpc", "client-off", "server-off"],
)
async def test_values_match_numpy_on_every_path(
    server_shm: bool, client_shm: bool, link: bool, expect_shm: bool
) -> None:
    async with running_server(consistency="asp", shared_memory=server_shm) as daemon:
        async with _client(daemon, "w0", shared_memory=client_shm, local_link=link) as ps:
            await _roundtrips(ps, seed=7)
            fp = ps.fastpath
            assert fp is not None and fp.sessions_opened == 1
            assert fp.shm_active is expect_shm
            # the same-host local link carries the session exactly when both sides allow it
            assert fp.on_local_link is (server_shm and client_shm and link)
            if server_shm and client_shm:
                assert fp.offers_accepted >= 1
            elif not server_shm:
                assert fp.shm_declined == "shared memory is off on this server"
            # views opt-in: the pull region, overwritten by the next request
            if expect_shm:
                key = "float32-600000"
                view = (await ps.pull([key], copy=False))[key]
                assert not view.flags.owndata
            assert _segments_of(os.getpid()) == []


async def test_session_off_uses_the_streams() -> None:
    async with running_server(consistency="asp") as daemon:
        async with _client(daemon, "w0", session=False) as ps:
            assert ps.fastpath is None
            await ps.init({"w": np.zeros(BIG, np.float32)}, rule=ADD)
            got = await ps.push_pull({"w": np.ones(BIG, np.float32)})
            np.testing.assert_array_equal(got["w"], np.ones(BIG, np.float32))
            assert daemon.servicer is not None and daemon.servicer.sessions.open_sessions == 0


@pytest.mark.parametrize(
    ("client_shm", "session"),
    [(True, True), (False, True), (False, False)],
    ids=["shared-memory", "network", "streams"],
)
async def test_a_dropped_pull_result_is_received_into_again_a_held_one_never(
    client_shm: bool, session: bool
) -> None:
    """Pull results of 1 MiB and up land in the memory of the key's last result once the caller
    has dropped it; a result the caller still holds keeps its values (numpy oracle)."""
    rng = np.random.default_rng(11)
    async with running_server(consistency="asp") as daemon:
        async with _client(daemon, "w0", shared_memory=client_shm, session=session) as ps:
            want = rng.standard_normal(BIG).astype(np.float32)
            await ps.init({"w": want}, rule=ADD)
            where: list[int] = []
            held: list[tuple[np.ndarray, np.ndarray]] = []
            for round_ in range(4):
                g = rng.standard_normal(BIG).astype(np.float32)
                want = want + g
                got = (await ps.push_pull({"w": g}))["w"]
                np.testing.assert_array_equal(got, want)
                assert got.flags.writeable and got.flags.owndata
                where.append(int(got.__array_interface__["data"][0]))
                if round_ == 1:
                    held.append((got, want.copy()))  # the caller keeps round 1's result
                del got
            kept, its_values = held[0]
            np.testing.assert_array_equal(kept, its_values)  # untouched by rounds 2 and 3
            # round 1 reused round 0's memory; round 2 could not (held); round 3 reused 2's
            assert where[1] == where[0] and where[2] != where[1] and where[3] == where[2]
            # (and round 0 reused the memory of init's read-back of the stored value)
            assert ps.pull_buffers.reused == 3
        assert ps.pull_buffers.kept_bytes() == 0  # close gives the memory back


async def test_declined_when_the_segment_is_not_visible_falls_back(tmp_path: Path) -> None:
    """A client whose /dev/shm is not the server's (another container): the server cannot open
    the file, declines, and the client carries on over the network."""
    async with running_server(consistency="asp") as daemon:
        async with _client(daemon, "w0", shared_memory_dir=tmp_path) as ps:
            await ps.init({"w": np.zeros(BIG, np.float64)}, rule=ADD)
            g = np.arange(BIG, dtype=np.float64)
            got = await ps.push_pull({"w": g})
            np.testing.assert_array_equal(got["w"], g)
            fp = ps.fastpath
            assert fp is not None and not fp.shm_active
            assert fp.shm_declined is not None and "cannot open" in fp.shm_declined
            assert os.listdir(tmp_path) == []  # the client unlinked its offered file


async def _raw_session(stub: pb_grpc.ParameterServerStub, offer: pb.ShmOffer | None) -> Any:
    call = stub.Session()
    opening = pb.SessionOpen(worker_id="")
    if offer is not None:
        opening.shm.CopyFrom(offer)
    await call.write(pb.SessionRequest(seq=1, open=opening))
    resp = await call.read()
    assert resp.seq == 1 and resp.WhichOneof("body") == "opened"
    return call, resp.opened


async def test_nonce_mismatch_declines_and_leaves_the_file() -> None:
    async with running_server(consistency="asp") as daemon:
        seg = shm.ClientSegment.create(1 << 20, 1 << 20)
        try:
            offer = seg.offer()
            offer.nonce = bytes(b ^ 0xFF for b in offer.nonce)
            async with grpc.aio.insecure_channel(address_of(daemon)) as channel:
                call, opened = await _raw_session(pb_grpc.ParameterServerStub(channel), offer)
                assert not opened.shm.accepted
                assert "nonce mismatch" in opened.shm.reason
                assert seg.name in _segments_of(os.getpid())  # not the server's to remove
                call.cancel()
        finally:
            seg.close()
        assert _segments_of(os.getpid()) == []


async def test_malicious_slot_is_invalid_argument_and_the_stream_keeps_serving() -> None:
    async with running_server(consistency="asp") as daemon:
        async with _client(daemon, "w0") as ps:
            await ps.init({"w": np.zeros(4, np.float32)}, rule=ADD)
        seg = shm.ClientSegment.create(1 << 20, 1 << 20)
        try:
            async with grpc.aio.insecure_channel(address_of(daemon)) as channel:
                stub = pb_grpc.ParameterServerStub(channel)
                reg = await stub.Register(pb.RegisterRequest(worker_name="raw"))
                call, opened = await _raw_session(stub, seg.offer())
                assert opened.shm.accepted, opened.shm.reason
                assert _segments_of(os.getpid()) == []  # the server unlinked it
                f32 = np.dtype(np.float32)
                bad_offsets = [
                    seg.push.size_bytes,  # past the end
                    seg.push.size_bytes - 8,  # half past the end
                    (1 << 64) - 8,  # wraps around
                ]
                for i, offset in enumerate(bad_offsets):
                    push = pb.SessionPush(
                        header=pb.PushHeader(worker_id=reg.worker_id, request_id=i, clock=0),
                        slots=slot_batch([("w", f32, (4,), offset)]),
                    )
                    await call.write(pb.SessionRequest(seq=10 + i, push=push))
                    resp = await call.read()
                    assert resp.seq == 10 + i
                    assert resp.WhichOneof("body") == "error"
                    assert resp.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
                    assert resp.error.error_class == "InvalidArgument"
                # the same stream still serves: a good push through the segment, then a pull
                seg.push.view(0, 16, np.dtype(np.float32), (4,))[:] = [1, 2, 3, 4]
                good = pb.SessionPush(
                    header=pb.PushHeader(worker_id=reg.worker_id, request_id=99, clock=0),
                    slots=slot_batch([("w", f32, (4,), 0)]),
                )
                await call.write(pb.SessionRequest(seq=20, push=good))
                assert (await call.read()).WhichOneof("body") == "push"
                await call.write(pb.SessionRequest(seq=21, pull=pb.PullRequest(keys=["w"])))
                pulled = (await call.read()).pull
                # small: answered inline, one slot at offset 0 of the batch's own bytes
                assert list(pulled.slots.keys) == ["w"] and list(pulled.slots.offsets) == [0]
                np.testing.assert_array_equal(
                    np.frombuffer(pulled.slots.data, np.float32, 4), [1, 2, 3, 4]
                )
                assert daemon.servicer is not None
                assert daemon.servicer.sessions.mapped_segments == 1
                call.cancel()
                await eventually(
                    lambda: (
                        daemon.servicer is not None
                        and daemon.servicer.sessions.mapped_segments == 0
                    ),
                    what="segment unmapped after the stream ended",
                )
        finally:
            seg.close()


async def _both_paths_raise(
    ps_fast: WorkerClient, ps_plain: WorkerClient, op: str, *args: Any
) -> type[ParamServerError]:
    """Run ``op`` on a session client and on a stream-only client; both must raise the same
    class with the same status code. Returns the class."""
    classes = []
    for ps in (ps_fast, ps_plain):
        with pytest.raises(ParamServerError) as info:
            await getattr(ps, op)(*args)
        classes.append((type(info.value), info.value.code))
    assert classes[0] == classes[1], classes
    return classes[0][0]


@pytest.mark.parametrize("link", [True, False], ids=["local-link", "grpc"])
async def test_errors_match_the_stream_path_and_keep_the_stream(link: bool) -> None:
    async with running_server(consistency="asp") as daemon:
        async with (
            _client(daemon, "fast", local_link=link) as fast,
            _client(daemon, "plain", session=False) as plain,
        ):
            await fast.init({"w": np.zeros(4, np.float32)}, rule=ADD)
            cls = await _both_paths_raise(fast, plain, "push", {"nope": np.ones(4, np.float32)})
            assert cls is KeyNotFound
            cls = await _both_paths_raise(fast, plain, "pull", ["nope"])
            assert cls is KeyNotFound
            cls = await _both_paths_raise(fast, plain, "push", {"w": np.ones(5, np.float32)})
            assert issubclass(cls, InvalidArgument) and cls is DimensionMismatch
            cls = await _both_paths_raise(fast, plain, "push", {"w": np.ones(4, np.float64)})
            assert issubclass(cls, InvalidArgument)
            cls = await _both_paths_raise(
                fast, plain, "push", {"w": np.array([1, np.nan, 0, 0], np.float32)}
            )
            assert issubclass(cls, InvalidArgument)
            # the stream kept serving after every refusal
            got = await fast.push_pull({"w": np.ones(4, np.float32)})
            np.testing.assert_array_equal(got["w"], np.ones(4, np.float32))
            assert fast.fastpath is not None and fast.fastpath.sessions_opened == 1
            assert fast.fastpath.on_local_link is link
            status = await fast.status()
            assert status.applied_updates == 1


async def test_stale_update_over_the_session() -> None:
    """BSP: a second push of a key in one step is StaleUpdate (FAILED_PRECONDITION) on both
    paths, and the session keeps serving."""
    async with running_server(consistency="bsp", lease_ms=60_000) as daemon:
        async with (
            _client(daemon, "fast") as fast,
            _client(daemon, "plain", session=False) as plain,
        ):
            await fast.init({"w": np.zeros(4, np.float32)}, rule=ADD)
            for ps in (fast, plain):
                await ps.push({"w": np.ones(4, np.float32)})
            cls = await _both_paths_raise(fast, plain, "push", {"w": np.ones(4, np.float32)})
            assert cls is StaleUpdate
            await asyncio.gather(fast.clock(), plain.clock())
            got = await fast.pull(["w"])
            np.testing.assert_array_equal(got["w"], np.ones(4, np.float32))  # mean of two 1s
            assert fast.fastpath is not None and fast.fastpath.sessions_opened == 1


async def test_broken_session_retries_with_the_same_request_id_exactly_once() -> None:
    """The server applies a push, then the stream is cancelled before the reply arrives: the
    client reopens the session and retries with the same request id; dedup applies it once."""
    async with running_server(consistency="asp") as daemon:
        servicer = daemon.servicer
        assert servicer is not None
        async with _client(daemon, "w0") as ps:
            await ps.init({"w": np.zeros(BIG, np.float32)}, rule=ADD)
            real_apply = servicer.shard.apply_push
            cuts = []

            async def apply_then_cut(**kw: Any) -> pb.PushResponse:
                resp = await real_apply(**kw)
                if not cuts:  # the stream dies after the commit, before the reply
                    cuts.append(kw["request_id"])
                    assert ps.fastpath is not None
                    ps.fastpath._call.cancel()
                return resp

            servicer.shard.apply_push = apply_then_cut  # type: ignore[method-assign]
            try:
                got = await ps.push_pull({"w": np.full(BIG, 2, np.float32)})
                ack = await ps.push({"w": np.ones(BIG, np.float32)})
            finally:
                servicer.shard.apply_push = real_apply  # type: ignore[method-assign]
            np.testing.assert_array_equal(got["w"], np.full(BIG, 2, np.float32))
            assert not ack.duplicate
            status = await ps.status()
            assert status.applied_updates == 2 and status.duplicate_pushes == 1
            final = await ps.pull(["w"])
            np.testing.assert_array_equal(final["w"], np.full(BIG, 3, np.float32))
            assert ps.fastpath is not None and ps.fastpath.sessions_opened == 2
            assert _segments_of(os.getpid()) == []


_WORKER = textwrap.dedent(
    """
    import asyncio, sys, numpy as np
    from pathlib import Path
    from paramserver.protocol import shm
    from paramserver.worker_client import UpdateRule, WorkerClient

    async def main(address, mode, *where):
        if mode == "create-only":  # in its own directory: no other test's client sweeps it
            seg = shm.ClientSegment.create(1 << 20, 1 << 20, Path(where[0]))
            print(seg.name, flush=True)
            await asyncio.sleep(60)
            return
        async with WorkerClient(address, "victim", heartbeat=False) as ps:
            await ps.init({"w": np.zeros(500_000, np.float32)}, rule=UpdateRule("add"))
            await ps.push_pull({"w": np.ones(500_000, np.float32)})
            assert ps.fastpath.shm_active
            print("negotiated", flush=True)
            await asyncio.sleep(60)

    asyncio.run(main(*sys.argv[1:]))
    """
)


async def _spawn_worker(
    tmp: Path, address: str, mode: str, *where: str
) -> tuple[ScriptProcess, str]:
    worker = ScriptProcess(tmp, f"session-worker-{mode}", ["-c", _WORKER, address, mode, *where])
    line = (await worker.readline(timeout_s=60)).strip()
    assert line, f"worker exited with {worker.proc.wait()}: {worker.stderr()}"
    return worker, line


@pytest.mark.slow
async def test_worker_killed_after_negotiation_leaks_nothing(tmp_path: Path) -> None:
    async with running_server(consistency="asp") as daemon:
        worker, line = await _spawn_worker(tmp_path, address_of(daemon), "session")
        with worker:
            assert line == "negotiated"
            assert _segments_of(worker.pid) == []  # unlinked by both sides once accepted
            servicer = daemon.servicer
            assert servicer is not None and servicer.sessions.mapped_segments == 1
            await asyncio.to_thread(worker.kill)
            await eventually(
                lambda: servicer.sessions.mapped_segments == 0,
                what="the server unmapped the dead worker's segment",
            )
            assert _segments_of(worker.pid) == []


@pytest.mark.slow
async def test_worker_killed_between_create_and_offer_is_swept(tmp_path: Path) -> None:
    async with running_server(consistency="asp") as daemon:
        segments = tmp_path / "shm"
        segments.mkdir()
        worker, name = await _spawn_worker(
            tmp_path, address_of(daemon), "create-only", str(segments)
        )
        with worker:
            assert _segments_of(worker.pid, segments) == [name]
            await asyncio.to_thread(worker.kill)
            assert _segments_of(worker.pid, segments) == [name]  # nobody to clean up yet
            async with _client(daemon, "next", shared_memory_dir=segments):
                pass
            assert _segments_of(worker.pid, segments) == []


@pytest.mark.slow
async def test_server_killed_leaks_nothing(tmp_path: Path) -> None:
    server = ServerProcess(tmp_path, "--consistency", "asp")
    try:
        async with WorkerClient(server.address, "w0", heartbeat=False) as ps:
            await ps.init({"w": np.zeros(BIG, np.float32)}, rule=ADD)
            got = await ps.push_pull({"w": np.ones(BIG, np.float32)})
            np.testing.assert_array_equal(got["w"], np.ones(BIG, np.float32))
            assert ps.fastpath is not None and ps.fastpath.shm_active
            server.stop(signal.SIGKILL)
            assert _segments_of(os.getpid()) == []
            assert _segments_of(server.proc.pid) == []
            ps.close_timeout_s = 0.1
    finally:
        server.stop()
    assert _segments_of(os.getpid()) == []


async def test_small_pushes_stay_inline_even_with_shared_memory() -> None:
    async with running_server(consistency="asp") as daemon:
        async with _client(daemon, "w0") as ps:
            n = SMALL_INLINE_BYTES // 4
            await ps.init({"w": np.zeros(n, np.float32)}, rule=ADD)
            for _ in range(3):
                await ps.push_pull({"w": np.ones(n, np.float32)})
            got = await ps.pull(["w"])
            np.testing.assert_array_equal(got["w"], np.full(n, 3, np.float32))
            assert ps.fastpath is not None and ps.fastpath.offers_accepted == 0


async def test_graceful_stop_does_not_wait_for_idle_sessions() -> None:
    """An idle Session stream ends when the server stops (its client would reconnect), so a
    graceful stop with a 5 s grace returns at once instead of after the grace."""
    from paramserver.server.config import ServerConfig

    daemon = ParameterServerDaemon(ServerConfig(host="127.0.0.1", port=0, consistency="asp"))
    await daemon.start()
    try:
        async with _client(daemon, "w0", close_timeout_s=0.2) as ps:
            await ps.init({"w": np.zeros(4, np.float32)}, rule=ADD)
            await ps.push_pull({"w": np.ones(4, np.float32)})
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            await daemon.stop(grace_s=5.0)
            assert loop.time() - t0 < 2.5
    finally:
        await daemon.stop(grace_s=0.1)


async def test_a_call_made_while_a_pull_waits_does_not_queue_behind_it() -> None:
    """SSP(0): w0's pull waits for w1's clock; a push by w0 meanwhile goes over its own stream
    (the session has a request in hand) and completes; the pull then sees it."""
    async with running_server(consistency="ssp", staleness=0, lease_ms=60_000) as daemon:
        async with _client(daemon, "w0") as w0, _client(daemon, "w1") as w1:
            await w0.init({"w": np.zeros(4, np.float32)}, rule=ADD)
            await w1.pull(["w"])
            await w0.clock()
            waiting = asyncio.ensure_future(w0.pull(["w"]))
            await eventually(lambda: w0.fastpath is not None and w0.fastpath.busy, what="busy")
            ack = await asyncio.wait_for(w0.push({"w": np.ones(4, np.float32)}), 5.0)
            assert not ack.duplicate and not waiting.done()
            await w1.clock()
            got = await asyncio.wait_for(waiting, 5.0)
            np.testing.assert_array_equal(got["w"], np.ones(4, np.float32))


async def test_bsp_queued_gradients_survive_the_next_push_through_shared_memory() -> None:
    """BSP queues a step's gradients until the step closes; a worker's next push (another key,
    same step) reuses its push region, so the queued gradient must not be a view of it."""
    async with running_server(consistency="bsp", lease_ms=60_000) as daemon:
        async with _client(daemon, "w0") as w0, _client(daemon, "w1") as w1:
            zeros = np.zeros(BIG, np.float32)
            await w0.init({"a": zeros, "b": zeros}, rule=ADD)
            ga = [np.full(BIG, 1, np.float32), np.full(BIG, 3, np.float32)]
            gb = [np.full(BIG, 10, np.float32), np.full(BIG, 30, np.float32)]
            for ps, a, b in zip((w0, w1), ga, gb, strict=True):
                await ps.pull(["a", "b"])
                await ps.push({"a": a})
                await ps.push({"b": b})
                assert ps.fastpath is not None and ps.fastpath.shm_active
            await asyncio.gather(w0.clock(), w1.clock())
            got = await w0.pull(["a", "b"])
            np.testing.assert_array_equal(got["a"], (ga[0] + ga[1]) / 2)
            np.testing.assert_array_equal(got["b"], (gb[0] + gb[1]) / 2)


async def test_a_reply_past_the_deadline_is_never_read_and_the_retry_is_a_duplicate() -> None:
    """The first reply comes after the push's 200 ms deadline: the client drops that stream
    (the late reply can never be taken for the next request's), retries on a new one with the
    same request id, and the server answers duplicate."""
    async with running_server(consistency="asp") as daemon:
        servicer = daemon.servicer
        assert servicer is not None
        async with _client(daemon, "w0") as ps:
            await ps.init({"w": np.zeros(4, np.float32)}, rule=ADD)
            real_apply = servicer.shard.apply_push
            slow = [True]

            async def slow_once(**kw: Any) -> pb.PushResponse:
                resp = await real_apply(**kw)
                if slow.pop() if slow else False:
                    await asyncio.sleep(0.6)
                return resp

            servicer.shard.apply_push = slow_once  # type: ignore[method-assign]
            try:
                ack = await ps.push({"w": np.ones(4, np.float32)}, timeout_s=0.2)
            finally:
                servicer.shard.apply_push = real_apply  # type: ignore[method-assign]
            assert ack.duplicate
            got = await ps.pull(["w"])
            np.testing.assert_array_equal(got["w"], np.ones(4, np.float32))
            assert ps.fastpath is not None and ps.fastpath.sessions_opened == 2


@pytest.mark.parametrize(
    ("session", "shared_memory", "n"),
    [
        (True, True, 4),  # one Session request
        (True, False, 600_000),  # 2.4 MB without shared memory: the Push stream, then Pull
        (False, False, 4),  # the Push stream per call
    ],
)
async def test_push_pull_with_an_unknown_pull_key_applies_nothing(
    session: bool, shared_memory: bool, n: int
) -> None:
    """ASP, sgd lr 1 on w = zeros(n): push_pull(ones, keys=["w", "nope"]) is refused with
    KeyNotFound and w stays zeros (closed form), on every path; push_pull(ones) then gives -1."""
    async with running_server(consistency="asp") as srv:
        async with WorkerClient(
            srv.address, "w0", heartbeat=False, session=session, shared_memory=shared_memory
        ) as ps:
            await ps.init({"w": np.zeros(n, np.float32)}, rule=UpdateRule("sgd", lr=1.0))
            ones = np.ones(n, np.float32)
            with pytest.raises(KeyNotFound, match="nope"):
                await ps.push_pull({"w": ones}, keys=["w", "nope"])
            np.testing.assert_array_equal((await ps.pull(["w"]))["w"], np.zeros(n, np.float32))
            got = await ps.push_pull({"w": ones})
            np.testing.assert_array_equal(got["w"], -ones)
            assert (await ps.status()).applied_updates == 1


async def test_a_write_core_refuses_as_internal_is_a_broken_link() -> None:
    """grpc.aio reports a write to a stream the server has just ended as INTERNAL "Internal error
    from Core" (grpc/grpc#36066; seen when a shard restarted under a training job). The client
    treats it as a broken link: it reopens the Session and the push is applied exactly once."""
    async with running_server(consistency="asp") as daemon:
        async with _client(daemon, "w0", local_link=False) as ps:  # the gRPC Session
            await ps.init({"w": np.zeros(4, np.float32)}, rule=ADD)
            await ps.push({"w": np.ones(4, np.float32)})  # the Session is open
            assert ps.fastpath is not None and ps.fastpath._call is not None
            call = ps.fastpath._call
            real_write = call.write
            refused = []

            async def write_refused_by_core(req: pb.SessionRequest) -> None:
                call.write = real_write  # type: ignore[method-assign]
                refused.append(req.seq)
                raise grpc.aio.AioRpcError(
                    grpc.StatusCode.INTERNAL,
                    grpc.aio.Metadata(),
                    grpc.aio.Metadata(),
                    "Internal error from Core",
                )

            call.write = write_refused_by_core  # type: ignore[method-assign]
            ack = await ps.push({"w": np.full(4, 2, np.float32)})
            assert refused and not ack.duplicate
            final = await ps.pull(["w"])
            np.testing.assert_array_equal(final["w"], np.full(4, 3, np.float32))
            assert (await ps.status()).applied_updates == 2
            assert ps.fastpath.sessions_opened == 2


async def test_a_push_stream_write_core_refuses_as_internal_is_retried() -> None:
    """The same grpc.aio report on a Push stream (the path of large tensors between hosts):
    the retry funnel takes it for the broken link it is; the push is applied exactly once."""
    async with running_server(consistency="asp") as daemon:
        async with _client(daemon, "w0", session=False) as ps:
            await ps.init({"w": np.zeros(4, np.float32)}, rule=ADD)
            real_push = ps.stub.Push
            refused = []

            def push_refused_by_core(requests: Any, timeout: float) -> Any:
                if refused:
                    return real_push(requests, timeout=timeout)
                refused.append(True)

                async def fail() -> Any:
                    raise grpc.aio.AioRpcError(
                        grpc.StatusCode.INTERNAL,
                        grpc.aio.Metadata(),
                        grpc.aio.Metadata(),
                        "Internal error from Core",
                    )

                return fail()

            ps.stub.Push = push_refused_by_core
            ack = await ps.push({"w": np.ones(4, np.float32)})
            assert refused and not ack.duplicate
            final = await ps.pull(["w"])
            np.testing.assert_array_equal(final["w"], np.ones(4, np.float32))
            assert (await ps.status()).applied_updates == 1


@pytest.mark.slow
def test_ssp_workers_ride_through_a_server_restart(tmp_path: Path) -> None:
    """The compose scenario on loopback: two SSP workers push and clock against a shard with a
    write-ahead log; the shard is stopped (SIGTERM) mid-run and restarted on the same port. Both
    workers finish without an error and every push counts exactly once (add rule: the final
    value is the number of pushes, a closed form)."""
    rounds, stop_at = 40, 12
    ckpt = tmp_path / "ckpt"
    flags = ["--consistency", "ssp", "--staleness", "2", "--checkpoint-dir", str(ckpt), "--wal"]
    flags += ["--checkpoint-every-steps", "5", "--grace-s", "3"]
    server = ServerProcess(tmp_path, *flags)
    port = server.port
    restarted: list[ServerProcess] = []

    async def worker(name: str, progress: list[int], halfway: asyncio.Event) -> None:
        async with WorkerClient(server.address, name, heartbeat=False) as ps:
            await ps.init({"w": np.zeros(1000, np.float32)}, rule=ADD)
            for _ in range(rounds):
                await ps.push({"w": np.ones(1000, np.float32)})
                await ps.clock()
                progress.append(1)
                if len(progress) == stop_at:
                    halfway.set()

    async def restart_when(halfway: asyncio.Event) -> None:
        await halfway.wait()
        loop = asyncio.get_running_loop()
        assert await loop.run_in_executor(None, server.stop) == 0, server.log()
        restarted.append(
            await loop.run_in_executor(None, lambda: ServerProcess(tmp_path, *flags, port=port))
        )

    async def main() -> np.ndarray:
        progress: list[int] = []
        halfway = asyncio.Event()
        await asyncio.wait_for(
            asyncio.gather(
                worker("w0", progress, halfway),
                worker("w1", progress, halfway),
                restart_when(halfway),
            ),
            timeout=60,
        )
        async with WorkerClient(f"127.0.0.1:{port}", "reader", heartbeat=False) as ps:
            return (await ps.pull(["w"]))["w"]

    try:
        final = asyncio.run(main())
    finally:
        server.stop()
        for proc in restarted:
            log = proc.log()
            assert proc.stop() == 0, log
    assert restarted and "restored checkpoint" in restarted[0].log()
    np.testing.assert_array_equal(final, np.full(1000, 2 * rounds, np.float32))


@pytest.mark.parametrize("consistency", ["asp", "bsp"])
async def test_one_exchange_region_serves_a_push_pull_of_other_keys(consistency: str) -> None:
    """The segment's one exchange region holds the request's gradients and then the reply's
    values: a push_pull that pushes ``a`` and pulls ``b`` then ``a`` (b lands where a's
    gradient lay) gives numpy's values, and the segment is no larger than the larger side."""
    rng = np.random.default_rng(11)
    a0 = rng.standard_normal(200_000).astype(np.float32)
    b0 = rng.standard_normal(300_000).astype(np.float64)
    ga = rng.standard_normal(200_000).astype(np.float32)
    async with running_server(consistency=consistency, lease_ms=60_000) as daemon:
        async with _client(daemon, "w0") as ps:
            await ps.init({"a": a0, "b": b0}, rule=ADD)
            if consistency == "bsp":  # the step applies at the clock; pull it then
                await ps.push({"a": ga})
                await ps.clock()
                got = await ps.pull(["b", "a"])
            else:
                got = await ps.push_pull({"a": ga}, keys=["b", "a"])
            fp = ps.fastpath
            assert fp is not None and fp.shm_active and fp._segment is not None
            seg = fp._segment
            assert seg.push.offset_bytes == seg.pull.offset_bytes
            assert seg.size_bytes < shm.HEADER_BYTES + 2 * (a0.nbytes + b0.nbytes)
        np.testing.assert_array_equal(got["a"], a0 + ga)
        np.testing.assert_array_equal(got["b"], b0)


async def test_slot_batches_round_trip_and_bad_ones_apply_nothing() -> None:
    # Many keys under one SlotBatch header, both ways: the values match numpy; a batch whose
    # arrays disagree, or with one slot outside the region, is INVALID_ARGUMENT, applies
    # nothing (not even its good keys), and the stream keeps serving.
    f32 = np.dtype(np.float32)
    n_big = SMALL_INLINE_BYTES // 4 + 1000  # so the pull comes back through shared memory
    async with running_server(consistency="asp") as daemon:
        async with _client(daemon, "w0") as ps:
            await ps.init(
                {"a": np.zeros((2, 3), np.float32), "b": np.zeros(n_big, np.float32)}, rule=ADD
            )
        seg = shm.ClientSegment.create(1 << 20, 1 << 20)
        try:
            async with grpc.aio.insecure_channel(address_of(daemon)) as channel:
                stub = pb_grpc.ParameterServerStub(channel)
                reg = await stub.Register(pb.RegisterRequest(worker_name="raw"))
                call = stub.Session()
                opening = pb.SessionOpen(worker_id="")
                opening.shm.CopyFrom(seg.offer())
                await call.write(pb.SessionRequest(seq=1, open=opening))
                opened = (await call.read()).opened
                assert opened.shm.accepted
                a = np.arange(6, dtype=np.float32).reshape(2, 3)
                b = np.linspace(-1, 1, n_big, dtype=np.float32)
                seg.push.view(0, a.nbytes, f32, a.shape)[:] = a
                b_off = shm.align_up(a.nbytes)
                seg.push.view(b_off, b.nbytes, f32, b.shape)[:] = b
                good = [("a", f32, (2, 3), 0), ("b", f32, (n_big,), b_off)]
                disagree = slot_batch(good)
                disagree.dims.append(7)  # one dimension too many
                outside = slot_batch([good[0], ("b", f32, (n_big,), seg.push.size_bytes)])
                for i, batch in enumerate([disagree, outside]):
                    push = pb.SessionPush(
                        header=pb.PushHeader(worker_id=reg.worker_id, request_id=i, clock=0),
                        slots=batch,
                    )
                    await call.write(pb.SessionRequest(seq=10 + i, push=push))
                    resp = await call.read()
                    assert resp.WhichOneof("body") == "error", resp
                    assert resp.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
                both = pb.SessionPushPull(
                    push=pb.SessionPush(
                        header=pb.PushHeader(worker_id=reg.worker_id, request_id=9, clock=0),
                        slots=slot_batch(good),
                    ),
                    pull=pb.PullRequest(worker_id=reg.worker_id, keys=["a", "b"]),
                )
                await call.write(pb.SessionRequest(seq=20, push_pull=both))
                resp = await call.read()
                assert resp.WhichOneof("body") == "push_pull", resp
                pulled = resp.push_pull.pull
                assert not pulled.slots.HasField("data")  # (the shared-memory carrier)
                assert list(pulled.slots.keys) == ["a", "b"]
                dims = list(pulled.slots.dims)
                assert list(pulled.slots.ndims) == [2, 1] and dims == [2, 3, n_big]
                offs = list(pulled.slots.offsets)
                got_a = seg.pull.view(offs[0], a.nbytes, f32, (2, 3))
                got_b = seg.pull.view(offs[1], b.nbytes, f32, (n_big,))
                # applied exactly once ("add" from zeros): the refused batches left nothing
                np.testing.assert_array_equal(got_a, a)
                np.testing.assert_array_equal(got_b, b)
                call.cancel()
        finally:
            seg.close()


async def test_client_batches_many_keys_through_shared_memory() -> None:
    # The client's push_pull of many keys (over the local link and over gRPC) goes as one
    # SlotBatch each way and returns every key's value (checked against numpy).
    shapes = [(3, 4), (5,), (), (2, 2, 2), (SMALL_INLINE_BYTES // 4,)]
    for link in (True, False):
        async with running_server(consistency="asp") as daemon:
            async with _client(daemon, "w0", local_link=link) as ps:
                keys = [f"k{i}" for i in range(len(shapes))]
                zeros = {k: np.zeros(s, np.float32) for k, s in zip(keys, shapes, strict=True)}
                await ps.init(zeros, rule=ADD)
                rng = np.random.default_rng(3)
                grads = {
                    k: rng.standard_normal(s).astype(np.float32)
                    for k, s in zip(keys, shapes, strict=True)
                }
                out = await ps.push_pull(grads)
                out = await ps.push_pull(grads)
                fp = ps.fastpath
                assert fp is not None and fp.shm_active
                assert fp.on_local_link is link
                for k in keys:
                    np.testing.assert_array_equal(out[k], grads[k] + grads[k])
                    assert out[k].shape == grads[k].shape and out[k].flags.writeable


async def test_many_key_pull_results_held_by_the_caller_are_never_overwritten() -> None:
    # A many-key pull lands in one private buffer: a result the caller still holds (any one of
    # its values) keeps its values through later pulls; once all are dropped it is reused.
    shapes = [(4, 5), (1 << 18,), (3,)]  # over 1 MiB in all: the buffer is kept for reuse
    keys = [f"k{i}" for i in range(len(shapes))]
    async with running_server(consistency="asp") as daemon:
        async with _client(daemon, "w0") as ps:
            zeros = {k: np.zeros(s, np.float32) for k, s in zip(keys, shapes, strict=True)}
            await ps.init(zeros, rule=ADD)
            rng = np.random.default_rng(5)
            want = {k: v.copy() for k, v in zeros.items()}
            held: list[tuple[np.ndarray, np.ndarray]] = []
            for round_ in range(4):
                g = {
                    k: rng.standard_normal(s).astype(np.float32)
                    for k, s in zip(keys, shapes, strict=True)
                }
                want = {k: want[k] + g[k] for k in keys}
                got = await ps.push_pull(g)
                for k in keys:
                    np.testing.assert_array_equal(got[k], want[k])
                if round_ == 1:
                    held.append((got["k2"], want["k2"].copy()))  # one small value kept
                del got
            kept, its_values = held[0]
            np.testing.assert_array_equal(kept, its_values)  # untouched by rounds 2 and 3
            assert ps.pull_buffers.reused >= 1  # a dropped round's buffer served a later one
