"""Tier pools of one rank: G1 device, G2 host (shared memory), G3 disk.

Every pool is a flat byte range of ``layout.total_bytes`` holding ``layout.num_blocks``
fully contiguous blocks, block ``b`` at byte offset ``b * layout.bytes_per_block``. Pools are
synchronous and are driven from worker threads by :func:`copy_blocks`; only the rank server's
event loop thread touches ``valid``.

* :class:`HostPool` (G2) lives in a shared-memory segment of :mod:`paramserver.protocol.shm`
  (:class:`~paramserver.protocol.shm.OwnedSegment`, ``/dev/shm/paramserver-g2-<pid>-<hex>``) so
  a same-host peer can map it (:func:`attach_peer_segment`) and copy without the network. The
  segment is unlinked on :meth:`HostPool.close`; a rank server killed before it closed leaves
  it to the next G2 pool (or worker client) created on the host, which sweeps the segments of
  dead owners first (:func:`~paramserver.protocol.shm.sweep_dead`).
* :class:`DiskPool` (G3) is one preallocated file; blocks are moved with ``os.preadv`` /
  ``os.pwrite`` at ``block_id * bytes_per_block``. The file is removed on close.
* :class:`DevicePool` (G1) exists only where PyTorch sees a CUDA GPU; elsewhere
  :func:`make_device_pool` raises :class:`~paramserver.spmd.transfer_errors.TierNotRegistered`.
"""

from __future__ import annotations

import abc
import errno
import importlib
import logging
import os
import threading
import time
import uuid
from pathlib import Path
from types import ModuleType

import numpy as np
import numpy.typing as npt

from paramserver.errors import ResourceExhausted
from paramserver.protocol.shm import SHM_DIR, MappedSegment, OwnedSegment, sweep_dead
from paramserver.spmd.faults import Faults
from paramserver.spmd.layout import Layout, Tier
from paramserver.spmd.planning import Run
from paramserver.spmd.transfer_errors import TierNotRegistered

__all__ = [
    "COPY_CHUNK_BYTES",
    "BlockPool",
    "CopyCancelled",
    "DevicePool",
    "DiskPool",
    "HostPool",
    "attach_peer_segment",
    "copy_blocks",
    "make_device_pool",
]

logger = logging.getLogger(__name__)

COPY_CHUNK_BYTES = 4 << 20
"""Largest span one copy step moves (4 MiB); cancellation is checked between steps."""


class CopyCancelled(Exception):
    """A copy stopped between chunks because its command was cancelled."""


class BlockPool(abc.ABC):
    """A flat, block-major byte pool of one tier.

    Attributes:
        tier: the tier.
        layout: the pool layout.
        valid: ``bool[num_blocks]``; true where the block holds data from a completed write.
    """

    def __init__(self, tier: Tier, layout: Layout) -> None:
        self.tier = tier
        self.layout = layout
        self.valid: npt.NDArray[np.bool_] = np.zeros(layout.num_blocks, dtype=np.bool_)

    @property
    def bytes_per_block(self) -> int:
        """Bytes per block."""
        return self.layout.bytes_per_block

    def view_bytes(self, offset: int, length: int) -> memoryview | None:
        """A writable zero-copy view of ``[offset, offset + length)``, or ``None``."""
        return None

    @abc.abstractmethod
    def read_bytes(self, offset: int, out: memoryview) -> None:
        """Copy ``len(out)`` bytes starting at pool byte ``offset`` into ``out``."""

    @abc.abstractmethod
    def write_bytes(self, offset: int, data: memoryview) -> None:
        """Copy ``data`` into the pool at byte ``offset``."""

    def read_block(self, block_id: int) -> bytes:
        """The bytes of one block (a copy), ``bytes_per_block`` long."""
        out = bytearray(self.bytes_per_block)
        self.read_bytes(block_id * self.bytes_per_block, memoryview(out))
        return bytes(out)

    def spec_extras(self) -> dict[str, str]:
        """Extra wire fields of this pool's ``LayoutSpec`` (``shm_name``, ``path``)."""
        return {}

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the pool's resources (idempotent)."""


# --------------------------------------------------------------------------- G2 host


