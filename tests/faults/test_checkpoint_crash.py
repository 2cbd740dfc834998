"""Case checkpoint-crash.md: a SIGKILL during a checkpoint leaves the previous one whole.

The checkpoint files are checked here independently of the product's reader: the manifest's
per-tensor sha256 is recomputed from ``safetensors.numpy.load_file`` and every value is compared
with its closed form. A disk-full error during a checkpoint (reported, previous checkpoint
intact, temporary files removed) is covered by
``tests/server/test_checkpoint.py::test_write_error_leaves_previous_checkpoint_intact``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from paramserver.api.v1 import parameter_server_pb2 as pb
from paramserver.api.v1 import parameter_server_pb2_grpc as pb_grpc
from paramserver.protocol import tensor
from paramserver.worker_client import UpdateRule, connect
from tests.harness import ServerProcess
from tests.harness import raw_stubs as raw

from .helpers import report, verify_checkpoint

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(150),
    pytest.mark.asyncio(loop_factories=["asyncio"]),
]

KEYS = 200
KEY_ELEMENTS = 500_000  # float32: 2 MB per key, 400 MB in all
BIG_BYTES = KEYS * KEY_ELEMENTS * 4
STEP_BUMP = 1000.0  # what the one big push between C50 and C60 adds to every key
CHUNK = (1 << 20) - (16 << 10)


def key(i: int) -> str:
    return f"k{i:03d}"


async def _init_frames() -> AsyncIterator[pb.InitRequest]:
    """Init stream: 200 float32 keys of 2 MB (key i holds i everywhere), rule ``add``."""
    yield pb.InitRequest(header=pb.InitHeader(rule=UpdateRule("add").to_proto()))
    for i in range(KEYS):
        for frame in tensor.encode_frames(key(i), np.full(KEY_ELEMENTS, i, np.float32), CHUNK):
            yield pb.InitRequest(frame=frame)


def checkpoint_step(path: Path) -> int:
    """The step a committed checkpoint holds (50 or 60), after checking it is whole: every
    checksum verifies and every key holds that step's value (never a mixture)."""
    got = verify_checkpoint(path)
    step = int(got["tensors"]["param/step"])
    assert step in (50, 60), (path.name, step)
    bump = STEP_BUMP if step == 60 else 0.0
    for i in range(KEYS):
        value = got["tensors"][f"param/{key(i)}"]
        assert value.shape == (KEY_ELEMENTS,)
        assert (value == np.float32(i + bump)).all(), f"{path.name}: {key(i)} not at step {step}"
    return step


