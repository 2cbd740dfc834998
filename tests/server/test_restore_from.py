"""``paramserver serve --restore-from``: checkpoint + write-ahead log, through real processes.

An old server (or 2-shard cluster) acknowledges pushes with ``--wal`` on, in the layout the Ray
launcher and the chart use (``<state>/checkpoints`` + ``<state>/wal``), and is SIGKILLed; a new
server on empty directories starts with ``--restore-from`` pointing at that state and must hold
every acknowledged update. Expected values are closed forms: SGD with lr 1 from zeros gives
``w = -(sum of the pushed gradients)``, and every gradient is a small integer, so float32 holds
each partial sum exactly.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from paramserver.api.v1 import parameter_server_pb2 as pb
from paramserver.api.v1 import parameter_server_pb2_grpc as pb_grpc
from paramserver.worker_client import UpdateRule, connect
from tests.harness import ServerProcess
from tests.harness import raw_stubs as raw
from tests.harness.processes import free_port

pytestmark = pytest.mark.timeout(120)

SGD1 = UpdateRule("sgd", lr=1.0)
KEYS = ("a", "b", "c", "d")


def grad(key: int, n: int) -> np.ndarray:
    """Push n's gradient of key number ``key``: small integers, exact in float32."""
    return np.arange(6, dtype=np.float32) + np.float32(n % 7 + key)


def state_args(state: Path) -> list[str]:
    return [
        "--checkpoint-dir",
        str(state / "checkpoints"),
        "--wal",
        "--wal-dir",
        str(state / "wal"),
    ]


async def push_acknowledged(address: str, pushes: range) -> None:
    """One acknowledged push per n in ``pushes`` (every key), in order."""
    async with connect(address, "trainer") as ps:
        if pushes.start == 0:
            await ps.init({k: np.zeros(6, np.float32) for k in KEYS}, rule=SGD1)
        for n in pushes:
            await ps.push({k: grad(i, n) for i, k in enumerate(KEYS)})


def expected(total: int) -> dict[str, np.ndarray]:
    return {
        k: -np.sum([grad(i, n) for n in range(total)], axis=0, dtype=np.float32)
        for i, k in enumerate(KEYS)
    }


async def read(address: str) -> dict[str, np.ndarray]:
    async with raw.channel(address) as channel:
        return await raw.pull(pb_grpc.ParameterServerStub(channel), KEYS)


@pytest.mark.parametrize(
    ("checkpoint_after", "source"),
    [
        (None, "state"),  # only a log: the case that failed with "holds no committed checkpoint"
        (12, "checkpoints"),  # a checkpoint, then pushes only the log holds
        (12, "parent"),  # the directory holding shard-0 (a whole Ray state directory)
    ],
)
async def test_restore_from_replays_the_log_after_the_checkpoint(
    tmp_path: Path, checkpoint_after: int | None, source: str
) -> None:
    total = 30
    state = tmp_path / "old" / "shard-0"
    old = ServerProcess(tmp_path, "--consistency", "asp", *state_args(state))
    with old:
        if checkpoint_after is None:
            await push_acknowledged(old.address, range(total))
        else:
            await push_acknowledged(old.address, range(checkpoint_after))
            async with raw.channel(old.address) as channel:
                stub = pb_grpc.ParameterServerStub(channel)
                await stub.Checkpoint(pb.CheckpointRequest(), timeout=30)
            await push_acknowledged(old.address, range(checkpoint_after, total))
        old.kill()  # SIGKILL: no final checkpoint
    ckpts = sorted((state / "checkpoints").glob("ckpt-*"))
    assert len(ckpts) == (0 if checkpoint_after is None else 1)
    assert any((state / "wal").glob("wal-*.log"))

    path = {"state": state, "checkpoints": state / "checkpoints", "parent": state.parent}[source]
    new_state = tmp_path / "new"
    with ServerProcess(
        tmp_path, "--consistency", "asp", *state_args(new_state), "--restore-from", str(path)
    ) as new:
        got = await read(new.address)
        for key, value in expected(total).items():
            np.testing.assert_array_equal(got[key], value, err_msg=key)
        async with raw.channel(new.address) as channel:
            status = await raw.status(pb_grpc.ParameterServerStub(channel))
        assert status.applied_updates == total
        new.kill()
    # The restored state is the new server's own now: it restarts from its own directories.
    with ServerProcess(tmp_path, "--consistency", "asp", *state_args(new_state)) as again:
        got = await read(again.address)
        for key, value in expected(total).items():
            np.testing.assert_array_equal(got[key], value, err_msg=key)


async def test_restore_two_shards_with_only_logs_into_one(tmp_path: Path) -> None:
    """Another shard count: each old shard's log is replayed, then the model is resharded."""
    total = 20
    ports = [free_port(), free_port()]
    addresses = ",".join(f"127.0.0.1:{p}" for p in ports)
    args = [
        [
            *("--consistency", "asp", *state_args(tmp_path / "old" / f"shard-{i}")),
            *("--shard-index", str(i), "--shard-addresses", addresses),
        ]
        for i in range(2)
    ]
    shards = [ServerProcess(tmp_path, *args[i], port=ports[i], start=False) for i in range(2)]
    with shards[0], shards[1]:
        for s in shards:
            s.start()
        await push_acknowledged(shards[0].address, range(total))
        for s in shards:
            s.kill()
    assert not list((tmp_path / "old").glob("shard-*/checkpoints/ckpt-*"))
    with ServerProcess(
        tmp_path,
        "--consistency", "asp", *state_args(tmp_path / "new"),
        "--restore-from", str(tmp_path / "old"),
    ) as new:  # fmt: skip
        got = await read(new.address)
        for key, value in expected(total).items():
            np.testing.assert_array_equal(got[key], value, err_msg=key)


async def test_a_log_with_a_gap_is_refused(tmp_path: Path) -> None:
    """A log whose first records are gone (no checkpoint holds them) is refused, by name."""
    state = tmp_path / "old"
    with ServerProcess(tmp_path, "--consistency", "asp", *state_args(state)) as old:
        await push_acknowledged(old.address, range(3))
        async with raw.channel(old.address) as channel:
            await pb_grpc.ParameterServerStub(channel).Checkpoint(
                pb.CheckpointRequest(), timeout=30
            )
        await push_acknowledged(old.address, range(3, 6))
        old.kill()
    for ckpt in (state / "checkpoints").glob("ckpt-*"):  # the checkpoint is lost
        for f in ckpt.iterdir():
            f.unlink()
        ckpt.rmdir()
    new = ServerProcess(
        tmp_path,
        "--consistency", "asp", *state_args(tmp_path / "new"), "--restore-from", str(state),
        start=False,
    )  # fmt: skip
    with new, pytest.raises(RuntimeError, match="lacks records 1 to"):
        new.start()