class HostPool(BlockPool):
    """G2: host memory in a shared-memory segment of ``layout.total_bytes`` bytes.

    ``array`` is a numpy view of shape ``(num_blocks, num_layers, outer_dim, page_size,
    inner_dim)`` and dtype ``layout.dtype`` over the segment.

    Args:
        layout: the pool layout.
        directory: where the segment file goes (``/dev/shm``); segments of dead owners there
            are removed first.

    Raises:
        ResourceExhausted: not enough shared memory for the pool, checked up front
            (RESOURCE_EXHAUSTED).
        OSError: no such directory.
    """

    def __init__(self, layout: Layout, *, directory: Path = SHM_DIR) -> None:
        super().__init__(Tier.G2, layout)
        sweep_dead(directory)
        try:
            self._segment: OwnedSegment | None = OwnedSegment.create(
                layout.total_bytes, "g2", directory
            )
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EDQUOT):
                raise
            raise ResourceExhausted(
                f"G2 pool of {layout.num_blocks} blocks ({layout.total_bytes} bytes) does not fit "
                f"in {directory} ({exc.strerror}): lower --host-blocks or enlarge {directory} "
                "(a container's --shm-size)"
            ) from None
        self.name = self._segment.name
        self._buf: memoryview = self._segment.buf
        # Touch every page now (one byte per 4 KiB) so that the first transfer into the pool
        # does not pay a page fault per page; the segment is zero-filled already.
        np.frombuffer(self._buf, dtype=np.uint8)[::4096] = 0

    @property
    def array(self) -> npt.NDArray[np.generic]:
        """Typed numpy view of the whole pool (no copy)."""
        shape = (self.layout.num_blocks, *self.layout.block_shape)
        return np.ndarray(shape, dtype=self.layout.np_dtype, buffer=self._buf)

    def view_bytes(self, offset: int, length: int) -> memoryview | None:
        return self._buf[offset : offset + length]

    def read_bytes(self, offset: int, out: memoryview) -> None:
        out[:] = self._buf[offset : offset + len(out)]

    def write_bytes(self, offset: int, data: memoryview) -> None:
        self._buf[offset : offset + len(data)] = data

    def spec_extras(self) -> dict[str, str]:
        return {"shm_name": self.name}

    def close(self) -> None:
        segment, self._segment = self._segment, None
        if segment is not None:
            segment.close()


PeerSegment = MappedSegment
"""A same-host peer's G2 segment mapped here (read by convention; never unlinked here)."""


def attach_peer_segment(name: str, size_bytes: int) -> PeerSegment:
    """Map a same-host peer's G2 segment ``name`` of at least ``size_bytes`` bytes.

    Raises:
        FileNotFoundError: no such segment (the peer is on another host or gone).
        ValueError: not a segment name, or the segment is smaller than the layout says.
    """
    return MappedSegment.attach(name, size_bytes)


# --------------------------------------------------------------------------- G3 disk


class DiskPool(BlockPool):
    """G3: one preallocated file per layout; block ``b`` at offset ``b * bytes_per_block``."""

    def __init__(self, layout: Layout, directory: Path, *, stem: str, faults: Faults) -> None:
        super().__init__(Tier.G3, layout)
        directory.mkdir(parents=True, exist_ok=True)
        self.path = (directory / f"{stem}-g3-{uuid.uuid4().hex[:8]}.bin").resolve()
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.ftruncate(self._fd, layout.total_bytes)
        self._faults = faults

    def read_bytes(self, offset: int, out: memoryview) -> None:
        done = 0
        while done < len(out):
            n = os.preadv(self._fd, [out[done:]], offset + done)
            if n <= 0:
                raise OSError(errno.EIO, f"short read from {self.path} at {offset + done}")
            done += n

    def write_bytes(self, offset: int, data: memoryview) -> None:
        if self._faults.disk_write_error:
            raise OSError(errno.EIO, f"injected disk write error on {self.path}")
        done = 0
        while done < len(data):
            n = os.pwrite(self._fd, data[done:], offset + done)
            if n <= 0:  # pragma: no cover
                raise OSError(errno.EIO, f"short write to {self.path} at {offset + done}")
            done += n

    def spec_extras(self) -> dict[str, str]:
        return {"path": str(self.path)}

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd < 0:
            return
        os.close(fd)
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass


# --------------------------------------------------------------------------- G1 device