async def server_state(address: str, sample: bool = False) -> tuple[int, list[int]]:
    """The served step and the keys whose values are not at that step's value; every key,
    or (``sample``) the first, middle and last key only."""
    indices = [0, KEYS // 2, KEYS - 1] if sample else list(range(KEYS))
    async with grpc.aio.insecure_channel(address) as ch:
        got = await raw.pull(pb_grpc.ParameterServerStub(ch), ["step", *map(key, indices)])
    step = int(got["step"])
    bump = STEP_BUMP if step == 60 else 0.0
    wrong = [i for i in indices if not (got[key(i)] == np.float32(i + bump)).all()]
    return step, wrong


def _dir_bytes(directory: Path) -> int:
    """Bytes of the files in ``directory`` (safetensors writes a hidden temporary file there
    and renames it when complete); 0 once the directory is gone."""
    total = 0
    try:
        for f in directory.iterdir():
            try:
                total += f.stat().st_size
            except FileNotFoundError:  # renamed or removed meanwhile
                pass
    except FileNotFoundError:
        return 0
    return total


async def kill_at_first_sight_of_checkpoint(server: ServerProcess, ckpt: Path) -> float:
    """Ask for a checkpoint and SIGKILL the server from outside as soon as its temporary
    directory appears (wherever the write then is). Returns the fill level reached at the kill
    (bytes in the temporary directory over the tensor bytes)."""
    async with grpc.aio.insecure_channel(server.address) as ch:
        call = asyncio.ensure_future(
            pb_grpc.ParameterServerStub(ch).Checkpoint(pb.CheckpointRequest(), timeout=60)
        )
        deadline = time.monotonic() + 30
        while not (tmp := partial_dirs(ckpt)):
            assert time.monotonic() < deadline and not call.done(), "no checkpoint in progress"
            await asyncio.sleep(0.001)
        server.kill()
        size = _dir_bytes(tmp[0])
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    return size / BIG_BYTES


async def checkpoint_and_die(server: ServerProcess, *, via_cli: bool = False) -> None:
    """Ask a server armed with a failpoint for a checkpoint; it dies (SIGKILL) part way and the
    caller is told UNAVAILABLE (RPC) or exit code 1 (``paramserver checkpoint`` CLI)."""
    if via_cli:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "paramserver", "checkpoint", "--server", server.address,
            stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        _, err = await proc.communicate()
        assert proc.returncode == 1 and b"UNAVAILABLE" in err, err
    else:
        async with grpc.aio.insecure_channel(server.address) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await pb_grpc.ParameterServerStub(ch).Checkpoint(pb.CheckpointRequest(), timeout=60)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert await server.wait_exit(timeout_s=30) == -9, server.log()


def committed_steps(ckpt: Path) -> list[int]:
    """The step of every committed checkpoint, each checked whole (see checkpoint_step)."""
    return [checkpoint_step(p) for p in sorted(ckpt.glob("ckpt-*"))]


def partial_dirs(ckpt: Path) -> list[Path]:
    """Temporary (uncommitted) checkpoint directories."""
    return [p for p in ckpt.iterdir() if p.name.startswith(".tmp-")]


@pytest.mark.timeout(600)  # 400 MB written and read ~10 times, 7 server starts: a hang guard
async def test_sigkill_during_checkpoint_restores_c50_or_c60_never_a_mixture(
    tmp_path: Path,
) -> None:
    """Case checkpoint-crash.md: 200 float32 keys of 2 MB (400 MB), ``add`` rule, ``--wal``.
    Step 50: checkpoint C50 committed. One 400 MB push adds 1000 to every key, 10 more steps
    (step 60). C60 is started and the server SIGKILLed part way, at several points: from
    outside as soon as the temporary directory appears, then (a failpoint in the server
    process, ``failpoint_server.py``) with a torn tensor file of ~100 keys' bytes, with the
    tensor file complete but no manifest, with everything fsynced but not renamed, and right
    after the rename. After each kill every committed checkpoint verifies (sha256 recomputed
    here) and holds all of step 50 or all of step 60, never a mixture. Each restart removes
    the temporary directory and serves exactly step 60 (C50 + WAL replay, or C60). Restarting
    without the WAL after the torn write serves C50 itself (every key at its step-50 value,
    step 50); after the kill that followed the rename, it serves all of C60."""
    ckpt = tmp_path / "ckpt"
    args = ("--consistency", "asp", "--checkpoint-dir", str(ckpt), "--keep-checkpoints", "5")
    wal = ("--wal", "--wal-dir", str(tmp_path / "wal"))
    timings: dict[str, float] = {}
    with ServerProcess(tmp_path, *args, *wal, start=False) as server:
        server.start()
        async with (
            grpc.aio.insecure_channel(server.address) as ch,
            connect(server.address, "trainer", rpc_timeout_s=120) as ps,
        ):
            stub = pb_grpc.ParameterServerStub(ch)
            await stub.Init(_init_frames(), timeout=120)
            await ps.init({"step": np.zeros((), np.int64)}, UpdateRule("add"))
            for _ in range(50):
                await ps.push({"step": np.ones((), np.int64)})
                await ps.clock()
            c50 = Path((await stub.Checkpoint(pb.CheckpointRequest(), timeout=120)).path)
            bump = np.full(KEY_ELEMENTS, STEP_BUMP, np.float32)
            await ps.push({key(i): bump for i in range(KEYS)})
            for _ in range(10):
                await ps.push({"step": np.ones((), np.int64)})
                await ps.clock()
        assert committed_steps(ckpt) == [50]
        assert c50.name == "ckpt-00000001"

        reached = await kill_at_first_sight_of_checkpoint(server, ckpt)
        assert committed_steps(ckpt) == [50]
        for point in ("tensors:0.5", "manifest", "rename", "committed"):
            restart_s = await server.astart(failpoint=point)  # armed for its next checkpoint
            timings[f"restart_s[{len(timings)}]"] = restart_s
            assert not partial_dirs(ckpt)
            # Every key after the first kill; a sample (and the log) after the later ones.
            served = await server_state(server.address, sample=point != "tensors:0.5")
            assert served == (60, [])
            assert "restored checkpoint ckpt-00000001" in server.last_log()
            await checkpoint_and_die(server, via_cli=point == "manifest")
            steps = committed_steps(ckpt)
            assert steps == ([50, 60] if point == "committed" else [50]), (point, steps)
            if point == "tensors:0.5":
                torn = partial_dirs(ckpt)
                assert len(torn) == 1 and 0.45 < _dir_bytes(torn[0]) / BIG_BYTES < 0.55
                server.args = args  # without the WAL: C50 alone is served
                await server.astart()
                assert not partial_dirs(ckpt)
                assert await server_state(server.address) == (50, [])
                server.kill()
                server.args = (*args, *wal)
        server.args = args  # without the WAL: C60 alone is served
        timings["restart_from_c60_s"] = await server.astart()
        assert await server_state(server.address) == (60, [])
        assert server.log().count("removing partial checkpoint") >= 4
    report("SIGKILL during a 400 MB checkpoint", first_sight_kill_fill=reached, **timings)


@pytest.mark.parametrize("consistency", ["asp", "bsp"])
async def test_checkpoint_while_pushes_continue_is_one_cut(
    tmp_path: Path, consistency: str
) -> None:
    """Case checkpoint-crash.md, last sentence: 16 float32 keys of 256 KiB, ``add`` rule; two
    workers keep pushing +1 to every key in one push (BSP: and clocking, so a step adds 1 to
    every key) while 5 checkpoints are taken (RPC, and once ``paramserver checkpoint``). In
    every committed checkpoint all elements of all keys hold the same count c (no key from a
    later push or step beside keys from an earlier one), and c is the manifest's applied
    updates (ASP) or its BSP step."""
    keys, elements = 16, 64 * 1024
    ckpt = tmp_path / "ckpt"
    args = ("--consistency", consistency, "--checkpoint-dir", str(ckpt), "--keep-checkpoints", "9")
    with ServerProcess(tmp_path, *args, start=False) as server:
        server.start()
        async with (
            connect(server.address, "a") as a,
            connect(server.address, "b") as b,
            grpc.aio.insecure_channel(server.address) as ch,
        ):
            zeros = {f"c{i:02d}": np.zeros(elements, np.float32) for i in range(keys)}
            await a.init(zeros, UpdateRule("add"))
            ones = {k: np.ones(elements, np.float32) for k in zeros}
            stop = asyncio.Event()

            async def pusher(ps: Any) -> int:
                n = 0
                while not stop.is_set():
                    if consistency == "bsp":
                        await ps.pull(list(ones)[:1])
                    await ps.push(ones)
                    await ps.clock()
                    n += 1
                return n

            pushers = [asyncio.ensure_future(pusher(ps)) for ps in (a, b)]
            paths = []
            for i in range(5):
                if i == 2:
                    proc = await asyncio.create_subprocess_exec(
                        sys.executable, "-m", "paramserver", "checkpoint", "--server",
                        server.address, stdout=asyncio.subprocess.PIPE,
                    )  # fmt: skip
                    out, _ = await proc.communicate()
                    assert proc.returncode == 0
                    paths.append(Path(json.loads(out)["path"]))
                else:
                    stub = pb_grpc.ParameterServerStub(ch)
                    resp = await stub.Checkpoint(pb.CheckpointRequest(), timeout=60)
                    paths.append(Path(resp.path))
            stop.set()
            pushed = sum(await asyncio.gather(*pushers))
    counts = []
    for path in paths:
        got = verify_checkpoint(path)
        params = [got["tensors"][f"param/{k}"] for k in zeros]
        c = float(params[0][0])
        assert all((p == c).all() for p in params), f"{path.name} is not one cut"
        m = got["manifest"]
        assert c == (m["applied_updates"] if consistency == "asp" else m["bsp_step"]), path.name
        counts.append(c)
    assert counts == sorted(counts) and counts[-1] > 0
    assert pushed > 0
