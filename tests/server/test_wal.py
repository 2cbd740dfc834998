"""Write-ahead log: framing, torn tails, rotation/truncation, and replay = the original state."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from paramserver.api.v1 import wal_pb2 as wal_pb
from paramserver.core.optimizers import UpdateRule
from paramserver.core.shard import ServerCore
from paramserver.server import wal_records
from paramserver.server.checkpoint import CheckpointManager
from paramserver.server.config import ServerConfig
from paramserver.server.wal import WalError, WriteAheadLog
from paramserver.server.wal_records import replay_into, tensors_from_wal, tensors_to_wal


def _clock_record(wid: str, clock: int) -> wal_pb.WalRecord:
    return wal_records.clock(wid, clock)


def test_tensors_round_trip_bit_exact() -> None:
    import ml_dtypes

    src = {
        "a": np.array([0x7FC00001, 0x80000000], np.uint32).view(np.float32),
        "b": np.zeros((3, 0, 5), np.float64),
        "c": np.array(7.5, np.float32),
        "d": np.array([1.5, -2.0], ml_dtypes.bfloat16),
        "e": np.arange(6, dtype=">i8").reshape(2, 3),
    }
    back = tensors_from_wal(tensors_to_wal(src))
    for k, v in src.items():
        assert back[k].shape == v.shape
        assert (
            back[k].tobytes() == np.ascontiguousarray(v.astype(v.dtype.newbyteorder("<"))).tobytes()
        )


def test_append_replay_and_torn_tail(tmp_path: Path) -> None:
    wal = WriteAheadLog(tmp_path)
    assert wal.open() == 0
    for i in range(5):
        assert wal.append(_clock_record("w#1", i)) == i + 1
    asyncio.run(wal.close())
    seg = wal.segments()[-1]
    size = seg.stat().st_size
    with open(seg, "ab") as fh:  # a crash mid-append: header and half a payload
        fh.write(b"\x40\x00\x00\x00\x12\x34\x56\x78partial")
    again = WriteAheadLog(tmp_path)
    assert again.open() == 5
    assert seg.stat().st_size == size  # the torn tail was cut off
    assert [r.clock.clock for r in again.replay()] == [0, 1, 2, 3, 4]
    assert [r.sequence for r in again.replay(after_sequence=3)] == [4, 5]
    assert again.append(_clock_record("w#1", 5)) == 6
    asyncio.run(again.close())


def test_corrupt_record_stops_replay_there(tmp_path: Path) -> None:
    wal = WriteAheadLog(tmp_path)
    wal.open()
    for i in range(3):
        wal.append(_clock_record("w#1", i))
    asyncio.run(wal.close())
    seg = wal.segments()[-1]
    blob = bytearray(seg.read_bytes())
    blob[-2] ^= 0xFF  # flip a bit inside the last record's payload
    seg.write_bytes(bytes(blob))
    assert [r.sequence for r in WriteAheadLog(tmp_path).replay()] == [1, 2]


def test_rotate_and_truncate(tmp_path: Path) -> None:
    wal = WriteAheadLog(tmp_path)
    wal.open()
    for i in range(3):
        wal.append(_clock_record("w#1", i))
    upto = wal.rotate()
    assert upto == 3
    wal.append(_clock_record("w#1", 3))
    assert len(wal.segments()) == 2
    assert wal.truncate_through(upto) == 1
    assert [r.sequence for r in wal.replay()] == [4]
    asyncio.run(wal.close())


def test_group_commit_releases_every_waiter(tmp_path: Path) -> None:
    async def main() -> int:
        wal = WriteAheadLog(tmp_path, fsync_interval_ms=5)
        wal.open()
        seqs = [wal.append(_clock_record("w#1", i)) for i in range(50)]
        await asyncio.wait_for(asyncio.gather(*(wal.durable(s) for s in seqs)), 10)
        fsyncs = wal.fsyncs
        await wal.close()
        return fsyncs

    assert 1 <= asyncio.run(main()) <= 3  # 50 records, one batched fsync (a few at most)


@pytest.mark.parametrize("consistency", ["bsp", "ssp", "asp"])
def test_checkpoint_plus_replay_reproduces_the_state(tmp_path: Path, consistency: str) -> None:
    """A single-process oracle: the same mutations applied directly vs checkpoint + WAL replay."""
    cfg = ServerConfig(consistency=consistency, staleness=1)
    live = ServerCore(cfg)
    wal = WriteAheadLog(tmp_path / "wal")
    wal.open()
    ckpts = CheckpointManager(tmp_path / "ckpt")
    rng = np.random.default_rng(3)

    def log(record: wal_pb.WalRecord) -> None:
        wal.append(record)

    init = {"w": rng.normal(size=(4, 3)), "b": np.zeros(3, np.float32)}
    live.init(init, UpdateRule("adam", lr=0.01))
    log(wal_records.init(UpdateRule("adam", lr=0.01), init))
    ids = []
    for name in ("a", "b"):
        rec = live.register(name, 0.0, client_nonce=f"n-{name}")
        ids.append(rec.worker_id)
        log(wal_records.register(name, False, f"n-{name}", rec.worker_id))
    checkpoint_at = 3
    for step in range(6):
        if step == checkpoint_at:
            seq = wal.rotate()
            ckpts.save(live, wal_sequence=seq)
            wal.truncate_through(seq)
        for i, wid in enumerate(ids):
            grads = {"w": rng.normal(size=(4, 3)), "b": rng.normal(size=3).astype(np.float32)}
            rid = 1000 * step + i
            live.push(wid, rid, step, grads, 0.0, num_samples=1 + i)
            log(wal_records.push(wid, rid, step, 1 + i, None, grads))
            live.clock(wid, step)
            log(_clock_record(wid, step))
    asyncio.run(wal.close())

    recovered = ServerCore(cfg)
    restored = ckpts.restore_latest(recovered)
    assert restored is not None
    manifest_seq = ckpts.last_restored_wal_sequence
    replayed = replay_into(recovered, WriteAheadLog(tmp_path / "wal").replay(manifest_seq), now=0.0)
    assert replayed == 3 * 2 * 2  # 3 steps x 2 workers x (push + clock) after the checkpoint
    for key in ("w", "b"):
        assert recovered.store.get(key).value.tobytes() == live.store.get(key).value.tobytes()
        for name, arr in live.store.get(key).state.items():
            assert recovered.store.get(key).state[name].tobytes() == arr.tobytes()
    assert recovered.applied_updates == live.applied_updates
    assert recovered.bsp_step == live.bsp_step
    # a retry of an acknowledged push is a duplicate after recovery
    assert recovered.push(ids[0], 5000, 6, {"b": np.ones(3, np.float32)}, 0.0).duplicate


def test_replay_mismatch_is_reported(tmp_path: Path) -> None:
    core = ServerCore(ServerConfig(consistency="asp"))
    bad = wal_records.clock("ghost#9", 0)
    bad.sequence = 1
    with pytest.raises(WalError, match="ghost"):
        replay_into(core, iter([bad]), now=0.0)


def test_a_rotation_during_an_inflight_group_fsync_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint rotates the log (closing the segment's descriptor) while the flusher's
    fsync of that segment runs in a worker thread: the fsync must still cover the records it
    was for, never fail with EBADF (which stopped the server taking mutations) nor sync some
    other file that reused the descriptor number."""
    import os
    import threading

    real_fsync = os.fsync
    in_thread, release = threading.Event(), threading.Event()
    main = threading.get_ident()

    synced: list[int] = []  # inode of each file the flusher's fsyncs reached

    def gated_fsync(fd: int) -> None:
        if threading.get_ident() != main:  # the flusher's fsync, off the event loop
            in_thread.set()
            assert release.wait(30), "the test never released the fsync"
            synced.append(os.fstat(fd).st_ino)  # EBADF here if the descriptor was closed
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", gated_fsync)

    async def body() -> None:
        wal = WriteAheadLog(tmp_path)
        wal.open()
        seq = wal.append(_clock_record("w#1", 1))
        durable = asyncio.ensure_future(wal.durable(seq))
        assert await asyncio.to_thread(in_thread.wait, 30)  # the fsync is in flight
        first_segment = os.stat(wal.segments()[-1]).st_ino
        last = wal.rotate()  # the checkpoint's cut: the old segment's descriptor is closed
        assert last == seq
        # a descriptor opened now may take the closed one's number
        spare = os.open(tmp_path / "other-file", os.O_WRONLY | os.O_CREAT, 0o644)
        release.set()
        await asyncio.wait_for(durable, 30)
        os.close(spare)
        assert wal.failed is None
        assert synced[0] == first_segment  # the segment holding the record, not a namesake
        seq2 = wal.append(_clock_record("w#1", 2))  # still taking mutations
        await asyncio.wait_for(wal.durable(seq2), 30)
        await wal.close()

    asyncio.run(body())
    again = WriteAheadLog(tmp_path)
    again.open()
    assert [r.clock.clock for r in again.replay()] == [1, 2]


def test_records_found_on_open_are_durable_at_once(tmp_path: Path) -> None:
    """A retry of a request logged before a restart is answered as soon as it is found a
    duplicate: the reopened log counts what it holds as durable (it fsyncs its open segment)."""
    wal = WriteAheadLog(tmp_path, fsync_interval_ms=5)
    wal.open()
    for step in range(3):
        wal.append(_clock_record("w#1", step))
    asyncio.run(wal.close())
    reopened = WriteAheadLog(tmp_path, fsync_interval_ms=5)
    assert reopened.open() == 3

    async def durable() -> None:
        await asyncio.wait_for(reopened.durable(3), timeout=5)

    asyncio.run(durable())
    asyncio.run(reopened.close())
