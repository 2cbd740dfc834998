"""The G2 shared-memory segment of a rank server follows the one segment lifecycle of
paramserver.protocol.shm (docs/spmd.md, "G2 shared memory"): the owner holds the file (and a
lock on it) while it lives and unlinks it on a clean stop; a SIGKILLed owner's file outlives it,
its lock released, until the next rank server on the host starts and sweeps it. No resource
tracker and no atexit hook take part."""

from __future__ import annotations

import asyncio
import fcntl
import os
import signal
from pathlib import Path

import pytest

from paramserver.api.v1 import spmd_pb2
from paramserver.cli.demos.rank_launcher import RankServerCluster, RankServerProcess
from paramserver.protocol.shm import SHM_DIR
from paramserver.spmd.layout import Layout
from paramserver.spmd.rank_client import RankClient

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(120),
    pytest.mark.skipif(not SHM_DIR.is_dir(), reason="no /dev/shm on this platform"),
]

LAYOUT = Layout(num_blocks=0, num_layers=1, outer_dim=1, page_size=4, inner_dim=8, dtype="float32")
HOST_BLOCKS = 16


def _g2_segment(proc: RankServerProcess) -> Path:
    """The G2 segment the rank server reports in its metadata (its name embeds its pid)."""

    async def metadata() -> spmd_pb2.RankMetadata:
        async with RankClient(proc.address, proc.rank) as client:
            return await client.export_metadata()

    specs = {s.tier: s for s in asyncio.run(metadata()).layouts}
    name = specs[spmd_pb2.TIER_G2_HOST].shm_name
    assert name.startswith(f"paramserver-g2-{proc.pid}-"), name
    return SHM_DIR / name


def _lock_is_free(fd: int) -> bool:
    """Whether the owner's lock on the open segment ``fd`` is gone (taken and dropped here)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    fcntl.flock(fd, fcntl.LOCK_UN)
    return True


def test_a_sigkilled_rank_servers_segment_is_swept_by_the_next_rank_server(
    tmp_path: Path,
) -> None:
    with RankServerCluster(
        tmp_path, layout=LAYOUT, host_blocks=HOST_BLOCKS, disk_blocks=0
    ) as cluster:
        first = cluster.spawn("shm-a", 0)
        cluster.wait_ready([first])
        segment = _g2_segment(first)
        assert segment.stat().st_size == HOST_BLOCKS * LAYOUT.with_blocks(1).bytes_per_block
        fd = os.open(segment, os.O_RDONLY)  # the file itself, even if unlinked later
        try:
            assert not _lock_is_free(fd)  # the live owner holds it

            first.process.send_signal(signal.SIGKILL)
            assert first.process.wait(timeout=30) == -signal.SIGKILL
            # No atexit hook ran: the file is whole, its memory held, and its owner's lock went
            # with the process. (Its name is checked below, after the next rank server: a
            # client or rank server of a test running in parallel may sweep it first, by the
            # same rule.)
            assert os.fstat(fd).st_size == HOST_BLOCKS * LAYOUT.with_blocks(1).bytes_per_block
            assert _lock_is_free(fd)
        finally:
            os.close(fd)

        second = cluster.spawn("shm-b", 0)
        cluster.wait_ready([second])
        own = _g2_segment(second)
        assert not segment.exists(), "the next rank server did not sweep the dead owner's file"
        assert own.exists()

        second.terminate(timeout_s=20)
        assert second.process.returncode == 0, second.log_tail()
        assert not own.exists(), "a cleanly stopped rank server left its segment"
