"""Unit tests of the SPMD tier pools (G2 shared memory, G3 file) and the G4 object store.

No sockets and no event loop; a few tests use a helper process (shared memory seen from another
process, a writer killed mid-put).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from paramserver.cli.demos.rank_launcher import wait_for
from paramserver.spmd.faults import Faults
from paramserver.spmd.layout import Layout
from paramserver.spmd.objects import FilesystemObjectStore
from paramserver.spmd.planning import coalesce_runs
from paramserver.spmd.pools import (
    CopyCancelled,
    DiskPool,
    HostPool,
    attach_peer_segment,
    copy_blocks,
    make_device_pool,
)
from paramserver.spmd.transfer_errors import ObjectNotFound, TierNotRegistered
from tests.harness import ScriptProcess

LAYOUT = Layout(num_blocks=16, num_layers=2, outer_dim=2, page_size=8, inner_dim=64)
BPB = LAYOUT.bytes_per_block  # 4096


def _pattern(block: int, salt: int = 0) -> bytes:
    return bytes((block * 31 + salt + i) % 251 for i in range(BPB))


@pytest.fixture
def host() -> HostPool:
    pool = HostPool(LAYOUT)
    yield pool  # type: ignore[misc]
    pool.close()


@pytest.fixture
def disk(tmp_path: Path) -> DiskPool:
    pool = DiskPool(LAYOUT, tmp_path, stem="t", faults=Faults())
    yield pool  # type: ignore[misc]
    pool.close()


def test_host_pool_array_view_and_bytes(host: HostPool) -> None:
    assert host.array.shape == (16, 2, 2, 8, 64)
    assert host.array.dtype == np.float16
    host.write_bytes(3 * BPB, memoryview(_pattern(3)))
    assert host.read_block(3) == _pattern(3)
    assert host.array[3].tobytes() == _pattern(3)
    assert host.valid.shape == (16,) and not host.valid.any()


def test_host_pool_close_unlinks_the_segment() -> None:
    pool = HostPool(LAYOUT)
    path = Path("/dev/shm") / pool.name
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm on this platform")
    assert path.exists()
    pool.close()
    pool.close()
    assert not path.exists()


@pytest.mark.timeout(60)
def test_peer_process_maps_the_segment_without_unlinking_it(host: HostPool) -> None:
    """A same-host peer copies without the network; its exit must not unlink our segment."""
    host.write_bytes(5 * BPB, memoryview(_pattern(5, 7)))
    code = (
        "import sys, hashlib\n"
        "from paramserver.spmd.pools import attach_peer_segment\n"
        f"seg = attach_peer_segment({host.name!r}, {LAYOUT.total_bytes})\n"
        f"print(hashlib.sha256(bytes(seg.buf[{5 * BPB}:{6 * BPB}])).hexdigest())\n"
        f"seg.buf[{6 * BPB}:{6 * BPB + 4}] = b'peer'\n"
        "seg.close()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    import hashlib

    assert out.stdout.strip() == hashlib.sha256(_pattern(5, 7)).hexdigest()
    assert host.read_block(6)[:4] == b"peer"
    # still attachable after the peer process exited (its resource tracker did not unlink it)
    seg = attach_peer_segment(host.name, LAYOUT.total_bytes)
    seg.close()


def test_attach_missing_segment_fails() -> None:
    with pytest.raises(FileNotFoundError):
        attach_peer_segment("paramserver-g2-1-0123456789abcdef", 10)
    with pytest.raises(ValueError, match="not a segment name"):
        attach_peer_segment("../etc/passwd", 10)


def test_peer_refuses_a_segment_smaller_than_the_layout(host: HostPool) -> None:
    with pytest.raises(ValueError, match=f"< {LAYOUT.total_bytes + 1} bytes"):
        attach_peer_segment(host.name, LAYOUT.total_bytes + 1)


def test_host_pool_segment_is_named_for_its_owner_and_sweeps_dead_owners(tmp_path: Path) -> None:
    """A G2 pool's file names its pid (the sweep's first test) and a new pool removes the file
    of a dead owner, but not that of a live one."""
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    stale = tmp_path / f"paramserver-g2-{int(dead.stdout)}-0123456789abcdef"
    stale.write_bytes(b"\0" * 64)
    first = HostPool(LAYOUT, directory=tmp_path)
    try:
        assert first.name.startswith(f"paramserver-g2-{os.getpid()}-")
        assert not stale.exists()
        second = HostPool(LAYOUT, directory=tmp_path)
        second.close()
        assert sorted(os.listdir(tmp_path)) == [first.name]
    finally:
        first.close()
    assert os.listdir(tmp_path) == []


def test_disk_pool_block_lives_at_id_times_block_bytes(disk: DiskPool) -> None:
    disk.write_bytes(9 * BPB, memoryview(_pattern(9)))
    raw = disk.path.read_bytes()
    assert len(raw) == LAYOUT.total_bytes
    assert raw[9 * BPB : 10 * BPB] == _pattern(9)
    assert disk.read_block(9) == _pattern(9)
    assert disk.spec_extras() == {"path": str(disk.path)}


def test_disk_pool_close_removes_the_file(tmp_path: Path) -> None:
    pool = DiskPool(LAYOUT, tmp_path, stem="x", faults=Faults())
    assert pool.path.exists()
    pool.close()
    pool.close()
    assert not pool.path.exists()


def test_disk_write_fault_injection(tmp_path: Path) -> None:
    pool = DiskPool(LAYOUT, tmp_path, stem="f", faults=Faults(disk_write_error=True))
    try:
        with pytest.raises(OSError, match="injected"):
            pool.write_bytes(0, memoryview(b"x" * 10))
    finally:
        pool.close()


@pytest.mark.parametrize(
    ("src_ids", "dst_ids"),
    [
        ([0, 1, 2, 3], [8, 9, 10, 11]),
        ([3, 2, 1, 0], [0, 1, 2, 3]),
        ([0, 5, 6, 15], [15, 1, 2, 0]),
        ([], []),
    ],
)
def test_copy_blocks_host_disk_round_trip(
    host: HostPool, disk: DiskPool, src_ids: list[int], dst_ids: list[int]
) -> None:
    for b in range(16):
        host.write_bytes(b * BPB, memoryview(_pattern(b)))
    moved = copy_blocks(host, disk, coalesce_runs(src_ids, dst_ids))
    assert moved == len(src_ids) * BPB
    for s, d in zip(src_ids, dst_ids, strict=True):
        assert disk.read_block(d) == _pattern(s)
    # disk -> host into other slots (bounce-free preadv into shared memory)
    back = [(d, s) for s, d in zip(src_ids, dst_ids, strict=True)]
    other = HostPool(LAYOUT)
    try:
        copy_blocks(disk, other, coalesce_runs([b[0] for b in back], [b[1] for b in back]))
        for s in src_ids:
            assert other.read_block(s) == _pattern(s)
    finally:
        other.close()


def test_copy_blocks_disk_to_disk_uses_a_bounce_buffer(tmp_path: Path) -> None:
    a = DiskPool(LAYOUT, tmp_path, stem="a", faults=Faults())
    b = DiskPool(LAYOUT, tmp_path, stem="b", faults=Faults())
    try:
        a.write_bytes(2 * BPB, memoryview(_pattern(2)))
        copy_blocks(a, b, coalesce_runs([2], [4]))
        assert b.read_block(4) == _pattern(2)
    finally:
        a.close()
        b.close()


def test_copy_blocks_stops_when_cancelled(host: HostPool, disk: DiskPool) -> None:
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(CopyCancelled):
        copy_blocks(host, disk, coalesce_runs([0], [0]), cancel=cancel)


def test_copy_blocks_refuses_different_block_sizes(host: HostPool, tmp_path: Path) -> None:
    other = DiskPool(
        LAYOUT.with_blocks(4).__class__(4, 1, 1, 1, 1), tmp_path, stem="o", faults=Faults()
    )
    try:
        with pytest.raises(ValueError):
            copy_blocks(host, other, coalesce_runs([0], [0]))
    finally:
        other.close()


def test_g1_is_not_registered_without_a_gpu() -> None:
    try:
        import torch

        if torch.cuda.is_available():
            pytest.skip("a GPU is present: G1 registers")
    except ImportError:
        pass
    with pytest.raises(TierNotRegistered, match="G1 not registered"):
        make_device_pool(LAYOUT)


def test_rank_server_refuses_g1_blocks_without_a_gpu(tmp_path: Path) -> None:
    from paramserver.spmd.rank_server import RankServerConfig, RankServicer

    try:
        import torch

        if torch.cuda.is_available():
            pytest.skip("a GPU is present: G1 registers")
    except ImportError:
        pass
    config = RankServerConfig(
        "g1", 0, device_blocks=4, disk_dir=tmp_path / "d", object_dir=tmp_path / "o"
    )
    with pytest.raises(TierNotRegistered, match="G1 not registered"):
        RankServicer.create(config)


# --------------------------------------------------------------------------- object store


def test_object_store_put_get_and_already_present(tmp_path: Path) -> None:
    store = FilesystemObjectStore(tmp_path)
    key = "0/00000000000000ab"
    assert store.size(key) is None and not store.has(key)
    with pytest.raises(ObjectNotFound):
        store.get(key)
    assert store.put(key, b"hello") is True
    assert store.put(key, b"other") is False  # first commit wins, never replaced
    assert store.get(key) == b"hello"
    assert store.size(key) == 5
    assert (tmp_path / "0" / "00000000000000ab").read_bytes() == b"hello"
    assert list((tmp_path / ".tmp").iterdir()) == []
    assert store.writes_in_progress == 0


@pytest.mark.parametrize("key", ["0/abc", "../x/00000000000000ab", "0/00000000000000AB", "x/0"])
def test_object_store_rejects_malformed_keys(tmp_path: Path, key: str) -> None:
    store = FilesystemObjectStore(tmp_path)
    with pytest.raises(ValueError):
        store.put(key, b"x")


def test_object_store_abort_leaves_nothing(tmp_path: Path) -> None:
    store = FilesystemObjectStore(tmp_path)
    writer = store.begin_put("1/0000000000000001")
    writer.write(b"partial")
    assert store.writes_in_progress == 1
    assert not store.has("1/0000000000000001")
    writer.abort()
    writer.abort()
    assert store.writes_in_progress == 0
    assert not store.has("1/0000000000000001")
    assert list((tmp_path / ".tmp").iterdir()) == []


@pytest.mark.timeout(60)
def test_concurrent_puts_first_commit_wins_and_readers_never_see_parts(tmp_path: Path) -> None:
    """Case concurrent-object-puts.md at the store level: 8 writer threads, one reader."""
    store = FilesystemObjectStore(tmp_path, durable=False)
    key = "0/0000000000000042"
    value = np.random.default_rng(0).integers(0, 256, 4 << 20, dtype=np.uint8).tobytes()
    start = threading.Barrier(9)
    outcomes: list[bool] = []
    seen: list[int] = []
    stop = threading.Event()

    def writer() -> None:
        start.wait()
        w = store.begin_put(key)
        for pos in range(0, len(value), 1 << 20):
            w.write(value[pos : pos + (1 << 20)])
        outcomes.append(w.commit())

    def reader() -> None:
        start.wait()
        while not stop.is_set():
            size = store.size(key)
            if size is not None:
                assert size == len(value)
                assert store.get(key) == value
            seen.append(-1 if size is None else size)

    threads = [threading.Thread(target=writer) for _ in range(8)]
    r = threading.Thread(target=reader)
    for t in [*threads, r]:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    r.join()
    assert sorted(outcomes) == [False] * 7 + [True]
    assert store.get(key) == value
    # presence is monotone: absent ... absent, present ... present
    first = next((i for i, s in enumerate(seen) if s >= 0), len(seen))
    assert all(s >= 0 for s in seen[first:])


@pytest.mark.timeout(60)
def test_killed_writer_leaves_nothing_visible(tmp_path: Path) -> None:
    code = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from paramserver.spmd.objects import FilesystemObjectStore\n"
        f"store = FilesystemObjectStore(Path({str(tmp_path)!r}))\n"
        "w = store.begin_put('0/00000000000000ff')\n"
        "w.write(b'x' * (1 << 20))\n"
        "print('writing', flush=True)\n"
        "time.sleep(60)\n"
    )
    logs = tmp_path.parent / f"{tmp_path.name}-logs"  # outside the store's directory
    logs.mkdir()
    with ScriptProcess(logs, "writer", ["-c", code]) as writer:
        assert writer.proc.stdout is not None
        assert writer.proc.stdout.readline().strip() == "writing", writer.stderr()
        temp = tmp_path / ".tmp"
        wait_for(lambda: list(temp.glob("*.part")), timeout_s=10, what="temp file")
        writer.kill()  # SIGKILL mid-write
    store = FilesystemObjectStore(tmp_path)
    assert not store.has("0/00000000000000ff")
    assert store.sweep_temp(older_than_s=0) == 1
    assert list((tmp_path / ".tmp").iterdir()) == []


def test_a_g2_pool_too_large_for_shared_memory_is_refused_up_front(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The segment's memory is reserved at creation (posix_fallocate), so a full /dev/shm is a
    clear RESOURCE_EXHAUSTED at start, never a SIGBUS on a later copy; nothing is left."""
    import errno

    from paramserver.errors import ResourceExhausted

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(ResourceExhausted, match="--host-blocks") as info:
        HostPool(LAYOUT, directory=tmp_path)
    assert str(LAYOUT.total_bytes) in info.value.message
    assert os.listdir(tmp_path) == []


def test_stream_chunk_of_a_host_pool_is_the_concatenation_of_its_blocks(host: HostPool) -> None:
    """A ReadBlocks chunk joined straight out of the segment (permuted ids, contiguous runs
    merged, chunk edges inside blocks) equals the numpy concatenation of the blocks."""
    from paramserver.spmd.rank_server.transfer import _join_pieces

    rng = np.random.default_rng(7)
    content = rng.integers(0, 256, size=(LAYOUT.num_blocks, BPB), dtype=np.uint8)
    host.write_bytes(0, memoryview(content.tobytes()))
    ids = [3, 4, 5, 9, 0, 1, 15, 14]
    stream = content[ids].reshape(-1)
    for offset, length in [(0, len(stream)), (BPB // 2, 3 * BPB), (5 * BPB - 7, 2 * BPB + 7)]:
        got = _join_pieces(host, ids, offset, length, threading.Event())
        assert got == stream[offset : offset + length].tobytes()
    cancelled = threading.Event()
    cancelled.set()
    with pytest.raises(CopyCancelled):
        _join_pieces(host, ids, 0, BPB, cancelled)
