"""paramserver.protocol.shm without sockets: segment layout, slot validation, nonce check, sweeping.

Segments are made in a temporary directory (standing in for /dev/shm), so nothing here touches
the real one.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from paramserver.errors import InvalidArgument
from paramserver.protocol import shm

pytestmark = pytest.mark.timeout(30)


def test_client_and_server_share_bytes_and_the_file_goes(tmp_path: Path) -> None:
    seg = shm.ClientSegment.create(1000, 3000, tmp_path)
    # one exchange region for both directions, as large as the larger (64-byte multiples)
    assert seg.push.size_bytes == seg.pull.size_bytes == 3008
    assert seg.push.offset_bytes == seg.pull.offset_bytes == shm.HEADER_BYTES
    assert seg.size_bytes == shm.HEADER_BYTES + 3008
    assert os.listdir(tmp_path) == [seg.name] and seg.name.startswith(f"paramserver-{os.getpid()}-")
    mapping = shm.ServerMapping.attach(seg.offer(), tmp_path)
    assert os.listdir(tmp_path) == []  # unlinked by the server once mapped
    values = np.arange(12, dtype=np.float64).reshape(3, 4)
    seg.push.view(64, 96, np.dtype(np.float64), (3, 4))[...] = values
    np.testing.assert_array_equal(mapping.push.view(64, 96, np.dtype(np.float64), (3, 4)), values)
    mapping.pull.view(0, 8, np.dtype(np.int64), ())[...] = -7
    assert int(seg.pull.view(0, 8, np.dtype(np.int64), ())) == -7
    seg.close()  # the file is already gone: fine
    mapping.close()


@pytest.mark.parametrize(
    ("offset", "size", "shape", "what"),
    [
        (1024, 8, (2,), "outside"),  # starts at the region's end
        (1020, 8, (2,), "outside"),  # straddles the end
        ((1 << 64) - 4, 8, (2,), "outside"),  # would wrap in C
        (0, 12, (2,), "size_bytes 12"),  # size disagrees with the shape
        (0, 8, (-2,), "negative"),
    ],
)
def test_slots_are_checked_before_a_view_is_made(
    tmp_path: Path, offset: int, size: int, shape: tuple[int, ...], what: str
) -> None:
    seg = shm.ClientSegment.create(1024, 1024, tmp_path)
    try:
        with pytest.raises(InvalidArgument, match=what):
            seg.push.view(offset, size, np.dtype(np.float32), shape)
        # the largest slot that fits, and a zero-size one at the very end, are fine
        assert seg.push.view(0, 1024, np.dtype(np.float32), (256,)).shape == (256,)
        assert seg.push.view(1024, 0, np.dtype(np.float32), (0,)).shape == (0,)
    finally:
        seg.close()


def test_declined_offers_name_the_reason(tmp_path: Path) -> None:
    seg = shm.ClientSegment.create(1024, 1024, tmp_path)
    try:
        bad_nonce = seg.offer()
        bad_nonce.nonce = bytes(16)
        with pytest.raises(shm.ShmDeclined, match="nonce mismatch"):
            shm.ServerMapping.attach(bad_nonce, tmp_path)
        assert os.listdir(tmp_path) == [seg.name]  # a mismatch never unlinks
        with pytest.raises(shm.ShmDeclined, match="cannot open"):
            shm.ServerMapping.attach(seg.offer(), tmp_path / "elsewhere")
        escape = seg.offer()
        escape.name = "../etc/passwd"
        with pytest.raises(shm.ShmDeclined, match="is not paramserver"):
            shm.ServerMapping.attach(escape, tmp_path)
        overlap = seg.offer()
        overlap.pull_offset_bytes = overlap.push_offset_bytes + 8
        with pytest.raises(shm.ShmDeclined, match="overlap"):
            shm.ServerMapping.attach(overlap, tmp_path)
        too_big = seg.offer()
        too_big.pull_size_bytes += 64
        with pytest.raises(shm.ShmDeclined, match=r"overlap|pass"):
            shm.ServerMapping.attach(too_big, tmp_path)
        wrong_size = seg.offer()
        wrong_size.size_bytes += 64
        wrong_size.push_size_bytes += 64
        wrong_size.pull_size_bytes += 64
        with pytest.raises(shm.ShmDeclined, match="regular file of"):
            shm.ServerMapping.attach(wrong_size, tmp_path)
    finally:
        seg.close()
    assert os.listdir(tmp_path) == []


def test_sweep_removes_only_segments_of_dead_processes(tmp_path: Path) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    dead_pid = int(dead.stdout)
    live_pid = os.getppid()
    names = {
        f"paramserver-{dead_pid}-0123456789abcdef": False,
        f"paramserver-{live_pid}-0123456789abcdef": True,
        f"paramserver-{os.getpid()}-0123456789abcdef": True,
        "paramserver-not-ours": True,
        "other-file": True,
    }
    for name in names:
        (tmp_path / name).write_bytes(b"")
    removed = shm.sweep_dead(tmp_path)
    assert removed == [f"paramserver-{dead_pid}-0123456789abcdef"]
    assert sorted(os.listdir(tmp_path)) == sorted(n for n, keep in names.items() if keep)


def _dead_pid() -> int:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    return int(dead.stdout)


def test_owned_segment_is_shared_by_name_and_unlinked_by_its_owner(tmp_path: Path) -> None:
    owner = shm.OwnedSegment.create(10_000, "g2", tmp_path)
    assert owner.name.startswith(f"paramserver-g2-{os.getpid()}-")
    assert owner.size_bytes == 10_000
    owner.buf[100:104] = b"abcd"
    peer = shm.MappedSegment.attach(owner.name, 10_000, tmp_path)
    assert bytes(peer.buf[100:104]) == b"abcd"
    peer.buf[200:202] = b"xy"  # the same memory
    assert bytes(owner.buf[200:202]) == b"xy"
    peer.close()
    peer.close()
    assert (tmp_path / owner.name).exists()  # a peer never unlinks
    assert shm.sweep_dead(tmp_path) == []  # a live owner's segment stays
    owner.close()
    owner.close()
    assert os.listdir(tmp_path) == []
    with pytest.raises(FileNotFoundError):
        shm.MappedSegment.attach(owner.name, 1, tmp_path)


def test_attach_checks_the_name_and_the_size(tmp_path: Path) -> None:
    owner = shm.OwnedSegment.create(4096, "g2", tmp_path)
    try:
        with pytest.raises(ValueError, match="4096 < 4097 bytes"):
            shm.MappedSegment.attach(owner.name, 4097, tmp_path)
        for bad in ("../x", f"paramserver-{os.getpid()}-0123456789abcdef", "paramserver-g2-x"):
            with pytest.raises(ValueError, match="not a segment name"):
                shm.MappedSegment.attach(bad, 1, tmp_path)
        with pytest.raises(ValueError, match="lower-case word"):
            shm.OwnedSegment.create(1, "G2/..", tmp_path)
    finally:
        owner.close()


def test_sweep_keeps_a_dead_pids_segment_while_its_lock_is_held(tmp_path: Path) -> None:
    """An owner in another pid namespace looks dead by pid; its lock keeps its segment."""
    path = tmp_path / f"paramserver-g2-{_dead_pid()}-0123456789abcdef"
    path.write_bytes(b"\0" * 64)
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        assert shm.sweep_dead(tmp_path) == []
        assert path.exists()
    finally:
        os.close(fd)
    assert shm.sweep_dead(tmp_path) == [path.name]
    assert not path.exists()