class DevicePool(BlockPool):
    """G1: one ``uint8`` CUDA tensor of ``layout.total_bytes`` (PyTorch; GPU hosts only)."""

    def __init__(self, layout: Layout, torch: ModuleType, device: str = "cuda:0") -> None:
        super().__init__(Tier.G1, layout)
        self._torch = torch
        self._tensor = torch.zeros(max(1, layout.total_bytes), dtype=torch.uint8, device=device)

    def read_bytes(self, offset: int, out: memoryview) -> None:
        src = self._tensor[offset : offset + len(out)]
        dst = self._torch.frombuffer(out, dtype=self._torch.uint8)
        dst.copy_(src)  # device -> host, synchronous

    def write_bytes(self, offset: int, data: memoryview) -> None:
        src = self._torch.frombuffer(bytearray(data), dtype=self._torch.uint8)
        self._tensor[offset : offset + len(data)].copy_(src)
        self._torch.cuda.synchronize()

    def close(self) -> None:
        self._tensor = None


def make_device_pool(layout: Layout) -> DevicePool:
    """Create the G1 pool where PyTorch sees a CUDA GPU.

    Raises:
        TierNotRegistered: no PyTorch or no GPU on this host (FAILED_PRECONDITION).
    """
    try:
        torch = importlib.import_module("torch")
    except ImportError:
        raise TierNotRegistered("tier G1 not registered: PyTorch is not installed") from None
    if not torch.cuda.is_available():
        raise TierNotRegistered("tier G1 not registered: no CUDA GPU on this host")
    return DevicePool(layout, torch)


# --------------------------------------------------------------------------- copying


def _check(cancel: threading.Event | None, faults: Faults | None) -> None:
    if faults is not None and faults.io_delay_s > 0:
        time.sleep(faults.io_delay_s)
    if cancel is not None and cancel.is_set():
        raise CopyCancelled()


def copy_blocks(
    src: BlockPool | PeerSegment,
    dst: BlockPool,
    runs: list[Run],
    *,
    src_bytes_per_block: int | None = None,
    cancel: threading.Event | None = None,
    faults: Faults | None = None,
) -> int:
    """Copy planned runs of blocks from ``src`` to ``dst`` (run in a worker thread).

    Copies in steps of at most :data:`COPY_CHUNK_BYTES`, checking ``cancel`` between steps,
    zero-copy where either side is mapped memory (``pwrite`` straight from shared memory,
    ``preadv`` straight into it).

    Args:
        src: source pool, or a mapped same-host peer G2 segment.
        dst: destination pool.
        runs: from :func:`~paramserver.spmd.planning.coalesce_runs`.
        src_bytes_per_block: block size of a :class:`PeerSegment` source, bytes.
        cancel: set by the command's owner to stop between steps.
        faults: TEST-ONLY fault injection (``io_delay_ms``).

    Returns:
        Bytes copied.

    Raises:
        CopyCancelled: ``cancel`` was set.
        OSError: a disk error.
    """
    bpb = dst.bytes_per_block
    if isinstance(src, PeerSegment):
        if src_bytes_per_block != bpb:
            raise ValueError("peer block size differs from the destination's")
    elif src.bytes_per_block != bpb:
        raise ValueError("source and destination block sizes differ")
    step = max(bpb, (COPY_CHUNK_BYTES // bpb) * bpb) if bpb else COPY_CHUNK_BYTES
    bounce: bytearray | None = None
    moved = 0
    for run in runs:
        total = run.count * bpb
        s0, d0 = run.src_start * bpb, run.dst_start * bpb
        pos = 0
        while pos < total:
            _check(cancel, faults)
            n = min(step, total - pos)
            if isinstance(src, PeerSegment):
                dst.write_bytes(d0 + pos, src.buf[s0 + pos : s0 + pos + n])
            else:
                src_view = src.view_bytes(s0 + pos, n)
                if src_view is not None:
                    dst.write_bytes(d0 + pos, src_view)
                else:
                    dst_view = dst.view_bytes(d0 + pos, n)
                    if dst_view is not None:
                        src.read_bytes(s0 + pos, dst_view)
                    else:
                        if bounce is None or len(bounce) < n:
                            bounce = bytearray(n)
                        mv = memoryview(bounce)[:n]
                        src.read_bytes(s0 + pos, mv)
                        dst.write_bytes(d0 + pos, mv)
            pos += n
            moved += n
    return moved
